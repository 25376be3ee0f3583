"""The job with ``output.database`` (``write: events``, with state; PostgreSQL and MariaDB) SIGKILLed while one slot of a
micro-batch has committed its database transaction and another holds its rows uncommitted, then
restarted: every event is in the table once, and every row's state counts each of its device's
events once (the replayed batch's state was not applied twice, and the committed slot skipped it
by its fence row).

The kill goes through the kill hook (tests/enrich/kill.py, ``job:``): the first slot with rows in a
batch from 1 on waits until another slot's fence row of that batch is committed, then kills every
process of the job inside its own transaction."""

from __future__ import annotations

import re
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from enrich.config import DatabaseDialect
from enrich.ops.batches import Checkpoint
from enrich.sinks.database.connect import connect, quote
from tests.enrich.helpers import produce_events
from tests.enrich.kill import read_note, session_pids
from tests.enrich.process import start_job, write_config
from tests.timing import bound

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

TOTAL, PER_BATCH = 600, 100
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_kill_between_two_slots_commits_leaves_each_event_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, request: pytest.FixtureRequest,
        db: str) -> None:
    url: str = request.getfixturevalue(db)
    dialect: DatabaseDialect = "postgresql" if db == "pg_url" else "mysql"
    config = tmp_path / "enrich.yaml"
    table = unique("events")
    cfg = write_config(config, kafka, unique, max_events_per_batch=PER_BATCH, joins=[],
                       events={"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, n INT",
                               "starting_offsets": "earliest"},
                       output={"database": {"url": url, "table": table, "write": "events"}},
                       state={"key": "device_id", "timestamp": "ts", "ttl": "2h", "watermark": "1h"})
    produce_events(kafka, cfg["events"]["topic"],
                   [{"device_id": f"d{i % 12}", "ts": (T0 + timedelta(seconds=i)).isoformat(), "n": i}
                    for i in range(TOTAL)], partitions=2)
    log, flag = tmp_path / "job.log", tmp_path / "killed"

    proc = start_job(config, log, "--available-now", kill=f"job:1+:*:{flag}")
    rc = proc.wait(bound(300))
    note = read_note(flag) if flag.exists() else None
    assert rc == -signal.SIGKILL and note is not None, f"exit {rc}, no kill: {log.read_text()[-3000:]}"
    assert note["other"] is not None, f"no other slot committed batch {note['batch']}: {note}"
    deadline = time.monotonic() + bound(10)
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_pids(proc.pid) == [], "a process of the killed job survived"
    batch = note["batch"]
    fenced = {r[0] for r in fetch(url, dialect, f"SELECT slot FROM {quote(dialect, table + '_commits')} "
                                                "WHERE batch_id = %s", (batch,))}
    assert note["other"] in fenced and note["slot"] not in fenced, fenced
    last = Checkpoint(Path(cfg["checkpoint"])).last_committed()
    assert last is None or last < batch

    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    rows = fetch(url, dialect, f"SELECT n, device_id, state_events FROM {quote(dialect, table)}")
    assert sorted(r[0] for r in rows) == list(range(TOTAL))
    counts: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for n, device, events in rows:
        counts[device].append((n, events))
    for device, seen in counts.items():
        assert [e for _, e in sorted(seen)] == list(range(1, len(seen) + 1)), device
    # The replay skipped the committed slot by its fence row.
    assert re.search(rf"batch {batch}: \d+ rows to {table} by \d+ task\(s\) \([1-9]\d* skipped as committed\)",
                     log.read_text()), log.read_text()[-3000:]


def fetch(url: str, dialect: DatabaseDialect, sql: str, params: tuple = ()) -> list[tuple]:
    """The rows of one query, on a connection of its own (committed rows only)."""
    conn = connect(url, dialect)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            rows = list(cur.fetchall())
        conn.commit()
        return rows
    finally:
        conn.close()
