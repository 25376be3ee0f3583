"""End-to-end benchmark of the enrichment job, side by side with its two baselines, in one run.

    .venv/bin/python -m bench.enrich_bench --events 3000000 --dimension-rows 1000000 --repeat 3

Against an embedded broker (or ``--bootstrap``), Kafka in and Kafka out, ~150-byte JSON events and a
``devices`` dimension of ``--dimension-rows`` rows published with the changelog codec:

1. **job**: refstream's ``EnrichJob`` (``--available-now``, ``max_events_per_batch=--batch``) on a
   backlog of ``--events`` events; the steady-state rate counts every batch after the first two, from
   the end of batch 1 to the end of the last batch. Query start, dimension bootstrap and the two
   warm-up batches are reported on their own: batch 0 ships the base, and in batches 0 and 1 every
   Python worker that runs the join for the first time fetches it and builds its index (a task
   runs two workers, the source's reader and the join, and they swap roles between batches);
2. **plain**: confluent-kafka consume-then-produce of the same events in one process, no Spark (the
   broker-bound limit);
3. **naive**: ``foreachBatch`` that rebuilds the dimension from the whole changelog every batch and
   broadcast-joins it (``bench.enrich_naive``), same batches, one transaction per batch from the
   driver; ``--naive-batches`` batches after the same two warm-up batches are timed;
4. **careful**: the same, but the rebuilt dimension is cached and re-read only when the changelog's
   end offsets moved (``bench.enrich_naive.CarefulBatch``); every batch after the two warm-up ones
   is timed.

Then the dimension update latency at a 1 s trigger (``--changes`` upserts published while events
flow at ``--latency-rate``/s, each timed until the first enriched event that shows it), and the
peak memory of the driver JVM, the Python driver and the Python workers during the job runs.

Data preparation and the plain copy run in their own processes, so the Python driver's memory is
the job's alone. Medians over ``--repeat`` rounds; each round runs plain, job and naive in turn.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from datetime import datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import psutil
from confluent_kafka import KafkaError, TopicPartition

from bench import enrich_data as data
from bench.common import broker_settings, events_in, percentile, thread_times
from refstream import kafka as rkafka
from refstream.logs import setup_logging

log = logging.getLogger("bench.enrich_bench")


#: The ``state:`` section of ``--job-with-state``: per device, the count, first/last seen and four
#: aggregates of two event fields (``enrich_data``'s events).
STATE_SECTION = {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "5m",
                 "aggregates": {"temperature": ["last", "min", "max", "mean"], "battery": ["last"]}}


#: The ``rollups:`` of ``--job-with-rollups`` (with STATE_SECTION): per device per minute, and per
#: site (a column of the devices join) per hour, written to Parquet in the round's work directory.
def rollups_section(workdir: Path) -> list[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    return [{"name": "device_1m", "by": ["device_id"], "window": "1m",
             "metrics": {"temperature": ["count", "mean", "max", "p95"], "battery": ["last"]},
             "output": {"parquet": {"path": str(workdir / f"rollups-{tag}" / "device_1m")}}},
            {"name": "site_1h", "by": ["site_id"], "window": "1h",
             "metrics": {"temperature": ["mean", "max", "p95"], "device_id": ["count_distinct"]},
             "output": {"parquet": {"path": str(workdir / f"rollups-{tag}" / "site_1h")}}}]


def _in_process(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a fresh process (keeps the Python driver's memory the job's alone)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


# ------------------------------------------------------------------------------------------ memory

class MemorySampler(threading.Thread):
    """Samples the process tree every ``interval`` s and keeps, per phase, the peak of:
    ``driver_python`` (this process, RSS), ``jvm`` (the JVM child of this process: in local mode the
    driver and the executor are that one JVM; RSS) and ``python_workers`` (every Python process under
    the JVM: ``pyspark.daemon`` and the workers it forks; sum of PSS, so pages shared by the fork
    are counted once).

    The workers' PSS is read every ``pss_interval`` s only: it comes from ``/proc/<pid>/smaps_rollup``,
    which the kernel computes by walking the process's pages; read for ~14 workers of 1-2 GB every
    0.25 s it cost about half a core (py-spy of this process during a job run), taken from the job
    it measures on a 2-core machine."""

    def __init__(self, interval: float = 0.25, pss_interval: float = 2.0) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.interval = interval
        self.pss_every = max(1, round(pss_interval / interval))
        self._n = 0
        self.phase: str | None = None
        self.peaks: dict[str, dict[str, float]] = {}
        self._stop_evt = threading.Event()
        self._me = psutil.Process()

    def sample(self, workers: bool = True) -> dict[str, float]:
        out = {"driver_python": float(self._me.memory_info().rss), "jvm": 0.0}
        if workers:
            out.update(python_workers=0.0, workers=0.0)
        for child in self._me.children():
            try:
                if child.name() != "java":
                    continue
                out["jvm"] += child.memory_info().rss
                if not workers:
                    continue
                for d in child.children(recursive=True):
                    if "python" in d.name():
                        out["python_workers"] += d.memory_full_info().pss
                        out["workers"] += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def run(self) -> None:
        while not self._stop_evt.wait(self.interval):
            phase = self.phase
            if phase is None:
                continue
            self._n += 1
            s = self.sample(workers=self._n % self.pss_every == 1 or self.pss_every == 1)
            peak = self.peaks.setdefault(phase, {})
            for k, v in s.items():
                peak[k] = max(peak.get(k, 0.0), v)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(5)


# ------------------------------------------------------------------------------------------ helpers

def _ts(p: dict[str, Any]) -> float:
    return datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()


def steady(progress: list[dict[str, Any]], skip: int = 2) -> dict[str, float]:
    """Rows/s from the end of batch ``skip - 1`` to the end of the last batch (idle triggers ignored).

    The first two batches are warm-up: Python workers start, and each worker that runs the join for
    the first time fetches the broadcast base and builds its index (see the module docstring)."""
    batches = [p for p in progress if p["numInputRows"] > 0]
    ends = [_ts(p) + p["durationMs"].get("triggerExecution", 0) / 1000.0 for p in batches]
    first = batches[0]["durationMs"].get("triggerExecution", 0) / 1000.0 if batches else 0.0
    second = batches[1]["durationMs"].get("triggerExecution", 0) / 1000.0 if len(batches) > 1 else 0.0
    if len(batches) <= skip:
        return {"rate": 0.0, "rows": 0, "batches": 0, "first_batch_s": first, "second_batch_s": second}
    rows = sum(events_in(p) for p in batches[skip:])
    span = ends[-1] - ends[skip - 1]
    per_batch = [p["durationMs"].get("triggerExecution", 0) / 1000.0 for p in batches[skip:]]
    parts = {k: statistics.median(p["durationMs"].get(k, 0) / 1000.0 for p in batches[skip:])
             for k in ("latestOffset", "queryPlanning", "addBatch", "walCommit", "commitOffsets")}
    log.info("median seconds per batch: %s", parts)
    res: dict[str, Any] = {
        "parts": parts, "rate": rows / span if span > 0 else 0.0, "rows": rows, "batches": len(batches) - skip,
        "first_batch_s": first, "second_batch_s": second, "batch_s_median": statistics.median(per_batch),
        "total_rows": sum(events_in(p) for p in batches)}
    ops = [p["stateOperators"][0] for p in batches[skip:] if p.get("stateOperators")]
    if ops:  # the state store's own figures (ms, bytes, rows), median per steady batch
        keys = ("commitTimeMs", "allUpdatesTimeMs", "allRemovalsTimeMs", "numRowsUpdated", "memoryUsedBytes")
        res["state_store"] = {k: statistics.median(o.get(k, 0) for o in ops) for k in keys}
        res["state_store"].update({k: statistics.median(o.get("customMetrics", {}).get(k, 0) for o in ops)
                                   for k in sorted(ops[-1].get("customMetrics", {}))})
    return res


def _job_config(settings: dict[str, str], events_topic: str, devices_topic: str, workdir: Path, *,
                batch: int | None, trigger: str, starting: str, parser: str = "auto",
                state: dict[str, Any] | None = None, rollups: list[dict[str, Any]] | None = None) -> Any:
    from enrich import config

    tag = uuid.uuid4().hex[:8]
    return config.parse({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events_topic, "schema": data.EVENT_DDL, "starting_offsets": starting,
                   "parser": parser},
        "joins": [{"dataset": "devices", "topic": devices_topic, "on": "device_id",
                   "columns": list(data.JOIN_COLUMNS)}],
        "output": {"kafka": {"topic": f"bench-enriched-{tag}"}},
        "dead_letter_topic": f"bench-dlq-{tag}",
        "checkpoint": str(workdir / f"checkpoint-{tag}"),
        "trigger": trigger,
        **({"max_events_per_batch": batch} if batch else {}),
        **({"state": state} if state else {}),
        **({"rollups": rollups} if rollups else {}),
    }, "bench")


def _check_output(settings: dict[str, str], topic: str, sample: int = 2000) -> float:
    """Share of the first ``sample`` output records that carry a device's owner (sanity check)."""
    c = rkafka.consumer(settings)
    c.assign([TopicPartition(topic, p, 0) for p in rkafka.partitions_of(settings, topic)])
    seen = matched = 0
    deadline = time.monotonic() + 20
    while seen < sample and time.monotonic() < deadline:
        for m in c.consume(1000, timeout=0.5):
            if m.error() is None:
                seen += 1
                matched += json.loads(m.value()).get("owner") is not None
    c.close()
    if not seen:
        raise RuntimeError(f"no enriched events on {topic}")
    return matched / seen


