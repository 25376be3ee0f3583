"""``enrich savepoint`` on the state of N devices, and a job forked from it against a plain restart.

    python -m bench.run state_savepoint --devices 100000 --rounds 3

Against an embedded broker (or ``--bootstrap``), with ``enrich_bench``'s data and ``state:`` section
(as ``state_rescale``):

1. **build**: a backlog of one event per device (every device once, shuffled), run through the job
   (``python -m enrich run --available-now``, ``--master``) on a fresh checkpoint.
2. each of ``--rounds`` rounds:

   - **savepoint**: ``python -m enrich savepoint --to DIR`` (a new directory), timed as a process
     and as the command's own figure (reading the state and writing the files);
   - ``--probe`` more events (one each for devices spread over the key space);
   - **fork**: ``python -m enrich run --from-savepoint DIR --available-now`` with a new checkpoint
     and output topic: its first run, loading every device as the initial state;
   - **restart**: ``python -m enrich run --available-now`` on the job's own checkpoint, over the same
     events;
   - **check**: every probe event's record in both outputs, once, with ``state.events`` equal to
     the device's events so far (the fork continued the state).

Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from bench import enrich_data as data
from bench.common import broker_settings
from bench.enrich_bench import _in_process, _machine
from bench.state_rescale import enrich
from bench.state_restart import checkpoint_size, produce_probe, write_config
from refstream import kafka as rkafka

_TOOK = re.compile(r"device\(s\).*, in ([\d.]+)s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run state_savepoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=100_000, help="devices in state (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="savepoint, fork and restart rounds (default %(default)s)")
    ap.add_argument("--probe", type=int, default=1000, help="events per round (default %(default)s)")
    ap.add_argument("--batch", type=int, default=100_000, help="max_events_per_batch (default %(default)s)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--keep", metavar="DIR", help="keep the work directory (configs, checkpoints, logs) here")
    ap.add_argument("--json", help="write the results to this file as well")
    args = ap.parse_args(argv)
    if args.probe > args.devices:
        ap.error("--probe must not exceed --devices")
    results: dict[str, Any] = {"args": vars(args), "machine": _machine(), "rounds": []}
    ok = True
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        if args.keep:
            workdir = Path(args.keep)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="state-savepoint-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic, out_topic = f"ref.devices-{tag}", f"bench-events-{tag}", f"bench-out-{tag}"
        config, checkpoint, log = workdir / "enrich.yaml", workdir / "checkpoint", workdir / "enrich.log"
        write_config(config, settings, events_topic, devices_topic, out_topic, checkpoint, args.batch,
                     args.driver_memory)
        pub_s = _in_process(data.publish_devices, settings, devices_topic, args.devices)
        fill_s, _, _ = _in_process(data.fill_events, settings, events_topic, args.devices, 2, args.devices, True)
        print(f"published {args.devices:,} devices in {pub_s:.1f}s, {args.devices:,} events in {fill_s:.1f}s",
              flush=True)
        build_s, _ = enrich("run", "--config", str(config), "--master", args.master, "--available-now", log=log,
                            timeout=3600)
        size = checkpoint_size(checkpoint)["state"]
        results["build"] = {"seconds": build_s, "state": size}
        print(f"build: {args.devices:,} events through the job in {build_s:.1f}s; spark/state "
              f"{size['bytes'] / 2**20:,.1f} MiB", flush=True)

        step = args.devices // args.probe
        for r in range(args.rounds):
            point = workdir / f"savepoint-{r}"
            wall, out = enrich("savepoint", "--config", str(config), "--to", str(point), "--master", args.master,
                               log=log, timeout=3600)
            took = _TOOK.search(out)
            saved = json.loads((point / "savepoint.json").read_text(encoding="utf-8"))
            probe = [1 + r + i * step for i in range(args.probe)]
            produce_probe(settings, events_topic, probe)
            fork_cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
            fork_cfg["checkpoint"] = str(workdir / f"fork-{r}")
            fork_out = fork_cfg["output"]["kafka"]["topic"] = f"{out_topic}-fork-{r}"
            fork_cfg["dead_letter_topic"] = f"{fork_out}-dlq"
            fork_path = workdir / f"fork-{r}.yaml"
            fork_path.write_text(yaml.safe_dump(fork_cfg), encoding="utf-8")
            fork_s, _ = enrich("run", "--config", str(fork_path), "--master", args.master, "--available-now",
                               "--from-savepoint", str(point), log=log, timeout=3600)
            restart_s, _ = enrich("run", "--config", str(config), "--master", args.master, "--available-now",
                                  log=log, timeout=3600)
            # Each round's devices are others (rounds < devices / probe): each one's second event.
            want = sorted(data.device_id(n) for n in probe)
            checks = {}
            for name, topic in (("fork", fork_out), ("restart", out_topic)):
                rows = [json.loads(m.value()) for m in rkafka.read_to_end(settings, topic, timeout=30)]
                second = sorted(x["device_id"] for x in rows if (x.get("state") or {}).get("events") == 2
                                and x["device_id"] in set(want))
                checks[name] = second == want and (name == "restart" or len(rows) == len(want))
            ok = ok and all(checks.values())
            one = {"savepoint_process_s": wall, "savepoint_s": float(took.group(1)) if took else None,
                   "devices": saved["devices"], "fork_first_run_s": fork_s, "restart_s": restart_s, "ok": checks}
            results["rounds"].append(one)
            print(f"round {r + 1}: savepoint of {saved['devices']:,} devices {one['savepoint_s']}s "
                  f"({wall:.1f}s as a process); fork's first run {fork_s:.1f}s, restart {restart_s:.1f}s; "
                  f"state continued: {checks}", flush=True)
    rounds = results["rounds"]
    results["median"] = {k: statistics.median(x[k] for x in rounds if x[k] is not None)
                         for k in ("savepoint_process_s", "savepoint_s", "fork_first_run_s", "restart_s")}
    print(f"medians over {len(rounds)} round(s): {json.dumps(results['median'])}")
    print(f"machine: {results['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
