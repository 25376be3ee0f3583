"""``enrich rescale`` on the state of N devices: how long moving it to other numbers of state partitions takes.

    python -m bench.run state_rescale --devices 100000 --to 4,1

Against an embedded broker (or ``--bootstrap``), with ``enrich_bench``'s data and ``state:`` section
(as ``state_restart``):

1. **build**: a backlog of one event per device (every device once, shuffled), run through the job
   (``python -m enrich run --available-now``, ``--master``, ``--start`` state partitions through the
   config's ``spark:`` section) on a fresh checkpoint; then the size of its state store.
2. **rescale**, for each number in ``--to`` in turn: ``python -m enrich rescale --partitions N``,
   timed as a process (interpreter, Spark session, repartition) and as the repartition alone (the
   time the command prints). The checkpoint's state is the build's: each rescale reads and writes
   every device's state.
3. **check**: ``--probe`` more events (one each for devices spread over the key space), run through
   the job on the rescaled checkpoint: each output record of the run must have ``state.events == 2``
   (the state continued), and the output must hold every event once.

Seconds per million devices: the repartition's time over the devices, a linear extrapolation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from bench import enrich_data as data
from bench.common import broker_settings
from bench.enrich_bench import _in_process, _machine
from bench.state_restart import checkpoint_size, produce_probe, write_config
from refstream import kafka as rkafka

ROOT = Path(__file__).resolve().parents[1]
_TOOK = re.compile(r"state partitions in ([\d.]+)s")


def enrich(*args: str, log: Path, timeout: float) -> tuple[float, str]:
    """``python -m enrich ARGS``: its wall time and stdout; a RuntimeError with the log's tail on failure."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    with open(log, "ab") as err:
        done = subprocess.run([sys.executable, "-m", "enrich", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=err, timeout=timeout, check=False)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"enrich {' '.join(args[:1])} exited {done.returncode}: {tail}")
    return seconds, done.stdout.decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run state_rescale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=100_000, help="devices in state (default %(default)s)")
    ap.add_argument("--start", type=int, default=2, help="state partitions of the build (default %(default)s)")
    ap.add_argument("--to", default="4,1", help="state partitions to rescale to, in turn (default %(default)s)")
    ap.add_argument("--probe", type=int, default=1000, help="events of the check after the rescales (default %(default)s)")
    ap.add_argument("--batch", type=int, default=100_000, help="max_events_per_batch (default %(default)s)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--keep", metavar="DIR", help="keep the work directory (config, checkpoint, logs) here")
    ap.add_argument("--json", help="write the results to this file as well")
    args = ap.parse_args(argv)
    targets = [int(n) for n in args.to.split(",") if n.strip()]
    if args.probe > args.devices:
        ap.error("--probe must not exceed --devices")
    results: dict[str, Any] = {"args": vars(args), "machine": _machine(), "rescales": []}
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        if args.keep:
            workdir = Path(args.keep)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="state-rescale-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic, out_topic = f"ref.devices-{tag}", f"bench-events-{tag}", f"bench-out-{tag}"
        config, checkpoint, log = workdir / "enrich.yaml", workdir / "checkpoint", workdir / "enrich.log"
        write_config(config, settings, events_topic, devices_topic, out_topic, checkpoint, args.batch,
                     args.driver_memory)
        cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
        cfg["spark"]["spark.sql.shuffle.partitions"] = str(args.start)
        config.write_text(yaml.safe_dump(cfg), encoding="utf-8")

        pub_s = _in_process(data.publish_devices, settings, devices_topic, args.devices)
        fill_s, _, _ = _in_process(data.fill_events, settings, events_topic, args.devices, 2, args.devices, True)
        print(f"published {args.devices:,} devices in {pub_s:.1f}s, {args.devices:,} events in {fill_s:.1f}s",
              flush=True)
        run = ("run", "--config", str(config), "--master", args.master, "--available-now")
        build_s, _ = enrich(*run, log=log, timeout=3600)
        size = checkpoint_size(checkpoint)["state"]
        in_state = sum(json.loads((checkpoint / "refstream" / "devices.json").read_text())["buckets"].values())
        results["build"] = {"seconds": build_s, "devices_in_state": in_state, "state": size}
        print(f"build: {args.devices:,} events through the job in {build_s:.1f}s; {in_state:,} devices in state, "
              f"spark/state {size['bytes'] / 2**20:,.1f} MiB in {size['files']} files", flush=True)

        before = args.start
        for n in targets:
            wall, out = enrich("rescale", "--config", str(config), "--partitions", str(n), "--master", args.master,
                               log=log, timeout=3600)
            took = _TOOK.search(out)
            spark_s = float(took.group(1)) if took else None
            per_m = None if spark_s is None else spark_s / in_state * 1e6
            results["rescales"].append({"from": before, "to": n, "process_s": wall, "repartition_s": spark_s,
                                        "repartition_s_per_million_devices": per_m, "output": out.strip()})
            print(f"rescale {before} -> {n}: {wall:.1f}s as a process, the repartition {spark_s}s "
                  f"({'-' if per_m is None else f'{per_m:.0f}'} s per million devices, extrapolated)", flush=True)
            print(f"  {out.strip()}", flush=True)
            before = n

        step = args.devices // args.probe
        produce_probe(settings, events_topic, [1 + i * step for i in range(args.probe)])
        check_s, _ = enrich(*run, log=log, timeout=3600)
        rows = [json.loads(m.value()) for m in rkafka.read_to_end(settings, out_topic, timeout=30)]
        seen = Counter((r["device_id"], (r.get("state") or {}).get("events")) for r in rows)
        second = sum(1 for (_, events) in seen if events == 2)
        ok = (len(rows) == args.devices + args.probe and max(seen.values()) == 1 and second == args.probe
              and all(events in (1, 2) for _, events in seen))
        results["check"] = {"seconds": check_s, "records": len(rows), "second_events": second, "ok": ok}
        print(f"check: {args.probe} more events through the rescaled checkpoint in {check_s:.1f}s; "
              f"{len(rows):,} output records, {second} with state.events == 2: "
              f"{'every device continued, every event once' if ok else 'WRONG'}", flush=True)
    print(f"machine: {results['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return 0 if results["check"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
