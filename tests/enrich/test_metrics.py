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


def test_calls_are_counted_by_call_and_result_once_there_are_calls() -> None:
    m = EnrichMetrics()
    assert m.registry.get_sample_value("refstream_enrich_calls_total", {"call": "risk", "result": "ok"}) is None
    m.calls_made({("risk", "ok"): 3, ("risk", "retried"): 2})
    m.calls_made({("risk", "ok"): 1, ("action", "replayed"): 4})
    value = m.registry.get_sample_value
    assert value("refstream_enrich_calls_total", {"call": "risk", "result": "ok"}) == 4
    assert value("refstream_enrich_calls_total", {"call": "risk", "result": "retried"}) == 2
    assert value("refstream_enrich_calls_total", {"call": "action", "result": "replayed"}) == 4


def test_gap_records_are_counted_by_kind_and_the_devices_without_an_interval() -> None:
    m = EnrichMetrics()
    value = m.registry.get_sample_value
    assert value("refstream_enrich_gaps_total", {"kind": "opened"}) is None
    m.gap_records({}, 0)  # the first batch shows every kind at 0
    assert value("refstream_enrich_gaps_total", {"kind": "source_idle"}) == 0
    m.gap_records({"opened": 2, "retracted": 1}, 3)
    m.gap_records({"opened": 1}, 1)
    assert value("refstream_enrich_gaps_total", {"kind": "opened"}) == 3
    assert value("refstream_enrich_gaps_total", {"kind": "retracted"}) == 1
    assert value("refstream_enrich_gaps_skipped_total", {"reason": "no_interval"}) == 4
