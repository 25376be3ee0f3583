"""The long-running refresher: every dataset on its schedule, ``watch: true`` files on change.

Scheduling (APScheduler 3, one :class:`BackgroundScheduler`):

- ``run:<dataset>``: ``schedule.every`` (IntervalTrigger) or ``schedule.cron`` (CronTrigger), with
  ``max_instances=1`` and ``coalesce=True`` (runs missed while the process was busy or suspended
  collapse into one), misfire grace of one period (a late run is still worth doing, an older one is
  superseded by the next);
- ``reconcile:<dataset>``: incremental datasets also get a periodic ``run(reconcile=True)`` every
  ``incremental.reconcile.every`` (daily unless turned off: the full diff that finds hard deletes and
  rows whose cursor is NULL);
- ``start:<dataset>``, ``watch:<dataset>``, ``retry:<dataset>``: one-off runs at start-up, after a
  settled file change, and after a transient failure (exponential backoff, :class:`RetryPolicy`).

Every job goes through :meth:`Daemon._execute`, which never runs one dataset twice at once in this
process: a request arriving while the dataset runs is queued (at most one, a reconcile wins over a
plain run) and executed right after. Across processes (``refresh run`` while the daemon runs) the
runner's per-dataset file lock serialises the runs.

Failures never stop the daemon: a failed run commits nothing (the runner guarantees it) and records
its error in the status; transient ones are retried with backoff, terminal ones (bad data, bad
config) and refused ones (a change set that looks like a partial source) wait for the next schedule
or file change. SIGTERM/SIGINT set ``stop``: no new runs start, a
running refresh finishes or aborts before its commit, everything is released through an ExitStack,
and the process exits 0. A second signal exits at once (safe: nothing is committed before the broker
acknowledged it, and the next run republishes).

Heartbeats: the daemon has no timer of its own that publishes one. Each run it starts (scheduled, at
start-up, on a file change, a retry) reads the source, and ends its transaction with a heartbeat
carrying its completeness - as of its own read, the changes it found with it, or alone when it found
none. A heartbeat therefore always means "the source was checked then"; a run that cannot read the
source (or publish) publishes none, so a dataset's completeness, and its age in the job, stop moving
while its source is unreachable, however long the daemon keeps running.

``<state_dir>/_daemon/next_runs.json`` (``{dataset: ISO time}`` of the datasets with a run planned) is
kept current for ``refresh status``; ``<state_dir>/_daemon/daemon.lock`` keeps a second daemon off the same state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from apscheduler.events import (
    EVENT_JOB_ADDED,
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MISSED,
    EVENT_JOB_MODIFIED,
    EVENT_JOB_REMOVED,
    EVENT_JOB_SUBMITTED,
    JobEvent,
    JobExecutionEvent,
)
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from refresh.config import FileSourceConfig
from refresh.errors import Refused
from refstream.atomic import write_bytes_atomic
from refstream.errors import ConfigError, RefstreamError, TerminalError, one_line
from refstream.retry import RetryPolicy

if TYPE_CHECKING:
    from refresh.config import DatasetConfig, RefreshConfig
    from refresh.metrics import RefreshMetrics
    from refresh.runner import RunResult
    from refstream.metrics import MetricsServer

__all__ = ["LOCK", "NEXT_RUNS", "Daemon", "DaemonOptions", "DatasetRunner", "daemon_dir", "run_daemon"]

log = logging.getLogger(__name__)

NEXT_RUNS = "next_runs.json"
LOCK = "daemon.lock"


def daemon_dir(config: RefreshConfig) -> Path:
    return Path(config.state_dir) / "_daemon"


@dataclass(frozen=True)
class DaemonOptions:
    """Knobs of the daemon itself (the datasets' schedules live in the config)."""

    debounce: float = 2.0  # seconds a changed file must stay still before it is refreshed
    workers: int = 2  # refreshes running at once (memory: each holds a snapshot)
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(initial=5.0, maximum=300.0))
    poll: float = 1.0  # how often next_runs.json is checked for changes


_PLAIN, _RECONCILE = 1, 2  # queued request kinds; a reconcile (full diff) covers a plain run


@dataclass
class _DatasetState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: bool = False
    queued: int = 0  # 0, _PLAIN or _RECONCILE
    failures: int = 0  # consecutive transient failures (backoff exponent)


def run_daemon(config: RefreshConfig, stop: threading.Event | None = None,
               options: DaemonOptions | None = None) -> int:
    """Run until ``stop`` is set or SIGTERM/SIGINT arrives (handled when called from the main
    thread); returns the process exit code (0 after a clean stop)."""
    return Daemon(config, options).run(stop)


