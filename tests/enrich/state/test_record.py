"""The checkpoint's record of the state settings, without Spark."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from enrich.checkpoint import CheckpointLayout
from enrich.config import StateConfig
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from enrich.state.record import BUCKET_IDS, PARTITIONS, check_checkpoint, record_partitions
from refstream.errors import ConfigError

CFG = StateConfig(key="device_id", timestamp="ts", aggregates=(("t", ("max",)),))
SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                 aggregates=(("t", ("max",), pa.float64()),))


def test_first_start_records_then_later_starts_compare(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2)
    kept = json.loads(ck.state_record.read_text())
    assert (kept["key"], kept["buckets"], kept["aggregates"]) == ("device_id", 64, {"t": ["max"]})
    check_checkpoint(ck, CFG, SPEC)   # same settings: fine
    other = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                      aggregates=(("t", ("max",), pa.int64()),))
    with pytest.raises(ConfigError, match=r"the aggregated columns' types changed against the checkpoint"):
        check_checkpoint(ck, CFG, other)
    with pytest.raises(ConfigError, match=r"state\.key changed .* was kept with \"device_id\", now \"site\""):
        check_checkpoint(ck, StateConfig(key="site", timestamp="ts", aggregates=CFG.aggregates),
                         StateSpec(key="site", key_type=pa.string(), timestamp="ts", ttl_us=1,
                                   aggregates=SPEC.aggregates))


def test_state_added_to_a_checkpoint_that_ran_without_it_is_refused(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, None, None)      # no state: nothing recorded
    assert not ck.state_record.exists()
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    with pytest.raises(ConfigError, match="was written by a query without state:; point checkpoint: at a new"):
        check_checkpoint(ck, CFG, SPEC, partitions=2)


def test_a_damaged_record_is_an_error_naming_it(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    ck.state_record.parent.mkdir(parents=True)
    ck.state_record.write_text("{not json")
    with pytest.raises(ConfigError, match=r"state\.json: not a state record"):
        check_checkpoint(ck, CFG, SPEC)


def test_a_new_checkpoint_records_its_bucket_layout_and_state_partitions(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    with pytest.raises(ConfigError, match="has no device state yet"):
        check_checkpoint(ck, CFG, SPEC)     # a lookup before the first start
    assert check_checkpoint(ck, CFG, SPEC, partitions=4) == BucketLayout.even(64)
    kept = json.loads(ck.state_record.read_text())
    assert kept[PARTITIONS] == 4 and kept[BUCKET_IDS] == list(BucketLayout.even(64).ids)
    # The layout is the record's, whatever the number of partitions a later start or a rescale has.
    assert check_checkpoint(ck, CFG, SPEC, partitions=8) == BucketLayout.even(64)
    record_partitions(ck, 2)
    assert json.loads(ck.state_record.read_text()) == {**kept, PARTITIONS: 2}
    assert check_checkpoint(ck, CFG, SPEC) == BucketLayout.even(64)


def test_a_start_with_a_number_that_does_not_divide_the_buckets_is_even_over_it(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    layout = check_checkpoint(ck, CFG, SPEC, partitions=12)
    assert layout == BucketLayout.even(64, 12) and layout is not None
    assert max(layout.spread(12)) - min(layout.spread(12)) == 1 and layout.spread(4) == [16] * 4
    assert json.loads(ck.state_record.read_text())[BUCKET_IDS] == list(layout.ids)


def damaged_record(tmp_path: Path, field: str, value: object) -> CheckpointLayout:
    """A checkpoint whose state.json, written by a first run on 4 partitions, has ``field`` set to ``value``."""
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=4)
    kept = json.loads(ck.state_record.read_text())
    ck.state_record.write_text(json.dumps({**kept, field: value}))
    return ck


@pytest.mark.parametrize("damaged", [None, "four", True, 0])
def test_a_damaged_number_of_state_partitions_is_an_error_naming_it(tmp_path: Path, damaged: object) -> None:
    ck = damaged_record(tmp_path, PARTITIONS, damaged)
    with pytest.raises(ConfigError, match=rf"state\.json: state_partitions: {damaged!r} is not a number of state "
                                          "partitions"):
        check_checkpoint(ck, CFG, SPEC)


@pytest.mark.parametrize("damaged", [None, [1, 2, 3], list(range(63)) + [0], list(range(63)) + [-1],
                                     list(range(63)) + ["x"], list(range(63)) + [2**31]])
def test_a_damaged_bucket_layout_is_an_error_naming_it(tmp_path: Path, damaged: object) -> None:
    ck = damaged_record(tmp_path, BUCKET_IDS, damaged)
    with pytest.raises(ConfigError, match=r"state\.json: bucket_ids: not one distinct grouping key per bucket "
                                          r"\(64 buckets\)"):
        check_checkpoint(ck, CFG, SPEC)


def test_waiting_turned_on_or_off_against_a_checkpoint_that_ran_is_refused(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2, waits=False)
    check_checkpoint(ck, CFG, SPEC, waits=True)  # nothing ran yet: the record follows the config
    assert json.loads(ck.state_record.read_text())["waits"] is True
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    check_checkpoint(ck, CFG, SPEC, waits=True)
    with pytest.raises(ConfigError, match=r"joins\[\]\.wait: complete was removed against the checkpoint .* \(the "
                                          r"tick source"):
        check_checkpoint(ck, CFG, SPEC, waits=False)
    old = CheckpointLayout(tmp_path / "old")  # a record from before joins[].wait: no waiting
    check_checkpoint(old, CFG, SPEC, partitions=2)
    kept = json.loads(old.state_record.read_text())
    del kept["waits"]
    old.state_record.write_text(json.dumps(kept))
    old.offsets.mkdir(parents=True)
    (old.offsets / "0").write_text("v1")
    check_checkpoint(old, CFG, SPEC, waits=False)
    with pytest.raises(ConfigError, match=r"joins\[\]\.wait: complete is new against the checkpoint"):
        check_checkpoint(old, CFG, SPEC, waits=True)


def test_rollups_added_removed_or_changed_against_a_checkpoint_that_ran_are_refused(tmp_path: Path) -> None:
    from enrich.rollups.spec import RollupSpec

    r1m = RollupSpec(name="d_1m", by=("device_id",), by_types=(pa.string(),), window_us=60_000_000,
                     correct_for_us=60_000_000, metrics=(("t", ("mean",), pa.float64()),))
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2, rollups=())
    check_checkpoint(ck, CFG, SPEC, rollups=(r1m,))   # nothing ran yet: the record follows
    assert [r["name"] for r in json.loads(ck.state_record.read_text())["rollups"]] == ["d_1m"]
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    check_checkpoint(ck, CFG, SPEC, rollups=(r1m,))
    # A longer horizon would reopen windows already dropped: refused as the rest.
    for other in [(), (RollupSpec(**{**r1m.__dict__, "window_us": 120_000_000}),),
                  (RollupSpec(**{**r1m.__dict__, "correct_for_us": 120_000_000}),),
                  (r1m, RollupSpec(**{**r1m.__dict__, "name": "d_2m"}))]:
        with pytest.raises(ConfigError, match=r"rollups changed against the checkpoint .* ran with rollups "
                                              r"\[\"d_1m\"\]"):
            check_checkpoint(ck, CFG, SPEC, rollups=other)


def test_a_record_without_rollups_reads_as_none(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2)
    kept = json.loads(ck.state_record.read_text())
    assert kept.pop("rollups") == []
    ck.state_record.write_text(json.dumps(kept))
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    check_checkpoint(ck, CFG, SPEC, rollups=())        # a job without rollups starts
