"""``output.database.table`` changed under a checkpoint that has run, in the job against the local
PostgreSQL: the start is refused with one line naming both tables, and nothing is written to the new
table (its fence rows would be missing for a pending batch, and its rows for every batch before)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.sinks.database.connect import connect
from refstream.errors import ConfigError
from tests.enrich.helpers import produce_events
from tests.enrich.sinks.test_database_state import db_config, iso, run, table

pytestmark = pytest.mark.integration


def test_another_table_under_a_checkpoint_that_has_run_is_refused(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, pg_url: str) -> None:
    data = {**db_config(kafka, unique, tmp_path, pg_url), "joins": []}
    first = data["output"]["database"]["table"]
    produce_events(kafka, data["events"]["topic"], [{"device_id": "a", "ts": iso(0), "temp": 1.0, "n": 1}])
    run(spark, data)
    assert list(table(pg_url, first)) == ["a"]

    produce_events(kafka, data["events"]["topic"], [{"device_id": "b", "ts": iso(1), "temp": 2.0, "n": 2}])
    second = unique("state")
    data["output"]["database"]["table"] = second
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    with pytest.raises(ConfigError) as refused:
        job.run(spark)
    line = str(refused.value)
    assert "\n" not in line and f"output.database.table: {second!r} differs from {first!r}" in line, line
    assert job.batches == 0
    conn = connect(pg_url, "postgresql")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s), to_regclass(%s)", (second, f"{second}_commits"))
            assert cur.fetchone() == (None, None)
    finally:
        conn.close()
    # Put back, the job goes on from its checkpoint into the first table.
    data["output"]["database"]["table"] = first
    run(spark, data)
    assert sorted(table(pg_url, first)) == ["a", "b"]
