"""The job with an as-of broadcast join against the same job joining the latest versions (issue 26).

    python -m bench.run asof_job --devices 1000000 --versions 3 --events 1000000 --repeat 3

Against an embedded broker (or ``--bootstrap``), with ``enrich_bench``'s events and ``state:`` section:
a ``devices`` changelog of ``--devices`` keys with ``--versions`` versions each, every version with a
``valid_from`` header (``enrich_data.publish_devices``), placed so that the events' times fall inside
a different version per device (device ``n``: version ``n % versions + 1``). Each round runs, on the
same backlog and the same changelog, ``python -m enrich run --available-now`` (``local[2]``,
``--batch`` events per micro-batch, each its own checkpoint): the ``devices`` broadcast join as it
is (``latest``), then with ``as_of: true`` (``as_of``). Throughput is the events of the full batches
after the first two (warm-up) over the sum of their "batch N done in S s" times from the job's log;
also the driver's bootstrap of the dimension and the first batch (it ships the dimension). The ratio
``as_of`` time per event over ``latest`` time per event is set against the issue's 1.5x. A sample of
each run's output is checked: ``latest`` must carry every device's last version, ``as_of`` the
version valid at the event's time (older ones for most devices), else the run fails.
Medians over the rounds; ``--keep DIR`` keeps the configs and the jobs' logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import TopicPartition

from bench import enrich_data as data
from bench.common import broker_settings, input_topics, run_available_now, workdir
from bench.enrich_bench import STATE_SECTION, _machine
from refstream import kafka as rkafka

log = logging.getLogger(__name__)

TARGET = 1.5  # issue 26: as-of time per event at most 1.5x the latest-version join's
_BOOT = re.compile(r"dataset devices: bootstrapped (\d+) rows from \S+ in ([\d.]+)s")
VARIANTS = ("latest", "as_of")


def config(path: Path, settings: dict[str, str], events: str, devices: str, work: Path, batch: int,
           as_of: bool, driver_memory: str) -> str:
    """Write the job's config to ``path``; returns its output topic."""
    name = uuid.uuid4().hex[:8]
    out = f"bench-out-{name}"
    join: dict[str, Any] = {"dataset": "devices", "topic": devices, "on": "device_id",
                            "columns": list(data.JOIN_COLUMNS)}
    if as_of:
        join["as_of"] = True
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [join],
        "output": {"kafka": {"topic": out}},
        "dead_letter_topic": f"bench-dlq-{name}",
        "checkpoint": str(work / f"checkpoint-{name}"),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "state": STATE_SECTION,
        "spark": {"spark.ui.enabled": "false", "spark.driver.memory": driver_memory},
    }), encoding="utf-8")
    return out


def run_job(cfg: Path, log_path: Path, events: int, batch: int) -> dict[str, float]:
    job = run_available_now(cfg, log_path)
    res = {"rate": job.steady_rate(events, batch), "wall_s": job.wall_s,
           "first_batch_s": job.batches.get(0, float("nan"))}
    boot = _BOOT.search(job.log)
    if boot:
        res["boot_rows"], res["boot_s"] = float(boot.group(1)), float(boot.group(2))
    return res


