"""Kill-everything soak: the real topology under reference churn and SIGKILLs, then a full accounting.

``python -m bench.soak --duration 600 --seed 7`` (or ``make bench ARGS="soak --duration 600 --seed 7"``)
runs, for ``--duration`` seconds:

- MariaDB with a ``devices`` table, a ``sites.csv`` file, the broker (the embedded one unless
  ``--bootstrap``), a private PostgreSQL the soak makes with ``initdb`` and runs with ``pg_ctl`` in
  a temporary directory (as the ``postgres`` user when run as root; removed at the end), a call
  service (``bench.soak_service``, HTTP on 127.0.0.1), the refresher daemon
  (``python -m refresh daemon``) and the job (``python -m enrich run``) as separate process groups.
  The job keeps per-device state (``state:`` keyed by the device, on the events' time) with the
  devices joined ``partitioned`` inside the state step and ``sites`` broadcast after it, over 4
  state partitions on ``local[2]``: a batch's state tasks run in two waves. Each event makes a call
  (``refresh: every event``, the device's ``state.events`` and the event's ``seq`` in the body,
  echoed back; retries outlast the service's restarts; ``on_error: "null"``), and the job writes
  Kafka with ``output.database`` (``write: events``: a row per event) on the private PostgreSQL
  beside it;
- an event producer (every event carries a unique ``seq`` and its produce time, in UTC, as ``ts``),
  and a change driver updating, deleting and inserting device rows and rewriting the CSV;
- a killer sending SIGKILL to every process of the refresher and of the job at random
  (seeded) moments and restarting them; the job is killed only once it has committed a batch
  since its last start, so every kill lands on a running query. At random moments too, it stops
  PostgreSQL (``pg_ctl stop -m immediate``: a crash, its open transactions rolled back by the
  recovery) and starts it again after 2-8 s, and SIGKILLs the call service and starts it again
  after 1-5 s. PostgreSQL is restarted only while the job runs (it has committed a batch since
  its last start, and no job kill falls while it is down): the job's start checks the table once,
  without retries, so a database down at the job's start stops the job.

Then, after a quiet period (every process running, one forced ``refresh run``): probe events, one
per device key ever used, and the checks - every produced event in the ``read_committed`` output
exactly once; the changelog topics, read through the contract, equal the database and the CSV; the
probes' enrichment equals the database (deleted keys unmatched); each device's last event in the
output (its highest ``seq``: the probe) counts in ``state.events`` every event produced for the
device, whether the database knew the device or not, and the ``state.events`` of a device's events
are 1..n, each once; every event carries its own call's answer (its device, its ``seq``, its
``state.events``: no null); the PostgreSQL table has a row per event, each once, with the same
``state_events`` and call results as the Kafka output; the dead-letter topic is empty;
``refresh status --check`` passes. The state's watermark and TTL (a day each) keep every event on
time and every device in state for any soak shorter than that.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
import yaml
from confluent_kafka import Producer

from demo.broker import EmbeddedBroker
from demo.processes import Child
from refstream import contract
from refstream import kafka as rkafka
from refstream.atomic import write_bytes_atomic

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DEVICES, SITES = 150, 8
PROBE_BASE = 10**12  # probe events' seq numbers start here
CLI_TIMEOUT_S = 300  # a `refresh` command's
PROBE_WAIT_S = 300   # for the probes in the output
MISSING_KILLS_SPAN = 4  # kills still missing after the churn: keep going for up to this many durations,
MISSING_KILLS_MIN_S = 480.0  # and at least this long (a job's restart under load: 80 s or more)
PG_BIN = Path(os.environ.get("REFSTREAM_PG_BIN", "/usr/lib/postgresql/15/bin"))
TABLE = "soak_events"


@dataclass
class Figures:
    seed: int
    duration_s: float = 0.0
    kills_refresher: int = 0
    kills_job: int = 0
    restarts_database: int = 0      # PostgreSQL stopped (-m immediate) and started again
    restarts_service: int = 0       # the call service SIGKILLed and started again
    db_write_retries: int = 0       # the job's log: a batch's write failed transiently and was retried
    call_requests: int = 0          # requests the call service received
    call_keys_repeated: int = 0     # of them, with an Idempotency-Key it had seen (a retry, a replay)
    events: int = 0
    probes: int = 0
    updates: int = 0
    deletes: int = 0
    inserts: int = 0
    csv_edits: int = 0
    lost: int = -1
    duplicated: int = -1
    dimension_mismatches: list[str] = field(default_factory=list)
    probe_mismatches: list[str] = field(default_factory=list)
    state_mismatches: list[str] = field(default_factory=list)  # devices whose final state.events is off
    late: int = -1                  # output events flagged _late (their state is null): none expected
    call_mismatches: list[str] = field(default_factory=list)  # events without their own call's answer
    dead_letters: int = -1          # records in the dead-letter topic: none expected
    db_rows: int = -1               # rows in the PostgreSQL table
    db_lost: int = -1               # events (probes included) with no row
    db_duplicated: int = -1         # rows beyond one per event
    db_mismatches: list[str] = field(default_factory=list)  # rows whose state or call differs from Kafka's
    produce_failures: int = 0       # events whose delivery failed (not counted as produced)
    status_check: int = -1
    status_problems: str = ""       # what a failed `refresh status --check` said

    @property
    def changes(self) -> int:
        return self.updates + self.deletes + self.inserts + self.csv_edits

    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicated == 0 and not self.dimension_mismatches
                and not self.probe_mismatches and not self.state_mismatches and self.status_check == 0
                and self.late == 0 and not self.call_mismatches and self.dead_letters == 0
                and self.db_lost == 0 and self.db_duplicated == 0 and not self.db_mismatches)


class PrivatePostgres:
    """A PostgreSQL of its own in a temporary directory (``initdb``, ``pg_ctl``), run as the
    ``postgres`` user when this process is root (PostgreSQL refuses to run as root), on a free port
    of 127.0.0.1 with trust authentication; :meth:`close` stops it and removes the directory."""

    def __init__(self, log_copy: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="refstream-soak-pg-"))
        self.log_copy = log_copy
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.data, self.log = self.dir / "data", self.dir / "postgres.log"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(PG_BIN / tool), *args], check=True, capture_output=True,
                       timeout=CLI_TIMEOUT_S)

    def init(self) -> PrivatePostgres:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        self.start()
        return self

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "120", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, as in a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def close(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self.crash()
        finally:
            if self.log.exists():
                shutil.copyfile(self.log, self.log_copy)
            shutil.rmtree(self.dir, ignore_errors=True)


class Soak:
    def __init__(self, work: Path, bootstrap: str, mysql_server: str, *, seed: int, duration: float,
                 min_kills: int = 5, min_restarts: int = 2, max_job_kills: int | None = None) -> None:
        self.work, self.bootstrap, self.seed, self.duration = work, bootstrap, seed, duration
        self.min_kills, self.min_restarts = min_kills, min_restarts
        # The job's kills at most (None: as many as its restarts allow): each restart costs 20-80 CPU s.
        self.max_job_kills = max_job_kills
        self.rng = random.Random(seed)
        self.kafka = {"bootstrap.servers": bootstrap}
        tag = uuid.uuid4().hex[:8]
        self.db_name = f"refstream_soak_{tag}"
        self.server = mysql_server
        self.db_url = f"{mysql_server}/{self.db_name}?charset=utf8mb4"
        self.topics = {"events": f"soak-{tag}.events", "out": f"soak-{tag}.enriched", "dlq": f"soak-{tag}.dlq",
                       "devices": f"soak-{tag}.ref.devices", "sites": f"soak-{tag}.ref.sites"}
        self.fig = Figures(seed=seed)
        self.produced: dict[int, str] = {}  # seq -> device of every event the broker acknowledged
        self.failed_produce = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sites = {f"s{i}": f"site-{i}" for i in range(SITES)}
        self.children: dict[str, Child] = {}
        self.service_port = free_port()
        self.pg: PrivatePostgres | None = None

    # ------------------------------------------------------------------------------------ setup

    def _setup(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        root = sa.create_engine(self.server + "/", isolation_level="AUTOCOMMIT")
        with root.connect() as c:
            c.execute(sa.text(f"CREATE DATABASE `{self.db_name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"))
        root.dispose()
        self.engine = sa.create_engine(self.db_url, isolation_level="AUTOCOMMIT")
        with self.engine.connect() as c:
            c.execute(sa.text("CREATE TABLE devices (device_id VARCHAR(20) PRIMARY KEY, owner VARCHAR(40) NOT NULL, "
                              "site_id VARCHAR(10) NOT NULL)"))
            for i in range(DEVICES):
                c.execute(sa.text("INSERT INTO devices VALUES (:d, :o, :s)"),
                          {"d": f"d{i}", "o": f"owner-{i}-0", "s": f"s{i % SITES}"})
        (self.work / "data").mkdir(exist_ok=True)
        self._write_sites()
        refresh = {
            "kafka": {"bootstrap_servers": self.bootstrap},
            "state_dir": str(self.work / "state"),
            "datasets": {
                # A fifth of the churn is deletes: while the refresher is down (SIGKILLs, slow restarts
                # on a loaded machine) they pile up past the default max_delete_fraction (0.1 of ~150
                # rows), which then refuses every run for the rest of the soak. The guard has its own
                # tests; here the deletes are meant.
                # max_age: the default, three intervals, is 3 s for devices, and on a slow machine under
                # the suite's load one run of them took over 6 s: `status --check` then failed with the
                # daemon running every second. 30 s still fails a refresher that stopped publishing.
                "devices": {"source": {"url": self.db_url, "table": "devices"}, "key": ["device_id"],
                            "mode": "diff", "schedule": {"every": "1s"}, "topic": self.topics["devices"],
                            "max_delete_fraction": 1, "max_age": "30s"},
                "sites": {"source": {"path": str(self.work / "data" / "sites.csv")}, "key": ["site_id"],
                          "mode": "diff", "watch": True, "schedule": {"every": "3s"}, "topic": self.topics["sites"],
                          "max_age": "30s"},
            },
        }
        enrich = {
            "kafka": {"bootstrap_servers": self.bootstrap},
            "events": {"topic": self.topics["events"], "schema": "device_id STRING, seq BIGINT, ts TIMESTAMP",
                       "starting_offsets": "earliest"},
            # The event time is the wall clock: a day of watermark and of TTL keep every event on
            # time (a late one would get a null state) and every device in state, across restarts.
            "state": {"key": "device_id", "timestamp": "ts", "watermark": "24h", "ttl": "24h", "buckets": 16,
                      "aggregates": {"seq": ["max"]}},
            "joins": [{"dataset": "devices", "topic": self.topics["devices"], "on": "device_id",
                       "columns": ["owner", "site_id"], "strategy": "partitioned"},
                      {"dataset": "sites", "topic": self.topics["sites"], "on": "site_id", "columns": ["name"]}],
            # Every event calls: its body carries the event's seq and its device's count including
            # it, echoed back. 8 tries 0.2-12.8 s apart (25 s) outlast the service's restarts. The
            # batch's budget is not what the soak tests: 60 s (the default) ran out on a busy
            # machine in the first batch after a restart (thousands of calls, the service down).
            "calls": [{"name": "echo", "url": f"http://127.0.0.1:{self.service_port}/echo", "refresh": "every event",
                       "body": {"device": "{device_id}", "events": "{state.events}", "seq": "{seq}"},
                       "response": {"device": "STRING", "events": "BIGINT", "seq": "BIGINT"},
                       "retries": {"attempts": 8, "backoff": "200ms"}, "on_error": "null", "budget": "15m"}],
            "output": {"kafka": {"topic": self.topics["out"]},
                       "database": {"url": self.pg_url, "table": TABLE, "write": "events"}},
            "dead_letter_topic": self.topics["dlq"],
            "checkpoint": str(self.work / "checkpoint"),
            "trigger": "500ms",
            "max_events_per_batch": 5000,
            # More state partitions than local[2]'s cores: a batch's state tasks run in waves.
            "spark": {"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"},
        }
        self.refresh_yaml, self.enrich_yaml = self.work / "refresh.yaml", self.work / "enrich.yaml"
        self.refresh_yaml.write_text(yaml.safe_dump(refresh), encoding="utf-8")
        self.enrich_yaml.write_text(yaml.safe_dump(enrich), encoding="utf-8")
        rkafka.ensure_topic(self.kafka, self.topics["events"], partitions=2)
        self.env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
                    "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        # The first publish of both datasets before the job starts: it bootstraps from them.
        self._refresh_cli("run")

    def _write_sites(self) -> None:
        lines = ["site_id,name"] + [f"{k},{v}" for k, v in sorted(self.sites.items())]
        write_bytes_atomic(self.work / "data" / "sites.csv", ("\n".join(lines) + "\n").encode())

    def _refresh_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "refresh", "--config", str(self.refresh_yaml), *args],
                              env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)

    def _child(self, name: str) -> Child:
        if name == "refresher":
            argv = [sys.executable, "-m", "refresh", "--config", str(self.refresh_yaml), "daemon"]
        elif name == "service":
            argv = [sys.executable, "-m", "bench.soak_service", "--port", str(self.service_port),
                    "--keys", str(self.work / "call-keys.txt")]
        else:
            argv = [sys.executable, "-m", "enrich", "run", "--config", str(self.enrich_yaml), "--master", "local[2]"]
        return Child(name, argv, self.work / f"{name}.log", env=self.env, cwd=ROOT).start()

    # -------------------------------------------------------------------------------- drivers

    def _produce_events(self) -> None:
        p = Producer({**self.kafka, "enable.idempotence": True, "linger.ms": 20})

        def delivered(err: Any, msg: Any) -> None:
            event = json.loads(msg.value())
            with self._lock:
                if err is None:
                    self.produced[event["seq"]] = event["device_id"]
                else:
                    self.failed_produce += 1

        seq = 0
        while not self._stop.is_set():
            for _ in range(20):
                dev = f"d{self.rng.randrange(DEVICES + 20)}"
                p.produce(self.topics["events"], json.dumps({"device_id": dev, "seq": seq, "ts": now()}).encode(),
                          dev.encode(), on_delivery=delivered)
                seq += 1
            p.poll(0)
            time.sleep(0.1)
        p.flush(30)

    def _change_reference(self) -> None:
        rng = random.Random(self.seed + 1)
        n = 0
        while not self._stop.wait(rng.uniform(0.3, 1.0)):
            n += 1
            dev = f"d{rng.randrange(DEVICES + 20)}"
            op = rng.random()
            with self.engine.connect() as c:
                if op < 0.6:
                    r = c.execute(sa.text("UPDATE devices SET owner = :o, site_id = :s WHERE device_id = :d"),
                                  {"o": f"owner-{dev}-{n}", "s": f"s{rng.randrange(SITES)}", "d": dev})
                    self.fig.updates += r.rowcount
                elif op < 0.8:
                    r = c.execute(sa.text("DELETE FROM devices WHERE device_id = :d"), {"d": dev})
                    self.fig.deletes += r.rowcount
                else:
                    r = c.execute(sa.text("INSERT IGNORE INTO devices VALUES (:d, :o, :s)"),
                                  {"d": dev, "o": f"owner-{dev}-{n}", "s": f"s{rng.randrange(SITES)}"})
                    self.fig.inserts += r.rowcount
            if n % 12 == 0:
                site = f"s{rng.randrange(SITES)}"
                self.sites[site] = f"site-{site}-{n}"
                self._write_sites()
                self.fig.csv_edits += 1

    def _job_commits(self) -> int:
        commits = self.work / "checkpoint" / "spark" / "commits"
        return sum(1 for p in commits.iterdir() if p.name.isdigit()) if commits.is_dir() else 0

    def _kill(self, name: str, down: float = 0.0) -> None:
        child = self.children[name]
        assert child.proc is not None
        kill_session(child.proc.pid)  # everything it started: driver, JVM, PySpark's daemons and workers
        child.proc.wait(30)
        log.info("SIGKILL %s (pid %d), down for %.1f s", name, child.proc.pid, down)
        time.sleep(down)
        self.children[name] = self._child(name)

    def _restart_database(self, down: float) -> None:
        assert self.pg is not None
        self.pg.crash()
        log.info("PostgreSQL stopped (-m immediate), down for %.1f s", down)
        time.sleep(down)
        self.pg.start()
        log.info("PostgreSQL started again")

    def _killer(self, deadline: float) -> None:
        rng = random.Random(self.seed + 2)
        job_started_commits = self._job_commits()
        refresher_started = time.monotonic()
        next_refresher_kill = refresher_started + rng.uniform(2, 8)
        job_extra_wait = rng.uniform(0, 3)
        job_ready_at: float | None = None
        # The database and the service on schedules of their own (their own seeds): the database
        # only while the job runs (committed a batch since its last start), the service at any time.
        rng_db, rng_svc = random.Random(self.seed + 3), random.Random(self.seed + 4)
        next_db = refresher_started + rng_db.uniform(10, 30)
        next_svc = refresher_started + rng_svc.uniform(5, 20)
        limit = deadline + missing_kills_span(self.duration)
        while not self._stop.is_set():
            now = time.monotonic()
            f = self.fig
            enough = (f.kills_refresher >= self.min_kills and f.kills_job >= self.min_kills
                      and f.restarts_database >= self.min_restarts and f.restarts_service >= self.min_restarts)
            if (now >= deadline and enough) or now >= limit:
                return
            for c in self.children.values():
                c.check()
            if now >= next_svc and (now < deadline or f.restarts_service < self.min_restarts):
                self._kill("service", rng_svc.uniform(1, 5))
                f.restarts_service += 1
                next_svc = time.monotonic() + rng_svc.uniform(10, 30)
            if (now >= next_db and self._job_commits() > job_started_commits
                    and (now < deadline or f.restarts_database < self.min_restarts)):
                self._restart_database(rng_db.uniform(2, 8))
                f.restarts_database += 1
                next_db = time.monotonic() + rng_db.uniform(15, 40)
            if now >= next_refresher_kill and (now < deadline or self.fig.kills_refresher < self.min_kills):
                self._kill("refresher")
                self.fig.kills_refresher += 1
                next_refresher_kill = time.monotonic() + rng.uniform(3, 12)
            if self._job_commits() > job_started_commits and job_ready_at is None:
                job_ready_at = now + job_extra_wait
            capped = self.max_job_kills is not None and self.fig.kills_job >= self.max_job_kills
            if job_ready_at is not None and now >= job_ready_at and not capped and \
                    (now < deadline or self.fig.kills_job < self.min_kills):
                self._kill("job")
                self.fig.kills_job += 1
                job_started_commits = self._job_commits()
                job_ready_at, job_extra_wait = None, rng.uniform(0, 3)
            time.sleep(0.2)

    # ------------------------------------------------------------------------------- checking

    def _read_dimension(self, topic: str) -> dict[str, dict[str, Any]]:
        """The changelog as a reader applies it through the contract: key -> row (deletes removed)."""
        rows: dict[bytes, bytes | None] = {}
        for m in rkafka.read_to_end(self.kafka, topic, timeout=30):
            ch = contract.decode(m.key(), m.value(), m.headers())
            if ch.op in (contract.OP_UPSERT, contract.OP_DELETE):
                rows[ch.key] = ch.value
        out = {}
        for k, v in rows.items():
            if v is not None:
                key = json.loads(k)
                out[str(next(iter(key.values())))] = json.loads(v)
        return out

    def _db_devices(self) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as c:
            return {r[0]: {"device_id": r[0], "owner": r[1], "site_id": r[2]}
                    for r in c.execute(sa.text("SELECT device_id, owner, site_id FROM devices"))}

    def _output(self) -> list[dict[str, Any]]:
        return [json.loads(m.value()) for m in rkafka.read_to_end(self.kafka, self.topics["out"], timeout=60)]

    @property
    def pg_url(self) -> str:
        assert self.pg is not None
        return self.pg.url

    def _table(self) -> list[dict[str, Any]]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT seq, device_id, state_events, echo_device, echo_events, echo_seq FROM {TABLE}")
            names = [d.name for d in cur.description or ()]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def _finish(self) -> None:
        f = self.fig
        for child in self.children.values():
            child.check()
        forced = self._refresh_cli("run")
        if forced.returncode != 0:
            raise AssertionError(f"the final refresh run failed: {forced.stderr[-2000:]}")
        db = self._db_devices()
        topic_devices = self._read_dimension(self.topics["devices"])
        topic_sites = {k: v["name"] for k, v in self._read_dimension(self.topics["sites"]).items()}
        f.dimension_mismatches = [f"devices {k}: topic {topic_devices.get(k)} db {db.get(k)}"
                                  for k in sorted(set(db) | set(topic_devices)) if topic_devices.get(k) != db.get(k)]
        f.dimension_mismatches += [f"sites {k}: topic {topic_sites.get(k)} csv {self.sites.get(k)}"
                                   for k in sorted(set(self.sites) | set(topic_sites))
                                   if topic_sites.get(k) != self.sites.get(k)]
        # Probes: one event per key ever used, sent after the final refresh committed.
        p = Producer({**self.kafka, "enable.idempotence": True})
        keys = [f"d{i}" for i in range(DEVICES + 20)]
        for i, dev in enumerate(keys):
            p.produce(self.topics["events"], json.dumps({"device_id": dev, "seq": PROBE_BASE + i, "ts": now()}).encode(),
                      dev.encode())
        assert p.flush(30) == 0
        f.probes = len(keys)
        expected = set(self.produced) | {PROBE_BASE + i for i in range(len(keys))}
        deadline = time.monotonic() + PROBE_WAIT_S
        while True:
            out = self._output()
            seqs = Counter(int(e["seq"]) for e in out)
            if expected <= set(seqs) or time.monotonic() > deadline:
                break
            self.children["job"].check()
            time.sleep(2)
        f.events, f.produce_failures = len(self.produced), self.failed_produce
        f.lost = len(expected - set(seqs))
        f.duplicated = sum(c - 1 for c in seqs.values() if c > 1)
        f.late = sum(1 for e in out if e.get("_late"))
        f.state_mismatches = self._state_mismatches(out, keys)
        f.call_mismatches = [f"{e['device_id']} seq {e['seq']}: state.events {(e.get('state') or {}).get('events')}, "
                             f"call {e.get('echo_device')}/{e.get('echo_seq')}/{e.get('echo_events')}"
                             for e in out if (e.get("echo_device"), e.get("echo_seq"), e.get("echo_events"))
                             != (e["device_id"], int(e["seq"]), (e.get("state") or {}).get("events"))]
        f.dead_letters = sum(1 for _ in rkafka.read_to_end(self.kafka, self.topics["dlq"], timeout=30))
        self._check_table(out, expected)
        sent = Counter((self.work / "call-keys.txt").read_text(encoding="utf-8").split())
        f.call_requests, f.call_keys_repeated = sum(sent.values()), sum(c - 1 for c in sent.values() if c > 1)
        f.db_write_retries = (self.work / "job.log").read_text(encoding="utf-8", errors="replace").count(
            ": writing output failed (attempt")
        probes = {e["device_id"]: e for e in out if int(e["seq"]) >= PROBE_BASE}
        for dev in keys:
            e, row = probes.get(dev), db.get(dev)
            if e is None:
                f.probe_mismatches.append(f"{dev}: no probe output")
            elif row is None:
                if e.get("_devices_matched") or e.get("owner") is not None:
                    f.probe_mismatches.append(f"{dev}: deleted in the database, enriched with {e}")
            elif (e.get("owner"), e.get("site_id"), e.get("name")) != (row["owner"], row["site_id"],
                                                                       self.sites.get(row["site_id"])):
                f.probe_mismatches.append(f"{dev}: enriched {e.get('owner')}/{e.get('site_id')}/{e.get('name')}, "
                                          f"database {row['owner']}/{row['site_id']}/{self.sites.get(row['site_id'])}")
        check = self._refresh_cli("status", "--check")
        f.status_check, f.status_problems = check.returncode, (check.stderr or check.stdout).strip()[-2000:]

    def _check_table(self, out: list[dict[str, Any]], expected: set[int]) -> None:
        """The PostgreSQL table: a row per event, each once, whose state and call results are the
        Kafka output's for the same event."""
        f = self.fig
        rows = self._table()
        seqs = Counter(int(r["seq"]) for r in rows)
        f.db_rows = len(rows)
        f.db_lost = len(expected - set(seqs))
        f.db_duplicated = sum(c - 1 for c in seqs.values() if c > 1)
        kafka = {int(e["seq"]): e for e in out}
        for r in rows:
            e = kafka.get(int(r["seq"]))
            want = None if e is None else (e["device_id"], (e.get("state") or {}).get("events"),
                                           e.get("echo_device"), e.get("echo_events"), e.get("echo_seq"))
            got = (r["device_id"], r["state_events"], r["echo_device"], r["echo_events"], r["echo_seq"])
            if got != want:
                f.db_mismatches.append(f"seq {r['seq']}: table {got}, Kafka {want}")

    def _state_mismatches(self, out: list[dict[str, Any]], keys: list[str]) -> list[str]:
        """Devices whose events do not count each event once: the ``state.events`` of a device's
        output events must be 1..n, n every event produced for the device (the acknowledged ones
        and its probe), so its last one (the probe) counts all of them. Unmatched devices count
        too (the state keeps every event with a key); there are no dead letters."""
        produced = Counter(self.produced.values()) + Counter(keys)
        counts: dict[str, list[int]] = {}
        for e in out:
            counts.setdefault(e["device_id"], []).append((e.get("state") or {}).get("events") or 0)
        bad = []
        for dev in sorted(set(produced) | set(counts)):
            got = sorted(counts.get(dev, []))
            if got != list(range(1, produced[dev] + 1)):
                wrong = Counter(got) - Counter(range(1, produced[dev] + 1))
                bad.append(f"{dev}: {produced[dev]} produced, state.events of its output events 1..n but for "
                           f"{dict(sorted(wrong.items())[:5])} extra and "
                           f"{sorted(set(range(1, produced[dev] + 1)) - set(got))[:5]} missing")
        return bad

    # ------------------------------------------------------------------------------------ run

    def run(self) -> Figures:
        log.info("soak: seed %d, %.0f s, work directory %s", self.seed, self.duration, self.work)
        t0 = time.monotonic()
        with ExitStack() as stack:
            self.pg = PrivatePostgres(self.work / "postgres.log")
            stack.callback(self.pg.close)
            self.pg.init()
            stack.callback(self._drop_database)
            self._setup()
            stack.callback(self._stop_children)
            self.children = {"service": self._child("service")}
            wait_for_port(self.service_port, 60)
            self.children.update({"refresher": self._child("refresher"), "job": self._child("job")})
            threads = [threading.Thread(target=self._produce_events, name="events", daemon=True),
                       threading.Thread(target=self._change_reference, name="changes", daemon=True)]
            for t in threads:
                t.start()
            stack.callback(self._stop.set)
            try:
                self._killer(time.monotonic() + self.duration)
            finally:
                self._stop.set()
                for t in threads:
                    t.join(60)
            self._finish()
        self.fig.duration_s = round(time.monotonic() - t0, 1)
        return self.fig

    def _stop_children(self) -> None:
        for c in self.children.values():
            c.stop()

    def _drop_database(self) -> None:
        engine = sa.create_engine(self.server + "/", isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(sa.text(f"DROP DATABASE IF EXISTS `{self.db_name}`"))
        engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a child started with ``start_new_session``). Its
    process group is not enough for the job: PySpark's daemons put themselves, and the Python
    workers they fork, in process groups of their own (``pyspark/daemon.py``), in the same session."""
    os.killpg(sid, signal.SIGKILL)
    for _ in range(2):  # a daemon may fork a worker meanwhile
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
                if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    os.kill(int(stat.parent.name), signal.SIGKILL)
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue


def now() -> str:
    """The wall clock in UTC as the events' ``ts``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextmanager
