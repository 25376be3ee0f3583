"""``enrich lookup --rollup NAME --key V``: a key's windows, latest revision, newest first, from the
rollup's table (real PostgreSQL and MariaDB) or its Parquet directory."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pyspark.sql.pandas.types import from_arrow_schema

from enrich import cli, config
from enrich.rollups.spec import RollupSpec
from enrich.sinks.database.connect import connect
from enrich.sinks.database.sink import ensure
from enrich.sinks.database.slots import write_slot
from enrich.sinks.database.tables import table_spec

SPEC = RollupSpec(name="site_1h", by=("site_id", "n"), by_types=(pa.string(), pa.int64()), window_us=3_600_000_000,
                  correct_for_us=3_600_000_000, metrics=(("temperature", ("mean",), pa.float64()),))


def rows(revisions: list[tuple[str, int, int, float, int]]) -> pa.Table:
    """(site, n, hour, mean, revision) rows of SPEC's output."""
    return pa.Table.from_pylist([
        {"site_id": s, "n": n, "window_start": datetime(2026, 1, 1, h, tzinfo=UTC),
         "window_end": datetime(2026, 1, 1, h + 1, tzinfo=UTC), "temperature_mean": m,
         "_kind": "provisional" if r == 1 else "final", "_revision": r, "_events": 3,
         "_finalized_by": None if r == 1 else "watermark", "_cause": None}
        for s, n, h, m, r in revisions], schema=SPEC.output_schema())


def write_config(tmp_path: Path, output: dict[str, Any]) -> Path:
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": "127.0.0.1:9"},
        "events": {"topic": "ev", "schema": "site_id STRING, n BIGINT, ts TIMESTAMP, temperature DOUBLE"},
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": str(tmp_path / "ck"),
        "state": {"key": "site_id", "timestamp": "ts"},
        "rollups": [{"name": "site_1h", "by": ["site_id", "n"], "window": "1h", "metrics": {"temperature": ["mean"]},
                     "output": output}]}))
    return path


def lookup(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    code = cli.main(["lookup", "--config", str(path), "--rollup", "site_1h", *args])
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_a_keys_windows_come_from_the_table_newest_first(db: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    url = request.getfixturevalue(db)
    table = f"site_1h_{tmp_path.name[-8:]}".replace("-", "_").lower()
    path = write_config(tmp_path, {"database": {"url": url, "table": table}})
    cfg = config.load(path)
    spec = table_spec(cfg.rollups[0].output.database, from_arrow_schema(SPEC.output_schema()).fields,
                      ("site_id", "n", "window_start"))
    ensure(spec)
    for batch, revisions in enumerate([[("s-6", 1, 0, 20.0, 1), ("s-7", 1, 0, 5.0, 1)],
                                       [("s-6", 1, 0, 21.0, 2), ("s-6", 1, 1, 22.0, 1), ("s-6", 2, 1, 9.0, 1)]]):
        conn = connect(spec.url, spec.dialect)
        try:
            write_slot(conn, spec, "q", 0, batch, rows(revisions))
        finally:
            conn.close()
    code, got = lookup(path, capsys, "--key", "s-6", "--key", "1")
    assert code == 0
    assert [(r["window_start"][:13], r["temperature_mean"], r["_revision"]) for r in got] == [
        ("2026-01-01T01", 22.0, 1), ("2026-01-01T00", 21.0, 2)]
    assert lookup(path, capsys, "--key", "s-6", "--key", "1", "--limit", "1")[1][0]["_revision"] == 1
    assert lookup(path, capsys, "--key", "s-9", "--key", "1") == (1, [])


def test_a_keys_windows_come_from_the_parquet_directory_when_there_is_no_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "site_1h"
    path = write_config(tmp_path, {"parquet": {"path": str(out)}})
    for batch, revisions in enumerate([[("s-6", 1, 0, 20.0, 1)], [("s-6", 1, 0, 21.0, 2), ("s-6", 1, 1, 22.0, 1)]]):
        (out / f"batch_id={batch}").mkdir(parents=True)
        pq.write_table(rows(revisions), out / f"batch_id={batch}" / "part-0.parquet")
    code, got = lookup(path, capsys, "--key", "s-6", "--key", "1")
    assert code == 0
    assert [(r["window_start"][:13], r["temperature_mean"], r["_revision"]) for r in got] == [
        ("2026-01-01T01", 22.0, 1), ("2026-01-01T00", 21.0, 2)]


def test_a_wrong_rollup_or_key_count_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, {"parquet": {"path": str(tmp_path / "r")}})
    assert cli.main(["lookup", "--config", str(path), "--rollup", "nope", "--key", "x"]) == 2
    assert "no rollup named 'nope' (rollups: site_1h)" in capsys.readouterr().err
    assert cli.main(["lookup", "--config", str(path), "--rollup", "site_1h", "--key", "x"]) == 2
    assert "rollup site_1h is by site_id, n: give --key 2 time(s)" in capsys.readouterr().err