# ------------------------------------------------------------------------------------------ phases

def run_job(spark: Any, settings: dict[str, str], events_topic: str, devices_topic: str, workdir: Path,
            batch: int, n: int, parser: str = "auto", state: dict[str, Any] | None = None,
            spy: Path | None = None, spy_idle: bool = False, cpu_only: bool = False,
            rollups: list[dict[str, Any]] | None = None) -> dict[str, float]:
    from enrich.job import EnrichJob

    cfg = _job_config(settings, events_topic, devices_topic, workdir, batch=batch, trigger="1s",
                      starting="earliest", parser=parser, state=state, rollups=rollups)
    job = EnrichJob(cfg, available_now=True)
    t0 = time.monotonic()
    spies: _Spies | None = None
    try:
        q = job.start(spark)
        start_s = time.monotonic() - t0
        # Without --py-spy, only the CPU of the job's processes after the warm-up batches.
        spies = _Spies(q, spy, spy_idle, cpu_only or spy is None)
        q.awaitTermination()
        wall = time.monotonic() - t0
        if spies is not None:
            spies.finish()
        progress = list(q.recentProgress)
        exc = q.exception()
    finally:
        if spies is not None:
            spies.finish()
        job.close()
    if exc is not None:
        raise RuntimeError(f"job failed: {exc}")
    res = steady(progress)
    if res.get("total_rows") != n:
        raise RuntimeError(f"job read {res.get('total_rows')} events, expected {n}")
    res.update(start_s=start_s, wall_s=wall, matched=_check_output(settings, cfg.output.topic))
    if spies is not None and spies.cpu:
        res["cpu_us"] = spies.cpu
    return res


