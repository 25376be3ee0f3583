"""``enrich run --config conf/enrich.yaml [--master local[*]] [--available-now] [--debug]``,
``enrich validate --config conf/enrich.yaml [--connect]``, ``enrich status --config F [--json] [--check
--max-age 10m]``, ``enrich lookup --config F DATASET KEY [--batch N]``, ``enrich lookup --config F --state
DEVICE [--batch N]``, ``enrich lookup --config F --rollup NAME --key V [--limit N]``, ``enrich rescale --config F --partitions N [--master M]``, ``enrich savepoint --config F
--to DIR [--master M]``, ``enrich run --config F --from-savepoint DIR``, ``enrich compile-pyspark
[--spark-home DIR]``; ``--version``,
``--log-format text|json``.

Also runs under ``spark-submit`` (``spark-submit -m enrich`` is not a thing; submit ``enrich/__main__.py``
or a one-line script calling :func:`main`): without ``--master`` the master set by spark-submit is kept.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from refstream import version
from refstream.config import duration_arg
from refstream.errors import ConfigError, RefstreamError, one_line
from refstream.logs import LOG_FORMATS, setup_logging

__all__ = ["compile_pyspark", "lookup", "main", "parser", "rescale", "run", "savepoint", "status", "validate"]

log = logging.getLogger("enrich")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="enrich", description="Enrich device events with reference dimensions.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    flags.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="text lines (default) or one JSON object per line (time, level, logger, message)")
    common = argparse.ArgumentParser(add_help=False, parents=[flags])
    common.add_argument("--config", default="conf/enrich.yaml", help="YAML configuration (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common], help="run the streaming enrichment job")
    run.add_argument("--master", default=None,
                     help="Spark master, e.g. local[*] or spark://host:7077 (default: the one spark-submit "
                          "set, else local[*])")
    run.add_argument("--available-now", action="store_true",
                     help="process what is in the topics now, then stop (backfills, tests)")
    run.add_argument("--from-savepoint", metavar="DIR", default=None,
                     help="start the config's (new) checkpoint from a savepoint (enrich savepoint): its state, "
                          "offsets and dimension positions; exit 2 when the config cannot continue it")
    v = sub.add_parser("validate", parents=[common],
                       help="load and check the config (Spark parses events.schema in a local session), "
                            "print what would run; exit 0 when valid, else 1")
    v.add_argument("--connect", action="store_true", help="also reach the broker and look up the job's topics")
    v.add_argument("--explain", action="store_true",
                   help="also print the job's plan: its stages in order with the columns each adds (reads the "
                        "published schemas from the changelog topics, so it reaches the broker)")

    st = sub.add_parser("status", parents=[common],
                        help="what the last committed micro-batch used, input lag, dead letters "
                             "(reads the checkpoint and the topics; the job may run or not)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--check", action="store_true",
                    help="exit 1 when no batch was committed, or (with --max-age) a dimension is older than "
                         "that, or events wait while the last batch is older than that")
    st.add_argument("--max-age", type=duration_arg, default=None, metavar="DURATION",
                    help="e.g. 10m: the oldest dimension version and batch --check accepts")

    lk = sub.add_parser("lookup", parents=[common],
                        help="the dimension row a committed micro-batch used for a key (DATASET KEY), or a "
                             "device's state after it (--state DEVICE)")
    lk.add_argument("dataset", nargs="?", help="a dataset the job joins")
    lk.add_argument("key", nargs="?", help="the key: its value, col=value,... or a JSON object")
    lk.add_argument("--state", metavar="DEVICE", default=None,
                    help="print this device's state (its state.key value) instead: from output.database's "
                         "table when it has write: state and no --batch is given, else from the checkpoint")
    lk.add_argument("--batch", type=int, default=None, help="a committed batch id (default: the last one)")
    lk.add_argument("--rollup", metavar="NAME", default=None,
                    help="print the latest revision of a key's windows of this rollup, newest first, as JSON "
                         "lines (from its database table, else its Parquet directory); give the key with --key")
    lk.add_argument("--key", dest="rollup_keys", action="append", default=[], metavar="V",
                    help="with --rollup: a by: value, once per by: column, in that order")
    lk.add_argument("--limit", type=_positive, default=100, metavar="N", help="with --rollup: at most N windows")

    rs = sub.add_parser("rescale", parents=[common],
                        help="move the device state of a stopped job (its last batch committed) to N state "
                             "partitions (docs/state.md); exit 2 when refused, nothing changed")
    rs.add_argument("--partitions", type=_positive, required=True, metavar="N",
                    help="the number of state partitions (best a number that divides state.buckets)")
    rs.add_argument("--master", default=None,
                    help="Spark master to rewrite the state with (default: the one spark-submit set, else local[*])")
    sp = sub.add_parser("savepoint", parents=[common],
                        help="write the device state of the last committed batch (the job stopped or running) "
                             "to DIR/state.parquet, with DIR/savepoint.json (docs/state.md); exit 2 when refused")
    sp.add_argument("--to", required=True, metavar="DIR", help="a new or empty directory")
    sp.add_argument("--master", default=None,
                    help="Spark master to read the state with (default: the one spark-submit set, else local[*])")
    cz = sub.add_parser("compile-pyspark", parents=[flags],
                        help="write PySpark's bytecode into the pyspark.zip Spark starts its Python processes "
                             "with (once per install, while no job runs; docs/deployment.md)")
    cz.add_argument("--spark-home", default=None, metavar="DIR",
                    help="the Spark installation (default: $SPARK_HOME, else the installed PySpark's)")
    return p


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "lookup":
        if args.rollup is not None:
            if args.dataset is not None or args.state is not None or not args.rollup_keys:
                p.error("lookup --rollup NAME takes --key V (once per by: column) and no DATASET KEY or --state")
        elif args.rollup_keys:
            p.error("--key goes with --rollup NAME")
        elif not (args.key is not None if args.state is None else args.dataset is None):
            p.error("lookup takes DATASET KEY, --state DEVICE, or --rollup NAME --key V")
    setup_logging(debug=args.debug, log_format=args.log_format)
    try:
        if args.command == "validate":
            return validate(args)
        if args.command == "status":
            return status(args)
        if args.command == "lookup":
            return lookup(args)
        if args.command == "rescale":
            return rescale(args)
        if args.command == "savepoint":
            return savepoint(args)
        if args.command == "compile-pyspark":
            return compile_pyspark(args)
        return run(args)
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyspark", "pandas", "py4j"):
            raise
        # The base install is the refresher's: the job's libraries come with the `enrich` extra.
        print(f"enrich: error: {exc.name} is not installed: install refstream with the job's "
              f"libraries: pip install 'refstream[enrich]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        _fail(args, exc)
        return 2
    except (RefstreamError, OSError) as exc:
        _fail(args, exc)
        return 1
    except Exception as exc:  # Spark/py4j errors: one line unless --debug
        _fail(args, exc)
        return 1


def _fail(args: argparse.Namespace, exc: BaseException) -> None:
    if args.debug:
        log.error("enrich failed", exc_info=exc)
    print(f"enrich: error: {one_line(exc)}", file=sys.stderr)


def validate(args: argparse.Namespace) -> int:
    """``enrich validate``: 0 when the config loads, its events schema parses (and, with
    ``--connect`` or ``--explain``, the broker and every changelog topic are there; with ``--explain``
    the pipeline plans against their schemas), else 1 with one line per problem."""
    from enrich import config
    from enrich.validate import check_schema, connect, explain, summary

    try:
        cfg = config.load(args.config)
        if not args.explain:  # --explain prints the plan, which says all of this and more
            for line in summary(cfg):
                print(line)
        print(f"  events schema parsed by Spark: {check_schema(cfg)}")
    except ConfigError as exc:
        print(f"enrich: invalid: {one_line(exc)}", file=sys.stderr)
        return 1
    contact = args.connect or args.explain
    problems = connect(cfg, print) if contact else []
    if args.explain and not problems:
        try:
            for line in explain(cfg):
                print(line)
        except RefstreamError as exc:
            problems.append(one_line(exc))
    for p in problems:
        print(f"enrich: {p}", file=sys.stderr)
    print(f"{cfg.source}: {'invalid' if problems else 'valid'}"
          f"{'' if contact else ' (broker not contacted: --connect does)'}")
    return 1 if problems else 0


def run(args: argparse.Namespace) -> int:
    from enrich import config
    from enrich.job import EnrichJob

    cfg = config.load(args.config)
    job = EnrichJob(cfg, available_now=args.available_now, from_savepoint=args.from_savepoint)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current micro-batch", signum)
        job.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    job.run(master=args.master)  # its session as the API builds it: the config's spark: section, the UI on
    return 0


def status(args: argparse.Namespace) -> int:
    import json

    from enrich import config
    from enrich.ops.status import render
    from enrich.ops.status import status as job_status

    st = job_status(config.load(args.config), max_age=args.max_age)
    print(json.dumps(st.to_json(), indent=2) if args.json else render(st))
    if args.check and st.problems:
        for problem in st.problems:
            print(f"enrich: check failed: {problem}", file=sys.stderr)
        return 1
    return 0


def lookup(args: argparse.Namespace) -> int:
    """Prints the row (or the device's state) as JSON; exit 0 when the batch saw the key (left state
    for the device), 1 when it was absent or deleted. With ``--rollup``: the key's windows as JSON
    lines, newest first; exit 1 when it has none."""
    import json

    from enrich import config

    if args.rollup is not None:
        from enrich.ops.rollups import rollup_rows

        rows = rollup_rows(config.load(args.config), args.rollup, args.rollup_keys, args.limit)
        for row in rows:
            print(json.dumps(row, default=str))
        return 0 if rows else 1
    if args.state is not None:
        cfg = config.load(args.config)
        db = cfg.output.database
        if db is not None and db.write == "state" and args.batch is None:  # the table: no Spark session
            from enrich.ops.state_db import device_state_from_database

            answer = device_state_from_database(cfg, args.state)
            print(json.dumps(answer, indent=2, default=str))
            return 0 if answer["found"] == "present" else 1
        from enrich.ops.device import device_state

        found = device_state(cfg, args.state, args.batch)
        print(json.dumps(found.to_json(), indent=2, default=str))
        return 0 if found.found == "present" else 1

    from enrich.ops.lookup import lookup as find

    res = find(config.load(args.config), args.dataset, args.key, args.batch)
    print(json.dumps(res.to_json(), indent=2, default=str))
    if not res.complete:
        print(f"enrich: warning: {res.topic} no longer holds every record below the positions of batch "
              f"{res.batch_id} (compaction or a recreated topic): the row is what it still holds", file=sys.stderr)
    return 0 if res.found == "present" else 1


def rescale(args: argparse.Namespace) -> int:
    """Prints what it did (or that there was nothing to do), and a warning line when the buckets
    spread unevenly over the new number; exit 2 with one line when refused (nothing changed)."""
    from enrich import config
    from enrich.ops.rescale import RescaleRefused
    from enrich.ops.rescale import rescale as move

    cfg = config.load(args.config)
    master = args.master or (None if os.environ.get("PYSPARK_GATEWAY_PORT") else "local[*]")
    try:
        res = move(cfg, args.partitions, master=master)
    except RescaleRefused as exc:
        _fail(args, exc)
        return 2
    for line in res.lines():
        print(line)
    for warning in res.warnings:
        print(f"enrich: warning: {warning}", file=sys.stderr)
    return 0


def savepoint(args: argparse.Namespace) -> int:
    """Prints what it wrote; exit 2 with one line when refused (nothing written)."""
    from enrich import config
    from enrich.ops.savepoint import take

    master = args.master or (None if os.environ.get("PYSPARK_GATEWAY_PORT") else "local[*]")
    for line in take(config.load(args.config), args.to, master=master).lines():
        print(line)
    return 0


def compile_pyspark(args: argparse.Namespace) -> int:
    """Prints what it wrote (or that the zip already had this Python's bytecode)."""
    from enrich.ops.pyspark_zip import compile_zip, spark_zip

    print(compile_zip(spark_zip(args.spark_home)).line())
    return 0
