"""The refresher daemon.

Scheduling logic (queueing, retry/backoff, job layout, next_runs.json, the daemon lock) with a fake
refresher; the behaviour that lives in the real pieces (interval runs reaching the topic, file watch,
SIGTERM, a forced ``refresh run`` beside the daemon, a broker outage) against the real MariaDB, the
real broker and real files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from demo.broker import EmbeddedBroker, free_port
from refresh.config import RefreshConfig, load_config
from refresh.daemon import NEXT_RUNS, Daemon, DaemonOptions, daemon_dir, run_daemon
from refresh.status import read_status
from refresh.stores.files import FileStateStore
from refstream.contract import OP_DELETE, OP_HEARTBEAT, OP_SCHEMA, OP_UPSERT, decode
from refstream.errors import DataError, TerminalError, TransientError
from refstream.kafka import end_offsets, read_to_end
from refstream.retry import RetryPolicy
from tests.netproxy import TcpRelay
from tests.timing import bound

FAST = DaemonOptions(debounce=0.5, retry=RetryPolicy(initial=0.3, maximum=1.0), poll=0.2)
ROOT = Path(__file__).resolve().parents[2]


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + bound(timeout)
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def write_config(tmp_path: Path, kafka: dict[str, str], datasets: str, extra: str = "") -> Path:
    kafka_yaml = "\n".join(f"  {k}: \"{v}\"" for k, v in kafka.items())
    text = (f"kafka:\n{kafka_yaml}\nstate_dir: {tmp_path / 'state'}\n{extra}"
            f"datasets:\n{textwrap.indent(textwrap.dedent(datasets).strip(), '  ')}\n")
    path = tmp_path / "refresh.yaml"
    path.write_text(text)
    return path


@contextmanager
def daemon_thread(config: RefreshConfig, options: DaemonOptions = FAST, **kw: Any) -> Iterator[Daemon]:
    stop = threading.Event()
    d = Daemon(config, options, **kw)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(d.run(stop)), name="daemon-under-test")
    t.start()
    try:
        yield d
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive(), "daemon did not stop"
    assert rc == [0]


def records(kafka: dict[str, str], topic: str) -> list[tuple[int, Any]]:
    """(offset, Change) of every record on ``topic``, schema records included."""
    return [(m.offset(), c) for m in read_to_end(kafka, topic, timeout=bound(10))
            if (c := decode(m.key(), m.value(), m.headers())).op != OP_HEARTBEAT]


def replay(changes: list[tuple[int, Any]]) -> dict[str, dict[str, Any]]:
    """What a consumer ends up holding: key JSON -> row."""
    state: dict[str, dict[str, Any]] = {}
    for _, c in changes:
        if c.op == OP_UPSERT:
            state[json.dumps(json.loads(c.key), sort_keys=True)] = json.loads(c.value)
        elif c.op == OP_DELETE:
            state.pop(json.dumps(json.loads(c.key), sort_keys=True), None)
    return state


def table_rows(url: str, table: str) -> dict[str, dict[str, Any]]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT id, name FROM `{table}`")).mappings().all()
    finally:
        eng.dispose()
    return {json.dumps({"id": r["id"]}): {"id": r["id"], "name": r["name"]} for r in rows}


def sql(url: str, *statements: str) -> None:
    eng = sa.create_engine(url)
    try:
        with eng.begin() as conn:
            for s in statements:
                conn.execute(sa.text(s))
    finally:
        eng.dispose()


@pytest.fixture
def items(mysql_url: str, unique: Callable[[str], str]) -> Iterator[str]:
    table = unique("items")
    sql(mysql_url, f"CREATE TABLE `{table}` (id INT PRIMARY KEY, name VARCHAR(40) NOT NULL)",
        f"INSERT INTO `{table}` VALUES (1, 'one'), (2, 'two'), (3, 'three')")
    yield table
    sql(mysql_url, f"DROP TABLE IF EXISTS `{table}`")


# ------------------------------------------------------------------------- scheduling logic (fake)

class FakeRefresher:
    """Records calls; ``plan`` maps a call number to an exception to raise or a sleep to take."""

    def __init__(self, plan: dict[int, Any] | None = None, duration: float = 0.0) -> None:
        self.plan = plan or {}
        self.duration = duration
        self.calls: list[tuple[str, bool, float]] = []
        self.active: dict[str, int] = {}
        self.max_active: dict[str, int] = {}
        self._lock = threading.Lock()

    def run(self, dataset: str, *, reconcile: bool = False, wait: bool = True,
            stop: threading.Event | None = None, full: bool = False) -> Any:
        with self._lock:
            n = len(self.calls)
            self.calls.append((dataset, reconcile, time.monotonic()))
            self.active[dataset] = self.active.get(dataset, 0) + 1
            self.max_active[dataset] = max(self.max_active.get(dataset, 0), self.active[dataset])
        try:
            time.sleep(self.duration)
            action = self.plan.get(n)
            if isinstance(action, BaseException):
                raise action
            return type("R", (), {"ok": True, "rows": 1, "inserts": 0, "updates": 0, "deletes": 0,
                                  "published": 0, "version": n + 1, "seconds": self.duration})()
        finally:
            with self._lock:
                self.active[dataset] -= 1

    def count(self, dataset: str | None = None, reconcile: bool | None = None) -> int:
        return sum(1 for d, r, _ in self.calls if (dataset is None or d == dataset)
                   and (reconcile is None or r == reconcile))


def fake_config(tmp_path: Path, datasets: str) -> RefreshConfig:
    return load_config(write_config(tmp_path, {"bootstrap.servers": "127.0.0.1:1"}, datasets))


def test_jobs_next_runs_and_startup_runs(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        hourly:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
          schedule: {{cron: "0 * * * *"}}
        models:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: m}}
          key: [id]
          mode: incremental
          incremental: {{column: ts, reconcile: {{every: 1h}}}}
          schedule: {{every: 10m}}
        sites:
          source: {{path: {tmp_path}/sites.csv}}
          key: [site_id]
          watch: true
    """)
    fake = FakeRefresher()
    with daemon_thread(cfg, refresher=fake) as d:
        wait_for(lambda: fake.count() == 3, 10, "three start-up runs")
        path = daemon_dir(cfg) / NEXT_RUNS
        runs = wait_for(lambda: path.exists() and json.loads(path.read_text()), 5, "next_runs.json")
        ids = sorted(j.id for j in d._scheduler.get_jobs())
        assert ids == ["reconcile:models", "run:hourly", "run:models"]
        now = datetime.now(UTC)
        hourly = datetime.fromisoformat(runs["hourly"])
        assert hourly.minute == 0 and hourly.second == 0 and now < hourly <= now + timedelta(hours=1)
        assert timedelta(minutes=9) < datetime.fromisoformat(runs["models"]) - now <= timedelta(minutes=10)
        assert "sites" not in runs  # watched only: nothing planned
        assert {r["dataset"]: r["next_run"] for r in read_status(cfg)}["hourly"] == runs["hourly"]
        assert fake.count(reconcile=True) == 0
    assert not path.exists()  # no daemon, no next runs


