"""The CPU seconds each test used, for the suite's summary (tests/conftest.py).

The suite is CPU-bound on two cores, so its time is the sum of its tests' CPU, not of their wall
times: a test waiting on a broker's timeout costs the run little, a test starting two Spark jobs
costs it a lot. A test's CPU is what its pytest-xdist worker and every process under it used from
the test's setup to its teardown: the Spark driver JVM and Python workers, the brokers and jobs its
fixtures and the test started (Linux, from ``/proc``). A process is followed from the moment it is
seen under the worker, also after its parent died (a SIGKILLed job's JVM is reparented away): a
:class:`Meter` looks every second, and at each test's start and end, and keeps each process's
latest CPU; a process that lives less than a second between two looks is not counted, nor the last
second of one that ended. A session-scoped service's background work lands on whichever test runs
beside it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: A process: its pid and its start time (clock ticks since boot), which tell a reused pid apart.
Proc = tuple[int, int]


def _stats() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, start time, CPU ticks of the process itself) of every process."""
    out: dict[int, tuple[int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            text = Path("/proc", name, "stat").read_text()
            fields = text[text.rindex(")") + 2:].split()  # the command may hold spaces and parentheses
            # From proc(5)'s field 3 on: ppid is field 4, utime and stime 14-15, starttime 22. Not
            # the reaped children's (cutime, cstime): a child seen alive is counted as itself.
            out[int(name)] = (int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):  # ended meanwhile, or read half-gone
            continue
    return out


def tree_cpu_seconds(root: int | None = None) -> float | None:
    """CPU seconds used so far by ``root`` (default: this process) and every process under it now
    (not those that ended); None off Linux."""
    root = os.getpid() if root is None else root
    stats = _stats()
    if root not in stats:
        return None
    return sum(stats[pid][2] for pid in _under(root, stats)) / _TICK


def _under(root: int, stats: dict[int, tuple[int, int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class Meter:
    """The CPU of this process and every process seen under it, also after it moved away: the
    latest ticks seen of each, looked at every ``every`` seconds by a daemon thread and on
    :meth:`total`."""

    def __init__(self, every: float = 1.0) -> None:
        self._root = os.getpid()
        self._seen: dict[Proc, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._every = every
        self._thread: threading.Thread | None = None

    def start(self) -> Meter:
        self._look()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def total(self) -> float:
        """CPU seconds of every process seen so far, at their latest look (this one included)."""
        self._look()
        with self._lock:
            return sum(self._seen.values()) / _TICK

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._look()

    def _look(self) -> None:
        stats = _stats()
        if self._root not in stats:
            return
        with self._lock:  # the greatest ticks seen: a look that read /proc earlier may store later
            seen = self._seen
            for pid in _under(self._root, stats):
                _, start, ticks = stats[pid]
                seen[(pid, start)] = max(seen.get((pid, start), 0), ticks)
            # A process seen before and now elsewhere (reparented when its parent died): still followed.
            for (pid, start) in list(seen):
                got = stats.get(pid)
                if got is not None and got[1] == start:
                    seen[(pid, start)] = max(seen[(pid, start)], got[2])

    def seen(self, pid: int) -> float | None:
        """CPU seconds of the process ``pid`` at its latest look, if it was seen."""
        with self._lock:
            got = [ticks for (p, _), ticks in self._seen.items() if p == pid]
        return got[-1] / _TICK if got else None
