"""The CPU seconds each test used, for the suite's summary (tests/conftest.py).

The suite is CPU-bound on two cores, so its time is the sum of its tests' CPU, not of their wall
times: a test waiting on a broker's timeout costs the run little, a test starting two Spark jobs
costs it a lot. A test's CPU is what its pytest-xdist worker's process tree used from the test's
setup to its teardown: the worker, the Spark driver JVM and Python workers it started, the brokers
and jobs its fixtures and the test started, and the processes that ended meanwhile (Linux, from
``/proc``). A session-scoped service's background work lands on whichever test runs beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stats() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks of the process and its reaped children) of every process."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            text = Path("/proc", name, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # the command may hold spaces and parentheses
        # state, ppid, ... utime stime cutime cstime are fields 14-17 of proc(5), 11-14 here.
        out[int(name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    return out


def tree_cpu_seconds(root: int | None = None) -> float | None:
    """CPU seconds used so far by ``root`` (default: this process) and every process under it,
    ended ones included once their parent reaped them; None off Linux."""
    root = os.getpid() if root is None else root
    stats = _stats()
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / _TICK
