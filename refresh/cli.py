"""``refresh`` command line: ``daemon``, ``run [DATASET ...] [--full] [--allow-deletes] [--dry-run]``,
``status [--json] [--check]``, ``validate [--connect]``; ``--version``, ``--log-format text|json``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType

from refresh.config import RefreshConfig, load_config
from refresh.errors import DatasetBusy
from refstream import version
from refstream.config import duration_arg
from refstream.errors import ConfigError, one_line
from refstream.logs import LOG_FORMATS, setup_logging

__all__ = ["DEFAULT_CONFIG", "build_parser", "main"]

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "conf/refresh.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refresh", description="Publish reference data changes to Kafka.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file (default {DEFAULT_CONFIG})")
    p.add_argument("--debug", action="store_true", help="debug logging and tracebacks on errors")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text lines (default) or one JSON object per line (time, level, logger, message)")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # The same options after the verb (`refresh run --config x.yaml`); SUPPRESS keeps the global value
    # when they are not repeated there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("daemon", parents=[common], help="run every dataset on its schedule and watch files")
    r = sub.add_parser("run", parents=[common], help="refresh datasets now (all when none is named)")
    r.add_argument("datasets", nargs="*", metavar="DATASET")
    r.add_argument("--full", action="store_true", help="republish every current row")
    r.add_argument("--reconcile", action="store_true",
                   help="incremental datasets: read the whole table to find hard deletes")
    r.add_argument("--allow-deletes", action="store_true",
                   help="the named datasets only, this run only: publish deletes beyond max_delete_fraction "
                        "(and of a source that reads empty) instead of refusing them")
    r.add_argument("--no-wait", action="store_true",
                   help="fail instead of waiting when a dataset is being refreshed elsewhere")
    r.add_argument("--dry-run", action="store_true",
                   help="read and diff, print what would be published; publish, commit and record nothing")
    s = sub.add_parser("status", parents=[common], help="show each dataset's state and last run")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--check", action="store_true",
                   help="exit 1 unless every dataset has been published, its last run did not fail and its "
                        "last successful run is not older than its max_age (for healthchecks and monitoring)")
    s.add_argument("--max-age", type=duration_arg, default=None, metavar="DURATION",
                   help="with --check: the oldest last successful run accepted, for every dataset (e.g. 2h; "
                        "default: each dataset's max_age, three schedule intervals)")
    v = sub.add_parser("validate", parents=[common],
                       help="load and check the config, print what would run; exit 0 when valid, else 1")
    v.add_argument("--connect", action="store_true",
                   help="also reach every source (a query for no rows, the files) and the broker")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (args.log_level or ("DEBUG" if args.debug else "INFO")).upper()
    if not isinstance(logging.getLevelName(level), int):
        print(f"refresh: --log-level {args.log_level!r} is not a level", file=sys.stderr)
        return 2
    setup_logging(level, log_format=args.log_format)
    if args.verb == "validate":
        return _validate(args.config, connect=args.connect)
    try:
        config = load_config(args.config)
        if args.verb == "daemon":
            from refresh.daemon import run_daemon  # the scheduler is only needed here

            return run_daemon(config)
        if args.verb == "status":
            return _status(config, args.json, check=args.check, max_age=args.max_age)
        if args.allow_deletes and not args.datasets:
            # Forcing deletes is a decision about one dataset's data, never a blanket one.
            raise ConfigError("--allow-deletes needs the datasets named: refresh run DATASET --allow-deletes")
        return _run(config, args.datasets, full=args.full, reconcile=args.reconcile, wait=not args.no_wait,
                    allow_deletes=args.allow_deletes, dry_run=args.dry_run)
    except KeyboardInterrupt:
        print("refresh: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that reports any error
        if args.debug:
            log.exception("refresh %s failed", args.verb)
        print(f"refresh: {one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _validate(path: str, *, connect: bool) -> int:
    """``refresh validate``: 0 when the config loads (and, with ``connect``, every source and the
    broker answer), else 1 with one line per problem on stderr."""
    from refresh.validate import connect as reach
    from refresh.validate import summary

    try:
        config = load_config(path)
    except Exception as exc:  # noqa: BLE001 - a config that does not load is the answer, not a crash
        print(f"refresh: invalid: {one_line(exc)}", file=sys.stderr)
        return 1
    for line in summary(config):
        print(line)
    problems = reach(config, print) if connect else []
    for p in problems:
        print(f"refresh: {p}", file=sys.stderr)
    print(f"{config.path}: {'invalid' if problems else 'valid'}"
          f"{'' if connect else ' (sources and broker not contacted: --connect does)'}")
    return 1 if problems else 0


def _status(config: object, as_json: bool, *, check: bool = False, max_age: timedelta | None = None) -> int:
    from refresh.status import format_status, read_status, unhealthy

    rows = read_status(config)  # type: ignore[arg-type]
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(format_status(rows))
    problems = unhealthy(rows, max_age=max_age.total_seconds() if max_age else None) if check else []
    if problems:
        print(f"refresh: not healthy: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _run(config: RefreshConfig, names: list[str], *, full: bool, reconcile: bool, wait: bool,
         allow_deletes: bool = False, dry_run: bool = False) -> int:
    from refresh.runner import Refresher

    refresher = Refresher(config)
    datasets = names or list(config.datasets)
    for n in datasets:
        config.dataset(n)  # unknown names fail before any run
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: stopping after the current step (nothing half-committed)", signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    failed = 0
    try:
        for name in datasets:
            if stop.is_set():
                failed += 1
                print(f"refresh: {name}: not run (stopped)", file=sys.stderr)
                continue
            try:
                r = refresher.run(name, full=full, reconcile=reconcile, wait=wait, stop=stop,
                                  allow_deletes=allow_deletes, dry_run=dry_run)
            except DatasetBusy as exc:
                failed += 1
                print(f"refresh: {exc}", file=sys.stderr)
                continue
            except Exception as exc:  # noqa: BLE001 - one line per failed dataset, then go on
                failed += 1
                log.debug("dataset %s failed", name, exc_info=True)
                print(f"refresh: {name}: {one_line(exc)}", file=sys.stderr)
                continue
            if dry_run:
                print(f"{r.dataset}: dry run ({r.kind}): {r.rows} rows read; would publish {r.inserts} "
                      f"inserts, {r.updates} updates, {r.deletes} deletes, {r.published} messages; "
                      f"nothing published" + (f" ({r.reason})" if r.reason else ""))
                continue
            print(f"{r.dataset}: version {r.version} ({r.kind}): {r.rows} rows read, {r.inserts} inserts, "
                  f"{r.updates} updates, {r.deletes} deletes, {r.published} messages acknowledged "
                  f"in {r.seconds:.2f}s")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 1 if failed else 0
