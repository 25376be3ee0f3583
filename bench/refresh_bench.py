"""Refresher benchmark: a full ``refresh run`` in diff mode against the time to only read the table.

    .venv/bin/python -m bench.refresh_bench [--rows 1000000] [--repeat 3] [--change 0.01] [--reader auto]

1. Loads a ``--rows`` MariaDB table of 10 mixed-type columns (:mod:`bench.refresh_data`) and starts
   the embedded broker.
2. Bootstrap: ``python -m refresh run`` publishes every row once (timed, for information); with
   ``--bootstrap state`` the first state is committed without publishing (:mod:`bench.refresh_seed`),
   since publishing 10M rows to the embedded broker would take longer than the benchmark itself.
3. ``--repeat`` times: change ``--change`` of the rows (80% updates, 10% inserts, 10% deletes), then in
   separate processes, in alternating order: ``python -m refresh run`` (read, diff, publish, commit)
   and ``python -m bench.refresh_read`` (only read the table into Arrow with the same source class
   and reader, ``--reader``). Wall time and peak RSS (``wait4`` rusage of that process) of each; the change counts
   the run reports are checked against the changes made.
4. Reads the topic back once and checks that every run published exactly what it reported.

Prints a Markdown summary (medians) and writes the raw figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.refresh_data import Mutation, connect, load, mutate
from refstream.logs import setup_logging

log = logging.getLogger("bench.refresh")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Proc:
    """One measured child process."""

    what: str
    wall: float
    rss_mb: float
    returncode: int
    stdout: str
    internal: float | None = None  # seconds the process itself reports for its work
    load_avg: float = 0.0  # 1-minute load average when it finished (other work on the machine)
    loads: tuple[float, ...] = ()  # the 1, 5 and 15-minute load averages then (`uptime`)
    cpu: float = 0.0  # CPU seconds of the process, all threads (less sensitive to a loaded machine)


def measure(what: str, cmd: list[str], log_path: Path) -> Proc:
    t0 = time.monotonic()
    with open(log_path, "ab") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
        assert p.stdout is not None
        out = p.stdout.read()  # before wait4: a full pipe would block the child
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    loads = tuple(round(x, 2) for x in os.getloadavg())
    return Proc(what, round(wall, 3), round(usage.ru_maxrss / 1024, 1), p.returncode, out.decode(),
                load_avg=loads[0], loads=loads, cpu=round(usage.ru_utime + usage.ru_stime, 3))


def refresh_run(cfg: Path, logs: Path, *, full: bool = False) -> Proc:
    cmd = [sys.executable, "-m", "refresh", "--config", str(cfg), "--log-level", "WARNING", "run", "items"]
    proc = measure("refresh run", cmd + (["--full"] if full else []), logs)
    if proc.returncode != 0:
        raise SystemExit(f"refresh run failed ({proc.returncode}); see {logs}")
    return proc


def read_only(cfg: Path, logs: Path) -> Proc:
    proc = measure("read only", [sys.executable, "-m", "bench.refresh_read", "--config", str(cfg), "items"],
                   logs)
    if proc.returncode != 0:
        raise SystemExit(f"read baseline failed ({proc.returncode}); see {logs}")
    proc.internal = json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]
    return proc


def last_run(cfg: Path) -> dict[str, Any]:
    from refresh.config import load_config
    from refresh.stores.files import FileStateStore

    c = load_config(cfg)
    run = FileStateStore(c.state_dir).read_status("items").last_run
    assert run is not None, "the dataset never ran"
    return run.to_json()


def verify_topic(kafka: dict[str, str], topic: str, runs: list[dict[str, Any]]) -> dict[int, int]:
    """Messages per version on the topic must equal what each run reported as published (heartbeats,
    each run's completeness records, left out: they are not changes)."""
    from refstream.contract import H_OP, H_VERSION, OP_HEARTBEAT, header_map
    from refstream.kafka import read_to_end

    per_version: Counter[int] = Counter()
    for m in read_to_end(kafka, topic, timeout=60):
        headers = header_map(m.headers())
        if headers.get(H_OP) != OP_HEARTBEAT:
            per_version[int(headers[H_VERSION])] += 1
    for r in runs:
        if per_version.get(r["version"], 0) != r["published"]:
            raise SystemExit(f"version {r['version']}: {per_version.get(r['version'], 0)} messages on "
                             f"the topic, the run reported {r['published']}")
    return dict(per_version)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.refresh_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--change", type=float, default=0.01, help="fraction of rows changed per round")
    ap.add_argument("--mysql", default=os.environ.get("REFSTREAM_BENCH_MYSQL", "mysql+pymysql://root@127.0.0.1:3306"))
    ap.add_argument("--database", default="refstream_bench")
    ap.add_argument("--reuse", action="store_true", help="keep a table of the right size from a former run")
    ap.add_argument("--no-verify", action="store_true", help="skip reading the topic back")
    ap.add_argument("--bootstrap", choices=("publish", "state"), default="publish",
                    help="first run: publish every row, or only commit the state (large tables)")
    ap.add_argument("--reader", choices=("auto", "connectorx", "pymysql"), default="auto",
                    help="the source's reader (auto: ConnectorX where it can)")
    ap.add_argument("--json", type=Path, help="write raw figures here")
    args = ap.parse_args(argv)
    setup_logging()

    from demo.broker import EmbeddedBroker

    table = f"bench_items_{args.rows}"
    server = connect(args.mysql + "/", database=None)
    with server.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{args.database}` CHARACTER SET utf8mb4")
    conn = connect(args.mysql + "/", database=args.database)
    load_seconds = None
    with conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = %s AND "
                    "table_name = %s", (args.database, table))
        exists = cur.fetchone()[0] == 1
    if not (args.reuse and exists):
        log.info("loading %d rows into %s.%s", args.rows, args.database, table)
        load_seconds = load(conn, table, args.rows)
        log.info("loaded in %.1fs", load_seconds)

    work = Path(tempfile.mkdtemp(prefix="refresh-bench-"))
    logs = work / "children.log"
    topic = f"bench.items.{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {"rows": args.rows, "change": args.change, "repeat": args.repeat,
                               "reader": args.reader, "load_seconds": load_seconds, "rounds": []}
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        kafka = {"bootstrap.servers": broker.bootstrap}
        cfg = work / "refresh.yaml"
        cfg.write_text(
            f"kafka: {{bootstrap_servers: \"{broker.bootstrap}\"}}\n"
            f"state_dir: {work / 'state'}\n"
            "datasets:\n"
            "  items:\n"
            f"    source: {{url: \"{args.mysql}/{args.database}?charset=utf8mb4\", table: {table}, "
            f"reader: {args.reader}}}\n"
            "    key: [id]\n"
            "    mode: diff\n"
            f"    topic: {topic}\n")
        if args.bootstrap == "publish":
            log.info("bootstrap run (publishes every row)")
            boot = refresh_run(cfg, logs)
        else:
            log.info("bootstrap: committing the first state without publishing it")
            boot = measure("seed state", [sys.executable, "-m", "bench.refresh_seed", "--config", str(cfg),
                                          "items"], logs)
            if boot.returncode != 0:
                raise SystemExit(f"seeding the state failed ({boot.returncode}); see {logs}")
        boot.internal = last_run(cfg)["seconds"]
        boot_run = last_run(cfg)
        results["bootstrap"] = {**asdict(boot), "run": boot_run, "mode": args.bootstrap}
        log.info("bootstrap: %.1fs wall, %.0f MB peak RSS, %d rows", boot.wall, boot.rss_mb, boot_run["rows"])
        runs = [boot_run] if args.bootstrap == "publish" else []
        for i in range(args.repeat):
            m: Mutation = mutate(conn, table, args.change, seed=100 + i)
            log.info("round %d: %d updates, %d inserts, %d deletes", i + 1, m.updates, m.inserts, m.deletes)
            order = ("run", "read") if i % 2 == 0 else ("read", "run")
            measured: dict[str, Proc] = {}
            for what in order:
                measured[what] = refresh_run(cfg, logs) if what == "run" else read_only(cfg, logs)
            run = last_run(cfg)
            measured["run"].internal = run["seconds"]
            got = (run["updates"], run["inserts"], run["deletes"])
            if got != (m.updates, m.inserts, m.deletes):
                raise SystemExit(f"round {i + 1}: the run found {got} (updates, inserts, deletes), "
                                 f"expected {(m.updates, m.inserts, m.deletes)}")
            runs.append(run)
            results["rounds"].append({"mutation": asdict(m), "run": asdict(measured["run"]),
                                      "read": asdict(measured["read"]), "result": run})
            log.info("round %d: refresh run %.2fs (%.0f MB), read only %.2fs (%.0f MB)", i + 1,
                     measured["run"].wall, measured["run"].rss_mb, measured["read"].wall,
                     measured["read"].rss_mb)
        if not args.no_verify:
            log.info("reading the topic back")
            results["topic_messages_per_version"] = verify_topic(kafka, topic, runs)

    results["summary"] = summary = summarise(results)
    results["machine"] = machine()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results, summary))
    return 0


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    rounds = results["rounds"]
    med = statistics.median
    run_wall = med(r["run"]["wall"] for r in rounds)
    read_wall = med(r["read"]["wall"] for r in rounds)
    run_int = med(r["run"]["internal"] for r in rounds)
    read_int = med(r["read"]["internal"] for r in rounds)
    return {
        "run_wall": run_wall, "run_rss_mb": max(r["run"]["rss_mb"] for r in rounds),
        "read_wall": read_wall, "read_rss_mb": max(r["read"]["rss_mb"] for r in rounds),
        "run_internal": run_int, "read_internal": read_int,
        "run_cpu": med(r["run"].get("cpu", 0.0) for r in rounds), "read_cpu": med(r["read"].get("cpu", 0.0) for r in rounds),
        "ratio_wall": run_wall / read_wall, "ratio_internal": run_int / read_int,
        "ratios_wall": [r["run"]["wall"] / r["read"]["wall"] for r in rounds],
        "load_avg": med(r[k]["load_avg"] for r in rounds for k in ("run", "read")),
        "phases": {k: med(r["result"].get("phases", {}).get(k, 0.0) for r in rounds)
                   for k in rounds[0]["result"].get("phases", {})},
        "changes": med(r["result"]["inserts"] + r["result"]["updates"] + r["result"]["deletes"]
                       for r in rounds),
    }


def machine() -> dict[str, Any]:
    import psutil

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "os": platform.platform()}


def markdown(results: dict[str, Any], s: dict[str, Any]) -> str:
    b = results["bootstrap"]
    lines = [
        f"rows: {results['rows']:,}; reader: {results.get('reader', 'auto')}; changed per round: {s['changes']:,.0f} "
        f"({results['change']:.1%}); rounds: {len(results['rounds'])} (medians; peak RSS = max)",
        "",
        "| measurement | wall time | peak RSS | time inside the process | CPU of the process |",
        "|---|---|---|---|---|",
        f"| `refresh run`, diff mode, {results['change']:.0%} changed | {s['run_wall']:.2f} s | "
        f"{s['run_rss_mb']:.0f} MB | {s['run_internal']:.2f} s | {s['run_cpu']:.2f} s |",
        f"| read the table into Arrow only (same reader) | {s['read_wall']:.2f} s | {s['read_rss_mb']:.0f} MB | "
        f"{s['read_internal']:.2f} s | {s['read_cpu']:.2f} s |",
        (f"| bootstrap `refresh run` (publishes every row), once | {b['wall']:.2f} s | {b['rss_mb']:.0f} MB | "
         f"{b['internal']:.2f} s | {b.get('cpu', 0.0):.2f} s |" if b.get("mode", "publish") == "publish" else
         f"| bootstrap: first state committed, nothing published, once | {b['wall']:.2f} s | "
         f"{b['rss_mb']:.0f} MB | {b['internal']:.2f} s | {b.get('cpu', 0.0):.2f} s |"),
        "",
        f"run / read ratio: {s['ratio_wall']:.2f} (wall; per round "
        f"{', '.join(f'{r:.2f}' for r in s['ratios_wall'])}), {s['ratio_internal']:.2f} (inside the processes)",
    ]
    if s["phases"]:
        lines.append("inside the run (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items()))
    if b.get("run", {}).get("phases"):
        lines.append("inside the bootstrap (s): " + ", ".join(f"{k} {v:.2f}" for k, v in b["run"]["phases"].items()))
    lines.append(f"1-minute load average during the timed runs (median): {s['load_avg']:.1f} "
                 f"on {os.cpu_count()} cores; load averages (1/5/15 min) after the bootstrap "
                 f"{'/'.join(f'{x:.1f}' for x in b.get('loads', ()))}, after each round's run "
                 + "; ".join("/".join(f"{x:.1f}" for x in r["run"].get("loads", ())) for r in results["rounds"]))
    if results.get("load_seconds") is not None:
        lines.append(f"table load (LOAD DATA LOCAL INFILE): {results['load_seconds']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
