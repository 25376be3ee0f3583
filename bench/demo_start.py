"""The demo's start: from ``python -m demo`` to the first enriched event it prints.

    python -m bench.run demo_start --rounds 3

Each round starts the demo as ``make demo`` does (its defaults: 5,000 devices, 500 events/s,
SQLite) in a work directory of its own, times the line that prints the first enriched event, then
stops the demo with SIGINT (Ctrl-C) and waits for it to stop its processes. The target (issue 44):
the first enriched event within 30 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT

FIRST = " -> model "  # the first enriched event's line (demo/cli.py)


def one_round(workdir: Path, timeout: float) -> float:
    """Seconds from the demo's process start to its first enriched event's line."""
    env = {k: v for k, v in os.environ.items() if k != "REF_DB_URL"}  # the demo's SQLite default
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "demo", "--workdir", str(workdir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = threading.Event()
    took: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if FIRST in line and not seen.is_set():
                took.append(time.monotonic() - t0)
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = t0 + timeout
        while not seen.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"no enriched event ({'the demo exited' if proc.poll() is not None else 'timed out'})"
                                 f":\n{''.join(lines[-20:])}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # the demo stops its processes one by one, each given up to 40 s
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
    return took[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.run demo_start", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a round may wait for its first event")
    args = p.parse_args(argv)
    times = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-start-") as tmp:
        for i in range(args.rounds):
            took = one_round(Path(tmp) / f"round{i}", args.timeout)
            times.append(took)
            print(f"round {i + 1}: first enriched event {took:.1f} s after the demo's start", flush=True)
    print(f"median of {len(times)}: {statistics.median(times):.1f} s (target: at most 30 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
