"""The job's Prometheus metrics (served with ``refstream.metrics.MetricsServer``), updated by the
driver once per micro-batch from what it has anyway: the sink's per-task counts, the dimensions it
pinned, the query's last progress. Nothing per event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from enrich.kafka.offsets import from_json_offsets

BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class EnrichMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter("refstream_enrich_events", "Events written by result (enriched, dead_letter)",
                              ["result"], registry=r)
        self.batch = Histogram("refstream_enrich_batch_duration_seconds", "Micro-batch duration on the driver",
                               buckets=BATCH_BUCKETS, registry=r)
        self.version = Gauge("refstream_enrich_dimension_version", "Refresher version of the dimension the last "
                             "batch used", ["dataset"], registry=r)
        self.age = Gauge("refstream_enrich_dimension_age_seconds", "Now minus the publish time of the newest "
                         "change (or heartbeat) the job applied", ["dataset"], registry=r)
        self.rows = Gauge("refstream_enrich_dimension_rows", "Rows of the dimension the last batch used",
                          ["dataset"], registry=r)
        self.lag = Gauge("refstream_enrich_input_lag_records", "Events topic end offset minus processed offset "
                         "(from the query's last progress)", ["partition"], registry=r)
        self._changed_ms: dict[str, int | None] = {}
        for result in ("enriched", "dead_letter"):
            self.events.labels(result)

    def after_batch(self, seconds: float, *, enriched: int | None, dead: int,
                    dimensions: Mapping[str, tuple[int, int, int | None]]) -> None:
        """One committed batch: its duration, counts, and per dataset (version, rows, changed_ms)."""
        self.batch.observe(seconds)
        if enriched is not None:
            self.events.labels("enriched").inc(enriched)
        self.events.labels("dead_letter").inc(dead)
        for ds, (version, rows, changed_ms) in dimensions.items():
            self.version.labels(ds).set(version)
            self.rows.labels(ds).set(rows)
            self._changed_ms[ds] = changed_ms
        self.refresh_ages()

    def refresh_ages(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for ds, changed in self._changed_ms.items():
            if changed is not None:
                self.age.labels(ds).set(max(0.0, now - changed / 1000))

    def progress(self, sources: Iterable[Mapping[str, Any]]) -> None:
        """Input lag from a ``StreamingQueryProgress``'s sources (``endOffset`` vs ``latestOffset``)."""
        for src in sources:
            end, latest = _offsets(src.get("endOffset")), _offsets(src.get("latestOffset"))
            for (topic, part), top in latest.items():
                self.lag.labels(f"{topic}/{part}").set(max(0, top - end.get((topic, part), 0)))


def _offsets(value: Any) -> dict[tuple[str, int], int]:
    if value is None:
        return {}
    try:
        obj = json.loads(value) if isinstance(value, str) else value
        return from_json_offsets(obj) if isinstance(obj, dict) else {}
    except (ValueError, TypeError, AttributeError):
        return {}
