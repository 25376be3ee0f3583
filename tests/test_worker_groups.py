"""`make test`'s worker groups (tests/conftest.py: WORKER_GROUPS): each group runs on one
pytest-xdist worker. pytest-xdist's own xdist_group marks stopped grouping silently under pytest 9.2,
so this runs a small suite on two workers and reads where each test ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import WORKER_GROUPS, worker_group

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_belongs_to_the_group_its_node_id_starts_with() -> None:
    assert worker_group("tests/refresh/test_diff.py::test_x") == "wall-clock"
    assert worker_group("tests/refstream/test_logs.py::test_y[a]") == "wall-clock"
    assert worker_group("tests/e2e/test_cluster_state.py::test_device_state_and_a_partitioned_dimension_on_a_two_worker_standalone_cluster") == "cluster"
    assert worker_group("tests/e2e/test_cluster_packed.py::test_z") is None  # it starts a cluster of its own
    assert worker_group("tests/enrich/test_job.py::test_w") is None
    assert all(prefix.startswith("tests/") for prefixes in WORKER_GROUPS.values() for prefix in prefixes)



def test_every_group_names_test_files_that_exist() -> None:
    """A test module moved without its prefix here would leave its group silently."""
    missing = [prefix for prefixes in WORKER_GROUPS.values() for prefix in prefixes
               if not (ROOT / prefix.removesuffix("::")).exists()]
    assert not missing, missing

@pytest.mark.integration
def test_a_group_runs_on_one_worker_and_the_other_tests_spread() -> None:
    # Two small modules of the wall-clock group and two outside it (ten tests there, so both
    # workers take some), on two workers.
    paths = ["tests/refstream/test_retry.py", "tests/refstream/test_errors.py",
             "tests/test_layers.py", "tests/enrich/test_packed.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", "-v", *paths], cwd=ROOT, capture_output=True, text=True).stdout
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (\S+)", out, re.MULTILINE)
    assert ran, out
    grouped = {worker for worker, nodeid in ran if worker_group(nodeid) == "wall-clock"}
    others = {worker for worker, nodeid in ran if worker_group(nodeid) is None}
    assert len(grouped) == 1, ran
    assert others - grouped, ran  # the other worker took the rest
