"""``enrich run --config conf/enrich.yaml [--master local[*]] [--available-now] [--debug]``,
``enrich validate --config conf/enrich.yaml [--connect]``; ``--version``, ``--log-format text|json``.

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
from refstream.errors import ConfigError, RefstreamError, one_line
from refstream.logs import LOG_FORMATS, setup_logging

log = logging.getLogger("enrich")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="enrich", description="Enrich device events with reference dimensions.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default="conf/enrich.yaml", help="YAML configuration (default: %(default)s)")
    common.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    common.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines (default) or one JSON object per line (time, level, logger, message)")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common], help="run the streaming enrichment job")
    run.add_argument("--master", default=None,
                     help="Spark master, e.g. local[*] or spark://host:7077 (default: the one spark-submit "
                          "set, else local[*])")
    run.add_argument("--available-now", action="store_true",
                     help="process what is in the topics now, then stop (backfills, tests)")
    v = sub.add_parser("validate", parents=[common],
                       help="load and check the config (Spark parses events.schema in a local session), "
                            "print what would run; exit 0 when valid, else 1")
    v.add_argument("--connect", action="store_true", help="also reach the broker and look up the job's topics")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(debug=args.debug, log_format=args.log_format)
    try:
        if args.command == "validate":
            return validate(args)
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
    ``--connect``, the broker and every changelog topic are there), else 1 with one line per problem."""
    from enrich import config
    from enrich.validate import check_schema, connect, plan

    try:
        cfg = config.load(args.config)
        for line in plan(cfg):
            print(line)
        print(f"  events schema parsed by Spark: {check_schema(cfg)}")
    except ConfigError as exc:
        print(f"enrich: invalid: {one_line(exc)}", file=sys.stderr)
        return 1
    problems = connect(cfg, print) if args.connect else []
    for p in problems:
        print(f"enrich: {p}", file=sys.stderr)
    print(f"{cfg.source}: {'invalid' if problems else 'valid'}"
          f"{'' if args.connect else ' (broker not contacted: --connect does)'}")
    return 1 if problems else 0


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
