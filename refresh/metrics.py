"""The refresher daemon's Prometheus metrics (served with ``refstream.metrics.MetricsServer``).

Gauges start from what the state directory says at the daemon's start (the last success, rows and
version of every dataset), so a restarted daemon reports the truth before its first run; counters
count the runs of this process, as Prometheus counters do.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from refresh.stores.abc import RunOutcome, RunRecord, StateStore

__all__ = ["DURATION_BUCKETS", "RefreshMetrics"]

#: Run durations: a small table refreshes in well under a second, a large one in minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class RefreshMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.last_success = Gauge("refstream_refresh_last_success_timestamp_seconds",
                                  "When the dataset's last successful run finished (Unix time)", ["dataset"], registry=r)
        self.runs = Counter("refstream_refresh_runs", "Runs by result (ok, failed, interrupted, refused)",
                            ["dataset", "result"], registry=r)
        self.changes = Counter("refstream_refresh_changes", "Changes published (upsert, delete)",
                               ["dataset", "op"], registry=r)
        self.duration = Histogram("refstream_refresh_run_duration_seconds", "Run duration, every result",
                                  ["dataset"], buckets=DURATION_BUCKETS, registry=r)
        self.rows = Gauge("refstream_refresh_rows", "Rows in the dataset's last published snapshot", ["dataset"],
                          registry=r)
        self.version = Gauge("refstream_refresh_version", "The dataset's last published version", ["dataset"],
                             registry=r)

    def start_from(self, store: StateStore, datasets: Iterable[str]) -> None:
        """Every dataset's series, the gauges from the state directory (counters at 0)."""
        for ds in datasets:
            for result in get_args(RunOutcome):
                self.runs.labels(ds, result)
            for op in ("upsert", "delete"):
                self.changes.labels(ds, op)
            self.duration.labels(ds)
            state, status = store.load(ds), store.read_status(ds)
            self.rows.labels(ds).set(state.rows)
            self.version.labels(ds).set(state.version)
            if status.last_success is not None:
                self.last_success.labels(ds).set(_epoch(status.last_success.finished))

    def observe(self, run: RunRecord) -> None:
        """Count one recorded run (:attr:`refresh.runner.Refresher.on_run`)."""
        r = run.result
        ds = r.dataset
        self.runs.labels(ds, r.outcome).inc()
        self.duration.labels(ds).observe(r.seconds)
        if r.ok:
            self.changes.labels(ds, "upsert").inc(r.inserts + r.updates)
            self.changes.labels(ds, "delete").inc(r.deletes)
            self.rows.labels(ds).set(r.rows)
            self.version.labels(ds).set(r.version)
            self.last_success.labels(ds).set(_epoch(run.finished))


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()
