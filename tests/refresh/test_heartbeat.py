"""Every run ends with a heartbeat (its completeness record); a run without changes publishes it alone:
readers see the dataset is current as of that run."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from enrich.dimension.abc import Record
from enrich.dimension.store import DimensionState
from refresh.runner import Refresher
from refstream import contract
from tests.refresh.conftest import execute, read_topic
from tests.refresh.test_runner import mysql_dataset


def test_a_run_without_changes_publishes_a_heartbeat_and_the_next_run_expects_it(
        make_config, mysql_engine, mysql_url, unique, kafka, caplog):
    t, topic = unique("hb"), unique("ref.hb")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)", f"INSERT INTO {t} VALUES (1, 1), (2, 2)")
    cfg = make_config({"h": mysql_dataset(mysql_url, t, topic, partitions=2)})
    Refresher(cfg).run("h")
    # Every run ends with its completeness record on every partition, changes or not.
    ops = [r.op for r in read_topic(kafka, topic, heartbeats=True)]
    assert sorted(ops) == ["heartbeat", "heartbeat", "schema", "schema", "upsert", "upsert"]
    before = datetime.now(UTC)
    quiet = Refresher(cfg).run("h")
    assert (quiet.version, quiet.published, quiet.kind) == (2, 0, "diff")
    beats = [r for r in read_topic(kafka, topic, heartbeats=True) if r.op == contract.OP_HEARTBEAT
             and contract.parse_time(r.headers["complete_as_of"]) >= before]
    assert sorted(b.partition for b in beats) == [0, 1] and {b.key for b in beats} == {contract.HEARTBEAT_KEY}
    body = json.loads(beats[0].value or b"")
    assert (body["dataset"], body["version"]) == ("h", 1) and datetime.fromisoformat(body["at"]) >= before
    assert body["complete_as_of"] == beats[0].headers["complete_as_of"]
    # The heartbeat moved the topic's end: the committed state expects it, so the next run is a plain
    # diff (not a republish of a topic that "changed"), and a change still publishes as usual.
    execute(mysql_engine, f"UPDATE {t} SET v = 3 WHERE id = 2")
    changed = Refresher(cfg).run("h")
    assert (changed.kind, changed.updates, changed.published) == ("diff", 1, 1)
    assert sorted(r.op for r in read_topic(kafka, topic)) == ["schema", "schema", "upsert", "upsert", "upsert"]
    # Every run publishes one, one run right after another too; `heartbeat:` no longer holds any back
    # (it is accepted, with a warning, for the configs that set it).
    again = Refresher(cfg)
    again.run("h")
    again.run("h")
    off = make_config({"h": {**mysql_dataset(mysql_url, t, topic, partitions=2), "heartbeat": "off"}},
                      name="off.yaml")
    assert "datasets.h.heartbeat is no longer used" in caplog.text
    Refresher(off).run("h")
    assert len([r for r in read_topic(kafka, topic, heartbeats=True) if r.op == contract.OP_HEARTBEAT]) == 2 * 6


def test_the_job_takes_a_heartbeat_as_fresh_and_changes_no_row() -> None:
    schema = contract.DatasetSchema("d", ("id",), (contract.Column("id", "int64"), contract.Column("v", "int64")))
    msgs = [contract.schema_message(schema), *contract.upsert_messages(schema, [{"id": 1, "v": 1}], 1)]
    state = DimensionState("d")
    state.apply([Record(0, i, m.key, m.value, m.headers, 1000 + i) for i, m in enumerate(msgs)])
    gens, rows = (state.base_gen, state.overlay_gen), state.live_rows()
    beat = contract.heartbeat_message("d", 1, datetime.now(UTC))
    assert contract.decode(beat.key, beat.value, beat.headers).op == contract.OP_HEARTBEAT
    assert state.apply([Record(0, 5, beat.key, beat.value, beat.headers, 9000)]) == 0
    assert (state.base_gen, state.overlay_gen, state.live_rows(), state.version) == (*gens, rows, 1)
    assert state.changed_ms == 9000  # current as of the heartbeat's publish time
