"""The demo's pipeline end to end, timed the way its users feel it: how long the job takes to start,
how long each micro-batch takes, and how long a reference change takes from the database commit to
the enriched output.

Per round (one per ``--rates`` entry, each on a fresh embedded broker): the demo's reference data
(``--devices`` devices in SQLite, or the database at ``--db-url``), the demo's refresher daemon
(``devices`` diffed every ``--poll``), the simulator at the round's rate, and the enrichment job as
a process with the demo's three joins and state aggregates (its ``calls:`` section only with
``--calls``), trigger ``--trigger``, on ``--master``, Kafka output. Then:

- **start-up**: from the job process's start to the first enriched event read back
  (``read_committed``), and the job's own phases from its log (Spark session, query started, first
  batch done);
- **batch time**: Spark's ``triggerExecution`` of every trigger after ``--warmup`` seconds (the job
  logs each trigger's durations), with the medians of its parts and of the job's own batch time;
- **change to output**: ``--changes`` UPDATEs of a device's ``owner``, one after another at random
  phases of the poll, each timed from the moment its commit returned to the first enriched event
  read back that carries the new owner (probe events for that device flow meanwhile, as in the
  demo): p50, p95, p99 and max;
- **rollup rows** (``--rollup-seconds N``): the demo's ``device_1m`` rollup written to a database
  table (``--rollup-db-url``) instead of Parquet; for ``N`` seconds the events are read back from
  the events topic (their Kafka timestamps) and the table is polled every 0.2 s. An event's
  provisional latency runs from its Kafka timestamp to the first poll that shows its window's row
  with at least as many events as the window had with it; a window's final latency from the time
  its end plus the watermark delay (30 s) passed to the first poll that shows it ``final``;
- **CPU per batch**: the job process's CPU with every process under it (the JVM, its Python
  workers and runners, those that ended included) from ``--warmup`` on, over the triggers in that
  span, and per second; ``--hold N`` stays N seconds more. At ``--rates 1`` the batches are all but
  empty: the figure is a batch's fixed cost.

    python -m bench.run pipeline --rates 1000,20000 --changes 25
    python -m bench.run pipeline --rates 1000 --changes 0 --rollup-seconds 120
    python -m bench.run pipeline --rates 1 --changes 0 --hold 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa
import yaml
from confluent_kafka import OFFSET_END, Producer, TopicPartition

from bench.common import BATCH_DONE, LogRecord, json_log, percentile, workdir
from demo.broker import EmbeddedBroker
from demo.cli import demo_environment
from demo.processes import Child
from demo.seed import DEVICES_TABLE, seed_database, write_sites
from demo.simulate import device_id, make_event, now_iso
from demo.tail import EnrichedTail
from refstream import kafka
from refstream.contract import default_topic

ROOT = Path(__file__).resolve().parents[1]
EVENTS_TOPIC, OUTPUT_TOPIC = "device-events", "device-events-enriched"
ROLLUP, WATERMARK_S = "device_1m", 30.0  # the demo's per-device rollup (1-minute windows) and state.watermark
_RNG = random.Random(7)


def job_config(path: Path, *, trigger: str, calls: bool, checkpoint: Path, spark: dict[str, str],
               buckets: int | None = None, rollup_table: dict[str, str] | None = None,
               correct_for: str | None = None, corrections: bool = False) -> None:
    """The demo's enrich.yaml, with this run's trigger, checkpoint and Spark settings, and without
    ``calls:`` unless asked (its ``${DEMO_...}`` variables stay for the job to substitute), its
    joins plain (no ``as_of``, no ``corrections``) unless ``corrections``;
    ``rollup_table``: ``device_1m``'s output (``{url, table}``) instead of its Parquet directory;
    ``correct_for``: the rollups' correction horizon (default: the demo's, ``state.ttl``)."""
    data = yaml.safe_load((ROOT / "demo" / "conf" / "enrich.yaml").read_text())
    if rollup_table is not None:
        for r in data["rollups"]:
            if r["name"] == ROLLUP:
                r["output"] = {"database": rollup_table}
    if correct_for is not None:
        for r in data["rollups"]:
            r["correct_for"] = correct_for
    data["trigger"] = trigger
    data["checkpoint"] = str(checkpoint)
    data["spark"] = {**(data.get("spark") or {}), **spark}
    if not calls:
        data.pop("calls", None)
    if not corrections:
        for j in data["joins"]:
            j.pop("as_of", None)
            j.pop("corrections", None)
    if buckets is not None:
        data["state"]["buckets"] = buckets
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def refresh_config(path: Path, *, poll: str) -> None:
    """The demo's refresh.yaml with ``devices`` diffed every ``poll``."""
    data = yaml.safe_load((ROOT / "demo" / "conf" / "refresh.yaml").read_text())
    data["datasets"]["devices"]["schedule"] = {"every": poll}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _wait_changelogs(settings: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for ds in ("devices", "models", "sites"):
        while not kafka.partitions_of(settings, default_topic(ds)) or \
                not any(True for _ in kafka.read_to_end(settings, default_topic(ds), timeout=10)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the refresher published nothing for {ds} in {timeout:.0f} s")
            time.sleep(0.5)


def triggers(records: list[LogRecord], after: float) -> list[dict[str, float]]:
    """Each trigger the job logged (``batch N: trigger S s (part S, ...)``) after wall time ``after``:
    its parts in seconds, ``triggerExecution`` included."""
    out = []
    for r in records:
        msg = r.message
        if ": trigger " not in msg or r.time < after:
            continue
        head, _, rest = msg.partition(": trigger ")
        total, _, parts = rest.partition("s (")
        row = {"triggerExecution": float(total)}
        for part in parts.rstrip(")").split(", "):
            name, _, secs = part.rpartition(" ")
            if name:
                row[name] = float(secs)
        out.append(row)
    return out


def batch_times(records: list[LogRecord], after: float) -> list[float]:
    """The job's own time per batch (its ``batch N done in S s`` lines) after wall time ``after``."""
    return [float(m.group(2)) for r in records if r.time >= after and (m := BATCH_DONE.match(r.message))]


class Round:
    """One rate's run: the pipeline up, its start timed, then the changes."""

    def __init__(self, args: argparse.Namespace, rate: float, work: Path) -> None:
        self.args, self.rate, self.work = args, rate, work
        self.logs = work / "logs"

    def run(self) -> dict[str, Any]:
        a = self.args
        self.logs.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            broker = stack.enter_context(EmbeddedBroker(log_path=self.logs / "broker.log"))
            settings = {"bootstrap.servers": broker.bootstrap}
            db_url = a.db_url or f"sqlite:///{self.work / 'refdata.db'}"
            seed_database(db_url, a.devices)
            (self.work / "data").mkdir(parents=True, exist_ok=True)
            write_sites(self.work / "data" / "sites.csv")
            env = {**os.environ, **demo_environment(self.work, broker.bootstrap, db_url)}
            os.environ.update(env)  # the tail and producer below need nothing of it; `refresh` children do
            refresh_yaml, enrich_yaml = self.work / "refresh.yaml", self.work / "enrich.yaml"
            refresh_config(refresh_yaml, poll=a.poll)
            table = {"url": a.rollup_db_url, "table": f"bench_{ROLLUP}_{uuid.uuid4().hex[:8]}"} \
                if a.rollup_seconds else None
            job_config(enrich_yaml, trigger=a.trigger, calls=a.calls, corrections=a.corrections,
                       checkpoint=self.work / "checkpoint",
                       spark=dict(kv.split("=", 1) for kv in a.spark), buckets=a.buckets, rollup_table=table,
                       correct_for=a.rollup_correct_for)

            def start(name: str, argv: list[str]) -> Child:
                child = Child(name, argv, self.logs / f"{name}.log", env=env, cwd=self.work).start()
                stack.callback(child.stop)
                return child

            start("refresher", [sys.executable, "-m", "refresh", "--config", str(refresh_yaml), "daemon"])
            _wait_changelogs(settings, a.startup_timeout)
            if a.calls:
                start("risk", [sys.executable, "-m", "demo.risk", "--port", env["DEMO_RISK_PORT"]])
            start("simulator", [sys.executable, "-m", "demo.simulate", "--bootstrap", broker.bootstrap, "--topic",
                                EVENTS_TOPIC, "--rate", f"{self.rate:g}", "--devices", str(a.devices),
                                "--partitions", "2", "--malformed", "0"])
            time.sleep(2.0)  # events already flowing when the job starts, as in the demo
            tail = EnrichedTail(settings, OUTPUT_TOPIC).start()
            stack.callback(tail.stop)
            first = tail.expect("first", lambda e: bool(e.get("site_name")))
            wall0, t0 = time.time(), time.monotonic()
            first.started = t0
            job = start("job", [sys.executable, "-m", "enrich", "run", "--log-format", "json", "--config",
                                str(enrich_yaml), "--master", a.master])
            startup = first.wait(a.startup_timeout)
            job.check()
            if startup is None:
                raise RuntimeError(f"no enriched event within {a.startup_timeout:.0f} s (see {self.logs / 'job.log'})")
            time.sleep(a.warmup)
            wall1 = time.time()
            cpu0 = tree_cpu(job.pid)
            producer = kafka.producer(settings, **{"linger.ms": "5"})
            stack.callback(producer.flush, 5)
            latencies = self._changes(db_url, tail, producer, job)
            rollups = RollupWatch(settings, table).run(a.rollup_seconds, job) if table is not None else None
            time.sleep(a.hold)
            job.check()
            cpu, wall2 = tree_cpu(job.pid) - cpu0, time.time()
            records = json_log(self.logs / "job.log")
        report = self._report(records, wall0, wall1, startup, latencies)
        report["cpu_s_per_second"] = round(cpu / (wall2 - wall1), 3)
        report["cpu_s_per_trigger"] = round(cpu / report["triggers"], 3) if report["triggers"] else None
        if rollups is not None:
            report["rollup_rows"] = rollups
        return report

    def _changes(self, db_url: str, tail: EnrichedTail, producer: Producer, job: Child) -> list[float]:
        a = self.args
        engine = sa.create_engine(db_url)
        seq = 2 * 10**9
        out = []
        try:
            for i in range(a.changes):
                dev = device_id(_RNG.randrange(1, a.devices + 1))
                owner = f"bench-{i}-{_RNG.randrange(10**6)}"
                exp = tail.expect(owner, lambda e, d=dev, o=owner: e.get("device_id") == d and e.get("owner") == o)
                with engine.begin() as conn:
                    conn.execute(sa.text(f"UPDATE {DEVICES_TABLE} SET owner = :o WHERE device_id = :d"),
                                 {"o": owner, "d": dev})
                exp.started = time.monotonic()  # the commit has returned
                deadline = exp.started + a.timeout
                latency = None
                while latency is None and time.monotonic() < deadline:
                    job.check()
                    seq += 1
                    producer.produce(EVENTS_TOPIC, make_event(dev, now_iso(), seq, _RNG), dev.encode())
                    producer.poll(0)
                    latency = exp.wait(0.1)
                if latency is None:
                    raise RuntimeError(f"change {i} ({dev} owner {owner}) not seen in {a.timeout:.0f} s")
                out.append(latency)
                print(f"  change {i + 1}/{a.changes}: {latency:.2f} s", flush=True)
                time.sleep(_RNG.uniform(0.0, 2.0))  # the next change at another phase of the poll and trigger
        finally:
            engine.dispose()
        return out

    def _report(self, records: list[LogRecord], wall0: float, wall1: float, startup: float,
                latencies: list[float]) -> dict[str, Any]:
        def first(text: str) -> float | None:
            for r in records:
                if text in r.message:
                    return round(r.time - wall0, 2)
            return None

        trig = triggers(records, wall1)
        parts = sorted({k for t in trig for k in t})
        return {
            "rate": self.rate, "startup_s": round(startup, 2),
            "phases_s": {"query started": first("enrichment query started"), "first batch done": first(" done in ")},
            "triggers": len(trig),
            "trigger_median_s": {k: round(statistics.median(t.get(k, 0.0) for t in trig), 3) for k in parts}
            if trig else {},
            "trigger_p95_s": round(percentile([t["triggerExecution"] for t in trig], 95), 3) if trig else None,
            "job_batch_median_s": round(statistics.median(bt), 3) if (bt := batch_times(records, wall1)) else None,
            "changes": len(latencies),
            "change_to_output_s": {"p50": round(percentile(latencies, 50), 2), "p95": round(percentile(latencies, 95), 2),
                                   "p99": round(percentile(latencies, 99), 2),
                                   "max": round(max(latencies), 2) if latencies else float("nan")},
        }


def tree_cpu(pid: int | None) -> float:
    """CPU seconds so far of process ``pid`` and every process under it, the ended ones included
    (a parent that waited for a child holds its CPU as ``children_*``)."""
    if pid is None:
        return 0.0
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class RollupWatch:
    """The rollup table's rows against the events that made them (see the module doc)."""

    def __init__(self, settings: dict[str, str], table: dict[str, str]) -> None:
        self.settings, self.table = settings, table

    def run(self, seconds: float, job: Child) -> dict[str, Any]:
        stop = threading.Event()
        events: list[tuple[str, float, float]] = []   # device, event time, Kafka timestamp (s)
        seen: dict[tuple[str, float], list[tuple[float, int]]] = {}   # (device, window) -> (poll time, events)
        final: dict[tuple[str, float], float] = {}
        start = time.time()

        def read() -> None:
            consumer = kafka.consumer(self.settings)
            consumer.assign([TopicPartition(EVENTS_TOPIC, p, OFFSET_END)
                             for p in kafka.partitions_of(self.settings, EVENTS_TOPIC)])
            try:
                while not stop.is_set():
                    for m in consumer.consume(1000, 0.2):
                        value = m.value()
                        if m.error() is None and value:
                            e = json.loads(value)
                            ts = datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
                            events.append((e["device_id"], ts, m.timestamp()[1] / 1000))
            finally:
                consumer.close()

        def poll() -> None:
            engine = sa.create_engine(self.table["url"])
            sql = sa.text(f"SELECT device_id, window_start, _events, _kind FROM {self.table['table']} "
                          "WHERE window_start >= :since")
            since = datetime.fromtimestamp(start - 120, UTC).replace(tzinfo=None)
            try:
                while not stop.is_set():
                    try:
                        with engine.connect() as conn:
                            rows = conn.execute(sql, {"since": since}).all()
                    except sa.exc.ProgrammingError:  # the table is made by the job's first write
                        rows = []
                    now = time.time()
                    for device, window, n, kind in rows:
                        key = (device, window.replace(tzinfo=UTC).timestamp())
                        got = seen.setdefault(key, [])
                        if not got or got[-1][1] < n:
                            got.append((now, int(n)))
                        if kind == "final" and key not in final:
                            final[key] = now
                    stop.wait(0.2)
            finally:
                engine.dispose()

        threads = [threading.Thread(target=f, daemon=True) for f in (read, poll)]
        for t in threads:
            t.start()
        end = start + seconds
        while time.time() < end:
            job.check()
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        return _rollup_figures(events, seen, final, start, end)


def _rollup_figures(events: list[tuple[str, float, float]], seen: dict[tuple[str, float], list[tuple[float, int]]],
                    final: dict[tuple[str, float], float], start: float, end: float) -> dict[str, Any]:
    """Provisional latency per event, final latency per window (module doc); only events and windows
    whose rows had time to appear (10 s before the end), and windows the reader saw from their start."""
    counted: dict[tuple[str, float], int] = {}
    provisional, missing = [], 0
    for device, ts, at in sorted(events, key=lambda e: e[2]):
        key = (device, ts // 60 * 60)
        counted[key] = counted.get(key, 0) + 1
        if at > end - 10 or key[1] < start:  # a window begun before the reader started: its count is unknown
            continue
        first = next((t for t, n in seen.get(key, []) if n >= counted[key]), None)
        if first is None:
            missing += 1
        else:
            provisional.append(first - at)
    finals = [t - (w + 60 + WATERMARK_S) for (_, w), t in final.items() if w >= start and w + 60 + WATERMARK_S < end - 10]
    due = sum(1 for (_, w) in counted if w >= start and w + 60 + WATERMARK_S < end - 10)

    def q(xs: list[float]) -> dict[str, float]:
        return {p: round(percentile(xs, v), 2) for p, v in (("p50", 50), ("p95", 95), ("p99", 99))} | \
            {"max": round(max(xs), 2) if xs else float("nan")}

    return {"events": len(provisional), "events_not_seen": missing, "provisional_s": q(provisional),
            "windows_final": len(finals), "windows_due": due, "final_after_watermark_s": q(finals)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1000,20000", help="events per second, one round each (comma-separated)")
    p.add_argument("--devices", type=int, default=5000)
    p.add_argument("--changes", type=int, default=25, help="reference changes timed per round (p95 needs 20+)")
    p.add_argument("--poll", default="2s", help="the refresher's schedule for the devices table (the demo's: 2s)")
    p.add_argument("--trigger", default="1s")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds after the first event before measuring")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a change may take")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--buckets", type=int, default=None, help="state.buckets (default: the demo's)")
    p.add_argument("--calls", action="store_true", help="keep the demo's calls: section (the risk service)")
    p.add_argument("--corrections", action="store_true",
                   help="keep the demo's models join as_of with corrections (plain joins otherwise)")
    p.add_argument("--spark", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting for the job (e.g. spark.eventLog.enabled=true; bench.tools.eventlog reads it)")
    p.add_argument("--db-url", default=None, help="reference database (default: a SQLite file per round)")
    p.add_argument("--rollup-seconds", type=float, default=0.0,
                   help="time the device_1m rollup's rows in a database table for this long (0: not)")
    p.add_argument("--rollup-db-url", default="postgresql://postgres@127.0.0.1:5432/test",
                   help="the database of the rollup's table")
    p.add_argument("--rollup-correct-for", default=None, help="the rollups' correct_for (default: state.ttl)")
    p.add_argument("--hold", type=float, default=0.0,
                   help="seconds to go on measuring the batches and their CPU after the changes and rollup rows")
    p.add_argument("--keep", type=Path, default=None, help="keep configs and logs here")
    p.add_argument("--json", action="store_true", help="one JSON line per round")
    args = p.parse_args(argv)
    results = []
    with ExitStack() as stack:
        root = workdir(stack, args.keep, "bench-pipeline-")
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            print(f"round at {rate:g} events/s", flush=True)
            # A directory per round: a rate named twice (two rounds of it) must not reuse a checkpoint.
            res = Round(args, rate, root / f"round-{i + 1}-rate-{rate:g}").run()
            results.append(res)
            print(json.dumps(res) if args.json else _text(res), flush=True)
    return 0


def _text(r: dict[str, Any]) -> str:
    m = r["trigger_median_s"]
    parts = ", ".join(f"{k} {v:.3f}" for k, v in m.items() if k != "triggerExecution" and v >= 0.005)
    c = r["change_to_output_s"]
    return (f"{r['rate']:g} events/s: start-up {r['startup_s']:.1f} s (query started at "
            f"{r['phases_s']['query started']} s, first batch done at {r['phases_s']['first batch done']} s); "
            f"{r['triggers']} triggers, triggerExecution median {m.get('triggerExecution', float('nan')):.3f} s, "
            f"p95 {r['trigger_p95_s']} s ({parts}); the job's batch median {r['job_batch_median_s']} s; "
            f"change to output over {r['changes']}: p50 {c['p50']} s, p95 {c['p95']} s, p99 {c['p99']} s, "
            f"max {c['max']} s; the job's CPU {r['cpu_s_per_trigger']} s per trigger, {r['cpu_s_per_second']} s per "
            "second" + (_rollup_text(r["rollup_rows"]) if "rollup_rows" in r else ""))


def _rollup_text(r: dict[str, Any]) -> str:
    p, f = r["provisional_s"], r["final_after_watermark_s"]
    return (f"; rollup rows: provisional over {r['events']} events ({r['events_not_seen']} not seen) p50 {p['p50']} s, "
            f"p95 {p['p95']} s, p99 {p['p99']} s, max {p['max']} s; final over {r['windows_final']} of "
            f"{r['windows_due']} windows, after end + watermark p50 {f['p50']} s, p95 {f['p95']} s, p99 {f['p99']} s, "
            f"max {f['max']} s")


if __name__ == "__main__":
    raise SystemExit(main())
