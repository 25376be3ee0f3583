"""Where the state step's time goes: the job's parse and state step (``enrich.query.attach``)
over Kafka-shaped rows read from Parquet, against the same parse without the step, both into Spark's
``noop`` sink; optionally with py-spy sampling the Python workers of the stateful run.

No broker and no joins: this isolates the step (the Kafka source and sink cost the same with and
without it). Each run reads the same files, one per micro-batch (``maxFilesPerTrigger=1``), with a
fresh checkpoint; the first two batches are warm-up.

    python -m bench.tools.state_profile --events 400000 --devices 100000 --batch 100000 --repeat 3 \
        [--py-spy var/state-profile.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.tools import pyspy

EVENT_SCHEMA = "device_id STRING, ts TIMESTAMP, temperature DOUBLE, battery DOUBLE"


def write_batches(spark: Any, root: Path, events: int, devices: int, batch: int) -> None:
    """``events`` Kafka-shaped rows (``key, value, topic, partition, offset``), one Parquet file per
    micro-batch; event time moves one second per event row so the watermark advances."""
    from pyspark.sql import functions as F

    for b, start in enumerate(range(0, events, batch)):
        n = min(batch, events - start)
        ids = spark.range(start, start + n)
        dev = F.concat(F.lit("d-"), ((F.col("id") * 7919) % devices).cast("string"))
        value = F.to_json(F.struct(dev.alias("device_id"),
                                   F.timestamp_seconds(F.lit(1_700_000_000) + F.col("id")).alias("ts"),
                                   (F.rand(1) * 40).alias("temperature"), (F.rand(2) * 100).alias("battery")))
        (ids.select(dev.cast("binary").alias("key"), value.cast("binary").alias("value"), F.lit("events").alias("topic"),
                    (F.col("id") % 2).cast("int").alias("partition"), F.col("id").alias("offset"))
         .coalesce(1).write.parquet(str(root / f"b{b:04d}")))
        src = next((root / f"b{b:04d}").glob("*.parquet"))
        src.rename(root / f"batch-{b:04d}.parquet")
        shutil.rmtree(root / f"b{b:04d}")


def run(spark: Any, data: Path, work: Path, *, state: bool, buckets: int, fast: bool = True) -> list[dict[str, Any]]:
    from pyspark.sql.types import StructType

    from enrich import config, events
    from enrich.events.fastparse import FastParser
    from enrich.pipeline import Pipeline
    from enrich.query import attach
    from enrich.state.layout import BucketLayout
    from enrich.state.stream import PROVIDER_CONF, ROCKSDB

    schema = StructType.fromDDL(EVENT_SCHEMA)
    raw = (spark.readStream.schema("key binary, value binary, topic string, partition int, offset long")
           .option("maxFilesPerTrigger", 1).parquet(str(data)))
    parsed = events.parse(raw, schema, keep_source=True)
    if state:
        cfg = config.parse({
            "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "events", "schema": EVENT_SCHEMA},
            "output": {"console": {}}, "dead_letter_topic": "dlq", "checkpoint": str(work),
            "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "5m", "buckets": buckets,
                      "aggregates": {"temperature": ["last", "min", "max", "mean"], "battery": ["last"]}}}, "bench")
        spark.conf.set(PROVIDER_CONF, ROCKSDB)
        parser = FastParser.for_schema(schema) if fast else None
        pipeline = Pipeline.build(cfg, {}, timezone="UTC")
        layout = BucketLayout.even(buckets, int(spark.conf.get("spark.sql.shuffle.partitions") or 4))
        parsed = attach(raw, pipeline, layout, parser=parser).frame()
    q = (parsed.writeStream.format("noop").option("checkpointLocation", str(work))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    return [json.loads(p.json) for p in q.recentProgress]


def steady_rate(progress: list[dict[str, Any]], skip: int = 2) -> tuple[float, float]:
    """Events per second over the batches after ``skip`` warm-up ones, and their median duration."""
    rows = [p for p in progress if p["numInputRows"] > 0][skip:]
    secs = [p["durationMs"]["triggerExecution"] / 1000 for p in rows]
    return sum(p["numInputRows"] for p in rows) / sum(secs), statistics.median(secs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.state_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--buckets", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--py-spy", metavar="FILE", help="sample the workers of the last stateful round into FILE "
                    "(py-spy's raw format: one line per stack, with its count)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("refstream-bench-state-profile")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, list[tuple[float, float]]] = {"no state": [], "state": []}
    with tempfile.TemporaryDirectory(prefix="refstream-state-profile-") as tmp:
        data = Path(tmp) / "data"
        write_batches(spark, data, args.events, args.devices, args.batch)
        for i in range(args.repeat):
            for name in results:
                spy: list[subprocess.Popen[bytes]] = []
                if name == "state" and args.py_spy and i == args.repeat - 1:
                    pyspy.spy_workers(Path(args.py_spy), spy)
                started = time.monotonic()
                progress = run(spark, data, Path(tmp) / f"ck-{name}-{i}", state=name == "state", buckets=args.buckets)
                pyspy.stop_all(spy)  # py-spy writes its file on SIGINT
                rate, med = steady_rate(progress)
                results[name].append((rate, med))
                print(f"round {i + 1} {name}: {rate:,.0f} events/s steady, median batch {med:.2f}s "
                      f"({time.monotonic() - started:.1f}s in all)", flush=True)
    load = os.getloadavg()
    print(f"\n{args.events:,} events over {args.devices:,} devices, batches of {args.batch:,}, {args.buckets} buckets, "
          f"{args.master}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| run | events/s, median | rounds | state / no state, per round |")
    print("|---|---:|---|---|")
    for name, rounds in results.items():
        ratio = (" / ".join(f"{s[0] / n[0]:.2f}" for s, n in zip(rounds, results["no state"], strict=True))
                 if name == "state" else "-")
        print(f"| {name} | {statistics.median(r[0] for r in rounds):,.0f} | "
              f"{' / '.join(f'{r[0]:,.0f}' for r in rounds)} | {ratio} |")
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
