"""The job with ``output.database`` (``write: state``) against the same job with Kafka output only.

    python -m bench.run database_sink --events 1000000 --devices 100000 --repeat 3 [--mysql]

Against an embedded broker (or ``--bootstrap``) and the local PostgreSQL (``--pg-url``; with
``--mysql``, also MariaDB/MySQL at ``--mysql-url``), with ``enrich_bench``'s data: a ``devices``
dimension of ``--devices`` rows and ``--events`` ~150-byte JSON events over them, and its ``state:``
section. Each round runs, on the same backlog, ``python -m enrich run --available-now`` (``local[2]``,
``--batch`` events per micro-batch, each its own checkpoint): Kafka output only, then
``output.database`` with ``write: state`` (a new table each round). Throughput is the events of the
full batches after the first two (warm-up) over the sum of their "batch N done in S s" times from
the job's log; "rows/s" are the table's rows upserted over the seconds of the sink's "rows to"
lines (the whole write step of each batch: state step, join pass and the tasks' writes).
Medians over the rounds; ``--keep DIR`` keeps the jobs' logs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from bench import enrich_data as data
from bench.common import broker_settings, input_topics, run_available_now, workdir
from bench.enrich_bench import STATE_SECTION, _machine

_ROWS = re.compile(r"batch (\d+): (\d+) rows to \S+ by \d+ task\(s\) \(\d+ skipped as committed\) in ([\d.]+)s")


def config(path: Path, settings: dict[str, str], events: str, devices: str, work: Path, batch: int,
           database: dict[str, str] | None) -> None:
    name = uuid.uuid4().hex[:8]
    output: dict[str, Any] = {"database": database} if database else {"kafka": {"topic": f"bench-out-{name}"}}
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": devices, "on": "device_id", "columns": list(data.JOIN_COLUMNS)}],
        "output": output,
        "dead_letter_topic": f"bench-dlq-{name}",
        "checkpoint": str(work / f"checkpoint-{name}"),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "state": STATE_SECTION,
        "spark": {"spark.ui.enabled": "false", "spark.driver.memory": "2g"},
    }), encoding="utf-8")


def run_job(cfg: Path, log: Path, events: int, batch: int) -> dict[str, float]:
    job = run_available_now(cfg, log)
    rows = [(int(n), float(s)) for _, n, s in _ROWS.findall(job.log)]
    out = {"rate": job.steady_rate(events, batch), "wall_s": job.wall_s}
    if rows:
        out["db_rows_per_s"] = sum(n for n, _ in rows) / max(sum(s for _, s in rows), 1e-9)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run database_sink", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100_000, help="max_events_per_batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bootstrap", help="a broker to use instead of an embedded one")
    ap.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--mysql", action="store_true", help="also the job writing to MySQL/MariaDB")
    ap.add_argument("--mysql-url", default="mysql+pymysql://root@127.0.0.1:3306/test")
    ap.add_argument("--keep", type=Path, help="keep the jobs' logs in this directory")
    args = ap.parse_args(argv)
    print(f"machine: {_machine()}; {args.events:,} events over {args.devices:,} devices, batches of "
          f"{args.batch:,}", flush=True)
    results: dict[str, list[dict[str, float]]] = {"kafka": [], "postgresql": [], "mysql": []}
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        work = workdir(stack, args.keep, "bench-db-")
        devices, events = input_topics()
        data.publish_devices(settings, devices, args.devices)
        data.fill_events(settings, events, args.events, 2, args.devices)
        variants: list[tuple[str, str | None]] = [("kafka", None), ("postgresql", args.pg_url)]
        if args.mysql:
            variants.append(("mysql", args.mysql_url))
        for r in range(args.repeat):
            for name, url in variants:
                cfg, log = work / f"{name}-{r}.yaml", work / f"{name}-{r}.log"
                db = {"url": url, "table": f"bench_state_{uuid.uuid4().hex[:8]}", "write": "state"} if url else None
                config(cfg, settings, events, devices, work, args.batch, db)
                res = run_job(cfg, log, args.events, args.batch)
                results[name].append(res)
                extra = f", {res['db_rows_per_s']:,.0f} rows/s" if "db_rows_per_s" in res else ""
                print(f"[{r + 1}/{args.repeat}] {name}: {res['rate']:,.0f} events/s{extra} "
                      f"(run {res['wall_s']:.0f}s)", flush=True)
    kafka = statistics.median(x["rate"] for x in results["kafka"])
    print(f"median: kafka only {kafka:,.0f} events/s")
    for name in ("postgresql", "mysql"):
        if results[name]:
            rate = statistics.median(x["rate"] for x in results[name])
            rows = statistics.median(x.get("db_rows_per_s", 0.0) for x in results[name])
            print(f"median: {name} write: state {rate:,.0f} events/s = {rate / kafka:.2f} of Kafka only "
                  f"({rows:,.0f} rows/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
