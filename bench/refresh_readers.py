"""MySQL readers side by side: PyMySQL against ConnectorX (one and several partitions) on one table.

    .venv/bin/python -m bench.refresh_readers [--rows 1000000] [--repeat 3] [--partitions 2]

1. Makes a ``--rows`` MariaDB table of 10 mixed-type columns with the SEQUENCE engine (``INSERT ...
   SELECT ... FROM seq_1_to_N``), the same column types as the refresher benchmark's.
2. ``--repeat`` rounds, the readers in rotating order, each a separate process
   (:mod:`bench.refresh_read`: ``refresh.sources.open_source(...).read()``, nothing else): wall time,
   the time the process reports for the read, CPU time and peak RSS (``wait4`` rusage), and the load
   averages when it finished.
3. Reads the table once with every reader in one process and checks that the Arrow tables are
   identical (schema included); after the rounds, since a child forked from a big process reports
   that process's peak RSS as its own.

Prints a Markdown table of medians (peak RSS: max) and writes the raw figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.refresh_data import connect

TABLE_DDL = """
    id BIGINT NOT NULL PRIMARY KEY, name VARCHAR(64) NOT NULL, price DECIMAL(12,2) NOT NULL,
    updated_at DATETIME NOT NULL, born DATE NOT NULL, score DOUBLE NOT NULL, active TINYINT(1) NOT NULL,
    notes TEXT NOT NULL, qty INT NULL, category VARCHAR(16) NULL
"""
FILL = """
    SELECT seq, CONCAT('item-', seq, '-ä'), (seq * 7919 % 10000000) / 100,
           TIMESTAMP('2020-01-01') + INTERVAL (seq * 7907 % 157680000) SECOND,
           DATE('1970-01-01') + INTERVAL (seq * 31 % 20000) DAY, RAND(seq) * 100 - 50, seq % 2,
           CONCAT(REPEAT('straße café 東京 ', 1 + seq % 6), seq), IF(seq % 10 = 0, NULL, seq * 13 % 1000),
           IF(seq % 5 = 0, NULL, ELT(1 + seq % 8, 'sensor', 'gateway', 'meter', 'camera', 'tracker', 'hub',
                                     'relay', 'beacon'))
    FROM seq_1_to_{rows}
"""


def make_table(url: str, database: str, rows: int, reuse: bool) -> tuple[str, float | None]:
    table = f"readers_{rows}"
    server = connect(url + "/", database=None)
    with server.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{database}` CHARACTER SET utf8mb4")
    conn = connect(url + "/", database=database)
    with conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = %s AND table_name = %s",
                    (database, table))
        if reuse and cur.fetchone()[0] == 1:
            return table, None
        t0 = time.monotonic()
        cur.execute(f"DROP TABLE IF EXISTS `{table}`")
        cur.execute(f"CREATE TABLE `{table}` ({TABLE_DDL}) ENGINE=InnoDB CHARACTER SET utf8mb4")
        cur.execute(f"INSERT INTO `{table}` {FILL.format(rows=rows)}")
        cur.execute(f"ANALYZE TABLE `{table}`")
    return table, time.monotonic() - t0


def readers(partitions: int) -> dict[str, dict[str, Any]]:
    """Contender name -> the source settings it reads with."""
    out: dict[str, dict[str, Any]] = {"pymysql": {"reader": "pymysql"}, "connectorx": {"reader": "connectorx"}}
    if partitions > 1:
        out[f"connectorx, {partitions} partitions"] = {"reader": "connectorx", "read_partitions": partitions}
    return out


def write_config(path: Path, url: str, contenders: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A refresher config with one dataset per contender; contender -> dataset name."""
    names = {c: f"r{i}" for i, c in enumerate(contenders)}
    lines = ['kafka: {bootstrap_servers: "127.0.0.1:9"}', f"state_dir: {path.parent / 'state'}", "datasets:"]
    for c, settings in contenders.items():
        extra = "".join(f", {k}: {v}" for k, v in settings.items())
        lines += [f"  {names[c]}:", f'    source: {{url: "{url}", table: {path.stem}{extra}}}', "    key: [id]"]
    path.write_text("\n".join(lines) + "\n")
    return names


