"""The job's metrics from what the driver has (``enrich.metrics``): here, the watermark from a progress."""

from __future__ import annotations

from datetime import UTC, datetime

from enrich.metrics import EnrichMetrics


def test_the_watermark_comes_from_the_progress_once_spark_has_one() -> None:
    metrics = EnrichMetrics()
    value = metrics.registry.get_sample_value
    # Before the first watermark Spark reports the epoch; a query without one reports none at all.
    for event_time in (None, {}, {"watermark": "1970-01-01T00:00:00.000Z"}, {"watermark": "soon"}):
        metrics.event_time(event_time)
        assert value("refstream_enrich_watermark_seconds") is None
    metrics.event_time({"avg": "2026-01-01T00:03:00.000Z", "watermark": "2026-01-01T00:01:30.250Z"})
    assert value("refstream_enrich_watermark_seconds") == datetime(2026, 1, 1, 0, 1, 30, 250000, tzinfo=UTC).timestamp()