@pytest.mark.integration  # the real scheduler on wall-clock time: seconds
def test_requests_while_running_are_queued_never_overlapped(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        fast:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
          schedule: {{every: 100ms}}
    """)
    fake = FakeRefresher(duration=0.5)
    with daemon_thread(cfg, refresher=fake) as d:
        for _ in range(10):  # a burst of file-change requests while runs are going on
            d._on_file_change("fast")
            time.sleep(0.05)
        wait_for(lambda: fake.count() >= 4, 10, "several runs")
    assert fake.max_active == {"fast": 1}
    starts = [t for _, _, t in fake.calls]
    assert all(b - a >= 0.45 for a, b in zip(starts, starts[1:], strict=False))  # back to back, not overlapped


@pytest.mark.integration  # the real scheduler on wall-clock time: seconds
def test_transient_failure_retried_with_backoff_terminal_not(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        flaky:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
          schedule: {{every: 1h}}
        broken:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: u}}
          key: [id]
          schedule: {{every: 1h}}
    """)

    class Plan(FakeRefresher):
        def run(self, dataset: str, **kw: Any) -> Any:
            if dataset == "flaky" and self.count("flaky") < 3:
                self.plan[len(self.calls)] = TransientError("broker down")
            if dataset == "broken":
                self.plan[len(self.calls)] = DataError("dataset broken: duplicate key {\"id\":1}")
            return super().run(dataset, **kw)

    fake = Plan()
    with daemon_thread(cfg, refresher=fake):
        wait_for(lambda: fake.count("flaky") == 4, 15, "three retries then a success")
        time.sleep(1.5)
    flaky = [t for d, _, t in fake.calls if d == "flaky"]
    gaps = [b - a for a, b in zip(flaky, flaky[1:], strict=False)]
    assert len(flaky) == 4  # success stops the retries
    assert 0.2 < gaps[0] < gaps[2]  # backoff grows (0.3s, 0.6s, 1.0s, +-20%)
    assert fake.count("broken") == 1  # bad data: no retry before its next schedule


