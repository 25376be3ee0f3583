"""The job with corrections on an as-of join against the same job without them (issue 42).

    python -m bench.run corrections --events 1000000 --devices 100000 --late 10000 --repeat 3

Against an embedded broker (or ``--bootstrap``), with ``enrich_bench``'s events and ``state:`` section:
a ``devices`` changelog of ``--devices`` keys, each valid from a day before the events. Each round
runs, on the same backlog, ``python -m enrich run --available-now`` (``local[2]``, ``--batch``
events per micro-batch, its own checkpoint) with the as-of ``devices`` join as it is (``as_of``),
then with ``corrections: {horizon: 24h}`` (``corrections``), and reports each one's throughput (the
full batches after the first two) and the size of its state store on disk (the checkpoint's
``spark/state``): the difference is what the corrections keep, per device and per event.

Then, on the last round's ``corrections`` checkpoint, the job runs (trigger 1s) and, once it has
run a few batches, a late version of ``--late`` devices (another owner, valid from an hour before
the events: every event of theirs is affected) is published: the time from the publish's start
until the output's committed end (its last stable offset) has moved by every correction is
reported, and the corrections, read back (``read_committed``), are checked (every event of those
devices once, with the new owner and the next revision); ``--late-rounds`` such versions one after
another, each with another owner, the worst of them against the target. ``--state-owner`` adds a third
job, ``corrections`` with ``owner: [last]`` among the state's aggregates (``refold``: a late version
folds the devices' aggregates again), and the late versions go to it instead; ``--rollup-owner`` a
fourth, that job with a rollup by ``owner`` per hour (``moves``: a late version moves the events
between its windows, written to Parquet), which the late versions then go to. Medians over the
rounds; ``--keep DIR`` keeps the configs and the jobs' logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from bench import enrich_data as data
from bench.common import BATCH_DONE, ROOT, broker_settings, input_topics, job_env, run_available_now, workdir
from bench.enrich_bench import STATE_SECTION, _machine
from refstream import contract
from refstream import kafka as rkafka

log = logging.getLogger(__name__)

TARGET_RATE = 0.8    # issue 42: with corrections on and no late change, at least 0.8 of the throughput without
TARGET_LATENCY = 10  # issue 42: 100k corrections committed within 10 s of the change reaching Kafka
VARIANTS = ("as_of", "corrections")


def publish(settings: dict[str, str], topic: str, ns: range, owner: str, at: datetime) -> None:
    """Versions of devices ``ns`` with ``owner``, valid from ``at`` (a schema record first if new)."""
    rkafka.ensure_topic(settings, topic, config=contract.TOPIC_CONFIG)
    p = rkafka.producer(settings, role="bulk", **{"enable.idempotence": True})
    m = contract.schema_message(data.DEVICES)
    p.produce(topic, m.value, m.key, headers=m.headers)
    for lo in range(ns.start, ns.stop, 50_000):
        rows = [data.device_row(n, owner) for n in range(lo, min(lo + 50_000, ns.stop))]
        for m in contract.upsert_messages(data.DEVICES, rows, 1, valid_from=at):
            while True:
                try:
                    p.produce(topic, m.value, m.key, headers=m.headers)
                    break
                except BufferError:
                    p.poll(0.1)
        p.poll(0)
    p.flush(120)


def config(path: Path, settings: dict[str, str], events: str, devices: str, work: Path, batch: int,
           corrections: bool, out: str | None = None, refold: bool = False,
           rollup: bool = False) -> tuple[str, Path]:
    """Write the job's config to ``path``; returns its output topic and checkpoint."""
    name = uuid.uuid4().hex[:8]
    out = out or f"bench-out-{name}"
    checkpoint = work / f"checkpoint-{name}"
    join: dict[str, Any] = {"dataset": "devices", "topic": devices, "on": "device_id",
                            "columns": list(data.JOIN_COLUMNS), "as_of": True}
    if corrections:
        join["corrections"] = {"horizon": "24h"}
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [join],
        "output": {"kafka": {"topic": out}},
        "dead_letter_topic": f"bench-dlq-{name}",
        "checkpoint": str(checkpoint),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "state": {**STATE_SECTION, "aggregates": {**STATE_SECTION["aggregates"], "owner": ["last"]}} if refold
        else STATE_SECTION,
        "spark": {"spark.ui.enabled": "false", "spark.driver.memory": "2g"},
        **({"rollups": [{"name": "by_owner", "by": ["owner"], "window": "1h", "correct_for": "24h",
                         "metrics": {"temperature": ["count", "mean", "max"]},
                         "output": {"parquet": {"path": str(work / f"rollup-{name}")}}}]} if rollup else {}),
    }), encoding="utf-8")
    return out, checkpoint


