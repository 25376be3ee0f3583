"""Real services (Kafka-protocol broker, MariaDB database) and factories for unique names.

- ``kafka``: librdkafka settings of a broker started once per test module (the embedded Tansu broker,
  or ``REFSTREAM_TEST_BOOTSTRAP`` to run the suite against another broker, e.g. real Kafka).
- ``mysql_url``: SQLAlchemy URL of a database created for this session on the MariaDB at
  ``REFSTREAM_TEST_MYSQL`` (default ``mysql+pymysql://root@127.0.0.1:3306``), dropped at the end.
- ``unique``: ``unique("topic")`` -> ``topic-<random>`` so tests never share topics, tables or dirs.

Tests come in two tiers. A test that needs a service - a fixture in ``SERVICE_FIXTURES``, directly or
through another fixture - is marked ``integration`` here; modules that start Spark, a broker or
child processes themselves carry the mark explicitly, as do the few tests that run the daemon's
scheduler or the file watcher for seconds of wall-clock time. The rest is the fast tier:
``pytest -m "not integration"`` (``make test-fast``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from demo.broker import EmbeddedBroker, serialise_transaction_ends, serialise_transactions
from refstream.kafka import SERIAL_TXN_ENDS_ENV, SERIAL_TXNS_ENV
from tests import cputime, timing
from tests.spark_archive import submit_args, with_tests_importable

# Before any Spark session or child process starts (they inherit it): the embedded broker's workarounds
# (demo.broker.serialise_transaction_ends and serialise_transactions), harmless against another broker.
# Their locks guard one broker's transactions: under pytest-xdist each worker starts brokers of its own,
# so each worker gets locks of its own (one broker shared by every worker keeps one pair). Set, not
# defaulted: the workers inherit the controller's environment, where this module set the shared pair.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and not os.environ.get("REFSTREAM_TEST_BOOTSTRAP"):
    for _env in (SERIAL_TXN_ENDS_ENV, SERIAL_TXNS_ENV):
        os.environ[_env] = str(Path(tempfile.gettempdir()) / f"refstream-{_env.lower()}-{_WORKER}.lock")
serialise_transaction_ends()
serialise_transactions()
# Spark's Python workers must run this interpreter (the venv), not the first python3 on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# The Spark defaults of every driver the tests start through PySpark (their session, `enrich run`,
# the demo): tests/spark-conf/spark-defaults.conf, copied into the run's directory, where the copy
# names the class-data-sharing archive once it is made (spark_defaults). Given as spark-submit's
# --properties-file, below a job's own `spark:` section, and not through SPARK_CONF_DIR: that
# directory would go on the JVM's class path, where a directory holding files turns class-data
# sharing off.
SPARK_DEFAULTS = Path(__file__).parent / "spark-conf" / "spark-defaults.conf"
os.environ.pop("SPARK_CONF_DIR", None)


def spark_defaults_less(prefix: str, to: Path) -> dict[str, str]:
    """The environment entry of a driver whose Spark defaults are the tests' current ones less the
    lines starting with ``prefix``, written to ``to``."""
    lines = spark_defaults().read_text().splitlines()
    to.write_text("".join(f"{line}\n" for line in lines if not line.startswith(prefix)))
    return {"PYSPARK_SUBMIT_ARGS": submit_args(to)}


def _run_defaults() -> Path:
    """The run's copy of the tests' Spark defaults: one path for the whole run, so that a driver
    started late by a long test (the soak's restarts, say) reads the archive's line as well."""
    return Path(os.environ["REFSTREAM_TEST_RUN_DIR"]) / "spark-defaults.conf"


# pytest-xdist's workers inherit the run's directory (pytest_configure); the controller, or a run
# without workers, sets it there.
os.environ["PYSPARK_SUBMIT_ARGS"] = submit_args(
    _run_defaults() if os.environ.get("REFSTREAM_TEST_RUN_DIR") else SPARK_DEFAULTS)

# Fixtures that start or reach a real service: the broker, MariaDB, a Spark session or cluster, the
# services run as processes.
SERVICE_FIXTURES = frozenset({
    "kafka",                                              # tests/conftest.py: the broker
    "mysql_server_url", "mysql_url",                      # tests/conftest.py: MariaDB
    "mysql_engine",                                       # tests/refresh/conftest.py
    "init_db",                                            # tests/demo/conftest.py
    "spark",                                              # tests/enrich/conftest.py
    "cluster",                                            # tests/e2e/conftest.py: a standalone cluster
    "bare_cluster",                                       # tests/e2e/test_cluster_packed.py: another
    "stack",                                              # tests/demo/test_native_topology.py
    "chromium",                                           # tests/conftest.py: a headless browser
    # Not a service, but the OS file watcher on wall-clock debounce windows: seconds per test.
    "watched",                                            # tests/refresh/test_watch.py
})


# Tests that one pytest-xdist worker runs in turn (`make test`: --dist loadgroup), by node id prefix:
# - "cluster": the shared standalone cluster's jobs, so it starts once and each job gets both its workers;
# - "wall-clock": the refresher's and the contract's tests. They start no Spark and mostly wait on the
#   wall clock (a broker down for 60 s, schedules, debounces): one worker runs them beside the Spark
#   tests from the start, instead of leaving the cores idle at the end of the run.
# The groups go by node id, not by xdist_group marks: pytest 9.2 ignores the group suffix pytest-xdist
# 3.8 writes into marked tests' node ids (pytest-dev/pytest-xdist#1386), so marks no longer group.
WORKER_GROUPS: dict[str, tuple[str, ...]] = {
    "cluster": ("tests/e2e/test_cluster_state.py::",),
    "wall-clock": ("tests/refresh/", "tests/refstream/"),
}


def worker_group(nodeid: str) -> str | None:
    """The ``WORKER_GROUPS`` entry a test belongs to, if any."""
    return next((group for group, prefixes in WORKER_GROUPS.items() if nodeid.startswith(prefixes)), None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup by ``WORKER_GROUPS``: a group is one unit of work, the largest handed out first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid) or nodeid

    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before the -m filter deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: fixtures requested through other fixtures count too.
        names = getattr(item, "fixturenames", ())
        if SERVICE_FIXTURES.intersection(names):
            item.add_marker(pytest.mark.integration)
        if "cluster" in names and worker_group(item.nodeid) != "cluster":
            raise pytest.UsageError(f"{item.nodeid} uses the shared standalone cluster: add its module "
                                    "to WORKER_GROUPS['cluster'] in tests/conftest.py")
        _scale_timeout(item)
    # The longest tests first (stable otherwise): `make test`'s workers take them at the start, and
    # the short ones fill in around them, instead of one worker ending on a long test alone.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _scale_timeout(item: pytest.Item) -> None:
    """pytest-timeout's limit of ``item`` (its mark's, or the suite's 900 s), stretched for this machine
    (tests/timing.py) as the tests' own waits are: it stops a hang, it does not time the test."""
    mark = item.get_closest_marker("timeout")
    base = (mark.args[0] if mark.args else mark.kwargs.get("timeout")) if mark is not None else None
    if base is None:
        base = float(item.config.getini("timeout") or 0)
    if base:
        item.add_marker(pytest.mark.timeout(timing.bound(float(base))), append=False)


_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    global _run_start
    _config.append(config)
    # One directory for the run, shared by pytest-xdist's workers (they inherit the environment).
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["REFSTREAM_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="refstream-tests-")
        _run_defaults().write_bytes(SPARK_DEFAULTS.read_bytes())
        os.environ["PYSPARK_SUBMIT_ARGS"] = submit_args(_run_defaults())
        cpu = _cpu_seconds()
        _run_start = None if cpu is None else (cpu, time.monotonic())
        # Before the workers start, which inherit it: how much to stretch every bound (tests/timing.py).
        timing.measure()


# The suite's time depends on the machine as much as on the suite: the same tests took 24 minutes on
# one 2-core machine and 35 on another, which spent 1.5 times the CPU seconds on them. The summary
# says how fast this machine runs a reference loop and how much CPU the run took.
_run_start: tuple[float, float] | None = None  # the machine's CPU seconds and the monotonic clock


def _cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(v) for v in fields[:3] + fields[5:7])  # user nice system, irq softirq
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# Each test's CPU (tests/cputime.py): measured in the process that runs it, carried to the
# controller in its teardown report, listed in the summary beside pytest's slowest wall times.
_CPU_AT_START = pytest.StashKey[float]()
_CPU_SHOWN = 25
_CPU_FILES_SHOWN = 15
#: A file to write every test's CPU seconds to, as ``seconds<TAB>node id`` lines, heaviest first.
CPU_LISTING_ENV = "REFSTREAM_TEST_CPU_LISTING"
#: The seconds between the meter's looks (a process living less than that between two looks is missed).
CPU_EVERY_ENV = "REFSTREAM_TEST_CPU_EVERY"
_cpu_by_test: dict[str, float] = {}
_meter: list[cputime.Meter] = []  # this process's, started by its first test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not _meter:
        _meter.append(cputime.Meter(every=float(os.environ.get(CPU_EVERY_ENV, "1"))).start())
    item.stash[_CPU_AT_START] = _meter[0].total()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    start = item.stash.get(_CPU_AT_START, None)
    if call.when == "teardown" and start is not None and _meter:
        outcome.get_result().user_properties.append(("cpu_seconds", _meter[0].total() - start))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    end = _cpu_seconds()
    if os.environ.get("PYTEST_XDIST_WORKER") or _run_start is None or end is None:
        return
    if _cpu_by_test:
        ranked = sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])
        top = ranked[:_CPU_SHOWN]
        terminalreporter.write_sep("=", f"most CPU {len(top)} (each test's process tree, setup to teardown)")
        for nodeid, seconds in top:
            terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
        terminalreporter.write_line(f"the tests' CPU in all: {sum(_cpu_by_test.values()):,.0f} s over "
                                    f"{len(_cpu_by_test)} tests; the top {len(top)}: {sum(v for _, v in top):,.0f} s")
        by_file: dict[str, list[float]] = {}
        for nodeid, seconds in _cpu_by_test.items():
            by_file.setdefault(nodeid.split("::")[0], []).append(seconds)
        files = sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:_CPU_FILES_SHOWN]
        terminalreporter.write_sep("=", f"most CPU by file {len(files)}")
        for path, each in files:
            terminalreporter.write_line(f"{sum(each):8.1f}s cpu  {len(each):4d} tests  {path}")
        listing = os.environ.get(CPU_LISTING_ENV)
        if listing:  # every test's figure, for a look beyond the summary
            Path(listing).write_text("".join(f"{v:.1f}\t{k}\n" for k, v in ranked))
    used, wall, cores = end - _run_start[0], time.monotonic() - _run_start[1], os.cpu_count() or 1
    terminalreporter.write_line(
        f"machine: {cores} cores, a reference Python loop at {timing.reference_loop_rate():.1f}M iterations/s, "
        f"bounds stretched {timing.slowdown():.2f}x; the run used {used:,.0f} CPU seconds in {wall / 60:.1f} minutes ({used / (wall * cores):.0%} of the cores)")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the workers have stopped: the archive goes
        import shutil

        run = os.environ.pop("REFSTREAM_TEST_RUN_DIR", "")
        _stop_archive_session(Path(run))
        shutil.rmtree(run, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start a Spark session
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("integration") is not None:
        spark_defaults()


def spark_defaults() -> Path:
    """The Spark defaults file the tests' drivers read (``PYSPARK_SUBMIT_ARGS``): the run's copy of
    tests/spark-conf/spark-defaults.conf, which names the run's class-data-sharing (AppCDS) archive
    once it exists, so that the drivers read their classes from it.

    The first test that may start Spark starts tests/spark_archive.py in the background, once per
    run: two Spark sessions in turn whose JVMs write an archive at their exit (a quick one, about
    20 s, 100 s under the suite's load; then one running a job of the tests' kind). pytest-xdist's
    workers go on meanwhile. Each replaces the run's copy in one rename, and every driver started
    after that reads the new line, whenever its environment was made. A driver then starts on about
    5 s less CPU with the first archive (a job's JVM: 8 s instead of 13 s, measured here), and less
    again with the second: most of that was looking classes up in Spark's 279 jars. If a
    session fails, the drivers go on with the archive before it, or none, and the log
    (``archive.log`` in the run's directory) says why."""
    run = Path(os.environ["REFSTREAM_TEST_RUN_DIR"])
    out = _run_defaults()
    try:
        fd = os.open(run / "archive.pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # made or being made
        return out
    import subprocess

    with open(run / "archive.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.spark_archive", str(run), str(SPARK_DEFAULTS), str(out)],
                                env=with_tests_importable(os.environ),
                                cwd=run, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.write(fd, str(proc.pid).encode())
    os.close(fd)
    return out


def _stop_archive_session(run: Path) -> None:
    """Stop the archive's sessions if they still run (a short run of the suite ends before them),
    and the broker of its job stage, a process group of its own."""
    import signal

    for name in ("archive.pid", "archive-broker.pid"):
        try:
            os.killpg(int((run / name).read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass



@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A broker per test module (a quarter of a second to start). The embedded broker keeps every
    transaction it has seen, epochs included, and rewrites that record on each transactional request:
    one broker for the whole suite made each transaction slower than the last (about 2 ms more per
    hundred transactions, seconds each by the suite's end), and long ends are where its race
    (refstream.kafka.transaction_end) bites."""
    external = os.environ.get("REFSTREAM_TEST_BOOTSTRAP")
    if external:
        yield {"bootstrap.servers": external}
        return
    log_path = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log_path) as broker:
        yield {"bootstrap.servers": broker.bootstrap}


@pytest.fixture(scope="session")
def mysql_server_url() -> str:
    return os.environ.get("REFSTREAM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")


@contextmanager
def mysql_database(server_url: str, options: str = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin") -> Iterator[str]:
    """The URL of a database of its own on the MariaDB at ``server_url``, created with ``options``
    and dropped when the block ends."""
    import sqlalchemy as sa

    name = f"refstream_test_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(server_url + "/", isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` {options}"))
    try:
        yield f"{server_url}/{name}?charset=utf8mb4"
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        engine.dispose()


@pytest.fixture(scope="session")
def mysql_url(mysql_server_url: str) -> Iterator[str]:
    with mysql_database(mysql_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    return os.environ.get("REFSTREAM_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")


@pytest.fixture(scope="session")
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A PostgreSQL database of its own for the session (dropped at its end)."""
    import psycopg

    name = f"refstream_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url + "/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{pg_server_url}/{name}"
    finally:
        with psycopg.connect(pg_server_url + "/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def unique() -> Callable[[str], str]:
    def make(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture(autouse=True)
def _quiet_py4j() -> None:
    logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def chromium() -> Callable[[str], str]:
    """``render(url)`` -> the DOM headless Chromium built for ``url`` (after layout, as a person's
    browser would show it). ``.ci/run`` installs Debian's ``chromium`` when it is missing."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "no headless browser: install Debian's chromium package (.ci/run does)"
    profile = tempfile.mkdtemp(prefix="refstream-chromium-")

    def render(url: str) -> str:
        out = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              f"--user-data-dir={profile}", "--virtual-time-budget=2000", "--dump-dom", url],
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout

    return render


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Name a failure the moment it happens: a CI run stopped at its time limit never reaches
    pytest's final summary, and its log's tail would then say only that something failed. Keeps
    each test's CPU for the summary."""
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_seconds":
                _cpu_by_test[report.nodeid] = float(value)
    reporter = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if not report.failed or reporter is None:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = (crash.message if crash is not None else str(report.longrepr)).strip()
    reason = reason.splitlines()[0][:300] if reason else ""
    # The progress dots leave no newline behind them.
    reporter.write_line(f"\n{report.when.upper()} FAILED {report.nodeid}: {reason}")
