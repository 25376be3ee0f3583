"""External calls (``calls:``, docs/state.md): what the calls cost, against a local service.

    .venv/bin/python -m bench.run calls --events 1000000 --devices 100000 --latency-ms 20 --repeat 3

1. **client**: one bucket's step (``enrich.calls.step.CallStep``, the code the state step runs:
   rendering, the aiohttp client, the responses recorded in a checkpoint) over ``--client-devices``
   devices, one ``refresh: once`` call each, ``--concurrency`` in flight, against a service in its
   own process answering after ``--latency-ms``: calls per second, and their share of
   ``concurrency / latency`` (the rate if latency were hidden entirely; target >= 0.7).
2. **job**: the enrichment job (``state:`` as ``bench.enrich_bench``'s, Kafka in and out, an
   embedded broker) on ``--events`` events over ``--devices`` devices, without and with one
   ``refresh: once`` call of that service per device state: events per second over every batch
   (the calls fall in the first batches, which a steady-state rate would leave out), and the ratio
   (target >= 0.8).

Medians over ``--repeat`` rounds (the job's after an untimed warm-up run)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench import enrich_data as data
from bench.common import broker_settings, events_in
from bench.enrich_bench import STATE_SECTION
from refstream.logs import setup_logging

log = logging.getLogger("bench.calls")


def _serve(port: int, latency: float, ready: Any) -> None:
    from aiohttp import web

    async def score(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(latency)
        return web.json_response({"score": 1.0, "level": "low"})

    app = web.Application()
    app.router.add_post("/score", score)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def start_service(stack: ExitStack, latency_ms: float) -> str:
    """A service answering ``POST /score`` after ``latency_ms``, in its own process; its URL."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve, args=(port, latency_ms / 1000, ready), daemon=True)
    proc.start()
    stack.callback(proc.terminate)
    if not ready.wait(30):
        raise RuntimeError("the benchmark's service did not start")
    return f"http://127.0.0.1:{port}/score"


def call_section(url: str, concurrency: int) -> dict[str, Any]:
    return {"name": "risk", "url": url, "refresh": "once", "concurrency": concurrency,
            "body": {"device": "{device_id}", "mean": "{state.temperature_mean}"},
            "response": {"score": "DOUBLE", "level": "STRING"}}


def run_client(url: str, devices: int, concurrency: int, workdir: Path) -> float:
    """Calls per second of one bucket's step with ``devices`` devices due for a call."""
    import numpy as np
    import pyarrow as pa

    from enrich.calls.config import CallConfig, RetryConfig
    from enrich.calls.step import CallStep
    from enrich.calls.template import Template

    call = CallConfig(name="risk", url=url, body=Template({"device": "{device_id}", "n": "{state.events}"}),
                      response=(("score", "DOUBLE"), ("level", "STRING")), concurrency=concurrency,
                      retries=RetryConfig(attempts=1, backoff=timedelta(0)))
    step = CallStep((call,), pa.string(), str(workdir / f"ck-{uuid.uuid4().hex[:8]}"))
    table = pa.table({"device_id": [f"d{i}" for i in range(devices)], "_partition": [0] * devices,
                      "_offset": list(range(devices))})
    state = pa.StructArray.from_arrays([pa.array([1] * devices, pa.int64())], names=["events"])
    ts = np.zeros(devices, dtype=np.int64)
    t0 = time.monotonic()
    out = step.run(0, table, "device_id", ts, state, None, ids=("bench", 0))
    secs = time.monotonic() - t0
    if out.counts.get(("risk", "ok")) != devices:
        raise RuntimeError(f"calls did not all succeed: {out.counts}")
    return devices / secs


