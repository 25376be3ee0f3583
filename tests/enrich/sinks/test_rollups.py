"""The rollups' database output (``enrich.sinks.rollups.RollupWriter``) on real PostgreSQL and
MariaDB: rows the table cannot hold are left out with a warning, the others written once per batch."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from enrich import config
from enrich.rollups.spec import RollupSpec
from enrich.sinks.database.connect import connect
from enrich.sinks.rollups import RollupWriter

SPEC = RollupSpec(name="site_1m", by=("site",), by_types=(pa.string(),), window_us=60_000_000,
                  correct_for_us=60_000_000, metrics=(("t", ("max",), pa.float64()),))


def rows(sites: list[str | None]) -> pa.Table:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return pa.Table.from_pylist([
        {"site": s, "window_start": t0, "window_end": t0, "t_max": 1.0, "_kind": "provisional", "_revision": 1,
         "_events": 1, "_finalized_by": None, "_cause": None} for s in sites], schema=SPEC.output_schema())


@pytest.mark.parametrize(("db", "hostile"), [("mysql_url", "s" * 300), ("pg_url", "s\x00nul")])
def test_rows_the_table_cannot_hold_are_dead_letters_not_a_failed_batch(
        db: str, hostile: str, request: pytest.FixtureRequest, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    url = request.getfixturevalue(db)
    table = f"site_1m_{tmp_path.name[-8:]}".replace("-", "_").lower()
    cfg = config.parse({
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": "site STRING, ts TIMESTAMP"},
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": str(tmp_path / "ck"),
        "state": {"key": "site", "timestamp": "ts"},
        "rollups": [{"name": "site_1m", "by": ["site"], "window": "1m", "metrics": {"t": ["max"]},
                     "output": {"database": {"url": url, "table": table}}}]}, "test.yaml")
    writer = RollupWriter((SPEC,), cfg.rollups, scope="q")
    spec = writer.tables[0]
    assert spec is not None
    with caplog.at_level(logging.WARNING, logger="enrich.sinks.rollups"):
        written, dead = writer._database(0, rows(["s-1", hostile, None]), SPEC, spec)
        again, _ = writer._database(0, rows(["s-1"]), SPEC, spec)   # batch 0 again: fenced
    assert (written, again) == (1, None)
    # The refused row is a dead letter naming the rollup and the table; the null-keyed one is not
    # refused data, only unkeyable: the other outputs keep it.
    (letter,) = dead.to_pylist()
    assert letter["_error"].startswith(f"rollup {SPEC.name} row refused by {table}: ") and letter["_topic"] == table
    assert json.loads(letter["_key"])["site"] == hostile and json.loads(letter["_value"])["site"] == hostile
    text = caplog.text
    assert "1 row(s) with a null key not written" in text and "1 row(s) not written to" in text, text
    conn = connect(spec.url, spec.dialect)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT site FROM {table}")
            assert [tuple(r) for r in cur.fetchall()] == [("s-1",)]
        conn.commit()
    finally:
        conn.close()


def test_a_rollup_record_larger_than_the_broker_takes_is_left_out_of_the_topic() -> None:
    from enrich.sinks.kafka.writer import fitting
    from enrich.sinks.rollups import records

    recs = records(SPEC, rows(["s-1", "x" * 2000, "s-2"]))
    assert fitting(recs, 1000).to_pylist() == [True, False, True]


def test_a_record_that_is_no_event_becomes_a_dead_letter_cut_to_fit_with_no_position() -> None:
    from enrich.sinks.deadletter import to_records, too_large
    from enrich.sinks.kafka.writer import fitting
    from enrich.sinks.rollups import records

    recs = records(SPEC, rows(["s-1", "x" * 2000, "s-2"]))
    left = recs.filter(pa.compute.invert(fitting(recs, 1000)))
    dead = too_large(left, f"rollup {SPEC.name} row", 1000, "site_1h")
    assert dead.num_rows == 1 and dead.column("_partition").null_count == 1
    assert dead.column("_error")[0].as_py().startswith(f"too_large: rollup {SPEC.name} row of ")
    out = to_records(dead, 1000).to_pylist()[0]
    headers = {h["key"]: h["value"] for h in out["headers"]}
    assert set(headers) == {"error", "source.topic", "reason", "original.size"}
    assert headers["source.topic"] == b"site_1h" and headers["reason"] == b"too_large"
    # The key (the rollup's keys: here the long value itself) is too large to keep as well.
    assert int(headers["original.size"]) > 2000 and out["key"] is None
    size = len(out["value"]) + sum(len(k) + len(v) for k, v in headers.items())
    assert size <= 1000 and out["value"] == left.column("value")[0].as_py()[:len(out["value"])]


def test_the_steps_dead_letters_and_the_rows_an_output_refused_make_one_table() -> None:
    from enrich.sinks.deadletter import refused as refused_letters
    from enrich.sinks.rollups import dead_letters

    step = pa.table({"_error": ["beyond the rollup horizon: site_1h"], "_key": [b"d1"], "_value": [b"{}"],
                     "_topic": ["ev"], "_partition": pa.array([1], pa.int32()), "_offset": pa.array([7], pa.int64())})
    refused = refused_letters(pa.table({"key": [b"k"], "value": [b"v"]}), ["NUL"], "rollup site_1h row", "t")
    assert refused.column("_error").to_pylist() == ["rollup site_1h row refused by t: NUL"]
    got = dead_letters([step, refused.slice(0, 0), refused])
    assert got.column("_topic").to_pylist() == ["ev", "t"] and got.column("_partition").to_pylist() == [1, None]
    assert dead_letters([]).num_rows == 0
