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

``--baseline`` also builds and restarts, right after the stateful job in every round, the same job
without the ``state:`` section (its own checkpoint and output topic, the same events): what a
restart costs without state (Spark session, dimension bootstrap, cold Python workers). Medians over the restart rounds; ``--keep DIR`` keeps the jobs' logs.
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
from dataclasses import dataclass, field
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
                 checkpoint: Path, batch: int, driver_memory: str, state: bool = True) -> None:
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
        **({"state": STATE_SECTION} if state else {}),
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

@dataclass
class Contender:
    """One job (with the ``state:`` section or without it) on the shared events topic: its own
    checkpoint, output topic, log and output watcher."""

    name: str
    state: bool
    config: Path
    checkpoint: Path
    job_log: Path
    watcher: OutputWatcher
    master: str
    expected: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def build(self, n: int, timeout: float) -> dict[str, Any]:
        """Run the job on the backlog of ``n`` events until all are out and committed, size the
        checkpoint, then SIGKILL it."""
        t0 = time.monotonic()
        proc = start_job(self.config, self.job_log, self.master)
        try:
            done = self.watcher.wait_for(n, proc, self.job_log, timeout)
            last = wait_committed(self.checkpoint, proc, self.job_log)
            size = checkpoint_size(self.checkpoint)
        finally:
            kill_job(proc)
        self.expected = n
        lines = log_lines_since(self.job_log, 0)
        devs = [int(m.group(1)) for _, line in lines if (m := _DEVICES.search(line))]
        batches = [float(m.group(2)) for _, line in lines if (m := _DONE.search(line))]
        res = {"seconds": done - t0, "last_batch": last, "devices_in_state": devs[-1] if devs else None,
               "batch_s": batches, "checkpoint": size, "checkpoint_after_kill": checkpoint_size(self.checkpoint)}
        print(f"{self.name}: build: {n:,} events through the job in {res['seconds']:.1f}s ({last + 1} batches, "
              f"{' / '.join(f'{b:.1f}' for b in batches)} s; devices in state: "
              f"{devs[-1] if devs else '-'}), then SIGKILL", flush=True)
        _print_size(f"{self.name}: checkpoint", size)
        return res

    def restart(self, r: int, repeat: int, probe: int) -> dict[str, Any]:
        """Start the job on its checkpoint (``probe`` new events waiting) and time it until their
        output is visible; SIGKILL once Spark committed the batch."""
        self.expected += probe
        self.watcher.expect = 1 + r if self.state else None
        offset = self.job_log.stat().st_size
        started_wall, started = time.time(), time.monotonic()
        proc = start_job(self.config, self.job_log, self.master)
        try:
            visible = self.watcher.wait_for(self.expected, proc, self.job_log, 600)
            committed = wait_committed(self.checkpoint, proc, self.job_log)
        finally:
            kill_job(proc)
        self.watcher.expect = None
        lines = log_lines_since(self.job_log, offset)
        query_at = next((ts for ts, line in lines if "enrichment query started" in line), None)
        # The batch that wrote the probe events (a batch without data may run before or after it).
        wrote = next((int(m.group(1)) for _, line in lines if (m := _WROTE.search(line)) and int(m.group(2))), None)
        done = next(((ts, m) for ts, line in lines if (m := _DONE.search(line)) and int(m.group(1)) == wrote), None)
        w = self.watcher
        rnd: dict[str, Any] = {
            "round": r, "restart_to_visible_s": visible - started,
            "to_query_started_s": query_at - started_wall if query_at else None,
            "to_batch_done_s": done[0] - started_wall if done else None,
            "batch_body_s": float(done[1].group(2)) if done else None,
            "batch_id": wrote, "last_committed": committed, "checked": w.checked, "wrong": len(w.wrong),
            "checkpoint": checkpoint_size(self.checkpoint)}
        self.rounds.append(rnd)
        check = (f"; state.events == {1 + r} in {w.checked - len(w.wrong)} of {w.checked} records checked so far"
                 if self.state else "")
        print(f"[{r}/{repeat}] {self.name}: restart -> {probe} events' output visible in "
              f"{rnd['restart_to_visible_s']:.1f}s (query started at {_s(rnd['to_query_started_s'])}, "
              f"batch {wrote} done at {_s(rnd['to_batch_done_s'])}, its foreachBatch body "
              f"{_s(rnd['batch_body_s'])}){check}", flush=True)
        if w.wrong:
            print(f"  wrong state, first: {json.dumps(w.wrong[0], default=str)[:400]}", flush=True)
        return rnd


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
    ap.add_argument("--baseline", action="store_true",
                    help="also the same job without the state: section, built and restarted in every round "
                         "right after the stateful one: what a restart costs without state")
    ap.add_argument("--keep", metavar="DIR", help="copy the jobs' logs into this directory at the end")
    ap.add_argument("--json", help="write the results to this file as well")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    if args.probe > args.devices:
        ap.error("--probe must not exceed --devices")
    results: dict[str, Any] = {"args": vars(args), "machine": _machine()}
    wall0 = time.monotonic()
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="state-restart-")))
        tag = uuid.uuid4().hex[:8]
        devices_topic, events_topic = f"ref.devices-{tag}", f"bench-events-{tag}"
        contenders = []
        for name, state in [("state", True), ("no state", False)][:2 if args.baseline else 1]:
            sub = workdir / name.replace(" ", "-")
            sub.mkdir()
            out_topic = f"bench-enriched-{sub.name}-{tag}"
            write_config(sub / "enrich.yaml", settings, events_topic, devices_topic, out_topic, sub / "checkpoint",
                         args.batch, args.driver_memory, state=state)
            watcher = OutputWatcher(settings, out_topic)
            watcher.start()
            stack.callback(watcher.stop)
            contenders.append(Contender(name, state, sub / "enrich.yaml", sub / "checkpoint", sub / "job.log",
                                        watcher, args.master))
        if args.keep:
            def keep_logs() -> None:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for c in contenders:
                    if c.job_log.exists():
                        shutil.copyfile(c.job_log, Path(args.keep) / f"{c.job_log.parent.name}.log")
            stack.callback(keep_logs)

        pub_s = _in_process(data.publish_devices, settings, devices_topic, args.devices)
        fill_s, size, distinct = _in_process(data.fill_events, settings, events_topic, args.devices,
                                             args.partitions, args.devices, True)
        results["prep"] = {"publish_dimension_s": pub_s, "fill_events_s": fill_s, "event_bytes": size,
                           "distinct_devices": distinct}
        print(f"published {args.devices:,} devices in {pub_s:.1f}s; {args.devices:,} events of {size:.0f} B "
              f"over {distinct:,} distinct devices in {fill_s:.1f}s", flush=True)

        results["build"] = {c.name: c.build(args.devices, args.build_timeout) for c in contenders}
        step = args.devices // args.probe
        probe = [1 + i * step for i in range(args.probe)]
        for r in range(1, args.repeat + 1):
            produce_probe(settings, events_topic, probe)
            for c in contenders:
                c.restart(r, args.repeat, args.probe)
        results["rounds"] = {c.name: c.rounds for c in contenders}
    results["wall_s"] = time.monotonic() - wall0
    _summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    return 1 if any(r["wrong"] for rounds in results["rounds"].values() for r in rounds) else 0