class _Spies:
    """py-spy on the job's Python processes from the end of the second batch with rows (the warm-up
    ones: dimension bootstrap and first index builds are left out) to the end of the query:
    ``<prefix>.workers.<pid>`` (each ``pyspark.daemon`` and its workers), ``<prefix>.driver`` (this process:
    ``foreachBatch``), ``<prefix>.source.<pid>`` (the Python data source's driver-side runners).
    With ``cpu_only``, no sampling: the CPU of the job's processes per event over the same span
    (:attr:`cpu`), and with a ``prefix`` the whole report in ``<prefix>.cpu.txt``."""

    def __init__(self, q: Any, prefix: Path | None, idle: bool, cpu_only: bool = False) -> None:
        from bench.tools import pyspy

        self._pyspy, self.prefix, self.idle, self.cpu_only = pyspy, prefix, idle, cpu_only
        self.started: list[Any] = []
        self.stop = threading.Event()
        self.began = self.ended = 0.0
        self.batches_before = self.rows_before = self.rows = 0
        #: µs of CPU per event by process kind (the broker left out), and ``job``: their sum.
        self.cpu: dict[str, float] = {}
        self._q: Any = None
        self._thread = threading.Thread(target=self._run, args=(q,), name="py-spy-starter", daemon=True)
        self._thread.start()

    def _run(self, q: Any) -> None:
        while not self.stop.is_set():
            done = sum(1 for p in q.recentProgress if p["numInputRows"] > 0)
            if done >= 2:
                break
            self.stop.wait(0.05)
        if self.stop.is_set():
            return
        self.batches_before = done
        self.rows_before = sum(events_in(p) for p in q.recentProgress)
        self._q = q
        self.began = time.monotonic()
        self.cpu_before = _cpu_snapshot()
        pyspy = self._pyspy
        if self.cpu_only or self.prefix is None:
            return
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        for daemon in pyspy.daemon_pids():  # one per worker module; the tasks' one forks the workers
            self.started.append(pyspy.spy_pid(daemon, self.prefix.with_name(f"{self.prefix.name}.workers.{daemon}"),
                                              idle=self.idle, subprocesses=True))
        self.started.append(pyspy.spy_pid(os.getpid(), self.prefix.with_name(self.prefix.name + ".driver"),
                                          idle=self.idle, threads=True))
        pyspy.spy_jvm_pythons(self.prefix.with_name(self.prefix.name + ".source"), self.started, self.stop,
                              idle=self.idle)

    def finish(self) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self._thread.join(10)
        self.ended = time.monotonic()
        self.rows = (sum(events_in(p) for p in self._q.recentProgress) - self.rows_before
                     if self.began else 0)
        cpu_after = _cpu_snapshot()
        self._pyspy.stop_all(self.started)
        secs = self.ended - self.began if self.began else 0.0
        if self.began and self.rows:
            self.cpu = _cpu_per_event(self.cpu_before, cpu_after, self.rows)
        if self.prefix is None:
            return
        if self.began:
            report = _cpu_report(self.cpu_before, cpu_after, secs, self.rows)
            self.prefix.with_name(self.prefix.name + ".cpu.txt").write_text(report + "\n", encoding="utf-8")
            print(report, flush=True)
        print(f"py-spy: {len(self.started)} sampler(s) over the last {secs:.1f}s of the job (after "
              f"{self.batches_before} batches), {'with' if self.idle else 'without'} idle stacks -> "
              f"{self.prefix}.*", flush=True)


