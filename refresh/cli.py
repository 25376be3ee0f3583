"""``refresh`` command line: ``daemon``, ``run [DATASET ...] [--full] [--allow-deletes]``,
``status [--json] [--check]``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from refresh.config import RefreshConfig, load_config
from refresh.errors import DatasetBusy
from refstream.errors import ConfigError, one_line
from refstream.logs import setup_logging

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "conf/refresh.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refresh", description="Publish reference data changes to Kafka.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file (default {DEFAULT_CONFIG})")
    p.add_argument("--debug", action="store_true", help="debug logging and tracebacks on errors")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    # The same options after the verb (`refresh run --config x.yaml`); SUPPRESS keeps the global value
    # when they are not repeated there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
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
    s = sub.add_parser("status", parents=[common], help="show each dataset's state and last run")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--check", action="store_true",
                   help="exit 1 unless every dataset has been published and its last run did not fail "
                        "(for healthchecks and monitoring)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (args.log_level or ("DEBUG" if args.debug else "INFO")).upper()
    if not isinstance(logging.getLevelName(level), int):
        print(f"refresh: --log-level {args.log_level!r} is not a level", file=sys.stderr)
        return 2
    setup_logging(level)
    try:
        config = load_config(args.config)
        if args.verb == "daemon":
            from refresh.daemon import run_daemon  # the scheduler is only needed here

            return run_daemon(config)
        if args.verb == "status":
            return _status(config, args.json, check=args.check)
        if args.allow_deletes and not args.datasets:
            # Forcing deletes is a decision about one dataset's data, never a blanket one.
            raise ConfigError("--allow-deletes needs the datasets named: refresh run DATASET --allow-deletes")
        return _run(config, args.datasets, full=args.full, reconcile=args.reconcile, wait=not args.no_wait,
                    allow_deletes=args.allow_deletes)
    except KeyboardInterrupt:
        print("refresh: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that reports any error
        if args.debug:
            log.exception("refresh %s failed", args.verb)
        print(f"refresh: {one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _status(config: object, as_json: bool, *, check: bool = False) -> int:
    from refresh.status import format_status, read_status, unhealthy

    rows = read_status(config)  # type: ignore[arg-type]
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(format_status(rows))
    problems = unhealthy(rows) if check else []
    if problems:
        print(f"refresh: not healthy: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _run(config: RefreshConfig, names: list[str], *, full: bool, reconcile: bool, wait: bool,
         allow_deletes: bool = False) -> int:
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
                                  allow_deletes=allow_deletes)
            except DatasetBusy as exc:
                failed += 1
                print(f"refresh: {exc}", file=sys.stderr)
                continue
            except Exception as exc:  # noqa: BLE001 - one line per failed dataset, then go on
                failed += 1
                log.debug("dataset %s failed", name, exc_info=True)
                print(f"refresh: {name}: {one_line(exc)}", file=sys.stderr)
                continue
            print(f"{r.dataset}: version {r.version} ({r.kind}): {r.rows} rows read, {r.inserts} inserts, "
                  f"{r.updates} updates, {r.deletes} deletes, {r.published} messages acknowledged "
                  f"in {r.seconds:.2f}s")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 1 if failed else 0
