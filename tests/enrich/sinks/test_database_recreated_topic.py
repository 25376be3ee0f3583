"""``write: events`` when the events topic is deleted and recreated (offsets from 0 again), with the
job run as ``enrich run`` against the real broker and the local PostgreSQL: the new topic's events are
new rows beside the old topic's (the key holds the topic's id), never an overwrite of its history."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.enrich.helpers import produce_events
from tests.enrich.process import run_job, write_config
from tests.enrich.sinks.test_database_kill import fetch
from tests.enrich.source.test_kafka import recreate

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_recreated_events_topic_gives_new_rows(kafka: dict[str, str], unique: Callable[[str], str],
                                                 tmp_path: Path, pg_url: str) -> None:
    config, log = tmp_path / "enrich.yaml", tmp_path / "job.log"
    table = unique("events")
    cfg = write_config(config, kafka, unique, joins=[],
                       output={"database": {"url": pg_url, "table": table, "write": "events"}})
    events = cfg["events"]["topic"]
    produce_events(kafka, events, [{"device_id": "d1", "n": n} for n in range(3)])
    assert run_job(config, log) == 0, log.read_text()[-3000:]
    recreate(kafka, events)
    produce_events(kafka, events, [{"device_id": "d2", "n": 100 + n} for n in range(2)])
    cfg["events"]["on_offset_reset"] = "earliest"
    config.write_text(yaml.safe_dump(cfg))
    assert run_job(config, log) == 0, log.read_text()[-3000:]
    rows = fetch(pg_url, "postgresql", f'SELECT n, "_offset", "_topic_id", "_kind" FROM {table} ORDER BY n')
    assert [(n, o, k) for n, o, _, k in rows] == [(0, 0, "event"), (1, 1, "event"), (2, 2, "event"),
                                                  (100, 0, "event"), (101, 1, "event")]
    first, second = {r[2] for r in rows[:3]}, {r[2] for r in rows[3:]}
    assert len(first) == len(second) == 1 and first != second and "" not in first | second
