"""What the benchmarks share: the broker they measure against, their working directory and input
topics, and the job run as a process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from enrich.source.offsets import from_json_offsets, starts_of

ROOT = Path(__file__).resolve().parents[1]
#: The job's line at the end of each batch's own work: batch id and seconds.
BATCH_DONE = re.compile(r"batch (\d+) done in ([\d.]+)s")


def broker_settings(stack: ExitStack, bootstrap: str | None) -> dict[str, str]:
    """Client settings for ``bootstrap``, or for an embedded broker that ``stack`` stops at exit."""
    if bootstrap:
        return {"bootstrap.servers": bootstrap}
    from demo.broker import EmbeddedBroker

    broker = stack.enter_context(EmbeddedBroker())
    return {"bootstrap.servers": broker.bootstrap}


def workdir(stack: ExitStack, keep: Path | None, prefix: str) -> Path:
    """``keep`` (the ``--keep`` option: the jobs' configs and logs stay there), or a temporary
    directory that ``stack`` removes at exit."""
    work = keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    work.mkdir(parents=True, exist_ok=True)
    return work


def input_topics() -> tuple[str, str]:
    """Fresh names for a run's device changelog and event topics."""
    suffix = uuid.uuid4().hex[:8]
    return f"bench-devices-{suffix}", f"bench-events-{suffix}"


def thread_times(pid: int) -> Iterator[tuple[int, str, float]]:
    """(thread id, name, CPU seconds so far: user + system) of every thread of process ``pid``,
    from ``/proc``; threads that end while being read are left out."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return
    for task in tasks:
        try:
            comm = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        parts = stat[stat.rindex(")") + 2:].split()
        yield int(task.name), comm, (int(parts[11]) + int(parts[12])) / tick


@dataclass(frozen=True)
class JobRun:
    """What one ``enrich run --available-now`` printed and how long it took."""

    log: str                    # the job's whole output
    wall_s: float
    batches: dict[int, float]   # batch id -> seconds, from its "batch N done in S s" lines

    def steady_rate(self, events: int, batch: int) -> float:
        """Events per second of the full batches after the first two (warm-up)."""
        steady = [s for b, s in self.batches.items() if 2 <= b < events // batch]
        if not steady:
            raise RuntimeError(f"no steady batches (events {events}, batch {batch}): give more events")
        return len(steady) * batch / sum(steady)


def job_env() -> dict[str, str]:
    """The environment of a job run as a process: this Python for the workers, this tree first on the path."""
    return {**os.environ, "PYSPARK_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_available_now(cfg: Path, log: Path) -> JobRun:
    """``python -m enrich run --config cfg --master local[2] --available-now`` as a process, its
    output appended to ``log``; raises with the log's tail if the job fails."""
    env = job_env()
    started = time.monotonic()
    with open(log, "ab") as out:
        rc = subprocess.run([sys.executable, "-m", "enrich", "run", "--config", str(cfg), "--master", "local[2]",
                             "--available-now"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            timeout=3600).returncode
    text = log.read_text()
    if rc != 0:
        raise RuntimeError(f"the job exited {rc}: {text[-2000:]}")
    return JobRun(text, time.monotonic() - started, {int(b): float(s) for b, s in BATCH_DONE.findall(text)})


@dataclass(frozen=True)
class LogRecord:
    """One record of a job's ``--log-format json`` log."""

    time: float     # seconds since the epoch
    logger: str
    message: str


def json_log(path: Path) -> list[LogRecord]:
    """The records of a ``--log-format json`` log, in order; other lines (the JVM's, Spark's) left out."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "time" in rec:
            out.append(LogRecord(datetime.fromisoformat(rec["time"]).timestamp(), str(rec.get("logger", "")),
                                 str(rec.get("message", ""))))
    return out


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, interpolated between the nearest ranks; NaN for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def events_in(progress: dict[str, Any]) -> int:
    """The events a trigger read: offsets from its sources' start to their end (the events topic
    holds no transaction markers). Not ``numInputRows``: a job without state reads the records in
    its writer's tasks, and its source's rows are their offset ranges."""
    n = 0
    for src in progress.get("sources") or []:
        end, start = ((json.loads(o) if isinstance(o, str) else o) or {}
                      for o in (src.get("endOffset"), src.get("startOffset")))
        if not all(isinstance(v, dict) for k, v in end.items() if not k.startswith("@")):
            continue  # not a Kafka source's offsets (the ticks' clock, a file stream's log offset)
        begin = {**from_json_offsets(start), **starts_of(end)}
        n += sum(max(0, o - begin.get(tp, 0)) for tp, o in from_json_offsets(end).items())
    return n