def _plain_copy_cpu(*args: Any) -> tuple[float, float]:
    """``enrich_data.plain_copy`` and the CPU seconds of its process (every thread: librdkafka's too)."""
    cpu0 = time.process_time()
    rate = data.plain_copy(*args)
    return rate, time.process_time() - cpu0


def _broker_cpu() -> float:
    """CPU seconds so far of this process's children that are not a JVM nor Python (the embedded broker)."""
    total = 0.0
    for child in psutil.Process().children():
        try:
            if child.name() != "java" and "python" not in child.name():
                t = child.cpu_times()
                total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def _cpu_snapshot() -> dict[str, Any]:
    """CPU seconds so far: the machine (``/proc/stat``), this process, its JVM's threads by name, the
    Python processes under the JVM, and any other child of this process (the embedded broker)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    snap: dict[str, Any] = {"machine_busy": (sum(fields) - fields[3] - fields[4]) / tick,
                            "machine_all": sum(fields) / tick, "procs": {}, "threads": {}}
    me = psutil.Process()

    def add(kind: str, p: psutil.Process) -> None:
        try:
            t = p.cpu_times()
            snap["procs"][p.pid] = (kind, t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass

    add("Python driver (bench process)", me)
    for child in me.children():
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        if name != "java":
            add(f"other child: {name}", child)
            continue
        add("JVM (driver + executor)", child)
        for d in child.children(recursive=True):
            add("Python workers and runners", d)
        for tid, comm, cpu in thread_times(child.pid):
            snap["threads"][tid] = (comm, cpu)
    return snap


#: :func:`_cpu_snapshot`'s process kinds that are the job's (the broker and other children are not).
JOB_KINDS = {"JVM (driver + executor)": "JVM", "Python workers and runners": "Python workers",
             "Python driver (bench process)": "Python driver"}


def _cpu_per_event(before: dict[str, Any], after: dict[str, Any], rows: int) -> dict[str, float]:
    """µs of CPU per event of each of the job's process kinds between two snapshots, and ``job``."""
    out = dict.fromkeys(JOB_KINDS.values(), 0.0)
    for pid, (kind, cpu) in after["procs"].items():
        if kind in JOB_KINDS:
            prev = before["procs"].get(pid)
            out[JOB_KINDS[kind]] += (cpu - (prev[1] if prev is not None else 0.0)) * 1e6 / rows
    out["job"] = sum(out.values())
    return out


def _cpu_text(cpu: dict[str, float]) -> str:
    return (f"CPU {cpu['job']:.1f} us/event (" + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if k != "job")
            + ")")


