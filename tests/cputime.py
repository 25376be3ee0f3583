"""The CPU seconds each test used, for the suite's summary (tests/conftest.py).

The suite is CPU-bound on two cores, so its time is the sum of its tests' CPU, not of their wall
times: a test waiting on a broker's timeout costs the run little, a test starting two Spark jobs
costs it a lot. A test's CPU is what its pytest-xdist worker and every process under it used from
the test's setup to its teardown: the Spark driver JVM and Python workers, the brokers and jobs its
fixtures and the test started (psutil). A process is followed from the moment it is
seen under the worker, also after its parent died (a SIGKILLed job's JVM is reparented away): a
:class:`Meter` looks every second, and at each test's start and end, and keeps each process's
greatest CPU; a process that lives less than a second between two looks is not counted, nor the last
second of one that ended. A session-scoped service's background work lands on whichever test runs
beside it.
"""

from __future__ import annotations

import threading

import psutil


def _cpu(proc: psutil.Process) -> float | None:
    """The process's own CPU seconds (not its reaped children's: a child seen alive counts as
    itself), or None once it has ended (psutil tells a reused pid apart by its start time)."""
    try:
        if not proc.is_running():
            return None
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(t.user + t.system)


def tree_cpu_seconds(root: int | None = None) -> float | None:
    """CPU seconds used so far by ``root`` (default: this process) and every process under it now
    (not those that ended); None if ``root`` does not exist."""
    try:
        proc = psutil.Process(root)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    return sum(c for c in map(_cpu, procs) if c is not None)


class Meter:
    """The CPU of this process and every process seen under it, also after it moved away: the
    greatest CPU seen of each, looked at every ``every`` seconds by a daemon thread and on
    :meth:`total`."""

    def __init__(self, every: float = 1.0) -> None:
        self._root = psutil.Process()
        self._live: dict[psutil.Process, float] = {}  # followed, at their latest look
        self._ended = 0.0  # the processes that ended, at their last look
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._every = every

    def start(self) -> Meter:
        self._look()
        threading.Thread(target=self._run, name="cpu-meter", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def total(self) -> float:
        """CPU seconds of every process seen so far, at their latest look (this one included)."""
        self._look()
        with self._lock:
            return self._ended + sum(self._live.values())

    def seen(self, pid: int) -> float | None:
        """CPU seconds of the live process ``pid`` at its latest look, if it is followed."""
        with self._lock:
            return next((cpu for p, cpu in self._live.items() if p.pid == pid), None)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._look()

    def _look(self) -> None:
        # One look at a time: the greatest CPU is kept, and an ended process is moved once.
        with self._lock:
            try:
                for child in self._root.children(recursive=True):
                    self._live.setdefault(child, 0.0)
            except psutil.NoSuchProcess:
                pass
            self._live.setdefault(self._root, 0.0)
            # A process seen before and now elsewhere (reparented when its parent died): still followed.
            for proc, last in list(self._live.items()):
                cpu = _cpu(proc)
                if cpu is None:
                    self._ended += last
                    del self._live[proc]
                else:
                    self._live[proc] = max(last, cpu)
