"""The checkpoint's record of the state settings, without Spark."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from enrich.config import StateConfig
from enrich.state.checkpoint import PARTITIONS, RECORD, check_checkpoint
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from refstream.errors import ConfigError

CFG = StateConfig(key="device_id", timestamp="ts", aggregates=(("t", ("max",)),))
SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                 aggregates=(("t", ("max",), pa.float64()),))


def test_first_start_records_then_later_starts_compare(tmp_path: Path) -> None:
    check_checkpoint(tmp_path, CFG, SPEC)
    kept = json.loads((tmp_path / RECORD).read_text())
    assert (kept["key"], kept["buckets"], kept["aggregates"]) == ("device_id", 64, {"t": ["max"]})
    check_checkpoint(tmp_path, CFG, SPEC)   # same settings: fine
    other = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                      aggregates=(("t", ("max",), pa.int64()),))
    with pytest.raises(ConfigError, match=r"the aggregated columns' types changed against the checkpoint"):
        check_checkpoint(tmp_path, CFG, other)
    with pytest.raises(ConfigError, match=r"state\.key changed .* was kept with \"device_id\", now \"site\""):
        check_checkpoint(tmp_path, StateConfig(key="site", timestamp="ts", aggregates=CFG.aggregates),
                         StateSpec(key="site", key_type=pa.string(), timestamp="ts", ttl_us=1,
                                   aggregates=SPEC.aggregates))


def test_state_added_to_a_checkpoint_that_ran_without_it_is_refused(tmp_path: Path) -> None:
    check_checkpoint(tmp_path, None, None)      # no state: nothing recorded
    assert not (tmp_path / RECORD).exists()
    (tmp_path / "spark" / "offsets").mkdir(parents=True)
    (tmp_path / "spark" / "offsets" / "0").write_text("v1")
    with pytest.raises(ConfigError, match="was written by a query without state:; point checkpoint: at a new"):
        check_checkpoint(tmp_path, CFG, SPEC)


def test_a_damaged_record_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / RECORD).parent.mkdir(parents=True)
    (tmp_path / RECORD).write_text("{not json")
    with pytest.raises(ConfigError, match=r"state\.json: not a state record"):
        check_checkpoint(tmp_path, CFG, SPEC)


def test_a_new_checkpoint_spreads_its_buckets_over_its_state_partitions(tmp_path: Path) -> None:
    assert check_checkpoint(tmp_path, CFG, SPEC, partitions=4) == BucketLayout.balanced(64, 4)
    assert json.loads((tmp_path / RECORD).read_text())[PARTITIONS] == 4
    # Spark keeps the first run's number of partitions: a later start with another one keeps the layout.
    assert check_checkpoint(tmp_path, CFG, SPEC, partitions=8) == BucketLayout.balanced(64, 4)
    assert check_checkpoint(tmp_path, CFG, SPEC) == BucketLayout.balanced(64, 4)


def test_a_checkpoint_recorded_before_layouts_keeps_the_bucket_numbers(tmp_path: Path) -> None:
    check_checkpoint(tmp_path, CFG, SPEC)
    kept = json.loads((tmp_path / RECORD).read_text())
    assert PARTITIONS not in kept
    assert check_checkpoint(tmp_path, CFG, SPEC, partitions=4) == BucketLayout.plain(64)
    (tmp_path / RECORD).write_text(json.dumps({**kept, PARTITIONS: "four"}))
    with pytest.raises(ConfigError, match=r"state\.json: state_partitions: 'four' is not a number of state partitions"):
        check_checkpoint(tmp_path, CFG, SPEC)
