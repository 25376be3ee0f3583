"""py-spy for the benches: sample a Spark job's Python processes, and summarise what was sampled.

Sampling (``py-spy`` must be installed next to the interpreter: ``pip install py-spy``):

* :func:`spy_workers` - the ``pyspark.daemon`` under this process's JVM and every worker it forks
  (``--subprocesses``), once the daemon has appeared;
* :func:`spy_jvm_pythons` - the other Python processes the JVM starts itself (the Python data
  source's driver-side runner: ``latestOffset``, ``partitions``, ``commit``);
* :func:`spy_pid` - one process, e.g. this one (the Python driver, where ``foreachBatch`` runs).

Each writes py-spy's raw format (one line per distinct stack, ``frame;frame;... count``, outermost
frame first; with ``--subprocesses`` the process is the first frame). :func:`summarise` groups the
samples of such a file by the first matching rule over the stack (phase) and lists the top leaf
frames:

    python -m bench.tools.pyspy FILE [--rules job] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

#: py-spy options common to every sampler: raw output, 100 Hz, no pausing of the process.
_OPTS = ["--format", "raw", "--rate", "100", "--nonblocking"]


def _exe() -> str:
    return str(Path(sys.executable).with_name("py-spy"))


def spy_pid(pid: int, out: Path, *, idle: bool = False, subprocesses: bool = False,
            threads: bool = False) -> subprocess.Popen[bytes]:
    """py-spy on ``pid`` (``--idle``: also the stacks of threads waiting; ``--threads``: a thread
    frame first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_exe(), "record", "--pid", str(pid), *_OPTS, "--output", str(out)]
    cmd += ["--idle"] * idle + ["--subprocesses"] * subprocesses + ["--threads"] * threads
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def spy_workers(out: Path, started: list[subprocess.Popen[bytes]], *, idle: bool = False,
                timeout: float = 120.0) -> threading.Thread:
    """In a thread: wait for the ``pyspark.daemon`` under this process's JVM, then py-spy it and its
    children into ``out``; the sampler is appended to ``started``."""

    def run() -> None:
        deadline = time.monotonic() + timeout
        while (daemon := daemon_pid()) is None:
            if time.monotonic() > deadline:
                print("py-spy: no pyspark.daemon appeared", file=sys.stderr)
                return
            time.sleep(0.2)
        started.append(spy_pid(daemon, out, idle=idle, subprocesses=True))

    t = threading.Thread(target=run, name="py-spy-workers", daemon=True)
    t.start()
    return t


def spy_jvm_pythons(out: Path, started: list[subprocess.Popen[bytes]], stop: threading.Event, *,
                    idle: bool = False) -> threading.Thread:
    """In a thread, until ``stop``: py-spy every Python child of this process's JVM other than the
    daemon, each into ``out`` with its pid as a suffix (``out.<pid>``)."""

    def run() -> None:
        seen: set[int] = set()
        while not stop.wait(0.2):
            for pid in jvm_pythons():
                if pid not in seen:
                    seen.add(pid)
                    started.append(spy_pid(pid, out.with_name(f"{out.name}.{pid}"), idle=idle))

    t = threading.Thread(target=run, name="py-spy-jvm-pythons", daemon=True)
    t.start()
    return t


