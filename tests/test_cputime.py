"""The per-test CPU the suite's summary lists (tests/cputime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests import cputime
from tests.conftest import CPU_EVERY_ENV, CPU_LISTING_ENV
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


def test_the_summary_lists_each_files_cpu_and_writes_every_tests_figure(tmp_path: Path) -> None:
    """A pytest run of this file's first test through the suite's conftest, its meter looking every
    50 ms: the child's 0.5 s, in the listing file and in the summary's list of files."""
    listing = tmp_path / "cpu.tsv"
    here = "tests/test_cputime.py"
    name = f"{here}::test_a_child_still_running_counts_and_the_tree_now_leaves_out_the_ended"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a pytest-xdist worker
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", name],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=bound(120),
                          env={**env, CPU_LISTING_ENV: str(listing), CPU_EVERY_ENV: "0.05"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ((seconds, listed),) = [line.split("\t") for line in listing.read_text().splitlines()]
    assert listed == name and 0.4 <= float(seconds) < 5, (seconds, listed)
    (line,) = [x for x in done.stdout.splitlines() if x.endswith(f"tests  {here}")]
    assert line.split()[:3] == [f"{seconds}s", "cpu", "1"], line
