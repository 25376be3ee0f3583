"""A real local Spark session, started once per test session (the standalone Spark cluster of the
end-to-end tests is tests/e2e/conftest.py's)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from py4j.clientserver import ClientServerConnection
from pyspark.sql import SparkSession

from enrich.session import build_session

log = logging.getLogger(__name__)

_send_command = ClientServerConnection.send_command


def _send_or_drop(self: ClientServerConnection, command: str) -> str:
    # py4j turns an Exception into a network error and drops the connection, but a BaseException
    # (pytest-timeout's failure, KeyboardInterrupt) leaves the thread's connection open with the
    # interrupted call's answer unread: every later call on it, in every later test sharing this
    # session, would read the answer meant for the one before. Drop the connection instead.
    try:
        return _send_command(self, command)
    except Exception:
        raise
    except BaseException:
        self.close(reset=True)
        raise


@pytest.fixture(autouse=True)
def _active_session() -> None:
    # A connection dropped above is replaced by one served by another JVM thread, where Spark's
    # thread-local active session is unset: set it again for each test, if a session exists.
    session = SparkSession._instantiatedSession
    if session is not None and session._jvm is not None:
        session._jvm.SparkSession.setActiveSession(session._jsparkSession)


ClientServerConnection.send_command = _send_or_drop  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "refstream-tests", {"spark.driver.memory": "2g"})
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(autouse=True)
def _no_leftover_queries(request: pytest.FixtureRequest) -> Iterator[None]:
    # A streaming query a test leaves running keeps taking the shared session's two task slots in
    # every later test; stop it here, and say which test left it.
    yield
    session = SparkSession._instantiatedSession
    if session is None or session._jvm is None:
        return
    for query in session.streams.active:
        log.warning("%s left streaming query %s running; stopped", request.node.nodeid, query.id)
        query.stop()


# A test that hangs in Spark fails by pytest-timeout with the Python threads' stacks, which show
# only that the driver waits. Shortly before the timeout, say what Spark and its JVM were doing:
# the active stages and their tasks, the heap (a full one stalls everything) and the Python workers.
REPORT_BEFORE_S = 45.0


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    if settings.timeout:
        before = min(REPORT_BEFORE_S, settings.timeout / 4)
        timer = threading.Timer(settings.timeout - before, _report_hang, (item.nodeid, before))
        timer.daemon = True
        timer.start()
        item.stash[_HANG_TIMER] = timer


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = item.stash.get(_HANG_TIMER, None)
    if timer is not None:
        timer.cancel()


_HANG_TIMER = pytest.StashKey[threading.Timer]()


def _report_hang(nodeid: str, before: float) -> None:
    lines = [f"+++ {nodeid}: {before:.0f} s before its timeout +++"]
    session = SparkSession._instantiatedSession
    pid: int | None = None
    workers: list[str] = []
    if session is not None and session._jvm is not None:
        try:
            pid = int(session._jvm.java.lang.ProcessHandle.current().pid())
            tracker = session.sparkContext.statusTracker()
            lines.append(f"active jobs {tracker.getActiveJobsIds()}, queries {[q.name or q.id for q in session.streams.active]}")
            for sid in tracker.getActiveStageIds():
                s = tracker.getStageInfo(sid)
                if s is not None:
                    lines.append(f"stage {sid} {s.name}: {s.numTasks} tasks, {s.numActiveTasks} active, "
                                 f"{s.numCompletedTasks} done, {s.numFailedTasks} failed")
        except Exception as exc:  # noqa: BLE001 - a report; the JVM may be what hangs
            lines.append(f"Spark did not answer: {exc!r}")
    if pid is not None:
        lines += [f"$ jcmd {pid} GC.heap_info", _run(["jcmd", str(pid), "GC.heap_info"])]
        table = _run(["ps", "-e", "-ww", "-o", "pid,ppid,stat,etime,time,rss,args"]).splitlines()
        tree, parent = {pid}, {int(r.split()[0]): int(r.split()[1]) for r in table[1:] if r.split()[0].isdigit()}
        while True:  # to a fixed point: pids wrap, so a child's may be lower than its parent's
            more = {p for p, pp in parent.items() if pp in tree} - tree
            if not more:
                break
            tree |= more
        rows = [r for r in table[1:] if int(r.split()[0]) in tree]
        lines += ["the JVM's processes:", table[0]] + [r[:200] for r in rows]
        workers = [r.split()[0] for r in rows if "pyspark.worker" in r]
    print("\n".join(lines), file=sys.stderr, flush=True)
    for worker in workers:  # each prints its stacks (enrich/daemon.py), one after the other
        _run(["kill", "-USR2", worker])
        time.sleep(0.5)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.rstrip()
    except (OSError, subprocess.SubprocessError) as exc:
        return repr(exc)