def run_job(spark: Any, settings: dict[str, str], topic: str, workdir: Path, n: int, batch: int,
            calls: list[dict[str, Any]]) -> dict[str, float]:
    """The job over the backlog: events/s over every batch with events (their own durations)."""
    from enrich import config
    from enrich.job import EnrichJob

    tag = uuid.uuid4().hex[:8]
    cfg = config.parse({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": topic, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "output": {"kafka": {"topic": f"bench-enriched-{tag}"}}, "dead_letter_topic": f"bench-dlq-{tag}",
        "checkpoint": str(workdir / f"checkpoint-{tag}"), "trigger": "1s", "max_events_per_batch": batch,
        "state": STATE_SECTION, "calls": calls}, "bench")
    job = EnrichJob(cfg, available_now=True)
    try:
        q = job.start(spark)
        q.awaitTermination()
        progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
        exc = q.exception()
    finally:
        job.close()
    if exc is not None:
        raise RuntimeError(f"job failed: {exc}")
    rows = sum(events_in(p) for p in progress)
    if rows != n:
        raise RuntimeError(f"job read {rows} events, expected {n}")
    secs = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    return {"rate": rows / secs, "batches": len(progress), "seconds": secs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run calls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000, help="job: events (default %(default)s)")
    ap.add_argument("--devices", type=int, default=100_000, help="job: devices (default %(default)s)")
    ap.add_argument("--batch", type=int, default=250_000, help="job: events per micro-batch (default %(default)s)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="the service's answer time (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=64, help="calls in flight per task (default %(default)s)")
    ap.add_argument("--client-devices", type=int, default=5000, help="client: calls per round (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--skip", default="", help="comma list of: client,job")
    args = ap.parse_args(argv)
    setup_logging(logging.WARNING)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    skip = set(filter(None, args.skip.split(",")))
    ideal = args.concurrency / (args.latency_ms / 1000)
    rate, rate_from = ideal, "concurrency / latency: the client did not run"  # calls/s per task
    with ExitStack() as stack:
        url = start_service(stack, args.latency_ms)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="calls-bench-")))
        if "client" not in skip:
            rates = []
            for r in range(args.repeat):
                rates.append(run_client(url, args.client_devices, args.concurrency, workdir))
                print(f"[{r + 1}/{args.repeat}] client: {rates[-1]:,.0f} calls/s", flush=True)
            med = statistics.median(rates)
            rate, rate_from = med, "the client's"
            print(f"client: {med:,.0f} calls/s per task with {args.latency_ms:g} ms latency and concurrency "
                  f"{args.concurrency}: {med / ideal:.2f} of concurrency / latency ({ideal:,.0f}/s; target >= 0.7)")
        if "job" not in skip:
            settings = broker_settings(stack, args.bootstrap)
            topic = f"bench-events-{uuid.uuid4().hex[:8]}"
            fill_s, _, distinct = data.fill_events(settings, topic, args.events, 2, args.devices)
            print(f"{args.events:,} events over {distinct:,} devices produced in {fill_s:.1f}s", flush=True)
            from enrich.session import build_session

            spark = build_session(args.master, "refstream-calls-bench", {"spark.driver.memory": args.driver_memory})
            stack.callback(spark.stop)
            # An untimed run first: the first query of a session pays for the JVM's warm-up and the
            # Python workers' start, which would land on whichever variant ran first.
            run_job(spark, settings, topic, workdir, args.events, args.batch, [])
            without, with_call, secs = [], [], []
            for r in range(args.repeat):
                base = run_job(spark, settings, topic, workdir, args.events, args.batch, [])
                without.append(base["rate"])
                secs.append(base["seconds"])
                res = run_job(spark, settings, topic, workdir, args.events, args.batch,
                              [call_section(url, args.concurrency)])
                with_call.append(res["rate"])
                print(f"[{r + 1}/{args.repeat}] job: {without[-1]:,.0f} events/s without the call, "
                      f"{with_call[-1]:,.0f} with it ({res['batches']} batches)", flush=True)
            a, b = statistics.median(without), statistics.median(with_call)
            print(f"job: {b:,.0f} events/s with one refresh: once call ({args.latency_ms:g} ms) vs {a:,.0f} "
                  f"without: {b / a:.2f} (target >= 0.8)")
            # What the calls allow: each device's first call, spread over the task slots at the
            # client's rate, either after the job's own work (nothing overlapped) or beside it.
            slots = spark.sparkContext.defaultParallelism
            t_calls, t_job = distinct / (slots * rate), statistics.median(secs)
            print(f"ceiling: {distinct:,} first calls on {slots} tasks at {rate:,.0f}/s ({rate_from}) take {t_calls:.1f}s "
                  f"against the job's {t_job:.1f}s: {t_job / (t_job + t_calls):.2f} with the calls after the "
                  f"job's work, {min(1.0, t_job / t_calls):.2f} with them entirely beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