def stop_all(started: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGINT every sampler (py-spy writes its file then) and wait for it."""
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in started:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def _ps() -> list[tuple[int, int, str]]:
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in ps.splitlines()[1:]:
        pid, ppid, *cmd = line.split()
        rows.append((int(pid), int(ppid), " ".join(cmd)))
    return rows


def _jvms(rows: list[tuple[int, int, str]]) -> set[int]:
    me = os.getpid()
    return {pid for pid, ppid, cmd in rows if ppid == me and "java" in cmd}


def daemon_pids(module: str | None = None) -> list[int]:
    """The ``pyspark.daemon`` processes whose parent is a JVM child of this process. Spark runs one
    daemon per worker module (``pyspark.daemon pyspark.sql.worker.plan_data_source_read``...); the
    tasks' workers (``pyspark.worker``: data source reads, ``mapInArrow``) fork from the one started
    without a module or with ``pyspark.worker``. ``module``: only the daemon of that module."""
    rows = _ps()
    jvms = _jvms(rows)
    found = []
    for pid, ppid, cmd in rows:
        if ppid in jvms and "pyspark.daemon" in cmd:
            mod = cmd.split("pyspark.daemon", 1)[1].strip() or "pyspark.worker"
            if module is None or mod == module:
                found.append(pid)
    return found


def daemon_pid() -> int | None:
    """The daemon of the tasks' workers (``pyspark.worker``), or None."""
    return next(iter(daemon_pids("pyspark.worker")), None)


def jvm_pythons() -> list[int]:
    """Python processes whose parent is a JVM child of this process, the daemon excepted."""
    rows = _ps()
    jvms = _jvms(rows)
    return [pid for pid, ppid, cmd in rows
            if ppid in jvms and "python" in cmd and "pyspark.daemon" not in cmd]


# ------------------------------------------------------------------------------------------ summary

#: Phases of the enrichment job's Python code: (name, regular expression over the whole stack).
#: The first rule that matches a stack names its phase; the order matters (most specific first).
JOB_RULES: list[tuple[str, str]] = [
    # workers: idle between tasks, the daemon, the collection after every task, waiting for the JVM
    ("worker idle: waiting for a task", r"_do_get_init_message|manager \(daemon\.py:184\)$"),
    ("worker: gc.collect() after each task (pyspark/daemon.py)", r"manager \(daemon\.py:275\)$"),
    ("worker: reading Arrow from the JVM (waits for its rows)", r"(pyarrow/ipc\.py:\d+\)|load_stream \(serializers\.py:\d+\))$"),
    ("worker: writing Arrow to the JVM", r"dump_stream \(serializers\.py:\d+\)$"),
    ("Kafka produce (TaskWriter: produce/poll)", r"produce_all \(enrich/sinks/kafka/writer\.py"),
    ("TaskWriter: probe of the output's ends (visible_ends)", r"visible_ends \(enrich/sinks/kafka/writer\.py"),
    ("TaskWriter: read of the slot's last marker (last_marker)", r"last_marker \(enrich/sinks/kafka/writer\.py"),
    ("TaskWriter: producer, init_transactions, begin/commit/flush", r"_SlotTransaction\.(__init__|begin|commit|close)|"
     r"commit \(enrich/sinks/kafka/writer"),
    ("TaskWriter: Arrow -> Python lists, dead letters", r"(write|too_large_to_dead_letters) \(enrich/sinks/kafka/tasks\.py"),
    ("Kafka fetch (consume)", r"read_range \(enrich/source/fetch\.py:\d+\)$"),
    ("Kafka fetch: messages -> Arrow (_to_batch)", r"_to_batch \(enrich/source/fetch\.py"),
    ("source reader other", r"enrich/source/kafka\.py"),
    ("JSON parse (fastparse)", r"enrich/fastparse\.py"),
    ("join: a worker builds its index of a dimension version", r"Lookup\.__init__ \(enrich/join\.py|"
     r"_cached \(enrich/join\.py"),
    ("join lookup", r"enrich/join\.py"),
    ("dimension fetch/index (worker)", r"enrich/dimension/"),
    ("PySpark serialization, other", r"pyspark/sql/pandas/serializers\.py|serializers\.py|conversion\.py"),
    ("PySpark worker other", r"pyspark/worker\.py|pyspark/sql/worker/"),
    # driver
    ("driver: dimension pin", r"enrich/dimension/manager\.py|pin \("),
    ("bench: memory sampler (psutil)", r"MemorySampler|psutil/"),
    ("bench: py-spy starter", r"_Spies|subprocess\.py"),
    ("driver: Py4J calls (planning, collect, waiting for Spark)", r"py4j/"),
    ("driver: foreachBatch other", r"enrich/job\.py"),
]


def load_raw(path: Path) -> Counter[str]:
    """py-spy raw file(s): stack -> samples. ``path`` may be a prefix: ``path`` and ``path.<pid>``."""
    stacks: Counter[str] = Counter()
    files = [path] if path.exists() else []
    files += sorted(path.parent.glob(path.name + ".*"))
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                stacks[stack] += int(n)
    return stacks


def summarise(stacks: Counter[str], rules: list[tuple[str, str]], top: int = 25) -> str:
    """Markdown tables: samples per phase (first matching rule) and the top leaf frames."""
    compiled = [(name, re.compile(rx)) for name, rx in rules]
    total = sum(stacks.values()) or 1
    phases: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for stack, n in stacks.items():
        phase = next((name for name, rx in compiled if rx.search(stack)), "other")
        phases[phase] += n
        frames = stack.split(";")
        leaves[f"{frames[-1]} <- {frames[-2] if len(frames) > 1 else ''}"] += n
    lines = [f"{total:,} samples", "", "| phase | samples | share |", "|---|---:|---:|"]
    lines += [f"| {p} | {n:,} | {n / total:.1%} |" for p, n in phases.most_common()]
    lines += ["", "| leaf frame <- caller | samples | share |", "|---|---:|---:|"]
    lines += [f"| `{f}` | {n:,} | {n / total:.1%} |" for f, n in leaves.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.pyspy", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="py-spy raw files (a prefix takes FILE.<pid> too)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--exclude", default="", help="regular expression: stacks matching it are left out")
    args = ap.parse_args(argv)
    stacks: Counter[str] = Counter()
    for f in args.files:
        stacks.update(load_raw(f))
    if args.exclude:
        rx = re.compile(args.exclude)
        stacks = Counter({s: n for s, n in stacks.items() if not rx.search(s)})
    print(summarise(stacks, JOB_RULES, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