def test_second_daemon_on_the_same_state_is_refused(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        a:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
    """)
    with daemon_thread(cfg, refresher=FakeRefresher()):
        lock = daemon_dir(cfg) / "daemon.lock"
        # The lock file exists before the daemon holding it has written its pid into it.
        wait_for(lambda: lock.exists() and lock.read_text().strip() == str(os.getpid()), 5, "lock")
        with pytest.raises(TerminalError, match=f"another refresh daemon \\(pid {os.getpid()}\\)"):
            Daemon(cfg, FAST, refresher=FakeRefresher()).run(threading.Event())


# --------------------------------------------------------------------- real MariaDB, broker, files

def test_interval_runs_reach_the_topic(mysql_url: str, kafka: dict[str, str], items: str, tmp_path: Path,
                                      unique: Callable[[str], str]) -> None:
    topic = unique("ref.items")
    cfg = load_config(write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 1s}}
          topic: {topic}
          max_delete_fraction: 1
    """))
    with daemon_thread(cfg):
        wait_for(lambda: len(replay(records(kafka, topic))) == 3, 30, "the first snapshot")
        sql(mysql_url, f"UPDATE `{items}` SET name = 'TWO' WHERE id = 2",
            f"INSERT INTO `{items}` VALUES (4, 'four')", f"DELETE FROM `{items}` WHERE id = 1")
        wait_for(lambda: replay(records(kafka, topic)) == table_rows(mysql_url, items), 15,
                 "the changes of the second run")
        runs = json.loads((daemon_dir(cfg) / NEXT_RUNS).read_text())
        assert datetime.fromisoformat(runs["items"]) <= datetime.now(UTC) + timedelta(seconds=2)
    recs = records(kafka, topic)
    changed = [(c.op, json.loads(c.key)["id"]) for _, c in recs if c.version > 1 and c.op != OP_SCHEMA]
    assert sorted(changed) == [(OP_DELETE, 1), (OP_UPSERT, 2), (OP_UPSERT, 4)]  # only what changed
    status = read_status(cfg)[0]
    # The daemon's stop may cut a scheduled run short: recorded as interrupted, never as failed.
    assert status["last_result"] in ("ok", "interrupted"), status
    assert status["version"] >= 2 and status["last_success"] and status["consecutive_failures"] == 0


