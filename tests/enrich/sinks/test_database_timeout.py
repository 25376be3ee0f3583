"""``output.database.statement_timeout`` in the running job, on the local PostgreSQL and MariaDB: a
lock another session holds (a DBA's open transaction) makes the job's write time out, log it once
per attempt naming the table, and retry; once the lock is released the batch is written. Never a
write that waits for good."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql
import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.config import DatabaseDialect
from enrich.job import EnrichJob
from enrich.sinks.database.connect import connect
from enrich.sinks.database.tables import exact_collation, fence_ddl
from tests.enrich.helpers import produce_events
from tests.enrich.sinks.test_database_state import db_config, iso, table
from tests.timing import bound

pytestmark = pytest.mark.integration


def hold_fence(url: str, dialect: DatabaseDialect, fence: str) -> Any:
    """The fence table, created as the job creates it, and a connection whose open transaction
    keeps every other session from inserting into it (PostgreSQL: a table lock; MariaDB: a
    repeatable-read ``FOR UPDATE`` scan, whose gap lock blocks inserts)."""
    conn = connect(url, dialect)
    with conn.cursor() as cur:
        cur.execute(fence_ddl(dialect, fence, exact_collation(cur) if dialect == "mysql" else ""))
    conn.commit()
    if dialect == "postgresql":
        conn.execute(f"LOCK TABLE {fence} IN SHARE ROW EXCLUSIVE MODE")
        return conn
    conn.close()
    from sqlalchemy.engine import make_url

    u = make_url(url)
    locker = pymysql.connect(host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
                             database=u.database, autocommit=False)
    with locker.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur.execute("BEGIN")
        cur.execute(f"SELECT * FROM {fence} FOR UPDATE")
    return locker


@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_a_locked_table_times_the_write_out_and_it_succeeds_once_released(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        request: pytest.FixtureRequest, db: str, caplog: pytest.LogCaptureFixture) -> None:
    url: str = request.getfixturevalue(db)
    dialect: DatabaseDialect = "postgresql" if db == "pg_url" else "mysql"
    data, name = _two_events_to(url, kafka, unique, tmp_path)
    locker = hold_fence(url, dialect, f"{name}_commits")
    try:
        # On a busy machine creating the table can time out too (tried again: the next test); the
        # lock is held until the write into it has timed out.
        runner, failed = _run_until(spark, data, caplog, f"writing {name}: timed out")
    finally:
        locker.rollback()   # released whatever happened: the job must finish either way
        locker.close()
    assert failed == []
    timeouts = _timeouts(caplog, f"writing {name}: timed out (output.database.statement_timeout")
    assert timeouts, "the write did not time out while the table was locked"
    assert "(attempt " in timeouts[0]
    runner.join(300)
    assert not runner.is_alive() and failed == []
    assert {k: r["events"] for k, r in table(url, name).items()} == {"a": 1, "b": 1}


def test_a_table_creation_that_times_out_is_tried_again(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, pg_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another session creating the same table in a transaction it has not committed holds the
    job's ``CREATE TABLE IF NOT EXISTS`` (PostgreSQL waits to see whether that name is taken): the
    creation times out, is logged as a failed attempt naming the table, and is tried again; once
    the other session rolls back, the job creates the table and writes every event once. (A
    creation slowed by a busy server is the same error.)"""
    data, name = _two_events_to(pg_url, kafka, unique, tmp_path)
    other = connect(pg_url, "postgresql")
    other.execute(f"CREATE TABLE {name} (x int)")   # uncommitted
    try:
        runner, failed = _run_until(spark, data, caplog, f"creating {name}")
    finally:
        other.rollback()
        other.close()
    runner.join(bound(300))
    assert not runner.is_alive() and failed == []
    timeouts = _timeouts(caplog, f"creating {name}: timed out (output.database.statement_timeout")
    assert timeouts and "(attempt " in timeouts[0], [r.getMessage() for r in caplog.records]
    assert {k: r["events"] for k, r in table(pg_url, name).items()} == {"a": 1, "b": 1}


def _two_events_to(url: str, kafka: dict[str, str], unique: Callable[[str], str],
                   tmp_path: Path) -> tuple[dict[str, Any], str]:
    """A job config writing to a new table of ``url`` with a 1 s statement timeout, and its table's
    name; two events are in its topic."""
    data = {**db_config(kafka, unique, tmp_path, url), "joins": []}
    data["output"]["database"]["statement_timeout"] = "1s"
    produce_events(kafka, data["events"]["topic"], [{"device_id": "a", "ts": iso(0), "temp": 1.0, "n": 1},
                                                    {"device_id": "b", "ts": iso(0), "temp": 2.0, "n": 2}])
    return data, data["output"]["database"]["table"]


def _run_until(spark: SparkSession, data: dict[str, Any], caplog: pytest.LogCaptureFixture,
               says: str) -> tuple[threading.Thread, list[BaseException]]:
    """The job of ``data`` started available-now in a thread, and returned once a failed attempt's
    log line contains ``says`` (or the job ended, or the bound passed); its thread and the
    exception it ended with, if any."""
    failed: list[BaseException] = []

    def job() -> None:
        try:
            EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)

    caplog.set_level(logging.WARNING, logger="refstream.retry")
    runner = threading.Thread(target=job, daemon=True)
    runner.start()
    deadline = time.monotonic() + bound(300)
    while time.monotonic() < deadline and runner.is_alive() and not _timeouts(caplog, says):
        time.sleep(0.2)
    return runner, failed


def _timeouts(caplog: pytest.LogCaptureFixture, says: str) -> list[str]:
    """The retry's log lines of a failed write attempt (the batch's write: creating the table, then
    writing it) that contain ``says``."""
    return [r.getMessage() for r in caplog.records if "writing output failed" in r.getMessage()
            and says in r.getMessage()]
