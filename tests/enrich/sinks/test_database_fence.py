"""The fence table stays bounded over many batches, in the job against the local PostgreSQL and
MariaDB: each batch deletes its query's fence rows of the batches before it (only the batch being
written can be replayed), so the table holds the last batch's rows, keyed by query and batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.config import DatabaseDialect
from enrich.ops.state_db import device_state_from_database
from tests.enrich.helpers import produce_events
from tests.enrich.sinks.test_database_kill import fetch
from tests.enrich.sinks.test_database_state import db_config, iso, run, table

pytestmark = pytest.mark.integration

BATCHES = 12


@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_the_fence_table_stays_bounded_over_many_batches(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        request: pytest.FixtureRequest, db: str) -> None:
    url: str = request.getfixturevalue(db)
    dialect: DatabaseDialect = "postgresql" if db == "pg_url" else "mysql"
    data = {**db_config(kafka, unique, tmp_path, url), "joins": [], "max_events_per_batch": 2}
    name = data["output"]["database"]["table"]
    produce_events(kafka, data["events"]["topic"], [{"device_id": f"d{n % 3}", "ts": iso(n / 60), "temp": 1.0, "n": n}
                                                    for n in range(2 * BATCHES)])
    run(spark, data)
    assert {k: r["events"] for k, r in table(url, name).items()} == {"d0": 8, "d1": 8, "d2": 8}
    fence = fetch(url, dialect, f"SELECT batch_id, slot FROM {name}_commits")
    batches = sorted({b for b, _ in fence})
    assert len(batches) == 1 and batches[0] >= BATCHES - 1, fence
    # The lookup's last batch is a range of the key (query, batch, slot), not a scan of the slots.
    key = fetch(url, dialect, "SELECT column_name FROM information_schema.key_column_usage WHERE table_name = %s "
                              "AND constraint_name LIKE %s ORDER BY ordinal_position", (f"{name}_commits", "%"))
    assert [str(r[0]) for r in key][:2] == ["query_id", "batch_id"]
    assert device_state_from_database(config.parse(data, "test.yaml"), "d0")["batch_id"] >= batches[0]
