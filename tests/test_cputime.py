"""The per-test CPU the suite's summary lists (tests/cputime.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import cputime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"


def test_a_child_that_ended_counts_and_one_still_running_counts_too() -> None:
    before = cputime.tree_cpu_seconds()
    assert before is not None
    subprocess.run([sys.executable, "-c", BURN], check=True)  # ended and reaped: the parent's cutime
    ended = cputime.tree_cpu_seconds()
    assert ended is not None and ended - before >= 0.45
    child = subprocess.Popen([sys.executable, "-c", BURN + "import sys\nsys.stdin.read()\n"],
                             stdin=subprocess.PIPE)
    try:
        # Alive, under this process: its own ticks count, once it has burnt them.
        while (cputime.tree_cpu_seconds(child.pid) or 0) < 0.45:
            assert child.poll() is None
            time.sleep(0.05)
        now = cputime.tree_cpu_seconds()
        assert now is not None and now - ended >= 0.45
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)


def test_a_process_that_does_not_exist_has_none() -> None:
    assert cputime.tree_cpu_seconds(2 ** 22 + 7) is None
