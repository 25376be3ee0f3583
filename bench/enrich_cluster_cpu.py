"""Where the job's CPU goes on a standalone Spark cluster: the driver's share of the run's CPU time.

    .venv/bin/python -m bench.enrich_cluster_cpu --events 1000000 --dimension-rows 1000000 --repeat 3

Starts a master and two workers (one core, ``--worker-memory`` each) with pyspark's ``spark-class``,
an embedded broker (or ``--bootstrap``), publishes the ``devices`` dimension and the events like
``bench.enrich_bench``, then runs ``python -m enrich run --available-now --master spark://...`` as
a child process. Every 0.2 s it reads the CPU time (user + system) of every process of two trees:
the **driver** (the ``enrich run`` process and its JVM) and the **cluster** (the workers' JVMs and
what they start: executor JVMs, ``pyspark.daemon`` and its Python workers). The master is left out
(it schedules, it does not compute). A process's last reading counts, so short-lived workers are
covered to within one sampling interval. Reports the driver's share of the sum, per round and the
median, and splits the driver's CPU into phases by the job's log (``--log-format json``, so every
line has its time): **start** (Python, the JVM and the session, up to the dimension bootstrap, whose
start is its log line's time minus the duration it reports), **bootstrap** (reading the
dimensions' changelogs), **plan** (from there to the first micro-batch's start: the query and its
first offsets), **batches** (from there to the last batch's end) and **stop**.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pyspark
import yaml

from bench import enrich_data as data
from bench.common import broker_settings, json_log, thread_times
from demo.broker import free_port

SPARK_HOME = Path(pyspark.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable}
    return subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def _alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
            return int(json.loads(r.read()).get("aliveworkers", 0))
    except OSError:
        return 0


def start_cluster(stack: ExitStack, workdir: Path, memory: str) -> tuple[str, list[psutil.Process]]:
    port, ui = free_port(), free_port()
    procs = [_spawn(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                     "--webui-port", str(ui)], workdir / "master.log")]

    def stop() -> None:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    stack.callback(stop)
    for i in range(2):
        procs.append(_spawn(["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}", "--host",
                             "127.0.0.1", "--cores", "1", "--memory", memory, "--webui-port", "0",
                             "--work-dir", str(workdir / f"work{i}")], workdir / f"worker{i}.log"))
    deadline = time.monotonic() + 120
    while _alive_workers(ui) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not come up")
        time.sleep(1)
    return f"spark://127.0.0.1:{port}", [psutil.Process(p.pid) for p in procs[1:]]


def processes(roots: list[psutil.Process]) -> Iterator[psutil.Process]:
    """Every live process of the trees under ``roots``, roots first."""
    for root in roots:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        yield from procs


def sink_batches(log: Path) -> list[tuple[float, int]]:
    """(time, records written) of every micro-batch the Kafka sink logged, from the job's JSON log."""
    return [(r.time, int(r.message.split(": ", 1)[1].split(" records")[0])) for r in json_log(log)
            if r.logger == "enrich.sinks.kafka.sink" and r.message.startswith("batch ") and " records and " in r.message]


class CpuTrees:
    """Last seen CPU time (user + system) of every process under some roots, per tree."""

    def __init__(self, trees: dict[str, list[psutil.Process]]) -> None:
        self.trees = trees
        self.seen: dict[str, dict[int, float]] = {name: {} for name in trees}

    def sample(self) -> None:
        for name, roots in self.trees.items():
            for p in processes(roots):
                try:
                    t = p.cpu_times()
                    self.seen[name][p.pid] = t.user + t.system
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue

    def totals(self) -> dict[str, float]:
        return {name: sum(v.values()) for name, v in self.seen.items()}