def state_bytes(checkpoint: Path) -> int:
    """The state store's files on disk."""
    return sum(f.stat().st_size for f in (checkpoint / "spark" / "state").rglob("*") if f.is_file())


def read_output(settings: dict[str, str], topic: str, start: dict[int, int] | None = None,
                ends: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Every committed record of ``topic`` from ``start`` (partition -> offset; default: the beginning)
    to its end, decoded; ``ends`` gets each partition's next offset."""
    out = []
    for m in rkafka.read_to_end(settings, topic, start, batch=10_000, timeout=120):
        if ends is not None:
            ends[m.partition()] = max(ends.get(m.partition(), 0), m.offset() + 1)
        if m.value() is not None:
            out.append(json.loads(m.value()))
    return out


def committed_total(settings: dict[str, str], topic: str) -> int:
    """The sum over ``topic``'s partitions of the last stable offset: what ``read_committed`` readers
    can read (committed records and the transactions' markers)."""
    return sum((rkafka.end_offsets(settings, topic, committed=True) or {}).values())


def wait_batches(log_path: Path, n: int, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    """Until the running job has logged ``n`` batches done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        if len(BATCH_DONE.findall(log_path.read_text())) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the job did not run {n} batches in {timeout:.0f}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run corrections", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--late", type=int, default=10_000, help="devices the late version moves")
    ap.add_argument("--batch", type=int, default=100_000, help="max_events_per_batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bootstrap", help="a broker to use instead of an embedded one")
    ap.add_argument("--keep", type=Path, help="keep the jobs' configs and logs in this directory")
    ap.add_argument("--late-rounds", type=int, default=3,
                    help="late versions published one after another, each correcting the same events again")
    ap.add_argument("--rollup-owner", action="store_true",
                    help="with --state-owner's job, a fourth with a rollup by owner whose events the late versions move")
    ap.add_argument("--state-owner", action="store_true",
                    help="a third job with owner: [last] among the state's aggregates (folded again by the late versions)")
    ap.add_argument("--only", choices=("as_of", "corrections", "refold", "moves"),
                    help="run this job alone (its throughput and the late versions; no ratios): for profiling")
    ap.add_argument("--py-spy", type=Path, help="sample the late versions' job (its process tree) into this "
                                               "file, py-spy's raw format (python -m bench.tools.pyspy FILE)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"machine: {_machine()}; {args.events:,} events over {args.devices:,} devices, batches of "
          f"{args.batch:,}; a late version of {args.late:,} devices", flush=True)
    variants = (*VARIANTS, *(["refold"] if args.state_owner or args.rollup_owner else []),
                *(["moves"] if args.rollup_owner else []))
    if args.only:
        variants = (args.only,)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        work = workdir(stack, args.keep, "bench-corrections-")
        devices, events = input_topics()
        t0 = datetime.now(UTC)
        publish(settings, devices, range(1, args.devices + 1), "team-a", t0 - timedelta(days=1))
        data.fill_events(settings, events, args.events, 2, args.devices)
        last: tuple[Path, str, Path] | None = None
        for r in range(args.repeat):
            for name in variants:
                cfg, job_log = work / f"{name}-{r}.yaml", work / f"{name}-{r}.log"
                out, checkpoint = config(cfg, settings, events, devices, work, args.batch, name != "as_of",
                                         refold=name in ("refold", "moves"), rollup=name == "moves")
                job = run_available_now(cfg, job_log)
                res = {"rate": job.steady_rate(args.events, args.batch), "state": float(state_bytes(checkpoint))}
                results[name].append(res)
                if name == variants[-1]:
                    last = (cfg, out, checkpoint)
                print(f"[{r + 1}/{args.repeat}] {name}: {res['rate']:,.0f} events/s, state store "
                      f"{res['state'] / 1e6:,.1f} MB (run {job.wall_s:.0f}s)", flush=True)
        med = {name: {k: statistics.median(x[k] for x in results[name]) for k in ("rate", "state")}
               for name in variants}
        for name in variants:
            print(f"median: {name} {med[name]['rate']:,.0f} events/s, state store {med[name]['state'] / 1e6:,.1f} MB")
        if not args.only:
            ratio = med["corrections"]["rate"] / med["as_of"]["rate"]
            kept = med["corrections"]["state"] - med["as_of"]["state"]
            print(f"corrections on / off, throughput: {ratio:.2f} (target >= {TARGET_RATE}: "
                  f"{'met' if ratio >= TARGET_RATE else 'NOT met'})")
            print(f"kept for corrections (state store with - without): {kept / 1e6:,.1f} MB, "
                  f"{kept / args.devices:,.0f} bytes per device, {kept / args.events:,.1f} bytes per event")
        if args.rollup_owner and not args.only:
            print(f"moves on / the refold's job, throughput: {med['moves']['rate'] / med['refold']['rate']:.2f}; "
                  f"state store {(med['moves']['state'] - med['refold']['state']) / 1e6:,.1f} MB more")
        if "refold" in variants and not args.only:
            more = med["refold"]["state"] - med["corrections"]["state"]
            print(f"refold on / corrections alone, throughput: {med['refold']['rate'] / med['corrections']['rate']:.2f}; "
                  f"kept for the refold: {more / args.events:,.1f} bytes per event more")

        assert last is not None
        cfg, out, checkpoint = last
        ends: dict[int, int] = {}
        before = [e for e in read_output(settings, out, ends=ends) if e["_kind"] == "event"]
        late = {data.device_id(n) for n in range(1, args.late + 1)}
        want = sorted((e["_partition"], e["_offset"]) for e in before if e["device_id"] in late)
        # The job running (trigger 1s, ticks every trigger), caught up: then the late versions.
        job_log = work / "late.log"
        with open(job_log, "ab") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "enrich", "run", "--config", str(cfg), "--master",
                                     "local[2]"], cwd=ROOT, env=job_env(), stdout=sink, stderr=subprocess.STDOUT)
        stack.callback(_stop, proc)
        wait_batches(job_log, 5, proc)
        read_output(settings, out, dict(ends), ends)  # whatever the restart wrote (nothing: it is caught up)
        if args.py_spy:
            from bench.tools import pyspy

            spies = [pyspy.spy_pid(proc.pid, args.py_spy, subprocesses=True)]
            stack.callback(pyspy.stop_all, spies)
        took = []
        for k in range(1, args.late_rounds + 1):
            # Each round a new owner, valid from the same time: the last record of a key with one
            # valid_from is the version, so every event of those devices is corrected again.
            owner = f"team-late-{k}"
            base = committed_total(settings, out)
            sent = time.monotonic()
            log.info("round %d: publishing the late version of %d devices", k, args.late)  # the job log's clock
            publish(settings, devices, range(1, args.late + 1), owner, t0 - timedelta(hours=1))
            published = time.monotonic() - sent
            log.info("published in %.2fs", published)
            # The clock stops when the output's committed end (read_committed) has moved by the
            # corrections: reading and decoding 100k records back takes seconds of its own.
            while committed_total(settings, out) - base < len(want) and time.monotonic() - sent < 300:
                time.sleep(0.05)
            seen = time.monotonic() - sent
            log.info("the output's committed end moved by %d records %.1fs after the publish began", len(want), seen)
            fixed = [e for e in read_output(settings, out, dict(ends), ends) if e["_kind"] == "correction"]
            log.info("%d corrections read back %.1fs after the publish began", len(fixed), time.monotonic() - sent)
            got = sorted((e["_partition"], e["_offset"]) for e in fixed)
            if got != want or any(e["owner"] != owner or e["_revision"] != k for e in fixed):
                raise RuntimeError(f"{len(got):,} corrections written, {len(want):,} expected (every event of the "
                                   f"{args.late:,} devices once, owner {owner}, revision {k})")
            print(f"late version {k} of {args.late:,} devices (published in {published:.1f}s): {len(fixed):,} "
                  f"corrections committed {seen:.1f}s after the publish began", flush=True)
            took.append(seen)
        worst = max(took)
        print(f"corrections committed after the publish began, {len(took)} late versions: median "
              f"{statistics.median(took):.1f}s, max {worst:.1f}s (target <= {TARGET_LATENCY}s: "
              f"{'met' if worst <= TARGET_LATENCY else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