def check_identical(cfg: Path, names: dict[str, str]) -> None:
    from refresh.config import load_config
    from refresh.sources import open_source

    c = load_config(cfg)
    first = None
    for contender, ds in names.items():
        table = open_source(c.dataset(ds)).read()
        if first is None:
            first = (contender, table)
        elif not (table.schema == first[1].schema and table.equals(first[1])):
            raise SystemExit(f"{contender} read another table than {first[0]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.refresh_readers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=2, help="ConnectorX partitions of the third contender")
    ap.add_argument("--mysql", default=os.environ.get("REFSTREAM_BENCH_MYSQL", "mysql+pymysql://root@127.0.0.1:3306"))
    ap.add_argument("--database", default="refstream_bench")
    ap.add_argument("--reuse", action="store_true", help="keep a table of the right size from a former run")
    ap.add_argument("--json", type=Path, help="write raw figures here")
    args = ap.parse_args(argv)
    from bench.refresh_bench import measure

    table, load_seconds = make_table(args.mysql, args.database, args.rows, args.reuse)
    work = Path(tempfile.mkdtemp(prefix="refresh-readers-"))
    cfg = work / f"{table}.yaml"
    contenders = readers(args.partitions)
    names = write_config(cfg, f"{args.mysql}/{args.database}?charset=utf8mb4", contenders)
    rounds: list[dict[str, Any]] = []
    order = list(contenders)
    for i in range(args.repeat):
        got: dict[str, Any] = {}
        for contender in order[i % len(order):] + order[: i % len(order)]:
            p = measure(contender, [sys.executable, "-m", "bench.refresh_read", "--config", str(cfg),
                                    names[contender]], work / "children.log")
            if p.returncode != 0:
                raise SystemExit(f"{contender} failed ({p.returncode}); see {work / 'children.log'}")
            report = json.loads(p.stdout.strip().splitlines()[-1])
            got[contender] = {"wall": p.wall, "read": report["seconds"], "cpu": report["cpu"],
                              "rss_mb": p.rss_mb, "rows": report["rows"], "load": list(os.getloadavg())}
        rounds.append(got)
    check_identical(cfg, names)
    results = {"rows": args.rows, "repeat": args.repeat, "load_seconds": load_seconds, "rounds": rounds,
               "versions": versions()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(markdown(results, order))
    return 0


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {d: md.version(d) for d in ("connectorx", "PyMySQL", "pyarrow")}


def markdown(results: dict[str, Any], order: list[str]) -> str:
    med = statistics.median
    rounds = results["rounds"]
    lines = [f"rows: {results['rows']:,}; rounds: {len(rounds)} (medians; peak RSS = max); "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), "",
             "| reader | wall (process) | read inside it | CPU of the process | peak RSS | per round: read (s) | load averages at the end (1/5/15 min) |",
             "|---|---|---|---|---|---|---|"]
    for c in order:
        rs = [r[c] for r in rounds]
        loads = "; ".join("/".join(f"{x:.1f}" for x in r["load"]) for r in rs)
        per_round = ", ".join(f"{r['read']:.2f}" for r in rs)
        lines.append(f"| {c} | {med(r['wall'] for r in rs):.2f} s | {med(r['read'] for r in rs):.2f} s | "
                     f"{med(r['cpu'] for r in rs):.2f} s | {max(r['rss_mb'] for r in rs):.0f} MB | "
                     f"{per_round} | {loads} |")
    if results.get("load_seconds") is not None:
        lines.append(f"\ntable made (INSERT ... SELECT FROM seq_1_to_{results['rows']}): {results['load_seconds']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
