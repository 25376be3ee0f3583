"""A real local Spark session and a standalone Spark cluster, each started once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from py4j.clientserver import ClientServerConnection
from pyspark.sql import SparkSession

from enrich.session import build_session
from tests.enrich.spark_cluster import Cluster, standalone_cluster

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


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A master and two one-core workers whose processes run this interpreter, shared by the tests
    that submit jobs to a cluster (tests/enrich/test_cluster.py, state/test_cluster_state.py): they
    run one at a time, each job gets both workers, and a test finds its own application as the one
    its job added (``Cluster.apps``). test_cluster_packed.py starts its own: its workers' bare
    environment is what it tests."""
    workdir = tmp_path_factory.mktemp("cluster")
    with standalone_cluster(workdir, {**os.environ, "PYSPARK_PYTHON": sys.executable}) as (master, ui):
        yield Cluster(master, ui, workdir)