def thread_cpu(roots: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds so far of every thread of the trees under ``roots``, summed by process name and
    thread name with digits folded (``java: C2 CompilerThre#``, ``python: python``)."""
    out: dict[str, float] = {}
    for p in processes(roots):
        try:
            pname = p.name()
        except psutil.NoSuchProcess:
            continue
        for _, comm, cpu in thread_times(p.pid):
            name = f"{pname}: {re.sub(r'[0-9]+', '#', comm)}"
            out[name] = out.get(name, 0.0) + cpu
    return out


PHASES = ("start", "bootstrap", "plan", "batches", "stop")


def phases(timeline: list[tuple[float, float, float]], log: Path,
           threads: list[tuple[float, dict[str, float]]] | None = None) -> dict[str, Any]:
    """The driver's CPU seconds per phase (see the module doc), from ``timeline`` (wall time, driver
    and cluster CPU so far) and the job's JSON log lines; ``cluster in batches`` is the cluster's CPU
    during the batches phase, ``driver threads in batches`` the driver's by thread name (from
    ``threads``: wall time and :func:`thread_cpu` samples)."""
    marks: dict[str, float] = {}
    batch_ends: list[float] = []
    first_batch_start = None
    for rec in json_log(log):
        t, msg = rec.time, rec.message
        if " bootstrapped " in msg and " rows from " in msg:
            took = float(msg.rsplit(" in ", 1)[1].split("s", 1)[0])
            marks.setdefault("bootstrap", t - took)
            marks["plan"] = t
        elif msg.startswith("batch ") and " done in " in msg:
            took = float(msg.split(" done in ", 1)[1].split("s", 1)[0])
            first_batch_start = first_batch_start if first_batch_start is not None else t - took
            batch_ends.append(t)
    if "bootstrap" not in marks or first_batch_start is None:
        return {}
    marks["batches"], marks["stop"] = first_batch_start, batch_ends[-1]

    def cpu_at(t: float, which: int = 1) -> float:
        before = [row[which] for row in timeline if row[0] <= t]
        return before[-1] if before else 0.0

    bounds = [cpu_at(marks[p]) for p in PHASES[1:]]
    edges = [0.0, *bounds, timeline[-1][1]]
    out: dict[str, Any] = {p: edges[i + 1] - edges[i] for i, p in enumerate(PHASES)}
    out["cluster in batches"] = cpu_at(marks["stop"], 2) - cpu_at(marks["batches"], 2)
    if threads:
        def at(t: float) -> dict[str, float]:
            before = [row[1] for row in threads if row[0] <= t]
            return before[-1] if before else {}
        start, end = at(marks["batches"]), at(marks["stop"])
        out["driver threads in batches"] = dict(sorted(
            ((k, v - start.get(k, 0.0)) for k, v in end.items()), key=lambda kv: -kv[1]))
    return out


def run_round(settings: dict[str, str], master: str, workers: list[psutil.Process], events_topic: str,
              devices_topic: str, workdir: Path, batch: int, n: int,
              spark: dict[str, str] | None = None) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    config = workdir / f"enrich-{tag}.yaml"
    out = f"bench-enriched-{tag}"
    config.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events_topic, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": devices_topic, "on": "device_id",
                   "columns": list(data.JOIN_COLUMNS)}],
        "output": {"kafka": {"topic": out}},
        "dead_letter_topic": f"bench-dlq-{tag}",
        "checkpoint": str(workdir / f"checkpoint-{tag}"),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "spark": {"spark.driver.memory": "2g", "spark.executor.memory": "2g", "spark.cores.max": "2",
                  "spark.driver.host": "127.0.0.1", "spark.ui.enabled": "false", **(spark or {})},
    }))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    log = workdir / f"job-{tag}.log"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "enrich", "run", "--config", str(config), "--master", master,
                             "--available-now", "--log-format", "json"], cwd=ROOT, env=env, stdout=open(log, "ab"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)
    cpu = CpuTrees({"driver": [psutil.Process(proc.pid)], "cluster": workers})
    timeline: list[tuple[float, float, float]] = []
    threads: list[tuple[float, dict[str, float]]] = []
    while proc.poll() is None:
        cpu.sample()
        now = cpu.totals()
        timeline.append((time.time(), now["driver"], now["cluster"]))
        threads.append((time.time(), thread_cpu([psutil.Process(proc.pid)])))
        time.sleep(0.2)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"job failed ({proc.returncode}): {log.read_text()[-3000:]}")
    totals = cpu.totals()
    written = sum(n for _, n in sink_batches(log))
    if written != n:
        raise RuntimeError(f"the job wrote {written} records, expected {n}")
    share = totals["driver"] / (totals["driver"] + totals["cluster"])
    return {"driver_cpu_s": totals["driver"], "cluster_cpu_s": totals["cluster"], "driver_share": share,
            "wall_s": wall, "phases": phases(timeline, log, threads)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.enrich_cluster_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--dimension-rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=250_000, help="events per micro-batch (default %(default)s)")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker-memory", default="3g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--ab-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting (repeatable): each round then runs the job without and with them")
    args = ap.parse_args(argv)
    ab = dict(kv.split("=", 1) for kv in args.ab_conf)
    variants: list[tuple[str, dict[str, str]]] = [("as configured", {})] + ([("with " + " ".join(args.ab_conf), ab)]
                                                                          if ab else [])
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="enrich-cluster-cpu-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic = f"ref.devices-{tag}", f"bench-events-{tag}"
        data.publish_devices(settings, devices_topic, args.dimension_rows)
        data.fill_events(settings, events_topic, args.events, args.partitions, args.dimension_rows)
        master, workers = start_cluster(stack, workdir, args.worker_memory)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
        for r in range(args.repeat):
            for name, conf in variants:
                res = run_round(settings, master, workers, events_topic, devices_topic, workdir, args.batch, args.events,
                                conf)
                rounds[name].append(res)
                print(f"[{r + 1}/{args.repeat}] {name}: driver {res['driver_cpu_s']:.1f} s CPU, cluster {res['cluster_cpu_s']:.1f} s "
                      f"CPU: driver share {res['driver_share']:.1%}; wall {res['wall_s']:.1f} s", flush=True)
                ph = res["phases"]
                if ph:
                    print("      driver CPU by phase: " + ", ".join(f"{p} {ph[p]:.1f} s" for p in PHASES)
                          + f"; in the batches phase the driver's share is {ph['batches'] / (ph['batches'] + ph['cluster in batches']):.1%}"
                          f" (cluster {ph['cluster in batches']:.1f} s)", flush=True)
                    top = list(ph.get("driver threads in batches", {}).items())[:12]
                    print("      driver CPU in batches by thread: " + ", ".join(f"{k} {v:.2f} s" for k, v in top),
                          flush=True)
        for name, done in rounds.items():
            med = statistics.median(r["driver_share"] for r in done)
            in_batches = statistics.median(r["phases"]["batches"] / (r["phases"]["batches"]
                                                                    + r["phases"]["cluster in batches"])
                                           for r in done if r["phases"])
            print(f"{name}: driver share of the run's CPU, median of {args.repeat}: {med:.1%} (target < 10%: "
                  f"{'met' if med < 0.10 else 'MISSED'}); in the batches phase {in_batches:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
