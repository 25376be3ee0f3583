"""The checkpoint's record of the state settings, without Spark."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pyarrow as pa
import pytest

from enrich.checkpoint import CheckpointLayout
from enrich.config import StateConfig
from enrich.rollups.spec import RollupSpec
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from enrich.state.record import BUCKET_IDS, PARTITIONS, check_checkpoint, dropped_rollups, record_partitions
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


def test_gaps_turned_on_or_off_against_a_checkpoint_that_ran_are_refused(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2, gaps=False)
    check_checkpoint(ck, CFG, SPEC, gaps=True)  # nothing ran yet: the record follows the config
    assert json.loads(ck.state_record.read_text())["gaps"] is True
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    check_checkpoint(ck, CFG, SPEC, gaps=True)
    with pytest.raises(ConfigError, match=r"gaps: is gone against the checkpoint .* \(the tick source\)"):
        check_checkpoint(ck, CFG, SPEC, gaps=False)
    other = CheckpointLayout(tmp_path / "other")
    check_checkpoint(other, CFG, SPEC, partitions=2, gaps=False)
    other.offsets.mkdir(parents=True)
    (other.offsets / "0").write_text("v1")
    with pytest.raises(ConfigError, match=r"gaps: is new against the checkpoint"):
        check_checkpoint(other, CFG, SPEC, gaps=True)


def _rollup(name: str = "d_1m", **changes: object) -> RollupSpec:
    r = RollupSpec(name=name, by=("device_id",), by_types=(pa.string(),), window_us=60_000_000,
                   correct_for_us=60_000_000, metrics=(("t", ("mean",), pa.float64()),))
    return dataclasses.replace(r, **changes)  # type: ignore[arg-type]


def _ran(ck: CheckpointLayout, rollups: tuple[RollupSpec, ...]) -> None:
    check_checkpoint(ck, CFG, SPEC, partitions=2, rollups=())
    check_checkpoint(ck, CFG, SPEC, rollups=rollups)   # nothing ran yet: the record follows
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")


def test_rollups_added_or_removed_against_a_checkpoint_that_ran_are_taken(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    ck = CheckpointLayout(tmp_path)
    _ran(ck, (_rollup(),))
    assert [r["name"] for r in json.loads(ck.state_record.read_text())["rollups"]] == ["d_1m"]
    check_checkpoint(ck, CFG, SPEC, rollups=(_rollup(),))
    with caplog.at_level(logging.INFO, logger="enrich.state.record"):
        check_checkpoint(ck, CFG, SPEC, rollups=(_rollup(), _rollup("d_2m", window_us=120_000_000)))
    assert "rollup d_2m is new against the checkpoint" in caplog.text and "no backfill" in caplog.text
    assert dropped_rollups(ck) == ()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="enrich.state.record"):
        check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("d_2m", window_us=120_000_000),))
    assert "rollup d_1m is gone against the checkpoint" in caplog.text
    assert dropped_rollups(ck) == ("d_1m",)
    assert [r["name"] for r in json.loads(ck.state_record.read_text())["rollups"]] == ["d_2m"]
    # Turning idle_finalize on would add the tick source (the query's inputs are fixed); fill is free.
    check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("d_2m", window_us=120_000_000, fill=True),))
    with pytest.raises(ConfigError, match=r"idle_finalize or a fill by a join.s keys is new against the checkpoint .*tick source"):
        check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("d_2m", window_us=120_000_000, idle_finalize_us=1),))


def test_rollup_changes_that_the_state_cannot_follow_are_refused(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    _ran(ck, (_rollup(),))
    # A longer horizon would reopen windows already dropped: refused as the layout's changes are.
    for changed, what in [(_rollup(window_us=120_000_000), "window"),
                          (_rollup(correct_for_us=120_000_000), "correct_for"),
                          (_rollup(by=("site",)), "by, metrics or their types"),
                          (_rollup(metrics=(("t", ("max",), pa.float64()),)), "metrics or their types")]:
        with pytest.raises(ConfigError, match=rf"rollup d_1m changed against the checkpoint .*\({what}\).*new name"):
            check_checkpoint(ck, CFG, SPEC, rollups=(changed,))
    with pytest.raises(ConfigError, match=r'the last rollups \["d_1m"\] cannot be removed .* keyed step'):
        check_checkpoint(ck, CFG, SPEC, rollups=())
    check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("other"),))   # d_1m removed
    with pytest.raises(ConfigError, match=r"rollup d_1m was removed from the checkpoint .* revision 1"):
        check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("other"), _rollup()))
    # The rollup step deletes d_1m's state variables (rollup_d_1m, ..._filled, ..._finals) at every start.
    for name in ("d_1m_finals", "d_1m_filled"):
        with pytest.raises(ConfigError, match=rf"rollup {name} is named like the state of a rollup removed"):
            check_checkpoint(ck, CFG, SPEC, rollups=(_rollup("other"), _rollup(name)))
    bare = CheckpointLayout(tmp_path / "bare")
    _ran(bare, ())
    with pytest.raises(ConfigError, match=r'the first rollups \["d_1m"\] cannot be added .* ran without rollups'):
        check_checkpoint(bare, CFG, SPEC, rollups=(_rollup(),))


def test_a_record_without_rollups_reads_as_none(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    check_checkpoint(ck, CFG, SPEC, partitions=2)
    kept = json.loads(ck.state_record.read_text())
    assert kept.pop("rollups") == []
    ck.state_record.write_text(json.dumps(kept))
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "0").write_text("v1")
    check_checkpoint(ck, CFG, SPEC, rollups=())        # a job without rollups starts