def test_a_refused_run_is_logged_and_the_schedule_goes_on(mysql_url: str, kafka: dict[str, str], items: str,
                                                         tmp_path: Path, unique: Callable[[str], str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    topic = unique("ref.items")
    cfg = load_config(write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 1s}}
          topic: {topic}
          max_delete_fraction: 0.5
    """))
    caplog.set_level(logging.ERROR, logger="refresh.daemon")
    with daemon_thread(cfg):
        wait_for(lambda: len(replay(records(kafka, topic))) == 3, 30, "the first snapshot")
        sql(mysql_url, f"DELETE FROM `{items}` WHERE id > 1")  # 2 of 3 rows gone: a partial read
        st = wait_for(lambda: (s := read_status(cfg)[0])["last_result"] == "refused" and s, 15, "a refused run")
        assert "would delete 2 of 3 rows (limit 0.5" in st["last_error"] and st["consecutive_failures"] == 0
        first = st["last_run"]
        wait_for(lambda: read_status(cfg)[0]["last_run"] != first, 15, "the next scheduled run")
        assert read_status(cfg)[0]["last_result"] == "refused"
        assert "refresh of items refused after" in caplog.text
        sql(mysql_url, f"INSERT INTO `{items}` VALUES (2, 'two'), (3, 'THREE')")  # the reload completes
        wait_for(lambda: read_status(cfg)[0]["last_result"] == "ok", 15, "a run once the table is whole again")
    assert all(c.op != OP_DELETE for _, c in records(kafka, topic))
    assert replay(records(kafka, topic)) == table_rows(mysql_url, items)


def test_file_watch_edit_rename_and_slow_write(kafka: dict[str, str], tmp_path: Path,
                                              unique: Callable[[str], str]) -> None:
    topic = unique("ref.sites")
    data = tmp_path / "data"
    data.mkdir()
    f = data / "sites.csv"
    f.write_text("site_id,name\n1,a\n2,b\n")
    cfg = load_config(write_config(tmp_path, kafka, f"""
        sites:
          source: {{path: {f}}}
          key: [site_id]
          watch: true
          topic: {topic}
    """))

    def versions() -> dict[int, list[tuple[str, int]]]:
        out: dict[int, list[tuple[str, int]]] = {}
        for _, c in records(kafka, topic):
            if c.op != OP_SCHEMA:
                out.setdefault(c.version, []).append((c.op, json.loads(c.key)["site_id"]))
        return out

    with daemon_thread(cfg):
        wait_for(lambda: 1 in versions(), 20, "the start-up run")
        t0 = time.monotonic()
        tmp = data / ".sites.csv.tmp"  # an editor's save: write a temp file, rename over the target
        tmp.write_text("site_id,name\n1,a\n2,B\n")
        os.replace(tmp, f)
        wait_for(lambda: 2 in versions(), 10, "the refresh after a rename")
        assert time.monotonic() - t0 < bound(8)
        assert versions()[2] == [(OP_UPSERT, 2)]
        with f.open("a") as fh:  # a slow writer: 10 rows over ~2 s, pauses shorter than the debounce
            for i in range(3, 13):
                fh.write(f"{i},row{i}\n")
                fh.flush()
                time.sleep(0.2)
        wait_for(lambda: 3 in versions(), 10, "the refresh after the slow write")
        time.sleep(FAST.debounce * 3)
    v = versions()
    assert sorted(v) == [1, 2, 3]  # one refresh for the whole slow write, none half-way
    assert sorted(v[3]) == [(OP_UPSERT, i) for i in range(3, 13)]


def test_sigterm_stops_the_daemon_cleanly(mysql_url: str, kafka: dict[str, str], items: str,
                                          tmp_path: Path, unique: Callable[[str], str]) -> None:
    topic = unique("ref.items")
    sql(mysql_url, f"INSERT INTO `{items}` SELECT seq, CONCAT('n', seq) FROM seq_10_to_5000")
    cfgp = write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 200ms}}
          topic: {topic}
    """)
    cfg = load_config(cfgp)
    log = (tmp_path / "daemon.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "refresh", "--config", str(cfgp), "daemon"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(replay(records(kafka, topic))) == 5000 - 9 + 3, 60, "the first snapshot")
        # keep it busy: every run now has changes to diff and publish when SIGTERM lands
        for i in range(3):
            sql(mysql_url, f"UPDATE `{items}` SET name = CONCAT(name, '+') WHERE id % 7 = {i}")
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(bound(30)) == 0, (tmp_path / "daemon.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert "SIGTERM received" in text and "refresh daemon stopped" in text
    assert not (daemon_dir(cfg) / NEXT_RUNS).exists()
    # Consistent state: a forced run publishes whatever the daemon had not committed, and the topic
    # then holds exactly the table.
    run = subprocess.run([sys.executable, "-m", "refresh", "--config", str(cfgp), "run", "items"], cwd=ROOT,
                         capture_output=True, text=True, timeout=bound(120))
    assert run.returncode == 0, run.stderr
    assert replay(records(kafka, topic)) == table_rows(mysql_url, items)


@pytest.mark.timeout(120)  # without the interruption the stuck read outlives the test
def test_sigterm_stops_a_daemon_stuck_in_a_read_within_10s(mysql_url: str, kafka: dict[str, str], items: str,
                                                           tmp_path: Path, unique: Callable[[str], str]) -> None:
    topic = unique("ref.items")
    cfgp = write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          topic: {topic}
    """)  # default timeouts: the read would wait for the lock for an hour
    cfg = load_config(cfgp)
    engine = sa.create_engine(mysql_url)
    log = (tmp_path / "daemon.log").open("w")
    proc = None
    try:
        with engine.connect() as holder:
            holder.execute(sa.text(f"LOCK TABLES `{items}` WRITE"))
            proc = subprocess.Popen([sys.executable, "-m", "refresh", "--config", str(cfgp), "daemon"], cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT)
            waiting = ("SELECT COUNT(*) FROM information_schema.processlist WHERE state = "
                       f"'Waiting for table metadata lock' AND info LIKE '%{items}%'")
            wait_for(lambda: holder.execute(sa.text(waiting)).scalar(), 60, "the start-up read to block on the lock")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(bound(10))
            except subprocess.TimeoutExpired:
                rc = None
            stopped_in = time.monotonic() - t0
            assert rc == 0, (rc, (tmp_path / "daemon.log").read_text()[-3000:])
            assert stopped_in < 10
            # The server dropped the statement as well (KILL): it no longer waits for the lock.
            wait_for(lambda: holder.execute(sa.text(waiting)).scalar() == 0, 5, "the blocked statement to end")
            holder.execute(sa.text("UNLOCK TABLES"))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        engine.dispose()
    text = (tmp_path / "daemon.log").read_text()
    assert "SIGTERM received" in text and "dataset items: stopped while reading" in text
    assert read_status(cfg)[0]["last_result"] == "interrupted"
    assert FileStateStore(cfg.state_dir).load("items").version == 0
    assert end_offsets(kafka, topic) is None  # nothing was published: the topic was never created


def test_forced_run_while_the_daemon_runs(mysql_url: str, kafka: dict[str, str], items: str,
                                          tmp_path: Path, unique: Callable[[str], str]) -> None:
    topic = unique("ref.items")
    sql(mysql_url, f"INSERT INTO `{items}` SELECT seq, CONCAT('n', seq) FROM seq_10_to_5000")
    cfgp = write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 300ms}}
          topic: {topic}
    """)
    cfg = load_config(cfgp)
    with daemon_thread(cfg):
        wait_for(lambda: len(replay(records(kafka, topic))) == 4994, 30, "the first snapshot")
        for i in range(3):
            sql(mysql_url, f"UPDATE `{items}` SET name = CONCAT(name, '{i}') WHERE id % 5 = {i}",
                f"DELETE FROM `{items}` WHERE id % 97 = {i}",
                f"INSERT INTO `{items}` VALUES ({100_000 + i}, 'new{i}')")
            run = subprocess.run([sys.executable, "-m", "refresh", "--config", str(cfgp), "run", "items"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=bound(120))
            assert run.returncode == 0, run.stderr
        wait_for(lambda: replay(records(kafka, topic)) == table_rows(mysql_url, items), 20, "convergence")
    recs = records(kafka, topic)
    # Never two runs at once: each version is one contiguous block, versions strictly increase.
    blocks: list[int] = []
    for _, c in recs:
        if not blocks or blocks[-1] != c.version:
            blocks.append(c.version)
    assert blocks == sorted(set(blocks)), blocks
    # Each mutation commits before its forced run, which returns only once it is published (by the
    # run itself, or by a daemon run it waited for): one version per mutation, none split or merged.
    assert len(blocks) == 4, blocks
    # No duplicate and no redundant change: every record of a version changes what a consumer holds.
    state: dict[str, Any] = {}
    for _, c in recs:
        if c.op == OP_SCHEMA:
            continue
        k = json.dumps(json.loads(c.key), sort_keys=True)
        new = json.loads(c.value) if c.op == OP_UPSERT else None
        assert state.get(k) != new, f"version {c.version} republished {k} unchanged"
        if new is None:
            state.pop(k)
        else:
            state[k] = new
    assert state == table_rows(mysql_url, items)
    assert read_status(cfg)[0]["version"] >= blocks[-1]  # runs without changes publish nothing


def quick_publisher(cfg: RefreshConfig) -> Any:
    """A refresher whose broker metadata requests give up after 2 s (default 10 s): a down broker
    fails a run sooner."""
    from refresh.publish import Publisher
    from refresh.runner import Refresher

    return Refresher(cfg, publisher_factory=lambda s: Publisher(s, topic_timeout=2.0))


@pytest.mark.integration  # starts a broker of its own
def test_broker_down_daemon_stays_up_and_publishes_when_it_returns(
        mysql_url: str, items: str, tmp_path: Path, unique: Callable[[str], str]) -> None:
    port = free_port()
    broker = EmbeddedBroker(port, log_path=tmp_path / "broker.log").start()
    kafka = {"bootstrap.servers": broker.bootstrap, "message.timeout.ms": "2000",
             "socket.timeout.ms": "2000"}
    topic = unique("ref.items")
    cfg = load_config(write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 1s}}
          topic: {topic}
    """, extra="retry: {attempts: 1}\n"))
    try:
        with daemon_thread(cfg, refresher=quick_publisher(cfg)) as d:
            wait_for(lambda: len(replay(records(kafka, topic))) == 3, 30, "the first snapshot")
            broker.stop()
            sql(mysql_url, f"UPDATE `{items}` SET name = 'down' WHERE id = 3")
            st = wait_for(lambda: (s := read_status(cfg)[0])["last_result"] == "failed" and s, 60,
                          "a failed run in the status")
            assert "Kafka" in st["last_error"] and st["consecutive_failures"] >= 1
            assert d._scheduler.running and not d.stop.is_set()  # the daemon stays up
            broker = EmbeddedBroker(port, log_path=tmp_path / "broker.log").start()  # memory storage: empty
            ok = wait_for(lambda: (s := read_status(cfg)[0])["last_result"] == "ok" and s, 60,
                          "a run after the broker returned")
            recs = records(kafka, topic)
        # The failed runs committed nothing (they stopped at the topic check, or at their publish - a
        # run publishes its heartbeat even without changes). The returning broker is empty (memory
        # storage): the first success finds the topic gone and republishes the whole table, with the
        # change made while the broker was down, under a new version. (Runs every 1 s: by the time the
        # status is read, later no-change runs may have committed further versions. The new topic may
        # have the broker's default partitions: a client that knew the old one names it in a metadata
        # request, and the test broker creates a topic so named.)
        published = [(c.op, json.loads(c.key)["id"], c.version) for _, c in recs if c.op != OP_SCHEMA]
        assert sorted((op, key) for op, key, _ in published) == [(OP_UPSERT, 1), (OP_UPSERT, 2), (OP_UPSERT, 3)]
        assert recs[0][1].op == OP_SCHEMA and len({v for _, _, v in published}) == 1
        assert published[0][2] > st["version"] and ok["version"] >= published[0][2]
        assert replay(recs) == table_rows(mysql_url, items)
    finally:
        broker.stop()


def test_run_daemon_returns_zero_when_stopped(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        a:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
    """)
    stop = threading.Event()
    stop.set()
    assert run_daemon(cfg, stop, FAST) == 0


