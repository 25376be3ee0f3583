"""The job SIGKILLed while its calls are in flight, then restarted (issue 24): every event is
written once, and every device's output shows one response per call - the buckets whose responses
were recorded before the kill reuse them, the others call again with the same Idempotency-Keys.

The service answers every request with a new score (a count), so two responses to one call could
not look alike."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from enrich.checkpoint import CheckpointLayout
from tests.enrich.calls.server import serve
from tests.enrich.helpers import produce_events, read_all
from tests.enrich.kill import session_pids
from tests.enrich.process import start_job
from tests.timing import bound

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

DEVICES, TOTAL = 24, 240


def test_a_kill_during_calls_leaves_one_response_per_call_and_each_event_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    with serve(delay=0.25) as svc:
        cfg = {
            "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
            "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, n INT",
                       "starting_offsets": "earliest"},
            "output": {"kafka": {"topic": unique("enriched")}},
            "dead_letter_topic": unique("dlq"),
            "checkpoint": str(tmp_path / "checkpoint"),
            "trigger": "300ms",
            "max_events_per_batch": 80,
            "spark": {"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "2"},
            "state": {"key": "device_id", "timestamp": "ts", "buckets": 4},
            "calls": [
                {"name": "risk", "url": svc.url("/unique"), "body": {"device": "{device_id}"}, "concurrency": 2,
                 "response": {"score": "DOUBLE"}},
                {"name": "action", "url": svc.url("/action"), "needs": ["risk"], "refresh": "every event",
                 "body": {"score": "{risk.score}"}, "response": {"action": "STRING"}},
            ],
        }
        config = tmp_path / "enrich.yaml"
        config.write_text(yaml.safe_dump(cfg))
        produce_events(kafka, cfg["events"]["topic"],
                       [{"device_id": f"d{i % DEVICES}", "ts": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z", "n": i}
                        for i in range(TOTAL)], partitions=2)
        log = tmp_path / "job.log"
        proc = start_job(config, log, "--available-now")
        deadline = time.monotonic() + bound(240)
        while svc.served < DEVICES // 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the job ended before the kill: {log.read_text()[-3000:]}"
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(bound(30)) == -signal.SIGKILL
        recorded = list(CheckpointLayout(Path(cfg["checkpoint"])).calls.glob("*/*.json"))
        before = Counter(svc.keys)

        proc = start_job(config, log, "--available-now")
        assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]

    rows = [json.loads(m.value()) for m in read_all(kafka, cfg["output"]["kafka"]["topic"])]
    got = Counter(r["n"] for r in rows)
    assert set(got) == set(range(TOTAL)) and max(got.values()) == 1, sorted(n for n, c in got.items() if c > 1)
    scores: dict[str, set[float]] = {}
    for r in rows:
        scores.setdefault(r["device_id"], set()).add(r["risk_score"])
        assert r["state"]["risk_score"] == r["risk_score"] and r["action_action"] == f"act-{r['risk_score']}"
    assert all(len(s) == 1 for s in scores.values()), scores
    assert len({s for v in scores.values() for s in v}) == DEVICES    # one response each, none shared
    # The calls in flight at the kill were made again, with the keys they had.
    again = [k for k in before if "-risk-" in k and svc.keys[k] > before[k]]
    assert again, "no call was made again after the kill"
    if recorded:
        assert "replayed" in log.read_text(), "responses recorded before the kill were not reused"
