"""What the benchmarks share: the broker they measure against."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path


def broker_settings(stack: ExitStack, bootstrap: str | None) -> dict[str, str]:
    """Client settings for ``bootstrap``, or for an embedded broker that ``stack`` stops at exit."""
    if bootstrap:
        return {"bootstrap.servers": bootstrap}
    from demo.broker import EmbeddedBroker

    broker = stack.enter_context(EmbeddedBroker())
    return {"bootstrap.servers": broker.bootstrap}


def thread_times(pid: int) -> Iterator[tuple[int, str, float]]:
    """(thread id, name, CPU seconds so far: user + system) of every thread of process ``pid``,
    from ``/proc``; threads that end while being read are left out."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return
    for task in tasks:
        try:
            comm = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        parts = stat[stat.rindex(")") + 2:].split()
        yield int(task.name), comm, (int(parts[11]) + int(parts[12])) / tick
