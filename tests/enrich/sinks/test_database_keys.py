"""Keys in the database output compare byte for byte, on the local MariaDB and PostgreSQL with the
servers' defaults: devices whose ids differ only in case, a trailing space or an accent are rows of
their own, each answered by ``enrich lookup --state``; an existing table whose key column would merge
them is refused at the start, naming the table and the column."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import cli, config
from enrich.job import EnrichJob
from enrich.sinks.database.connect import connect
from refstream.errors import ConfigError
from tests.enrich.helpers import produce_events
from tests.enrich.sinks.test_database_state import db_config, iso, run, table

pytestmark = pytest.mark.integration

#: Six devices that a case-, accent- and trailing-space-insensitive key makes three.
DEVICES = ["Dev-1", "dev-1", "d2", "d2 ", "\u00e9", "e"]


@pytest.mark.parametrize("db", ["mysql_default_url", "pg_url"])
def test_devices_differing_in_case_space_or_accent_are_rows_of_their_own(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        request: pytest.FixtureRequest, db: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = request.getfixturevalue(db)
    data = {**db_config(kafka, unique, tmp_path, url), "joins": [], "max_events_per_batch": 100}
    # Device i sends i + 1 events: its row's count says whose state it is.
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": d, "ts": iso(n / 60), "temp": float(i), "n": n}
        for n, (i, d) in enumerate((i, d) for i, d in enumerate(DEVICES) for _ in range(i + 1))])
    run(spark, data)
    rows = table(url, data["output"]["database"]["table"])
    assert {k: r["events"] for k, r in rows.items()} == {d: i + 1 for i, d in enumerate(DEVICES)}
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data))
    for i, device in enumerate(DEVICES):
        capsys.readouterr()
        assert cli.main(["lookup", "--config", str(path), "--state", device]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert (answer["key"], answer["state"]["events"], answer["state"]["temp_last"]) == \
            ({"device_id": device}, i + 1, float(i)), device


@pytest.mark.parametrize(("db", "column"), [("mysql_default_url", "VARCHAR(255)"),
                                            ("mysql_url", "VARCHAR(255)"),   # utf8mb4_bin: PAD SPACE
                                            ("pg_url", "CHAR(20)")])
def test_an_existing_table_whose_key_merges_keys_is_refused_at_start(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        request: pytest.FixtureRequest, db: str, column: str) -> None:
    url = request.getfixturevalue(db)
    data = {**db_config(kafka, unique, tmp_path, url), "joins": []}
    name = data["output"]["database"]["table"]
    conn = connect(url, "postgresql" if db == "pg_url" else "mysql")
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {name} (device_id {column} NOT NULL PRIMARY KEY)")
        conn.commit()
    finally:
        conn.close()
    produce_events(kafka, data["events"]["topic"], [{"device_id": "a", "ts": iso(0), "temp": 1.0, "n": 1}])
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    with pytest.raises(ConfigError, match=rf"table {name} has the key column\(s\) \['device_id'\]"):
        job.run(spark)
    assert job.batches == 0