def check_output(settings: dict[str, str], topic: str, versions: int, as_of: bool,
                 sample: int = 20_000) -> dict[str, int]:
    """Versions the first ``sample`` output records joined (from their ``owner``, ``team-*-v<version>``)
    against those expected: the last version (``latest``), or device ``n``'s version ``n % versions + 1``
    (``as_of``). Raises unless every sampled record has the expected one and, for ``as_of``, some
    have an older version than the latest: else the benchmark would time a no-op."""
    c = rkafka.consumer(settings)
    c.assign([TopicPartition(topic, p, 0) for p in rkafka.partitions_of(settings, topic)])
    seen = older = clipped = 0
    wrong: list[tuple[str, Any]] = []
    deadline = time.monotonic() + 60
    try:
        while seen < sample and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=0.5):
                value = m.value()
                if m.error() is not None or value is None:
                    continue
                row = json.loads(value)
                seen += 1
                n = int(row["device_id"].removeprefix("d-"))
                owner = row.get("owner")
                got = int(owner.rsplit("-v", 1)[1]) if owner else None
                want = data.expected_version(n, versions) if as_of else versions
                if got != want:
                    wrong.append((row["device_id"], owner))
                older += got is not None and got < versions
                clipped += bool(row.get("_as_of_clipped"))
    finally:
        c.close()
    name = "as_of" if as_of else "latest"
    if not seen:
        raise RuntimeError(f"{name}: no output records on {topic}")
    if wrong:
        raise RuntimeError(f"{name}: {len(wrong)} of {seen} sampled output records joined another version than "
                           f"expected, e.g. (device, owner) {wrong[:5]}")
    if as_of and (not older or clipped):
        raise RuntimeError(f"{name}: of {seen} sampled output records {older} joined an older version and "
                           f"{clipped} were clipped: the as-of join is not measured as meant")
    return {"sampled": seen, "older": older}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run asof_job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--devices", type=int, default=1_000_000, help="keys of the dimension")
    ap.add_argument("--versions", type=int, default=3, help="versions per key")
    ap.add_argument("--batch", type=int, default=100_000, help="max_events_per_batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bootstrap", help="a broker to use instead of an embedded one")
    # The as-of driver holds and ships every version: 3M of them at the default size.
    ap.add_argument("--driver-memory", default="2g", help="spark.driver.memory of the jobs")
    ap.add_argument("--keep", type=Path, help="keep the jobs' configs and logs in this directory")
    args = ap.parse_args(argv)
    if not 2 <= args.versions <= 100:
        ap.error("--versions must be 2..100 (an hour apart, all within the join's default history of 7d)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"machine: {_machine()}; {args.events:,} events over {args.devices:,} devices with "
          f"{args.versions} versions each, batches of {args.batch:,}", flush=True)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        work = workdir(stack, args.keep, "bench-asof-")
        devices, events = input_topics()
        # Events first: their times (the time they are produced) fix where the versions' valid_from go.
        t0 = datetime.now(UTC)
        fill_s, _, _ = data.fill_events(settings, events, args.events, 2, args.devices)
        t1 = datetime.now(UTC)
        if t1 - t0 >= data.VERSION_STEP / 2:
            raise RuntimeError(f"the events took {t1 - t0} to produce: their times span more than half of "
                               f"{data.VERSION_STEP}, the versions' spacing")
        at = t0 + (t1 - t0) / 2
        pub_s = data.publish_devices(settings, devices, args.devices, versions=args.versions, at=at)
        log.info("events produced in %.1fs, %d versions published in %.1fs", fill_s,
                 args.devices * args.versions, pub_s)
        for r in range(args.repeat):
            for name in VARIANTS:
                cfg, job_log = work / f"{name}-{r}.yaml", work / f"{name}-{r}.log"
                out = config(cfg, settings, events, devices, work, args.batch, name == "as_of",
                             args.driver_memory)
                res = run_job(cfg, job_log, args.events, args.batch)
                check = check_output(settings, out, args.versions, name == "as_of", min(20_000, args.events))
                results[name].append(res)
                # The bootstrap's count is of what the driver holds: rows (latest) or versions (as_of).
                boot = (f", bootstrap {res['boot_s']:.1f}s ({res['boot_rows']:,.0f} held)"
                        if "boot_s" in res else "")
                print(f"[{r + 1}/{args.repeat}] {name}: {res['rate']:,.0f} events/s, first batch "
                      f"{res['first_batch_s']:.1f}s{boot} (run {res['wall_s']:.0f}s; output checked: "
                      f"{check['older']:,} of {check['sampled']:,} sampled on an older version)", flush=True)
    med = {name: {k: statistics.median(x.get(k, float("nan")) for x in results[name])
                  for k in ("rate", "first_batch_s", "boot_s")} for name in VARIANTS}
    for name in VARIANTS:
        m = med[name]
        print(f"median: {name} {m['rate']:,.0f} events/s, first batch {m['first_batch_s']:.1f}s, "
              f"bootstrap {m['boot_s']:.1f}s")
    ratio = med["latest"]["rate"] / med["as_of"]["rate"]
    print(f"as_of time per event / latest time per event: {ratio:.2f}x (target <= {TARGET}x: "
          f"{'met' if ratio <= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
