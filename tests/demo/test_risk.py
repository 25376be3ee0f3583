"""The demo's risk-score service (demo/risk.py), served for real on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from demo.risk import score
from tests.enrich.calls.server import free_port
from tests.timing import bound


def test_the_score_follows_the_temperature_mean() -> None:
    assert score({"mean": 10.0}) == {"score": 0.0, "level": "low"}
    assert score({"mean": 40.0}) == {"score": 90.0, "level": "high"}
    assert score({"mean": None}) == {"score": 0.0, "level": "low"}
    assert score({"mean": 99}) == {"score": 100.0, "level": "high"}


@pytest.mark.integration
def test_the_service_answers_posts_of_json() -> None:
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "demo.risk", "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}/score"
        deadline = time.monotonic() + bound(20)
        while True:
            try:
                req = urllib.request.Request(url, json.dumps({"device": "d-1", "mean": 20.0}).encode(),
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=bound(5)) as r:
                    assert json.loads(r.read()) == {"score": 30.0, "level": "low"}
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the service did not start"
                time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(urllib.request.Request(url, b"nope"), timeout=bound(5))
    finally:
        proc.terminate()
        proc.wait(bound(10))
