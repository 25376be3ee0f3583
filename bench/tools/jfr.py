"""Where a Spark JVM's CPU goes: summarise a Java Flight Recorder recording of it.

Record with the JDK's own recorder (no agent to install), e.g. the job's driver JVM in local mode,
where the executor's tasks run too::

    python -m bench.run enrich ... --conf "spark.driver.extraJavaOptions=-XX:StartFlightRecording=settings=profile"

dump it while the JVM runs (PySpark kills its JVM at exit, before a ``filename=`` recording is
written)::

    jcmd PID JFR.dump name=1 filename=job.jfr

then::

    python -m bench.tools.jfr job.jfr [--threads "Executor task launch"] [--top 25]

It reads the recording's execution samples (``jfr print``, from the JDK that runs it), keeps the
threads whose name contains ``--threads``, puts each sample in the phase of :data:`PHASES` that its
innermost matching frame names, and prints each phase's share and the top innermost frames. Samples are taken of threads running Java code: a thread inside a native call
(a socket read, a JNI copy) shows in ``jdk.NativeMethodSample`` instead, which this leaves out.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

#: (phase, pattern over the frames' ``class.method``). A sample counts in the phase of its innermost
#: frame that matches one, so it counts where the work is, not who asked for it (in Spark 4 a Python
#: worker's input is computed while its output stream is read, so ``BufferedInputStream.fill`` sits
#: above most of a task's work); a frame matching several takes the first.
PHASES: tuple[tuple[str, str], ...] = (
    ("JSON output (to_json)", r"json\.JacksonGenerator|StructsToJson|jackson\.core\."),
    ("Arrow batches to rows (from Python)", r"ArrowColumnVector|ArrowConverters|ColumnarBatchRow|arrow\.vector\.\w+Vector\.get"),
    ("rows to Arrow batches (to Python)", r"execution\.arrow\.ArrowWriter|ArrowFieldWriter|arrow\.vector\.\w+Vector\.set"),
    ("Python I/O (sockets, streams)", r"java\.io\.(DataInputStream|DataOutputStream|BufferedInputStream|BufferedOutputStream)|sun\.nio\.ch|java\.net\.Socket"),
    ("shuffle write and read", r"shuffle\.|ShuffleWriter|ShuffleReader|ExternalSorter|UnsafeShuffle|BlockStoreShuffle"),
    ("state store (RocksDB, state server)", r"state\.RocksDB|rocksdb|StateServer|StateStore"),
    ("generated code (projections, filters, joins)", r"GeneratedClass|codegen|UnsafeProjection|UnsafeRow"),
    ("Python runner (hand-off, threads)", r"python\.(BasePythonRunner|PythonRunner|ArrowPythonRunner|PythonArrowInput|PythonArrowOutput)|api\.python"),
    ("scheduling, RPC, listeners", r"scheduler\.|rpc\.|netty|ListenerBus|AppStatus"),
    ("class loading and JIT", r"ClassLoader|defineClass|jdk\.internal\.org\.objectweb|janino|codehaus"),
)

_SAMPLE = re.compile(r"^jdk\.ExecutionSample \{")
_THREAD = re.compile(r'^\s*sampledThread = "(?P<name>.*)" \(javaThreadId')
_FRAME = re.compile(r"^\s{4}(?P<frame>[\w$.<>/]+)\(")


def samples(recording: Path, depth: int = 96) -> Iterator[tuple[str, list[str]]]:
    """``(thread name, frames innermost first)`` of each execution sample in ``recording``."""
    home = _java_home()
    jfr = str(home / "bin" / "jfr") if home is not None else "jfr"
    cmd = [jfr, "print", "--stack-depth", str(depth), "--events", "jdk.ExecutionSample", str(recording)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        yield from parse(proc.stdout)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")


def parse(lines: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """``(thread name, frames innermost first)`` of each sample in ``jfr print``'s text."""
    thread, frames, inside = "", [], False
    for line in lines:
        if _SAMPLE.match(line):
            thread, frames, inside = "", [], True
        elif inside and (m := _THREAD.match(line)):
            thread = m.group("name")
        elif inside and (m := _FRAME.match(line)):
            frames.append(m.group("frame"))
        elif inside and line.startswith("}"):
            inside = False
            yield thread, frames


def _java_home() -> Path | None:
    java = shutil.which("java")
    if java is None:
        return None
    home = Path(java).resolve().parent.parent
    return home if (home / "bin" / "jfr").exists() else None


_PHASES = [(name, re.compile(pattern)) for name, pattern in PHASES]


def phase(frames: Sequence[str]) -> str:
    """The phase of the innermost of ``frames`` that matches one of :data:`PHASES` ("other" if none)."""
    for frame in frames:
        for name, rx in _PHASES:
            if rx.search(frame):
                return name
    return "other"


def summarise(recording: Path, threads: str = "", top: int = 25) -> str:
    """The phases' shares and the top innermost frames of the samples of threads named ``*threads*``."""
    phases: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for thread, frames in samples(recording):
        if threads not in thread or not frames:
            continue
        total += 1
        phases[phase(frames)] += 1
        leaves[frames[0]] += 1
    if not total:
        return f"{recording}: no execution samples of threads named *{threads}*"
    out = [f"{recording}: {total} samples of threads named *{threads}*", "", "phase:"]
    out += [f"  {n / total:6.1%}  {name}" for name, n in phases.most_common()]
    out += ["", "innermost frames:"]
    out += [f"  {n / total:6.1%}  {name}" for name, n in leaves.most_common(top)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.jfr", description=__doc__.splitlines()[0])
    ap.add_argument("recording", type=Path, help="a .jfr file")
    ap.add_argument("--threads", default="Executor task launch",
                    help="keep the threads whose name contains this (default: Spark's task threads; '' for all)")
    ap.add_argument("--top", type=int, default=25, help="innermost frames listed (default %(default)s)")
    args = ap.parse_args(argv)
    print(summarise(args.recording, args.threads, args.top))


if __name__ == "__main__":
    main()
