"""``enrich run --config conf/enrich.yaml [--master local[*]] [--available-now] [--debug]``.

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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(debug=args.debug)
    try:
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