class DatasetRunner(Protocol):
    """What the daemon needs of :class:`refresh.runner.Refresher`: a run that returns its result
    on success and raises on failure (after recording it)."""

    def run(self, dataset: str, *, reconcile: bool = False, wait: bool = True,
            stop: threading.Event | None = None) -> RunResult: ...


class Daemon:
    """The scheduler, the file watcher and the bookkeeping around :meth:`Refresher.run`.

    ``refresher`` defaults to :class:`refresh.runner.Refresher` of ``config``; any
    :class:`DatasetRunner` works.
    """

    def __init__(self, config: RefreshConfig, options: DaemonOptions | None = None,
                 refresher: DatasetRunner | None = None) -> None:
        self.config = config
        self.options = options or DaemonOptions()
        self.stop = threading.Event()
        self._states = {name: _DatasetState() for name in config.datasets}
        self._refresher = refresher
        self._scheduler: BackgroundScheduler | None = None
        self._jobs_changed = threading.Event()
        # Scheduler changes asked for by job and watcher threads, applied by the main loop: a job
        # thread must never call into the scheduler, whose shutdown() waits for job threads while
        # holding the lock those calls need.
        self._ops: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._written: dict[str, str] | None = None
        self.metrics_server: MetricsServer | None = None  # with ``metrics:``, once running

    # ------------------------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event | None = None) -> int:
        if stop is not None:
            self.stop = stop
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._daemon_lock())
            stack.enter_context(self._signals())
            stack.callback(self._remove_next_runs)

            metrics = self._metrics(stack)
            if self._refresher is None:
                from refresh.runner import Refresher  # late: keeps `refresh --help` fast

                self._refresher = Refresher(self.config, on_run=metrics.observe if metrics else None)

            self._scheduler = BackgroundScheduler(
                executors={"default": ThreadPoolExecutor(max(1, self.options.workers))},
                job_defaults={"max_instances": 1, "coalesce": True},
            )
            self._scheduler.add_listener(
                self._on_job_event,
                EVENT_JOB_ADDED | EVENT_JOB_REMOVED | EVENT_JOB_MODIFIED | EVENT_JOB_SUBMITTED
                | EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED,
            )
            self._add_jobs()
            self._scheduler.start()
            # Shut down before the watcher's callback stops mattering: queued runs see `stop` and
            # return at once, a running one finishes or aborts before its commit.
            stack.callback(self._shutdown_scheduler)
            stack.enter_context(self._watcher())
            log.info("refresh daemon started: %d dataset(s), state in %s", len(self.config.datasets),
                     self.config.state_dir)

            while not self.stop.is_set():
                self._apply_ops()
                try:
                    self._write_next_runs()
                except OSError as exc:  # a full disk must not take the daemon down
                    log.warning("cannot write %s: %s", daemon_dir(self.config) / NEXT_RUNS, exc)
                self._jobs_changed.wait(self.options.poll)
                self._jobs_changed.clear()
            log.info("refresh daemon stopping")
        log.info("refresh daemon stopped")
        return 0

    def _metrics(self, stack: contextlib.ExitStack) -> RefreshMetrics | None:
        """With ``metrics:`` configured: the metrics, and the server of /metrics and the status page."""
        if self.config.metrics is None:
            return None
        from refresh import page
        from refresh.metrics import RefreshMetrics
        from refresh.stores.files import FileStateStore
        from refstream.metrics import MetricsServer

        store = FileStateStore(self.config.state_dir)
        metrics = RefreshMetrics()
        metrics.start_from(store, self.config.datasets)

        def status_page() -> tuple[str, bytes]:
            rows = [(store.read_status(ds), store.read_runs(ds)) for ds in self.config.datasets]
            return "text/html; charset=utf-8", page.render(rows).encode("utf-8")

        self.metrics_server = stack.enter_context(
            MetricsServer(self.config.metrics, metrics.registry, {"/": status_page}))
        return metrics

    @contextlib.contextmanager
    def _daemon_lock(self) -> Iterator[None]:
        d = daemon_dir(self.config)
        d.mkdir(parents=True, exist_ok=True)
        path = d / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise TerminalError(f"another refresh daemon (pid {other}) is running on "
                                    f"{self.config.state_dir}; stop it first") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled in the main thread; the caller owns `stop`
            return
        count = 0

        def handler(signum: int, _frame: object) -> None:
            nonlocal count
            count += 1
            if count > 1:
                # Safe: state is committed only after the broker acknowledged every change.
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(128 + signum)
            log.info("%s received: finishing or aborting running refreshes, then stopping",
                     signal.Signals(signum).name)
            self.stop.set()
            self._jobs_changed.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def _watcher(self) -> Iterator[None]:
        watched = {n: d for n, d in self.config.datasets.items() if d.watch}
        if not watched:
            yield
            return
        from refresh.watch import FileWatcher  # late: watchdog starts an inotify thread

        watcher = FileWatcher(self._on_file_change, debounce=self.options.debounce)
        for name, ds in watched.items():
            if not isinstance(ds.source, FileSourceConfig):
                log.warning("dataset %s: watch is set but its source is not a file; not watching", name)
                continue
            try:
                watcher.add(name, ds.source.path)  # absolute since the config was loaded
            except OSError as exc:
                log.error("dataset %s: %s; refreshed on its schedule only", name, exc)
        with watcher:
            yield

    def _shutdown_scheduler(self) -> None:
        self.stop.set()
        if self._scheduler is not None and self._scheduler.running:
            # Drop the jobs first (this waits for a scheduling pass in flight): APScheduler 3 raises
            # JobLookupError in its own thread when shutdown() races a pass that removes a one-off job.
            self._scheduler.pause()
            self._scheduler.remove_all_jobs()
            self._scheduler.shutdown(wait=True)

    # ------------------------------------------------------------------------------------ scheduling

    def _add_jobs(self) -> None:
        assert self._scheduler is not None
        now = datetime.now(UTC)
        for name, ds in self.config.datasets.items():
            trigger, period = self._trigger(ds)
            if trigger is not None:
                self._scheduler.add_job(self._execute, trigger, args=(name, "schedule"),
                                        id=f"run:{name}", name=f"refresh {name}",
                                        misfire_grace_time=period)
            reconcile = self._reconcile_every(ds)
            if reconcile is not None:
                secs = max(1, int(reconcile.total_seconds()))
                self._scheduler.add_job(self._execute, IntervalTrigger(seconds=secs),
                                        args=(name, "reconcile schedule", True),
                                        id=f"reconcile:{name}", name=f"reconcile {name}",
                                        misfire_grace_time=secs)
            self._once("start", name, now, "start-up")
            log.info("dataset %s: %s%s%s", name,
                     f"every {ds.schedule.every}" if ds.schedule.every else
                     (f"cron '{ds.schedule.cron}'" if ds.schedule.cron else "no schedule"),
                     f", reconcile every {reconcile}" if reconcile is not None else "",
                     ", on file change" if ds.watch else "")

    def _trigger(self, ds: DatasetConfig) -> tuple[BaseTrigger | None, int | None]:
        sched = ds.schedule
        if sched.cron:
            try:
                trigger = CronTrigger.from_crontab(sched.cron)
            except ValueError as exc:
                raise ConfigError(f"{self.config.path}: datasets.{ds.name}.schedule.cron: "
                                  f"{sched.cron!r}: {exc}") from None
            first = trigger.get_next_fire_time(None, datetime.now(UTC))
            second = trigger.get_next_fire_time(first, first) if first else None
            period = int((second - first).total_seconds()) if first and second else 3600
            return trigger, max(1, period)
        if sched.every:
            secs = sched.every.total_seconds()
            return IntervalTrigger(seconds=secs), max(1, int(secs))
        return None, None

    @staticmethod
    def _reconcile_every(ds: DatasetConfig) -> timedelta | None:
        return ds.incremental.reconcile_every if ds.incremental is not None else None

    def _once(self, kind: str, name: str, when: datetime, reason: str, reconcile: bool = False) -> None:
        """A one-off run; never dropped as misfired however long it waits for a worker."""
        assert self._scheduler is not None
        self._scheduler.add_job(self._execute, DateTrigger(run_date=when), args=(name, reason, reconcile),
                                id=f"{kind}:{name}", name=f"{reason} {name}", replace_existing=True,
                                misfire_grace_time=None)

    def _on_file_change(self, name: str) -> None:
        self._defer(lambda: self._once("watch", name, datetime.now(UTC), "file change"))

    def _defer(self, op: Callable[[], None]) -> None:
        self._ops.put(op)
        self._jobs_changed.set()

    def _apply_ops(self) -> None:
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if self.stop.is_set():
                return
            try:
                op()
            except Exception:
                log.exception("scheduler update failed")

    # -------------------------------------------------------------------------------------- running

    def _execute(self, name: str, reason: str, reconcile: bool = False) -> None:
        """Every job lands here; one run of a dataset at a time, later requests queued."""
        st = self._states[name]
        with st.lock:
            if self.stop.is_set():
                return
            if st.running:
                st.queued = max(st.queued, _RECONCILE if reconcile else _PLAIN)
                log.debug("dataset %s already refreshing; %s run queued", name, reason)
                return
            st.running = True
        try:
            while True:
                self._run_once(name, reason, reconcile)
                with st.lock:
                    if self.stop.is_set() or not st.queued:
                        return
                    reconcile, st.queued, reason = st.queued == _RECONCILE, 0, "queued request"
        finally:
            with st.lock:
                st.running = False

    def _run_once(self, name: str, reason: str, reconcile: bool) -> None:
        st = self._states[name]
        what = "reconcile" if reconcile else "refresh"
        log.info("%s %s (%s)", what, name, reason)
        started = time.monotonic()
        assert self._refresher is not None  # set by run()
        try:
            result = self._refresher.run(name, reconcile=reconcile, wait=True, stop=self.stop)
        except Refused as exc:
            # A guard against a partial source: the next run (schedule, file change) reads again.
            st.failures = 0
            log.error("%s of %s refused after %.1fs: %s (nothing published; the dataset keeps its "
                      "schedule)", what, name, time.monotonic() - started, exc)
            return
        except TerminalError as exc:
            st.failures = 0
            log.error("%s of %s failed after %.1fs: %s (not retried until its next schedule or file "
                      "change)", what, name, time.monotonic() - started, exc)
            return
        except Exception as exc:  # transient (database or broker down) or unexpected: retry later
            if self.stop.is_set():
                log.info("%s of %s aborted by shutdown: %s", what, name, exc)
                return
            st.failures += 1
            delay = self.options.retry.backoff(st.failures)
            log.warning("%s of %s failed after %.1fs (%s); retry #%d in %.0fs", what, name,
                        time.monotonic() - started, one_line(exc), st.failures, delay,
                        exc_info=not _is_expected(exc))
            failures = st.failures
            self._defer(lambda: self._schedule_retry(name, delay, reconcile, failures))
            return
        st.failures = 0
        self._defer(lambda: self._cancel("retry", name))
        # The runner logs the run's figures at INFO; this line only ties them to the daemon's trigger.
        log.debug("%s %s: %s rows read, %s inserts, %s updates, %s deletes, %s published, version %s, "
                 "%.1fs", what, name, result.rows, result.inserts, result.updates, result.deletes,
                 result.published, result.version, result.seconds)

    def _schedule_retry(self, name: str, delay: float, reconcile: bool, failures: int) -> None:
        when = datetime.now(UTC) + timedelta(seconds=delay)
        nxt = self._next_run(name, exclude=("retry",))
        if nxt is not None and nxt <= when and not reconcile:
            log.info("dataset %s: next run at %s comes before a retry would", name, nxt.isoformat())
            return
        self._once("retry", name, when, f"retry #{failures}", reconcile)

    def _cancel(self, kind: str, name: str) -> None:
        assert self._scheduler is not None
        with contextlib.suppress(JobLookupError):
            self._scheduler.remove_job(f"{kind}:{name}")

    # ----------------------------------------------------------------------------------- next runs

    def _on_job_event(self, event: JobEvent) -> None:
        # Never touch the scheduler here (it may hold its lock): wake the main loop instead.
        if isinstance(event, JobExecutionEvent) and event.code == EVENT_JOB_ERROR:
            log.error("job %s crashed: %s", event.job_id, event.exception)
        self._jobs_changed.set()

    def _next_run(self, name: str, exclude: tuple[str, ...] = ()) -> datetime | None:
        assert self._scheduler is not None
        times = []
        for job in self._scheduler.get_jobs():
            kind, _, ds = job.id.partition(":")
            if ds == name and kind not in exclude and job.next_run_time is not None:
                times.append(job.next_run_time)
        return min(times) if times else None

    def next_runs(self) -> dict[str, str]:
        """Each dataset's next run (ISO, UTC); datasets with none planned (watch only) are absent."""
        if self._scheduler is None:
            return {}
        out: dict[str, datetime] = {}
        for job in self._scheduler.get_jobs():
            _, _, ds = job.id.partition(":")
            t = job.next_run_time
            if t is not None and (ds not in out or t < out[ds]):
                out[ds] = t
        return {n: out[n].astimezone(UTC).isoformat(timespec="seconds")
                for n in self.config.datasets if n in out}

    def _write_next_runs(self) -> None:
        runs = self.next_runs()
        if runs == self._written:
            return
        write_bytes_atomic(daemon_dir(self.config) / NEXT_RUNS,
                           json.dumps(runs, indent=2, sort_keys=True).encode() + b"\n")
        self._written = runs

    def _remove_next_runs(self) -> None:
        # No daemon, no next runs: status must not show stale times.
        with contextlib.suppress(FileNotFoundError):
            (daemon_dir(self.config) / NEXT_RUNS).unlink()


def _is_expected(exc: BaseException) -> bool:
    return isinstance(exc, RefstreamError)
