"""The job's state at scale: checkpoint size with ``--devices`` devices in state, and the time to
restart on that checkpoint and resume.

    python -m bench.run state_restart --devices 1000000 --probe 1000 --repeat 3

Against an embedded broker (or ``--bootstrap``), with ``enrich_bench``'s data (a ``devices``
dimension of ``--devices`` rows, ~150-byte JSON events) and its ``state:`` section
(``enrich_bench.STATE_SECTION``):

1. **build**: a backlog of one event per device (every device once, shuffled), and the job
   (``python -m enrich run``, ``local[2]``, 1 s trigger, ``--batch`` events per micro-batch,
   ``spark.ui.enabled: false``) started on it with a fresh checkpoint, until every event's output is
   in the output topic (read_committed) and Spark committed the last batch. Then the checkpoint's
   size: every file under it, and under ``spark/state`` (the state store), apparent bytes and bytes
   on disk (allocated blocks). Then the job's process group (driver, JVM, Python workers) gets
   SIGKILL: a crash, not a clean stop.
2. **restart**, ``--repeat`` times: ``--probe`` events (one each for the same ``--probe`` devices,
   spread over the key space) appended to the events topic, then the job started again on the
   checkpoint, timed from starting the process until all of those events' output is visible to a
   read_committed consumer; each output record's ``state.events`` must be ``1 + round`` (the state
   continued: nothing lost, nothing counted twice) and not late. The log's timestamps split the time
   into: up to "enrichment query started" (interpreter, Spark session, dimension bootstrap, query
   start), and from there to the batch's "done" line and its visibility. After Spark commits the
   batch the process group gets SIGKILL again.

Medians over the restart rounds. The job's log is ``<workdir>/job.log`` (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import KafkaError, TopicPartition

from bench import enrich_data as data
from bench.common import broker_settings
from bench.enrich_bench import STATE_SECTION, _in_process, _machine
from refstream import kafka as rkafka
from refstream.logs import setup_logging

log = logging.getLogger("bench.state_restart")
ROOT = Path(__file__).resolve().parents[1]
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_DONE = re.compile(r"batch (\d+) done in ([\d.]+)s")
_WROTE = re.compile(r"enrich\.sinks\.kafka: batch (\d+): (\d+) records")
_DEVICES = re.compile(r"; (\d+) device\(s\) in state$")


# ------------------------------------------------------------------------------------------ output

class OutputWatcher(threading.Thread):
    """Counts the committed records of the job's output topic as they become visible; while
    ``expect`` is set, also checks each record's ``state.events`` against it."""

    def __init__(self, settings: dict[str, str], topic: str) -> None:
        super().__init__(name="output-watcher", daemon=True)
        self.settings, self.topic = settings, topic
        self.count = 0
        self.expect: int | None = None
        self.wrong: list[dict[str, Any]] = []
        self.checked = 0
        self.reached: dict[int, float] = {}   # target count -> monotonic time it was reached
        self._targets: set[int] = set()
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()

    def target(self, n: int) -> None:
        with self._lock:
            self._targets.add(n)

    def run(self) -> None:
        c = rkafka.consumer(self.settings, **{"fetch.wait.max.ms": 10})
        while not rkafka.partitions_of(self.settings, self.topic):
            if self._stop_evt.wait(0.2):
                return
        c.assign([TopicPartition(self.topic, p, 0) for p in rkafka.partitions_of(self.settings, self.topic)])
        while not self._stop_evt.is_set():
            for m in c.consume(10_000, timeout=0.05):
                if m.error() is not None:
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("output watcher: %s", m.error())
                    continue
                self.count += 1
                expect = self.expect
                if expect is not None:
                    rec = json.loads(m.value())
                    self.checked += 1
                    st = rec.get("state") or {}
                    if st.get("events") != expect or rec.get("_late") is not False:
                        self.wrong.append(rec)
            with self._lock:
                for t in [t for t in self._targets if self.count >= t]:
                    self.reached[t] = time.monotonic()
                    self._targets.discard(t)
        c.close()

    def wait_for(self, n: int, proc: subprocess.Popen[bytes], job_log: Path, timeout: float) -> float:
        """Monotonic time at which ``n`` records were visible; fails if the job exits first."""
        self.target(n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if n in self.reached:
                    return self.reached[n]
            if proc.poll() is not None:
                raise RuntimeError(f"the job exited ({proc.returncode}) with {self.count:,} of {n:,} records "
                                   f"out: {_tail(job_log)}")
            time.sleep(0.02)
        raise RuntimeError(f"{self.count:,} of {n:,} output records after {timeout:.0f}s: {_tail(job_log)}")

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(10)


# ------------------------------------------------------------------------------------------ the job

def write_config(path: Path, settings: dict[str, str], events_topic: str, devices_topic: str, out_topic: str,
                 checkpoint: Path, batch: int, driver_memory: str) -> None:
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": events_topic, "schema": data.EVENT_DDL, "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": devices_topic, "on": "device_id",
                   "columns": list(data.JOIN_COLUMNS)}],
        "output": {"kafka": {"topic": out_topic}},
        "dead_letter_topic": f"{out_topic}-dlq",
        "checkpoint": str(checkpoint),
        "trigger": "1s",
        "max_events_per_batch": batch,
        "state": STATE_SECTION,
        "spark": {"spark.ui.enabled": "false", "spark.driver.memory": driver_memory},
    }), encoding="utf-8")


