"""A standalone Spark cluster, started once per test session for the tests that submit jobs to it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from tests.enrich.spark_cluster import Cluster, standalone_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A master and two one-core workers whose processes run this interpreter, shared by the tests
    that submit jobs to a cluster (tests/e2e/test_cluster_state.py): they run one at a time, each
    job gets both workers, and a test finds its own application as the one its job added
    (``Cluster.apps``). test_cluster_packed.py starts its own: its workers' bare
    environment is what it tests."""
    workdir = tmp_path_factory.mktemp("cluster")
    with standalone_cluster(workdir, {**os.environ, "PYSPARK_PYTHON": sys.executable}) as (master, ui):
        yield Cluster(master, ui, workdir)
