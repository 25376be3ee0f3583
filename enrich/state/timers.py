"""Event time in the keyed steps (``transformWithStateInPandas``, event-time mode): the batch's
watermark as the steps reckon it, and a group's one timer."""

from __future__ import annotations

from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle, TimerValues

__all__ = ["keep_one_timer", "watermark_us"]


def watermark_us(timer_values: TimerValues) -> int | None:
    """The batch's event-time watermark in microseconds; None before the first one (Spark reports 0)."""
    ms = timer_values.getCurrentWatermarkInMs()
    return ms * 1000 if ms > 0 else None


def keep_one_timer(handle: StatefulProcessorHandle, due_us: int | None) -> None:
    """The group's timers made exactly one, at ``due_us`` (milliseconds rounded up: never early), or
    none; left alone when already so (most batches: two state-server calls saved)."""
    want = [-(-due_us // 1000)] if due_us is not None else []
    timers = list(handle.listTimers())
    if timers == want:
        return
    for timer in timers:
        handle.deleteTimer(timer)
    for timer in want:
        handle.registerTimer(timer)