def start_job(config: Path, job_log: Path, master: str) -> subprocess.Popen[bytes]:
    """``python -m enrich run`` in its own process group (driver, JVM and Python workers)."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(job_log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "enrich", "run", "--config", str(config), "--master", master],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the job's whole process group: a crash."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)
    # The JVM and the Python workers are in the group too; give the kernel a moment to reap them.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_committed(checkpoint: Path, proc: subprocess.Popen[bytes], job_log: Path, timeout: float = 120) -> int:
    """Wait until Spark committed every batch it planned (``spark/commits`` caught up with
    ``spark/offsets``); returns that batch id."""
    def ids(d: str) -> list[int]:
        p = checkpoint / "spark" / d
        return sorted(int(f.name) for f in p.iterdir() if f.name.isdigit()) if p.is_dir() else []

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        offsets, commits = ids("offsets"), ids("commits")
        if offsets and commits and commits[-1] == offsets[-1]:
            return commits[-1]
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}): {_tail(job_log)}")
        time.sleep(0.1)
    raise RuntimeError(f"batch not committed after {timeout:.0f}s: {_tail(job_log)}")


def dir_size(root: Path) -> dict[str, int]:
    """Apparent bytes, bytes on disk (allocated blocks) and files under ``root``."""
    apparent = on_disk = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            apparent += st.st_size
            on_disk += st.st_blocks * 512
            files += 1
    return {"bytes": apparent, "bytes_on_disk": on_disk, "files": files}


def checkpoint_size(checkpoint: Path) -> dict[str, dict[str, int]]:
    return {"total": dir_size(checkpoint), "state": dir_size(checkpoint / "spark" / "state")}


def log_lines_since(job_log: Path, offset: int) -> list[tuple[float, str]]:
    """The job log's lines after byte ``offset``, with their timestamp (epoch s) where they have one."""
    with open(job_log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    out = []
    for line in text.splitlines():
        # Spark's console progress bar shares lines with log records: keep the record.
        line = line.rsplit("\r", 1)[-1]
        i = line.find("20")
        m = _LOG_TIME.match(line[i:]) if i >= 0 else None
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((ts, line[i:]))
    return out


def _tail(job_log: Path, n: int = 3000) -> str:
    try:
        return job_log.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


def produce_probe(settings: dict[str, str], topic: str, devices: list[int]) -> None:
    """One event for each of ``devices``, stamped now, flushed before returning."""
    p = rkafka.producer(settings, **{"enable.idempotence": True, "linger.ms": 5})
    maker = data.EventMaker(len(devices), seed=13)
    ts = data.now_iso()
    for n in devices:
        dev = data.device_id(n)
        p.produce(topic, maker.event(dev, ts), dev.encode())
    if p.flush(60):
        raise RuntimeError("probe events not acknowledged")


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run state_restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=1_000_000,
                    help="devices (dimension rows, backlog events, devices in state; default %(default)s)")
    ap.add_argument("--probe", type=int, default=1000, help="events appended before each restart (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="restart rounds (default %(default)s)")
    ap.add_argument("--batch", type=int, default=250_000, help="max_events_per_batch (default %(default)s)")
    ap.add_argument("--partitions", type=int, default=2, help="event topic partitions (default %(default)s)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--build-timeout", type=float, default=1800.0, help="seconds for the first run (default %(default)s)")
    ap.add_argument("--keep", help="copy the job's log here at the end")
    ap.add_argument("--json", help="write the results to this file as well")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    if args.probe > args.devices:
        ap.error("--probe must not exceed --devices")
    results: dict[str, Any] = {"args": vars(args), "machine": _machine(), "rounds": []}
    wall0 = time.monotonic()
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="state-restart-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic, out_topic = f"ref.devices-{tag}", f"bench-events-{tag}", f"bench-enriched-{tag}"
        checkpoint, config, job_log = workdir / "checkpoint", workdir / "enrich.yaml", workdir / "job.log"
        if args.keep:
            stack.callback(lambda: job_log.exists() and shutil.copyfile(job_log, args.keep))
        write_config(config, settings, events_topic, devices_topic, out_topic, checkpoint, args.batch,
                     args.driver_memory)

        pub_s = _in_process(data.publish_devices, settings, devices_topic, args.devices)
        fill_s, size, distinct = _in_process(data.fill_events, settings, events_topic, args.devices,
                                             args.partitions, args.devices, True)
        results["prep"] = {"publish_dimension_s": pub_s, "fill_events_s": fill_s, "event_bytes": size,
                           "distinct_devices": distinct}
        print(f"published {args.devices:,} devices in {pub_s:.1f}s; {args.devices:,} events of {size:.0f} B "
              f"over {distinct:,} distinct devices in {fill_s:.1f}s", flush=True)

        watcher = OutputWatcher(settings, out_topic)
        watcher.start()
        stack.callback(watcher.stop)

        # 1. build the state: every device once, then SIGKILL.
        t0 = time.monotonic()
        proc = start_job(config, job_log, args.master)

        def kill_if_running() -> None:
            if proc.poll() is None:
                kill_job(proc)

        stack.callback(kill_if_running)
        done = watcher.wait_for(args.devices, proc, job_log, args.build_timeout)
        last = wait_committed(checkpoint, proc, job_log)
        build_s = done - t0
        lines = log_lines_since(job_log, 0)
        devs = [int(m.group(1)) for _, line in lines if (m := _DEVICES.search(line))]
        batches = [float(m.group(2)) for _, line in lines if (m := _DONE.search(line))]
        size0 = checkpoint_size(checkpoint)
        kill_job(proc)
        size_killed = checkpoint_size(checkpoint)
        results["build"] = {"seconds": build_s, "last_batch": last, "devices_in_state": devs[-1] if devs else None,
                            "batch_s": batches, "checkpoint": size0, "checkpoint_after_kill": size_killed}
        print(f"build: {args.devices:,} events through the job in {build_s:.1f}s (batches {last + 1}, "
              f"{' / '.join(f'{b:.1f}' for b in batches)} s; devices in state: "
              f"{devs[-1] if devs else 'unknown'}), then SIGKILL", flush=True)
        _print_size("checkpoint", size0)

        # 2. restarts
        step = args.devices // args.probe
        probe = [1 + i * step for i in range(args.probe)]
        expected = args.devices
        for r in range(1, args.repeat + 1):
            produce_probe(settings, events_topic, probe)
            expected += args.probe
            watcher.expect = 1 + r
            offset = job_log.stat().st_size
            started_wall, started = time.time(), time.monotonic()
            proc = start_job(config, job_log, args.master)
            visible = watcher.wait_for(expected, proc, job_log, 600)
            batch_id = wait_committed(checkpoint, proc, job_log)
            lines = log_lines_since(job_log, offset)
            kill_job(proc)
            watcher.expect = None
            query_at = next((ts for ts, line in lines if "enrichment query started" in line), None)
            # The batch that wrote the probe events (a batch without data may run before or after it).
            wrote = next((int(m.group(1)) for _, line in lines if (m := _WROTE.search(line)) and int(m.group(2))),
                         None)
            first_done = next(((ts, m) for ts, line in lines if (m := _DONE.search(line))
                               and int(m.group(1)) == wrote), None)
            rnd: dict[str, Any] = {"round": r, "restart_to_visible_s": visible - started,
                   "to_query_started_s": query_at - started_wall if query_at else None,
                   "to_batch_done_s": first_done[0] - started_wall if first_done else None,
                   "batch_body_s": float(first_done[1].group(2)) if first_done else None,
                   "batch_id": wrote, "last_committed": batch_id, "checked": watcher.checked, "wrong": len(watcher.wrong),
                   "checkpoint": checkpoint_size(checkpoint)}
            results["rounds"].append(rnd)
            print(f"[{r}/{args.repeat}] restart -> {args.probe} events' output visible in "
                  f"{rnd['restart_to_visible_s']:.1f}s (query started at {_s(rnd['to_query_started_s'])}, "
                  f"batch {wrote} done at {_s(rnd['to_batch_done_s'])}, its foreachBatch body "
                  f"{_s(rnd['batch_body_s'])}); state.events == {1 + r} in {watcher.checked - len(watcher.wrong)} "
                  f"of {watcher.checked} records checked so far", flush=True)
            if watcher.wrong:
                print(f"  wrong state, first: {json.dumps(watcher.wrong[0], default=str)[:400]}", flush=True)
    results["wall_s"] = time.monotonic() - wall0
    _summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return 1 if any(r["wrong"] for r in results["rounds"]) else 0


def _s(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}s"


def _print_size(what: str, size: dict[str, dict[str, int]]) -> None:
    t, s = size["total"], size["state"]
    print(f"{what}: {t['bytes'] / 2**20:,.1f} MiB in {t['files']} files ({t['bytes_on_disk'] / 2**20:,.1f} MiB on "
          f"disk); spark/state: {s['bytes'] / 2**20:,.1f} MiB in {s['files']} files "
          f"({s['bytes_on_disk'] / 2**20:,.1f} MiB on disk)", flush=True)


def _summary(res: dict[str, Any]) -> None:
    rounds = res["rounds"]

    def med(key: str) -> float:
        vals = [r[key] for r in rounds if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\n== summary ({len(rounds)} restart rounds, medians) ==")
    print(f"machine: {res['machine']}")
    _print_size(f"checkpoint with {res['build']['devices_in_state']} devices in state", res["build"]["checkpoint"])
    print(f"restart to output visible: {med('restart_to_visible_s'):.1f}s "
          f"(rounds {' / '.join(f'{v:.1f}' for v in (r['restart_to_visible_s'] for r in rounds))}); "
          f"to 'query started' {med('to_query_started_s'):.1f}s, to 'batch done' {med('to_batch_done_s'):.1f}s, "
          f"first batch's foreachBatch body {med('batch_body_s'):.1f}s")
    print(f"state continued: {sum(r['wrong'] for r in rounds[-1:])} wrong of {rounds[-1]['checked'] if rounds else 0} "
          f"probe records checked")
    print(f"total wall time: {res['wall_s']:.0f}s")


if __name__ == "__main__":
    raise SystemExit(main())
