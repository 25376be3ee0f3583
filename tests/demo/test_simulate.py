"""The device simulator against the real broker: what it produces is read back and checked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime

from refstream.kafka import read_to_end
from tests.timing import bound

EVENT_FIELDS = {"device_id": str, "ts": str, "temperature": float, "battery": int}


def _simulate(kafka: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "demo.simulate", "--bootstrap", kafka["bootstrap.servers"],
                           "--json", *args], capture_output=True, text=True, timeout=bound(timeout))


def _well_formed(value: bytes) -> dict | None:
    try:
        obj = json.loads(value)
    except ValueError:
        return None
    if not all(isinstance(obj.get(k), t) for k, t in EVENT_FIELDS.items()):
        return None
    return obj


def test_count_burst_produces_keyed_events_with_a_malformed_share(
        kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("events")
    res = _simulate(kafka, "--topic", topic, "--count", "20000", "--devices", "300", "--malformed", "0.05",
                    "--seed", "7")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats["produced"] == stats["delivered"] == 20000
    assert stats["failed"] == 0
    assert 130 <= stats["avg_event_bytes"] <= 170  # ~150-byte events, as the benchmarks assume

    msgs = list(read_to_end(kafka, topic))
    assert len(msgs) == 20000
    good, bad, devices = 0, 0, set()
    for m in msgs:
        key = m.key().decode()
        devices.add(key)
        obj = _well_formed(m.value())
        if obj is None:
            bad += 1
            assert key.encode() in m.value()  # even a broken event says which device sent it
            continue
        good += 1
        assert obj["device_id"] == key
        assert 0 <= obj["battery"] <= 100
        assert datetime.fromisoformat(obj["ts"].replace("Z", "+00:00")).tzinfo is not None
    assert bad == stats["malformed"]
    assert 0.03 * 20000 < bad < 0.07 * 20000
    assert devices <= {f"d-{n}" for n in range(1, 301)}
    assert len(devices) > 290  # uniform over the device population
    seqs = [json.loads(m.value())["seq"] for m in msgs if _well_formed(m.value())]
    assert len(set(seqs)) == len(seqs)


def test_rate_and_duration_bound_the_stream(kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("events")
    t0 = time.monotonic()
    res = _simulate(kafka, "--topic", topic, "--rate", "400", "--duration", "2.5", "--malformed", "0")
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    n = len(list(read_to_end(kafka, topic)))
    assert 800 <= n <= 1100, n  # 400/s for 2.5 s
    assert elapsed < 15
    assert all(_well_formed(m.value()) for m in read_to_end(kafka, topic))


def test_sigterm_stops_cleanly_after_flushing(kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("events")
    proc = subprocess.Popen([sys.executable, "-m", "demo.simulate", "--bootstrap", kafka["bootstrap.servers"],
                             "--topic", topic, "--rate", "300", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Its handlers are installed once it says what it produces to (a fixed sleep raced a slow start).
    assert proc.stderr is not None
    head = []
    for line in proc.stderr:
        head.append(line)
        if "producing to" in line:
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=bound(60))
    err = "".join(head) + err
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["produced"] > 0
    assert stats["delivered"] == stats["produced"]
    assert len(list(read_to_end(kafka, topic))) == stats["produced"]


def test_bad_arguments_give_one_clear_line(kafka: dict[str, str]) -> None:
    res = _simulate(kafka, "--malformed", "1.5", "--count", "1")
    assert res.returncode == 2
    assert res.stderr.strip() == "simulate: --malformed is a share between 0 and 1"