@pytest.mark.integration  # the real scheduler on wall-clock time: seconds
def test_misfires_after_a_suspension_are_coalesced_into_one_run(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, f"""
        m:
          source: {{url: "sqlite:///{tmp_path}/x.db", table: t}}
          key: [id]
          schedule: {{every: 2s}}
    """)
    fake = FakeRefresher()
    with daemon_thread(cfg, refresher=fake) as d:
        wait_for(lambda: fake.count() >= 1, 10, "the start-up run")
        d._scheduler.pause()  # as if the process had been suspended (laptop lid, SIGSTOP, a stalled VM)
        first_missed = d._scheduler.get_job("run:m").next_run_time
        # Stay away for three periods (three fire times missed), resuming half-way between two ticks.
        time.sleep(max(0.0, (first_missed + timedelta(seconds=5) - datetime.now(UTC)).total_seconds()))
        resumed, resumed_at = time.monotonic(), datetime.now(UTC)
        d._scheduler.resume()
        # The first regular tick after resuming, on the monotonic clock the calls are stamped with.
        tick = first_missed
        while tick <= resumed_at:
            tick += timedelta(seconds=2)
        tick_mono = resumed + (tick - resumed_at).total_seconds()
        # Judged up to just before the tick after it: a loaded machine may delay the catch-up run
        # or the regular one, but uncoalesced misfires would make three runs, not one, before the tick.
        time.sleep(max(0.0, tick_mono + 1.5 - time.monotonic()))
        runs = [t for _, _, t in fake.calls if resumed <= t < tick_mono + 1.5]
    assert len(runs) == 2, (runs, resumed, tick_mono)  # the coalesced catch-up and the regular tick


