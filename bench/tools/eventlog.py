"""Where a micro-batch's wall time goes, stage by stage, from a Spark event log.

Run a bench with ``--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=DIR``, then:

    python -m bench.tools.eventlog DIR/<application dir or file> [--min-ms 500] [--group job-description]

Prints, per Spark job that took at least ``--min-ms`` (a micro-batch of a query is one job, or more),
its stages: tasks, the stage's wall time, the sum of its tasks' run time, the executors' JVM CPU
time (Python workers are not in it), shuffle write and read, and JVM GC; then the medians per
query (the job description Spark gives a query's batches). Event logs compressed with zstd (Spark's
default) are read through pyarrow.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa


def events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of one event log file, or of every ``events_*`` file of an application directory."""
    files = sorted(path.glob("events_*")) if path.is_dir() else [path]
    for f in files:
        if f.suffix == ".zstd":
            with pa.CompressedInputStream(str(f), "zstd") as stream:
                data = stream.read()
        else:
            data = f.read_bytes()
        for line in data.splitlines():
            if line.strip():
                yield json.loads(line)


def summarise(path: Path, min_ms: int = 500) -> list[dict[str, Any]]:
    """One dict per Spark job of at least ``min_ms``: ``job``, ``query``, ``ms`` and its ``stages``."""
    jobs: dict[int, dict[str, Any]] = {}
    stages: dict[int, dict[str, Any]] = {}
    tasks: dict[int, list[dict[str, float]]] = defaultdict(list)
    for e in events(path):
        kind = e["Event"]
        if kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            jobs[e["Job ID"]] = {"start": e["Submission Time"], "stage_ids": e["Stage IDs"],
                                 "query": (props.get("spark.job.description") or "").split("\n")[0]}
        elif kind == "SparkListenerJobEnd" and e["Job ID"] in jobs:
            jobs[e["Job ID"]]["end"] = e["Completion Time"]
        elif kind == "SparkListenerStageCompleted":
            stages[e["Stage Info"]["Stage ID"]] = e["Stage Info"]
        elif kind == "SparkListenerTaskEnd":
            m = e.get("Task Metrics") or {}
            write, read = m.get("Shuffle Write Metrics") or {}, m.get("Shuffle Read Metrics") or {}
            tasks[e["Stage ID"]].append({
                "run_ms": m.get("Executor Run Time", 0), "cpu_ms": m.get("Executor CPU Time", 0) / 1e6,
                "write_mb": write.get("Shuffle Bytes Written", 0) / 1e6,
                "read_mb": (read.get("Remote Bytes Read", 0) + read.get("Local Bytes Read", 0)) / 1e6,
                "gc_ms": m.get("JVM GC Time", 0)})
    out = []
    for jid in sorted(jobs):
        job = jobs[jid]
        if "end" not in job or job["end"] - job["start"] < min_ms:
            continue
        rows = []
        for sid in job["stage_ids"]:
            info = stages.get(sid)
            if info is None or "Submission Time" not in info:
                continue  # skipped (its shuffle output was reused)
            ts = tasks[sid]
            rows.append({"stage": sid, "tasks": len(ts), "wall_ms": info["Completion Time"] - info["Submission Time"],
                         **{k: round(sum(t[k] for t in ts), 1) for k in ("run_ms", "cpu_ms", "write_mb", "read_mb",
                                                                         "gc_ms")}})
        out.append({"job": jid, "query": job["query"], "ms": job["end"] - job["start"], "stages": rows})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.eventlog", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--min-ms", type=int, default=500)
    args = ap.parse_args(argv)
    jobs = summarise(args.path, args.min_ms)
    by_query: dict[tuple[str, int], list[list[float]]] = defaultdict(list)
    for job in jobs:
        print(f"job {job['job']} ({job['query'] or 'no description'}): {job['ms']} ms")
        for s in job["stages"]:
            print(f"    stage {s['stage']}: {s['tasks']} tasks, {s['wall_ms']} ms wall, task run {s['run_ms']:.0f} ms, "
                  f"JVM CPU {s['cpu_ms']:.0f} ms, shuffle write {s['write_mb']:.1f} MB, read {s['read_mb']:.1f} MB, "
                  f"GC {s['gc_ms']:.0f} ms")
        by_query[(job["query"], len(job["stages"]))].append(
            [job["ms"], *[v for s in job["stages"] for v in (s["wall_ms"], s["run_ms"], s["cpu_ms"])]])
    print("\nmedians per query and stage count (job ms; per stage: wall, task run, JVM CPU ms):")
    for (query, n), rows in by_query.items():
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        stages_txt = "; ".join(f"stage {i + 1}: {med[1 + 3 * i]:.0f} / {med[2 + 3 * i]:.0f} / {med[3 + 3 * i]:.0f}"
                               for i in range(n))
        print(f"  {query or 'no description'} ({len(rows)} jobs): {med[0]:.0f} ms; {stages_txt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