def _cpu_report(before: dict[str, Any], after: dict[str, Any], secs: float, rows: int) -> str:
    """CPU seconds spent between two :func:`_cpu_snapshot`s, by process kind and by JVM thread name
    (digits folded: ``Executor task launch worker for task 12`` -> ``... task #``)."""
    import re

    def diff(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (kind, cpu) in after[key].items():
            prev = before[key].get(pid)
            name = re.sub(r"\d+", "#", kind) if key == "threads" else kind
            out[name] = out.get(name, 0.0) + cpu - (prev[1] if prev is not None else 0.0)
        return out

    busy = after["machine_busy"] - before["machine_busy"]
    lines = [f"CPU over {secs:.1f}s: machine busy {busy:.1f} s of {after['machine_all'] - before['machine_all']:.1f} s "
             f"(all processes, incl. others'); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    procs = diff("procs")
    per = 1e6 / rows if rows else 0.0
    lines[0] += f"; {rows:,} events"
    lines += [f"  {k}: {v:.1f} s ({v * per:.1f} us/event)" for k, v in sorted(procs.items(), key=lambda kv: -kv[1])]
    lines.append(f"  this bench, all: {sum(procs.values()):.1f} s ({sum(procs.values()) * per:.1f} us/event)")
    lines.append(f"  not this bench's: {busy - sum(procs.values()):.1f} s")
    lines.append("JVM threads (CPU s):")
    threads = diff("threads")
    lines += [f"  {k}: {v:.2f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:20] if v >= 0.05]
    return "\n".join(lines)


def run_naive(spark: Any, settings: dict[str, str], events_topic: str, devices_topic: str, workdir: Path,
              batch: int, batches: int, careful: bool = False) -> dict[str, float]:
    from bench import enrich_naive as naive
    from enrich.query import read_stream
    from enrich.sinks.kafka.writer import TransactionalBatchWriter

    naive.register(spark)
    out = f"bench-naive-{uuid.uuid4().hex[:8]}"
    rkafka.ensure_topic(settings, out, partitions=2)
    writer = TransactionalBatchWriter(settings, out, f"bench-naive-{uuid.uuid4().hex[:8]}")
    fn = (naive.CarefulBatch if careful else naive.NaiveBatch)(settings, devices_topic, writer)
    df = read_stream(spark, settings, [events_topic], starting_offsets="earliest", max_offsets_per_trigger=batch)
    cp = workdir / f"naive-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    q = (df.writeStream.foreachBatch(fn).option("checkpointLocation", str(cp))
         .trigger(availableNow=True).start())
    try:
        while q.isActive:
            if sum(1 for p in q.recentProgress if p["numInputRows"] > 0) >= batches + 2:
                q.stop()
                break
            q.awaitTermination(0.2)
        progress = list(q.recentProgress)
        exc = q.exception()
    finally:
        if q.isActive:
            q.stop()
        writer.close()
        if isinstance(fn, naive.CarefulBatch):
            fn.close()
    if exc is not None:
        raise RuntimeError(f"{'careful' if careful else 'naive'} job failed: {exc}")
    res = steady(progress)
    res.update(wall_s=time.monotonic() - t0, matched=_check_output(settings, out))
    return res


def run_latency(spark: Any, settings: dict[str, str], devices_topic: str, workdir: Path, *, changes: int,
                rate: float, devices: int, partitions: int) -> dict[str, Any]:
    """Upsert ``changes`` devices one after another while events flow; time each until it shows."""
    from enrich.job import EnrichJob

    events_topic = f"bench-live-{uuid.uuid4().hex[:8]}"
    rkafka.ensure_topic(settings, events_topic, partitions=partitions)
    cfg = _job_config(settings, events_topic, devices_topic, workdir, batch=None, trigger="1s",
                      starting="latest")
    job = EnrichJob(cfg)
    flow = data.SteadyEvents(settings, events_topic, rate, devices)
    seen: dict[str, float] = {}
    first_output = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        c = rkafka.consumer(settings, **{"fetch.wait.max.ms": 10})
        while not rkafka.partitions_of(settings, cfg.output.topic) and not stop.is_set():
            time.sleep(0.1)
        c.assign([TopicPartition(cfg.output.topic, p, 0) for p in rkafka.partitions_of(settings, cfg.output.topic)])
        while not stop.is_set():
            for m in c.consume(10_000, timeout=0.05):
                if m.error() is not None:
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("latency watcher: %s", m.error())
                    continue
                first_output.set()
                v = m.value()
                if b'"owner":"chg-' in v:
                    owner = json.loads(v)["owner"]
                    seen.setdefault(owner, time.monotonic())
        c.close()

    watcher = threading.Thread(target=watch, name="latency-watcher", daemon=True)
    lat: list[float] = []
    missing: list[str] = []
    p = rkafka.producer(settings, **{"linger.ms": 0, "enable.idempotence": True})
    try:
        q = job.start(spark)
        watcher.start()
        flow.start()
        t0 = time.monotonic()
        if not first_output.wait(120):
            raise RuntimeError("latency: no enriched output within 120 s")
        log.info("latency: first enriched event %.1fs after the flow started", time.monotonic() - t0)
        time.sleep(5)  # a few batches at the steady rate first
        for i in range(changes):
            owner, dev = f"chg-{i}", 1 + (i * 7919) % devices
            flow.probe = data.device_id(dev)
            published = time.monotonic()
            data.publish_change(p, devices_topic, dev, owner, version=2 + i)
            deadline = published + 20
            while owner not in seen and time.monotonic() < deadline:
                if not q.isActive:
                    raise RuntimeError(f"latency: job stopped: {q.exception()}")
                time.sleep(0.01)
            if owner in seen:
                lat.append(seen[owner] - published)
            else:
                missing.append(owner)
            # Desynchronise the next change from the trigger clock.
            time.sleep(0.3 + (i * 0.37) % 1.0)
        batch_s = [pp["durationMs"].get("triggerExecution", 0) / 1000.0 for pp in q.recentProgress
                   if pp["numInputRows"] > 0]
        produced = flow.produced
    finally:
        flow.stop()
        stop.set()
        job.close()
        watcher.join(5)
    lat.sort()
    return {"n": len(lat), "missing": missing, "p50": percentile(lat, 50), "p95": percentile(lat, 95), "max": max(lat or [0]),
            "rate": rate, "produced": produced,
            "batch_s_median": statistics.median(batch_s) if batch_s else 0.0}


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.enrich_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=2_000_000, help="backlog of events (default %(default)s)")
    ap.add_argument("--dimension-rows", type=int, default=1_000_000, help="devices rows (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of plain, job, naive (default %(default)s)")
    ap.add_argument("--batch", type=int, default=250_000, help="events per micro-batch (default %(default)s)")
    ap.add_argument("--naive-batches", type=int, default=2,
                    help="naive batches timed after the two warm-up ones (default %(default)s)")
    ap.add_argument("--partitions", type=int, default=2, help="event topic partitions (default %(default)s)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--changes", type=int, default=25, help="latency probes (default %(default)s)")
    ap.add_argument("--latency-rate", type=float, default=5000.0, help="events/s while measuring latency")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--job-from-json", action="store_true",
                    help="also run the job with events.parser: spark in every round (A/B of the fast parser)")
    ap.add_argument("--job-with-state", action="store_true",
                    help="also run the job with a state: section (STATE_SECTION) in every round")
    ap.add_argument("--job-with-rollups", action="store_true",
                    help="also run the job with state and two rollups (rollups_section: device per minute, site "
                         "per hour, to Parquet) in every round, beside --job-with-state's")
    ap.add_argument("--cover-devices", action="store_true",
                    help="events visit every device once per pass (shuffled) instead of at random, so "
                         "min(events, dimension rows) devices are in the backlog")
    ap.add_argument("--skip", default="", help="comma list of: plain,job,naive,careful,latency")
    ap.add_argument("--json", help="write the results to this file as well")
    ap.add_argument("--py-spy", metavar="PREFIX", type=Path,
                    help="py-spy the job's Python processes in the last round, after its two warm-up batches, "
                    "into PREFIX.workers.<daemon pid>, PREFIX.driver and PREFIX.source.<pid> (raw format; summarise "
                    "them with python -m bench.tools.pyspy), and the CPU by process and JVM thread into PREFIX.cpu.txt; "
                    "with --job-with-state, the stateful job's into PREFIX-state-r<round>.*")
    ap.add_argument("--py-spy-idle", action="store_true", help="with --py-spy: also the stacks of waiting threads")
    ap.add_argument("--cpu-only", action="store_true", help="with --py-spy: no sampling, only PREFIX-r<round>.cpu.txt, "
                    "in every round")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting for the session (repeatable), e.g. to A/B a state store setting")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    skip = set(filter(None, args.skip.split(",")))
    wall0 = time.monotonic()
    results: dict[str, Any] = {"args": vars(args), "machine": _machine()}
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="enrich-bench-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic = f"ref.devices-{tag}", f"bench-events-{tag}"
        pub_s = _in_process(data.publish_devices, settings, devices_topic, args.dimension_rows)
        fill_s, size, distinct = _in_process(data.fill_events, settings, events_topic, args.events,
                                             args.partitions, args.dimension_rows, args.cover_devices)
        results["prep"] = {"publish_dimension_s": pub_s, "fill_events_s": fill_s, "event_bytes": size,
                           "distinct_devices": distinct}
        print(f"published {args.dimension_rows:,} devices in {pub_s:.1f}s; {args.events:,} events "
              f"of {size:.0f} B over {distinct:,} distinct devices in {fill_s:.1f}s", flush=True)

        sampler = MemorySampler()
        sampler.start()
        stack.callback(sampler.stop)
        from enrich.session import build_session

        t0 = time.monotonic()
        spark = build_session(args.master, "refstream-enrich-bench",
                              {"spark.driver.memory": args.driver_memory, **dict(kv.split("=", 1) for kv in args.conf)})
        stack.callback(spark.stop)
        results["spark_startup_s"] = time.monotonic() - t0
        print(f"Spark session ({args.master}) up in {results['spark_startup_s']:.1f}s", flush=True)

        rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "job": [], "naive": [], "careful": [],
                                                   "job_from_json": [], "job_state": [], "job_rollups": []}
        for r in range(args.repeat):
            if "plain" not in skip:
                broker0 = _broker_cpu()
                rate, cpu = _in_process(_plain_copy_cpu, settings, events_topic,
                                        f"bench-copy-{uuid.uuid4().hex[:8]}", args.events, args.partitions)
                broker = _broker_cpu() - broker0
                rounds["plain"].append({"rate": rate, "cpu_s": cpu, "broker_cpu_s": broker})
                print(f"[{r + 1}/{args.repeat}] plain copy: {rate:,.0f} events/s; CPU {cpu:.1f} s in the copy process "
                      f"({cpu / args.events * 1e6:.1f} us/event) + {broker:.1f} s in the embedded broker "
                      f"({broker / args.events * 1e6:.1f} us/event)", flush=True)
            if "job" not in skip:
                sampler.phase = f"job round {r + 1}"
                res = run_job(spark, settings, events_topic, devices_topic, workdir, args.batch, args.events,
                              spy=(args.py_spy.with_name(f"{args.py_spy.name}-r{r + 1}") if args.py_spy and args.cpu_only
                                   else args.py_spy if r == args.repeat - 1 else None),
                              spy_idle=args.py_spy_idle, cpu_only=args.cpu_only)
                sampler.phase = None
                rounds["job"].append(res)
                print(f"[{r + 1}/{args.repeat}] job: {res['rate']:,.0f} events/s steady over {res['batches']} "
                      f"batches (median batch {res['batch_s_median']:.2f}s; {_parts(res)}); start {res['start_s']:.1f}s, "
                      f"first batches {res['first_batch_s']:.1f}s + {res['second_batch_s']:.1f}s, wall {res['wall_s']:.1f}s, "
                      f"{res['matched']:.0%} matched; {_cpu_text(res['cpu_us']) if 'cpu_us' in res else 'CPU not measured'}"
                      "; median s per batch: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in res.get("parts", {}).items()), flush=True)
            if args.job_from_json:
                sampler.phase = f"job (from_json) round {r + 1}"
                res = run_job(spark, settings, events_topic, devices_topic, workdir, args.batch, args.events,
                              parser="spark")
                sampler.phase = None
                rounds["job_from_json"].append(res)
                print(f"[{r + 1}/{args.repeat}] job, parser spark: {res['rate']:,.0f} events/s steady over "
                      f"{res['batches']} batches (median batch {res['batch_s_median']:.2f}s)", flush=True)
            if args.job_with_state:
                sampler.phase = f"job (state) round {r + 1}"
                res = run_job(spark, settings, events_topic, devices_topic, workdir, args.batch, args.events,
                              state=STATE_SECTION,
                              spy=(args.py_spy.with_name(f"{args.py_spy.name}-state-r{r + 1}")
                                   if args.py_spy and (args.cpu_only or r == args.repeat - 1) else None),
                              spy_idle=args.py_spy_idle, cpu_only=args.cpu_only)
                sampler.phase = None
                rounds["job_state"].append(res)
                print(f"[{r + 1}/{args.repeat}] job with state: {res['rate']:,.0f} events/s steady over "
                      f"{res['batches']} batches (median batch {res['batch_s_median']:.2f}s; "
                      f"{_parts(res)}); {_cpu_text(res['cpu_us']) if 'cpu_us' in res else 'CPU not measured'}; "
                      "state store, median per batch: "
                      + ", ".join(f"{k} {v:,.0f}" for k, v in res.get("state_store", {}).items() if v), flush=True)
            if args.job_with_rollups:
                sampler.phase = f"job (rollups) round {r + 1}"
                res = run_job(spark, settings, events_topic, devices_topic, workdir, args.batch, args.events,
                              state=STATE_SECTION, rollups=rollups_section(workdir), cpu_only=args.cpu_only)
                sampler.phase = None
                rounds["job_rollups"].append(res)
                print(f"[{r + 1}/{args.repeat}] job with state and two rollups: {res['rate']:,.0f} events/s steady "
                      f"over {res['batches']} batches (median batch {res['batch_s_median']:.2f}s; {_parts(res)})",
                      flush=True)
            if "naive" not in skip:
                sampler.phase = f"naive round {r + 1}"
                res = run_naive(spark, settings, events_topic, devices_topic, workdir, args.batch,
                                args.naive_batches)
                sampler.phase = None
                rounds["naive"].append(res)
                print(f"[{r + 1}/{args.repeat}] naive: {res['rate']:,.0f} events/s over {res['batches']} "
                      f"batches (median batch {res['batch_s_median']:.2f}s; first two {res['first_batch_s']:.1f}s + {res['second_batch_s']:.1f}s), "
                      f"{res['matched']:.0%} matched", flush=True)
            if "careful" not in skip:
                sampler.phase = f"careful round {r + 1}"
                res = run_naive(spark, settings, events_topic, devices_topic, workdir, args.batch,
                                args.events // args.batch - 2, careful=True)
                sampler.phase = None
                rounds["careful"].append(res)
                print(f"[{r + 1}/{args.repeat}] careful: {res['rate']:,.0f} events/s over {res['batches']} "
                      f"batches (median batch {res['batch_s_median']:.2f}s; first two {res['first_batch_s']:.1f}s + "
                      f"{res['second_batch_s']:.1f}s), {res['matched']:.0%} matched", flush=True)
        results["rounds"] = rounds
        if "latency" not in skip:
            sampler.phase = "latency"
            lat = run_latency(spark, settings, devices_topic, workdir, changes=args.changes,
                              rate=args.latency_rate, devices=args.dimension_rows, partitions=args.partitions)
            sampler.phase = None
            results["latency"] = lat
            print(f"latency over {lat['n']} changes at {lat['rate']:.0f} events/s, 1s trigger: "
                  f"p50 {lat['p50']:.2f}s, p95 {lat['p95']:.2f}s, max {lat['max']:.2f}s "
                  f"(missing {lat['missing']}; median batch {lat['batch_s_median']:.2f}s)", flush=True)
        results["memory"] = sampler.peaks
    results["wall_s"] = time.monotonic() - wall0
    _summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return 0


def _parts(res: dict[str, Any]) -> str:
    """The median steady batch's phases (Spark's ``durationMs``), e.g. ``addBatch 4.1s``."""
    return ", ".join(f"{k} {v:.2f}s" for k, v in res.get("parts", {}).items())


def _machine() -> str:
    return (f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def _med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def _summary(res: dict[str, Any]) -> None:
    rounds = res["rounds"]
    plain, job, naive, careful = (_med(rounds[k], "rate") for k in ("plain", "job", "naive", "careful"))
    print("\n== summary (medians of", res["args"]["repeat"], "rounds) ==")
    print(f"machine: {res['machine']}")
    print(f"plain copy (broker-bound): {plain:,.0f} events/s")
    print(f"refstream job:             {job:,.0f} events/s  ({job / plain:.0%} of plain, target >= 75%: "
          f"{'met' if job >= 0.75 * plain else 'MISSED'})")
    print(f"naive foreachBatch:        {naive:,.0f} events/s  (job / naive = {job / naive:.1f}x, target >= 3x: "
          f"{'met' if job >= 3 * naive else 'MISSED'})")
    print(f"careful foreachBatch:      {careful:,.0f} events/s  (job / careful = {job / careful:.2f}x, target >= 1.5x: "
          f"{'met' if job >= 1.5 * careful else 'MISSED'})")
    if rounds["job_from_json"]:
        jf = _med(rounds["job_from_json"], "rate")
        print(f"job, from_json only:       {jf:,.0f} events/s  ({jf / plain:.0%} of plain; fast parser gain "
              f"{job / jf:.2f}x)")
    if rounds["job_state"]:
        js = _med(rounds["job_state"], "rate")
        print(f"job with state:            {js:,.0f} events/s  (state on / off = {js / job:.2f}, target >= 0.5: "
              f"{'met' if js >= 0.5 * job else 'MISSED'})")
    if rounds.get("job_rollups") and rounds["job_state"]:
        jr, js = _med(rounds["job_rollups"], "rate"), _med(rounds["job_state"], "rate")
        print(f"job with state and rollups: {jr:,.0f} events/s  (rollups on / off, both with state = {jr / js:.2f}, "
              f"target >= 0.7: {'met' if jr >= 0.7 * js else 'MISSED'}); per core of local[2]: {jr / 2:,.0f} events/s")
    # Targets of issue 44: the stateless job at most 2.5x the copy's CPU per event, with state 4x.
    for kind, what, bound in (("job", "no state", 2.5), ("job_state", "with state", 4.0)):
        cpu = [r["cpu_us"]["job"] for r in rounds.get(kind, []) if "cpu_us" in r]
        if cpu and rounds["plain"]:
            copy = statistics.median(r["cpu_s"] for r in rounds["plain"]) * 1e6 / res["args"]["events"]
            job_cpu = statistics.median(cpu)
            print(f"CPU per event, job (JVM, Python workers and driver; {what}) {job_cpu:.1f} us against the plain "
                  f"copy's {copy:.1f} us: {job_cpu / copy:.1f}x (target <= {bound:g}x: "
                  f"{'met' if job_cpu <= bound * copy else 'MISSED'}; the broker in neither)")
    if rounds["job"]:
        print(f"job start (bootstrap {res['args']['dimension_rows']:,} rows + sinks + query start): "
              f"{_med(rounds['job'], 'start_s'):.1f}s; warm-up batches: {_med(rounds['job'], 'first_batch_s'):.1f}s + "
              f"{_med(rounds['job'], 'second_batch_s'):.1f}s; "
              f"Spark session: {res['spark_startup_s']:.1f}s")
    for phase, peak in res.get("memory", {}).items():
        print(f"peak memory during {phase}: JVM {peak.get('jvm', 0) / 2**20:,.0f} MiB, Python driver "
              f"{peak.get('driver_python', 0) / 2**20:,.0f} MiB, Python workers {peak.get('python_workers', 0) / 2**20:,.0f} "
              f"MiB ({peak.get('workers', 0):.0f} processes)")
    print(f"total wall time: {res['wall_s']:.0f}s")


if __name__ == "__main__":
    raise SystemExit(main())
