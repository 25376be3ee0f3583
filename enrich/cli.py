"""``enrich run --config conf/enrich.yaml [--master local[*]] [--available-now] [--debug]``;
``enrich status --config F [--json] [--check --max-age 10m]``; ``enrich lookup --config F DATASET KEY [--batch N]``.

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
from datetime import timedelta
from types import FrameType

from refstream.errors import ConfigError, RefstreamError, one_line
from refstream.logs import setup_logging

log = logging.getLogger("enrich")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="enrich", description="Enrich device events with reference dimensions.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the streaming enrichment job")
    run.add_argument("--config", default="conf/enrich.yaml", help="YAML configuration (default: %(default)s)")
    run.add_argument("--master", default=None,
                     help="Spark master, e.g. local[*] or spark://host:7077 (default: the one spark-submit "
                          "set, else local[*])")
    run.add_argument("--available-now", action="store_true",
                     help="process what is in the topics now, then stop (backfills, tests)")
    run.add_argument("--debug", action="store_true", help="debug logging and tracebacks")

    st = sub.add_parser("status", help="what the last committed micro-batch used, input lag, dead letters "
                                       "(reads the checkpoint and the topics; the job may run or not)")
    st.add_argument("--config", default="conf/enrich.yaml", help="YAML configuration (default: %(default)s)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--check", action="store_true",
                    help="exit 1 when no batch was committed, or (with --max-age) a dimension is older than "
                         "that, or events wait while the last batch is older than that")
    st.add_argument("--max-age", type=_duration, default=None, metavar="DURATION",
                    help="e.g. 10m: the oldest dimension version and batch --check accepts")
    st.add_argument("--debug", action="store_true", help="debug logging and tracebacks")

    lk = sub.add_parser("lookup", help="the dimension row a committed micro-batch used for a key")
    lk.add_argument("--config", default="conf/enrich.yaml", help="YAML configuration (default: %(default)s)")
    lk.add_argument("dataset", help="a dataset the job joins")
    lk.add_argument("key", help="the key: its value, col=value,... or a JSON object")
    lk.add_argument("--batch", type=int, default=None, help="a committed batch id (default: the last one)")
    lk.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    return p


def _duration(text: str) -> timedelta:
    from refstream.config import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(debug=args.debug)
    try:
        if args.command == "status":
            return status(args)
        if args.command == "lookup":
            return lookup(args)
        return run(args)
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


def run(args: argparse.Namespace) -> int:
    from enrich import config
    from enrich.job import EnrichJob
    from enrich.session import build_session

    cfg = config.load(args.config)
    master = args.master or (None if os.environ.get("PYSPARK_GATEWAY_PORT") else "local[*]")
    spark = build_session(master, "refstream-enrich", cfg.spark_conf)
    job = EnrichJob(cfg, spark, available_now=args.available_now)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current micro-batch", signum)
        job.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        job.run()
    finally:
        spark.stop()
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
    """Prints the row as JSON; exit 0 when the batch saw the key, 1 when it was absent or deleted."""
    import json

    from enrich import config
    from enrich.ops.lookup import lookup as find

    res = find(config.load(args.config), args.dataset, args.key, args.batch)
    print(json.dumps(res.to_json(), indent=2, default=str))
    if not res.complete:
        print(f"enrich: warning: {res.topic} no longer holds every record below the positions of batch "
              f"{res.batch_id} (compaction or a recreated topic): the row is what it still holds", file=sys.stderr)
    return 0 if res.found == "present" else 1
