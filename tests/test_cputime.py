"""The per-test CPU the suite's summary lists (tests/cputime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests import cputime
from tests.timing import bound

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
# A child that starts a grandchild burning CPU (then idling) and prints its pid, then waits to be
# killed: the grandchild is reparented away from this process's tree while it goes on burning.
ORPHAN = f"""import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", {BURN + "time.sleep(600)"!r}], start_new_session=True)
print(p.pid, flush=True)
sys.stdin.read()
"""


def test_a_child_still_running_counts_and_the_tree_now_leaves_out_the_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN + "import sys\nsys.stdin.read()\n"], stdin=subprocess.PIPE)
    try:
        while (cputime.tree_cpu_seconds(child.pid) or 0) < 0.45:
            assert child.poll() is None
            time.sleep(0.05)
        assert (cputime.tree_cpu_seconds() or 0) >= 0.45
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    assert cputime.tree_cpu_seconds(child.pid) is None


def test_the_meter_follows_a_process_after_its_parent_died() -> None:
    meter = cputime.Meter(every=60).start()  # looks only when asked: no race with its thread
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert parent.stdout is not None
    orphan = int(parent.stdout.readline())
    try:
        meter.total()
        assert meter.seen(orphan) is not None  # seen under this process's tree
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + bound(60)
        while (cputime.tree_cpu_seconds(orphan) or 0) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)  # burning on, outside this tree
        assert orphan not in {c.pid for c in psutil.Process().children(recursive=True)}
        burnt = cputime.tree_cpu_seconds(orphan)
        assert burnt is not None and burnt >= 0.45
        meter.total()
        assert (meter.seen(orphan) or 0) >= 0.45  # followed: not left at what it had when first seen
    finally:
        meter.stop()
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass
