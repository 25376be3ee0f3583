"""A partitioned dimension against a broadcast one, on a standalone cluster: driver memory, bootstrap, throughput.

    .venv/bin/python -m bench.partitioned_bench --events 1000000 --devices 1000000 \\
        --contenders broadcast:50000,partitioned:5000000,broadcast:1000000,partitioned:1000000 --repeat 3

Starts a master and two workers (``bench.enrich_cluster_cpu.start_cluster``: one core and
``--worker-memory`` each) and an embedded broker (or ``--bootstrap``). Publishes a ``devices``
dimension per row count (the contract's bulk encoder, as the refresher publishes) and one backlog of
``--events`` events over ``--devices`` devices. Each contender runs ``python -m enrich run
--available-now --master spark://...`` with the same ``state:`` section and a ``devices`` join of
that strategy and row count; per round it reports:

- **driver RSS**: the peak, sampled every 0.2 s, of the sum of the RSS of the driver's processes
  (the ``enrich run`` Python process and its JVM); on a cluster the executors are other processes;
- **executors RSS**: the same peak over the workers' trees (executor JVMs, with the state store's
  RocksDB, and their Python workers, PSS);
- **first batch**: from the job's start to the end of its first micro-batch (JVM and session,
  the driver's bootstrap of a broadcast dimension or its schema scan of a partitioned one, and the
  first batch, which loads a partitioned dimension into the state store);
- **steady events/s**: events of the later batches over the time from the first batch's end to the
  last one's (from the job's JSON log).
Medians over ``--repeat`` rounds; contenders run in turn within each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import yaml

from bench import enrich_data as data
from bench.common import broker_settings
from bench.enrich_bench import STATE_SECTION
from bench.enrich_cluster_cpu import processes, sink_batches, start_cluster
from refstream import contract
from refstream import kafka as rkafka

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 200_000


def publish_devices(settings: dict[str, str], topic: str, rows: int) -> float:
    """``rows`` device rows (``enrich_data.device_row``'s values) as one schema record and upserts,
    encoded in bulk from Arrow; returns seconds taken."""
    rkafka.ensure_topic(settings, topic, config=contract.TOPIC_CONFIG)
    p = rkafka.producer(settings, role="bulk", **{"enable.idempotence": True})
    t0 = time.monotonic()
    m = contract.schema_message(data.DEVICES)
    p.produce(topic, m.value, m.key, headers=m.headers)
    for lo in range(1, rows + 1, CHUNK):
        n = list(range(lo, min(lo + CHUNK, rows + 1)))
        table = pa.table({"device_id": [f"d-{i}" for i in n], "model_id": [f"m-{i % 97}" for i in n],
                          "site_id": pa.array([i % 211 for i in n], pa.int64()),
                          "owner": [f"team-{i % 13}" for i in n],
                          "installed": pa.array([datetime(2024, 3, 1 + i % 28, 8, 30) for i in n],
                                                pa.timestamp("us"))})
        for batch in contract.upsert_batches(data.DEVICES, table, version=1):
            for key, value in zip(batch.keys, batch.values, strict=True):
                while True:
                    try:
                        p.produce(topic, value, key, headers=batch.headers)
                        break
                    except BufferError:
                        p.poll(0.05)
        p.poll(0)
    p.flush(300)
    return time.monotonic() - t0


def _tree_memory(roots: list[psutil.Process]) -> float:
    """RSS of the processes under ``roots``; PSS for Python processes other than a root (forked
    workers share pages with their daemon)."""
    total = 0.0
    for p in processes(roots):
        try:
            total += p.memory_full_info().pss if "python" in p.name() and p not in roots else p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def run_round(settings: dict[str, str], master: str, workers: list[psutil.Process], events_topic: str,
              devices_topic: str, strategy: str, workdir: Path, batch: int, n: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    config = workdir / f"enrich-{tag}.yaml"
    config.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events_topic, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": devices_topic, "on": "device_id",
                   "columns": list(data.JOIN_COLUMNS), "strategy": strategy}],
        "state": STATE_SECTION,
        "output": {"kafka": {"topic": f"bench-enriched-{tag}"}},
        "dead_letter_topic": f"bench-dlq-{tag}",
        "checkpoint": str(workdir / f"checkpoint-{tag}"),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "bootstrap_timeout": "10m",
        "spark": {"spark.driver.memory": "2g", "spark.executor.memory": "2g", "spark.cores.max": "2",
                  "spark.driver.host": "127.0.0.1", "spark.ui.enabled": "false",
                  "spark.sql.shuffle.partitions": "4"},
    }))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    log = workdir / f"job-{tag}.log"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "enrich", "run", "--config", str(config), "--master", master,
                             "--available-now", "--log-format", "json"], cwd=ROOT, env=env, stdout=open(log, "ab"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)
    driver = psutil.Process(proc.pid)
    peak_driver = peak_exec = 0.0
    while proc.poll() is None:
        peak_driver = max(peak_driver, _tree_memory([driver]))
        peak_exec = max(peak_exec, _tree_memory(workers))
        time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed ({proc.returncode}): {log.read_text()[-3000:]}")
    batches = sink_batches(log)
    written = sum(k for _, k in batches)
    if written != n:
        raise RuntimeError(f"the job wrote {written} records, expected {n} ({log})")
    first_end = batches[0][0]
    later = sum(k for _, k in batches[1:])
    span = batches[-1][0] - first_end
    return {"driver_rss_mb": peak_driver / 2**20, "executors_mb": peak_exec / 2**20,
            "first_batch_s": first_end - t0, "steady_eps": later / span if span > 0 else 0.0,
            "batches": len(batches), "wall_s": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.partitioned_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--devices", type=int, default=1_000_000, help="distinct devices the events pick from")
    ap.add_argument("--contenders", default="broadcast:50000,partitioned:5000000,broadcast:1000000,"
                                            "partitioned:1000000", help="strategy:rows, comma separated")
    ap.add_argument("--batch", type=int, default=250_000, help="events per micro-batch (default %(default)s)")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker-memory", default="4g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    args = ap.parse_args(argv)
    contenders = [(s, int(r)) for s, r in (c.split(":") for c in args.contenders.split(","))]
    print(f"load average before: {os.getloadavg()}", flush=True)
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="partitioned-bench-")))
        tag = uuid.uuid4().hex[:8]
        topics = {}
        for rows in sorted({r for _, r in contenders}):
            topics[rows] = f"ref.devices-{rows}-{tag}"
            took = publish_devices(settings, topics[rows], rows)
            print(f"published {rows:,} device rows in {took:.1f} s", flush=True)
        events_topic = f"bench-events-{tag}"
        data.fill_events(settings, events_topic, args.events, args.partitions, args.devices)
        master, workers = start_cluster(stack, workdir, args.worker_memory)
        results: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in contenders}
        for r in range(args.repeat):
            for strategy, rows in contenders:
                res = run_round(settings, master, workers, events_topic, topics[rows], strategy, workdir,
                                args.batch, args.events)
                results[(strategy, rows)].append(res)
                print(f"[{r + 1}/{args.repeat}] {strategy} {rows:,} rows: driver {res['driver_rss_mb']:.0f} MB, "
                      f"executors {res['executors_mb']:.0f} MB, first batch at {res['first_batch_s']:.1f} s, "
                      f"steady {res['steady_eps']:,.0f} events/s over {res['batches'] - 1} batches, "
                      f"wall {res['wall_s']:.1f} s", flush=True)
        print("\nmedians:")
        print("| contender | driver RSS MB | executors MB | first batch s | steady events/s |")
        print("|---|---:|---:|---:|---:|")
        for (strategy, rows), rs in results.items():
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            print(f"| {strategy} {rows:,} | {med['driver_rss_mb']:.0f} | {med['executors_mb']:.0f} | "
                  f"{med['first_batch_s']:.1f} | {med['steady_eps']:,.0f} |")
    print(f"load average after: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
