"""A real local Spark session, started once per test session (the standalone Spark cluster of the
end-to-end tests is tests/e2e/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from py4j.clientserver import ClientServerConnection
from pyspark.sql import SparkSession

from enrich.session import build_session

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
