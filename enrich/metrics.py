"""The job's Prometheus metrics (served with ``refstream.metrics.MetricsServer``), updated by the
driver once per micro-batch from what it has anyway: the sink's per-task counts, the dimensions it
pinned, the query's last progress. Nothing per event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from enrich.gaps.engine import KINDS as GAP_KINDS
from enrich.rollups.packs import RESULTS as ROLLUP_RESULTS
from enrich.source.offsets import from_json_offsets

#: ``refstream_enrich_events_total``'s results; ``unmatched`` and ``late`` count among ``enriched``.
RESULTS = ("enriched", "unmatched", "late", "dead_letter")
BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class EnrichMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, results: Iterable[str] = RESULTS,
                 rollups: Iterable[str] = ()) -> None:
        """``results``: the results of ``refstream_enrich_events_total`` counted (shown from the start);
        ``rollups``: the rollups' names (``refstream_enrich_rollup_events_total``, shown from the start)."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter("refstream_enrich_events", "Events by result: enriched (written to the output), "
                              "unmatched and late (among enriched: some join found no row; later than the "
                              "watermark), dead_letter; counted by the Kafka sink's tasks, see the README for "
                              "the other sinks", ["result"], registry=r)
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
        self.devices: Gauge | None = None  # with state: only, once the count is known
        self.watermark: Gauge | None = None  # with state: only, once Spark has one
        self.calls: Counter | None = None  # with calls: only
        self.corrected: Counter | None = None  # with corrections: only, from the first batch
        self.gaps: Counter | None = None  # with gaps: only, from the first batch
        self._changed_ms: dict[str, int | None] = {}
        for result in results:
            self.events.labels(result)
        self.rollups: Counter | None = None
        names = list(rollups)
        if names:
            self.rollups = Counter("refstream_enrich_rollup_events", "Events by rollup and result: counted (into a "
                                   "window not final yet), corrected (into a final window: a correction), "
                                   "beyond_horizon (a dead letter: its window is past the rollup's correct_for)",
                                   ["rollup", "result"], registry=r)
            for name in names:
                for result in ROLLUP_RESULTS:
                    self.rollups.labels(name, result)

    def after_batch(self, seconds: float, *, enriched: int | None, dead: int, unmatched: int | None = None,
                    late: int | None = None, dimensions: Mapping[str, tuple[int, int, int | None]]) -> None:
        """One committed batch: its duration, counts (None: not counted), and per dataset (version,
        rows, changed_ms)."""
        self.batch.observe(seconds)
        for result, n in (("enriched", enriched), ("unmatched", unmatched), ("late", late), ("dead_letter", dead)):
            if n is not None:
                self.events.labels(result).inc(n)
        for ds, (version, rows, changed_ms) in dimensions.items():
            self.version.labels(ds).set(version)
            self.rows.labels(ds).set(rows)
            self._changed_ms[ds] = changed_ms
        self.refresh_ages()

    def devices_in_state(self, devices: int | None) -> None:
        """Set ``refstream_enrich_devices_in_state``; None (unknown) leaves it as it is (not exported
        while it was never known)."""
        if devices is None:
            return
        if self.devices is None:
            self.devices = Gauge("refstream_enrich_devices_in_state", "Devices in the state store after the last "
                                 "batch (counted exactly, also across task retries: each bucket's call reports its "
                                 "absolute count)", registry=self.registry)
        self.devices.set(devices)

    def gap_records(self, kinds: Mapping[str, int], no_interval: int) -> None:
        """Add a batch's gap records by kind to ``refstream_enrich_gaps_total`` and its devices without
        an expected interval to ``refstream_enrich_gaps_skipped_total{reason="no_interval"}``."""
        if self.gaps is None:
            self.gaps = Counter("refstream_enrich_gaps", "Gap records written, by kind: opened, closed, retracted "
                                "(a device's silence), source_idle, source_resumed (a source partition's)",
                                ["kind"], registry=self.registry)
            self.gaps_skipped = Counter("refstream_enrich_gaps_skipped", "Devices with events in a batch whose "
                                        "expected interval is null (no gaps for them), once per batch",
                                        ["reason"], registry=self.registry)
            for kind in GAP_KINDS:
                self.gaps.labels(kind)
            self.gaps_skipped.labels("no_interval")
        for kind, n in kinds.items():
            self.gaps.labels(kind).inc(n)
        self.gaps_skipped.labels("no_interval").inc(no_interval)

    def rollup_events(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Add a batch's rollup counts, by ``(rollup, result)``, to ``refstream_enrich_rollup_events_total``."""
        if self.rollups is None:
            return
        for (rollup, result), n in counts.items():
            self.rollups.labels(rollup, result).inc(n)

    def corrections(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Add a batch's late versions, by ``(dataset, result)``, to ``refstream_enrich_corrections_total``."""
        if self.corrected is None:
            self.corrected = Counter("refstream_enrich_corrections", "Versions of a corrected dataset that reached "
                                     "the job after events they apply to were written, by dataset and result: "
                                     "corrected (those events were written again as corrections), beyond_horizon "
                                     "(some were older than the horizon and were not), unchanged (the joined "
                                     "columns were as written)", ["dataset", "result"], registry=self.registry)
        for (dataset, result), n in counts.items():
            self.corrected.labels(dataset, result).inc(n)

    def calls_made(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Add a batch's call counts, by ``(call, result)``, to ``refstream_enrich_calls_total``."""
        if self.calls is None:
            self.calls = Counter("refstream_enrich_calls", "External calls by call and result: ok, error, timeout "
                                 "(the last try timed out), retried (tries after the first), replayed (a response "
                                 "recorded by an earlier attempt of the batch, reused), skipped (circuit breaker "
                                 "open or the batch's budget spent)", ["call", "result"],
                                 registry=self.registry)
        for (call, result), n in counts.items():
            self.calls.labels(call, result).inc(n)

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

    def event_time(self, event_time: Mapping[str, Any] | None) -> None:
        """Set ``refstream_enrich_watermark_seconds`` from a ``StreamingQueryProgress``'s ``eventTime``:
        the watermark its batch ran with. Not exported before the query has one (Spark reports the
        epoch), nor without a watermark at all (no ``state:``)."""
        value = (event_time or {}).get("watermark")
        if not isinstance(value, str):
            return
        try:
            seconds = datetime.fromisoformat(value).timestamp()
        except ValueError:
            return
        if seconds <= 0:
            return
        if self.watermark is None:
            self.watermark = Gauge("refstream_enrich_watermark_seconds", "Event-time watermark of the state step "
                                   "(greatest event time seen, dead letters left out, minus state.watermark), "
                                   "from the query's last progress", registry=self.registry)
        self.watermark.set(seconds)


def _offsets(value: Any) -> dict[tuple[str, int], int]:
    if value is None:
        return {}
    try:
        obj = json.loads(value) if isinstance(value, str) else value
        return from_json_offsets(obj) if isinstance(obj, dict) else {}
    except (ValueError, TypeError, AttributeError):
        return {}