def test_sigint_stops_the_daemon_cleanly(kafka: dict[str, str], tmp_path: Path,
                                         unique: Callable[[str], str]) -> None:
    f = tmp_path / "sites.csv"
    f.write_text("site_id,name\n1,a\n")
    cfgp = write_config(tmp_path, kafka, f"""
        sites:
          source: {{path: {f}}}
          key: [site_id]
          schedule: {{every: 1h}}
          topic: {unique("ref.sites")}
    """)
    cfg = load_config(cfgp)
    with (tmp_path / "daemon.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "refresh", "--config", str(cfgp), "daemon"], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: read_status(cfg)[0]["last_result"] == "ok", 60, "the start-up run")
            wait_for(lambda: (daemon_dir(cfg) / NEXT_RUNS).exists(), 10, "next_runs.json")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(bound(30)) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = (tmp_path / "daemon.log").read_text()
    assert "SIGINT received" in text and "refresh daemon stopped" in text and "Traceback" not in text
    assert not (daemon_dir(cfg) / NEXT_RUNS).exists()


@pytest.mark.integration  # a daemon process for a minute of wall-clock time
def test_a_daemon_whose_broker_is_down_logs_few_lines_and_says_why(tmp_path: Path) -> None:
    """librdkafka retries a broker that is down about 20 times a second per client, a line each: its
    lines come through logging, a repeated one once per minute with its count. The daemon's first
    minute, start-up and shutdown included, stays under 20 lines and says it cannot reach Kafka."""
    f = tmp_path / "sites.csv"
    f.write_text("site_id,name\n1,a\n")
    cfgp = write_config(tmp_path, {"bootstrap.servers": f"127.0.0.1:{free_port()}"}, f"""
        sites:
          source: {{path: {f}}}
          key: [site_id]
          schedule: {{every: 1h}}
    """)
    with (tmp_path / "daemon.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "refresh", "--config", str(cfgp), "daemon"], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(60)
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(bound(60)) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = (tmp_path / "daemon.log").read_text().splitlines()
    shown = "\n".join(lines)
    assert len(lines) < 20, shown
    assert any("cannot reach Kafka" in line for line in lines), shown
    # librdkafka's lines: in the format of every other line (none from its own stderr writer), the
    # connection failure once at first and then with the counts of its repeats (hundreds of them).
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ", line) for line in lines), shown
    failed = [line for line in lines if " librdkafka: " in line and "Connection refused" in line]
    assert len(failed) >= 2 and " ERROR librdkafka: " in failed[0] and "(repeated" not in failed[0], shown
    counts = [re.search(r"\(repeated (\d+) times? in the last \d+ s\)$", line) for line in failed[1:]]
    assert all(counts) and sum(int(m.group(1)) for m in counts if m) >= 100, shown



def test_database_down_daemon_stays_up_and_publishes_when_it_returns(
        mysql_url: str, kafka: dict[str, str], items: str, tmp_path: Path, unique: Callable[[str], str],
        caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy.engine import make_url

    real = make_url(mysql_url)
    relay = TcpRelay((real.host or "127.0.0.1", real.port or 3306))  # not started: the database is down
    url = real.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
    topic = unique("ref.items")
    cfg = load_config(write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{url}", table: {items}}}
          key: [id]
          topic: {topic}
    """, extra="retry: {attempts: 2, initial: 50ms}\n"))
    caplog.set_level(logging.INFO)
    try:
        with daemon_thread(cfg) as d:
            st = wait_for(lambda: (s := read_status(cfg)[0])["consecutive_failures"] >= 2 and s, 30,
                          "two failed runs")
            assert st["last_result"] == "failed" and "query on" in st["last_error"] and st["version"] == 0
            assert d._scheduler.running and not d.stop.is_set()  # the daemon stays up
            relay.start()
            wait_for(lambda: read_status(cfg)[0]["last_result"] == "ok", 30, "a run after the database returned")
        assert replay(records(kafka, topic)) == table_rows(mysql_url, items)
    finally:
        relay.stop()
    # A log line per attempt: the runner's retries inside a run, the daemon's retries between runs.
    assert any("dataset items: read snapshot failed (attempt 1/2)" in m for m in caplog.messages)
    assert any("refresh of items failed" in m and "retry #1 in" in m for m in caplog.messages)
    assert any("refresh of items failed" in m and "retry #2 in" in m for m in caplog.messages)
