"""A Python worker that does not start, does not connect to the JVM, or gets no answer from its
task's state server fails the query; the job starts the query again from its checkpoint instead of
exiting (``EnrichJob.run``, ``transient_worker_failure``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from enrich.failures import transient_worker_failure
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.process import SCHEMA, seed, start_job, write_config
from tests.timing import bound

pytestmark = pytest.mark.integration  # starts a job process


def test_only_a_worker_start_or_a_silent_state_server_counts_as_transient() -> None:
    started = "a Python worker did not start"
    assert transient_worker_failure(RuntimeError(
        "[STREAM_FAILED] ... Python worker failed to connect back. SQLSTATE")) == started
    state_server = ('    stateful_processor_api_client = StatefulProcessorApiClient(\n  File "..."\n'
                    '    self._client_socket.connect(("localhost", state_server_port))\n{}: [Errno 110] ...')
    assert transient_worker_failure(RuntimeError(state_server.format("TimeoutError"))) == started
    assert transient_worker_failure(RuntimeError(state_server.format("ConnectionRefusedError"))) == started
    # The driver reading a batch's write results (a collect()) from a socket the JVM had closed.
    assert transient_worker_failure(RuntimeError(
        "[FOREACH_BATCH_USER_FUNCTION_ERROR] ... pyspark.errors.exceptions.base.PySparkRuntimeError: "
        "[CANNOT_OPEN_SOCKET] Can not open socket: [\"tried to connect to ('127.0.0.1', 42145), but an error "
        "occurred: [Errno 111] Connection refused\"].\n ... UnboundLocalError: cannot access local variable "
        "'sockfile' where it is not associated with a value")) == started
    # A request that the state server did not answer within state.server_timeout.
    silent = transient_worker_failure(RuntimeError(
        '  File "/x/pyspark/sql/streaming/stateful_processor_api_client.py", line 462, in '
        '_receive_proto_message\n    length = read_int(self.sockfile)\n ... TimeoutError: timed out'))
    assert silent is not None and "no answer from its state server" in silent
    assert transient_worker_failure(RuntimeError("[STREAM_FAILED] ... refstream.errors.DataError: bad row")) is None
    # A state step's worker failing on something other than its connection is not a start failure.
    assert transient_worker_failure(RuntimeError(
        "stateful_processor_api_client = StatefulProcessorApiClient(\n ... TimeoutError in handle_pre_init")) is None
    # A timeout elsewhere (an external call's, say) is not the state server's.
    assert transient_worker_failure(RuntimeError('  File "/x/enrich/calls/client.py" ... TimeoutError: timed out')) is None


def run_restarted(tmp_path: Path, kafka: dict[str, str], config: Path, cases: str,
                  why: str = "a Python worker did not start") -> tuple[str, list[dict]]:
    """Run the job of ``config`` available-now with a shell wrapper as the workers' interpreter, which
    runs ``cases`` (branches of a ``case "$*"`` on the worker's arguments) first; check that it ended
    well, starting its query again on the way for ``why``, and return its log and output rows."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/sh
case "$*" in
{cases}
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    log = tmp_path / "job.log"
    proc = start_job(config, log, "--available-now", env={"PYSPARK_PYTHON": str(wrapper)})
    try:
        rc = proc.wait(bound(300))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the job did not end:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert f"{why}, which is transient: starting the query again" in text, text[-4000:]
    topic = yaml.safe_load(config.read_text())["output"]["kafka"]["topic"]
    return text, [json.loads(m.value()) for m in read_all(kafka, topic)]


def test_the_query_starts_again_when_a_python_worker_does_not_start(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    # The workers' interpreter: the first process that is not Spark's worker daemon (the Python data
    # source's planning worker, started when the query starts) exits without connecting back.
    flag, calls = tmp_path / "failed-once", tmp_path / "calls.log"
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    total = 300
    seed(kafka, cfg, total)
    _, rows = run_restarted(tmp_path, kafka, config, f"""  *daemon*) echo "$@" >> {calls} ;;
  *) echo "$@" >> {calls}; if [ ! -e {flag} ]; then touch {flag}; exit 1; fi ;;""")
    assert flag.exists(), calls.read_text() if calls.exists() else "the wrapper never ran"
    assert sorted(r["n"] for r in rows) == list(range(total))


# Imported by the job's Python worker daemon only (the test's wrapper puts it on that process's path):
# the first state step's worker of an executor task connects to a socket nothing listens on, for
# real, through PySpark's own connect line, as a worker does whose task's state server has gone.
REFUSE_ONCE = """
import os, socket, tempfile
from pyspark.sql.streaming import stateful_processor_api_client as api

_init = api.StatefulProcessorApiClient.__init__

def _refuse_once(self, state_server_port, key_schema, is_driver=False):
    if not is_driver:
        try:
            os.close(os.open({flag!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            # the job's state servers are Unix sockets (enrich.session): a socket file that nothing
            # listens on refuses the connection
            state_server_port = os.path.join(tempfile.mkdtemp(), "refused.sock")
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(state_server_port)
    _init(self, state_server_port, key_schema, is_driver)

api.StatefulProcessorApiClient.__init__ = _refuse_once
"""


def run_injected_state_job(tmp_path: Path, kafka: dict[str, str], unique: Callable[[str], str], inject: str,
                           total: int, why: str = "a Python worker did not start", **state: str) -> tuple[str, list[dict]]:
    """A job with state over ``total`` events of one device, run through :func:`run_restarted` with
    ``inject`` as the ``sitecustomize`` of the workers' daemon (``state``: more ``state:`` keys); its
    log and output rows."""
    path = tmp_path / "inject"
    path.mkdir()
    (path / "sitecustomize.py").write_text(inject)
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique, state={"key": "device_id", "timestamp": "ts", "watermark": "2h",
                                                     "aggregates": {"n": ["max"]}, **state})
    cfg["events"]["schema"] = "device_id STRING, ts TIMESTAMP, n INT"
    config.write_text(yaml.safe_dump(cfg))
    publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": "d1", "owner": "o1"}]))
    produce_events(kafka, cfg["events"]["topic"],
                   [{"device_id": "d1", "ts": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}", "n": i}
                    for i in range(total)], partitions=2)
    return run_restarted(tmp_path, kafka, config, f"  *daemon*) PYTHONPATH={path}:$PYTHONPATH; export PYTHONPATH ;;",
                         why)


def test_the_query_starts_again_when_a_state_worker_cannot_reach_its_state_server(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    flag = tmp_path / "refused-once"
    total = 200
    text, rows = run_injected_state_job(tmp_path, kafka, unique, REFUSE_ONCE.format(flag=str(flag)), total)
    assert flag.exists(), "no state step's worker was refused: the test proves nothing"
    assert "ConnectionRefusedError" in text, text[-4000:]
    assert sorted(r["n"] for r in rows) == list(range(total))
    # The state counted every event once, the refused batch's included.
    assert max(r["state"]["events"] for r in rows) == total


# Imported by the job's Python worker daemon only: the first state step's worker of an executor task
# sends its requests to a listening socket that never answers (it accepts nothing, so the connection
# waits in its backlog), as a worker's do whose task's state server thread has died.
SILENT_ONCE = """
import os, socket, tempfile
from pyspark.sql.streaming import stateful_processor_api_client as api

_init = api.StatefulProcessorApiClient.__init__
_kept = []

def _silent_once(self, state_server_port, key_schema, is_driver=False):
    _init(self, state_server_port, key_schema, is_driver)
    if is_driver:
        return
    try:
        os.close(os.open({flag!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(tempfile.mkdtemp(), "silent.sock"))
    listener.listen(1)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(listener.getsockname())
    _kept.extend([listener, self._client_socket, self.sockfile])  # the real ones stay open, unused
    self._client_socket, self.sockfile = silent, silent.makefile("rwb", 65536)

api.StatefulProcessorApiClient.__init__ = _silent_once
"""


def test_the_query_starts_again_when_a_state_server_stops_answering(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    flag = tmp_path / "silent-once"
    total = 100
    _, rows = run_injected_state_job(
        tmp_path, kafka, unique, SILENT_ONCE.format(flag=str(flag)), total,
        why="a state step's worker got no answer from its state server within state.server_timeout",
        server_timeout="5s")
    assert flag.exists(), "no state step's worker was sent to a silent server: the test proves nothing"
    assert sorted(r["n"] for r in rows) == list(range(total))
    assert max(r["state"]["events"] for r in rows) == total
