"""A Python worker that does not start fails the query at its start; the job starts the query again
from its checkpoint instead of exiting (``EnrichJob.run``, ``worker_start_failed``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from enrich.job import worker_start_failed
from tests.enrich.helpers import read_all
from tests.enrich.test_restart import seed, start_job, write_config

pytestmark = pytest.mark.integration  # starts a job process


def test_only_a_worker_start_failure_counts_as_transient() -> None:
    assert worker_start_failed(RuntimeError("[STREAM_FAILED] ... Python worker failed to connect back. SQLSTATE"))
    assert not worker_start_failed(RuntimeError("[STREAM_FAILED] ... refstream.errors.DataError: bad row"))


def test_the_query_starts_again_when_a_python_worker_does_not_start(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    # The workers' interpreter: the first process that is not Spark's worker daemon (the Python data
    # source's planning worker, started when the query starts) exits without connecting back.
    flag, calls = tmp_path / "failed-once", tmp_path / "calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
case "$*" in
  *daemon*) ;;
  *) if [ ! -e {flag} ]; then touch {flag}; exit 1; fi ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    total = 300
    seed(kafka, cfg, total)
    log = tmp_path / "job.log"
    proc = start_job(config, log, "--available-now", env={"PYSPARK_PYTHON": str(wrapper)})
    rc = proc.wait(300)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert flag.exists(), calls.read_text() if calls.exists() else "the wrapper never ran"
    assert "a Python worker did not start, which is transient: starting the query again" in text, text[-4000:]
    rows = [json.loads(m.value()) for m in read_all(kafka, cfg["output"]["kafka"]["topic"])]
    assert sorted(r["n"] for r in rows) == list(range(total))