def _broker(bootstrap: str | None, work: Path) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with EmbeddedBroker(log_path=work / "broker.log") as b:
        yield b.bootstrap


def time_limit(duration: float) -> float:
    """A bound on a soak of ``duration`` seconds: the churn and the span for missing kills (each job
    kill waits for a batch after a restart, a minute or more on a slow or loaded machine), three
    ``refresh`` commands (setup, the forced run, ``status --check``) and the probes' wait."""
    return duration + missing_kills_span(duration) + 3 * CLI_TIMEOUT_S + PROBE_WAIT_S


def missing_kills_span(duration: float) -> float:
    """How long a soak of ``duration`` seconds goes on for the kills and restarts it still misses."""
    return max(MISSING_KILLS_SPAN * duration, MISSING_KILLS_MIN_S)


def run(work: Path, *, duration: float, seed: int, bootstrap: str | None = None,
        mysql_server: str = "mysql+pymysql://root@127.0.0.1:3306", min_kills: int = 5,
        min_restarts: int = 2, max_job_kills: int | None = None) -> Figures:
    """One soak; returns its figures (``Figures.ok()`` says whether every check passed).
    ``max_job_kills``: kill the job at most this many times (None: whenever it has committed a batch
    since its last start, until the churn ends)."""
    work.mkdir(parents=True, exist_ok=True)
    with _broker(bootstrap, work) as servers:
        return Soak(work, servers, mysql_server, seed=seed, duration=duration, min_kills=min_kills,
                    min_restarts=min_restarts, max_job_kills=max_job_kills).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of churn and kills (default 180)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; logged)")
    p.add_argument("--kills", type=int, default=5, help="at least this many SIGKILLs of the refresher and the job")
    p.add_argument("--restarts", type=int, default=2,
                   help="at least this many restarts of PostgreSQL and of the call service")
    p.add_argument("--bootstrap", default=None, help="a broker to use instead of the embedded one")
    p.add_argument("--mysql", default=os.environ.get("REFSTREAM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306"))
    p.add_argument("--work", type=Path, default=None, help="work directory (default: var/soak/<seed>)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    seed = args.seed if args.seed is not None else int(time.time())
    work = args.work or Path("var") / "soak" / str(seed)
    fig = run(work, duration=args.duration, seed=seed, bootstrap=args.bootstrap, mysql_server=args.mysql,
              min_kills=args.kills, min_restarts=args.restarts)
    print(json.dumps({**asdict(fig), "changes": fig.changes, "ok": fig.ok()}, indent=2))
    return 0 if fig.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