def _s(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}s"


def _print_size(what: str, size: dict[str, dict[str, int]]) -> None:
    t, s = size["total"], size["state"]
    print(f"{what}: {t['bytes'] / 2**20:,.1f} MiB in {t['files']} files ({t['bytes_on_disk'] / 2**20:,.1f} MiB on "
          f"disk); spark/state: {s['bytes'] / 2**20:,.1f} MiB in {s['files']} files "
          f"({s['bytes_on_disk'] / 2**20:,.1f} MiB on disk)", flush=True)


def _summary(res: dict[str, Any]) -> None:
    print("\n== summary (medians of the restart rounds) ==")
    print(f"machine: {res['machine']}")
    for name, rounds in res["rounds"].items():
        def med(key: str, rounds: list[dict[str, Any]] = rounds) -> float:
            vals = [r[key] for r in rounds if r.get(key) is not None]
            return statistics.median(vals) if vals else float("nan")

        build = res["build"][name]
        _print_size(f"{name}: checkpoint after the build ({build['devices_in_state'] or '-'} devices in state)",
                    build["checkpoint"])
        print(f"{name}: restart to output visible {med('restart_to_visible_s'):.1f}s over {len(rounds)} rounds "
              f"({' / '.join(f'{v:.1f}' for v in (r['restart_to_visible_s'] for r in rounds))}); to 'query "
              f"started' {med('to_query_started_s'):.1f}s, to 'batch done' {med('to_batch_done_s'):.1f}s, the "
              f"batch's foreachBatch body {med('batch_body_s'):.1f}s")
        if rounds and any(r["checked"] for r in rounds):
            print(f"{name}: state continued: {rounds[-1]['wrong']} wrong of {rounds[-1]['checked']} probe records")
    print(f"total wall time: {res['wall_s']:.0f}s")


if __name__ == "__main__":
    raise SystemExit(main())
