"""Follow the enriched output topic and tell when an expected event shows up.

The operator registers an :class:`Expectation` *before* changing anything, then waits on it: the
first enriched event read after registration that satisfies the predicate fulfils it, and the time
between the change and that read is the change's end-to-end latency.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

from refstream.kafka import consumer, partitions_of

log = logging.getLogger(__name__)

Event = dict[str, Any]


class Expectation:
    """An enriched event the demo waits for."""

    def __init__(self, description: str, predicate: Callable[[Event], bool]) -> None:
        self.description = description
        self.predicate = predicate
        self.registered = time.monotonic()
        self.started: float | None = None  # when the change was made (set by the operator)
        self.seen_at: float | None = None
        self.event: Event | None = None
        self._done = threading.Event()

    def mark_started(self) -> None:
        self.started = time.monotonic()

    def offer(self, event: Event, now: float) -> None:
        if not self._done.is_set() and self.predicate(event):
            self.event, self.seen_at = event, now
            self._done.set()

    def wait(self, timeout: float, stop: threading.Event | None = None) -> float | None:
        """Seconds from the change to the event, or None when it did not show up in ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._done.wait(0.1):
                return (self.seen_at or 0.0) - (self.started or self.registered)
            if stop is not None and stop.is_set():
                return None
        return None


class EnrichedTail:
    """A background consumer of the enriched topic (every partition, from the beginning)."""

    def __init__(self, settings: Mapping[str, str], topic: str,
                 on_correction: Callable[[Event], None] | None = None) -> None:
        self.settings, self.topic = dict(settings), topic
        #: Enriched events read (corrections of events written earlier are counted apart).
        self.count = 0
        self.corrections = 0
        self.on_correction = on_correction
        self.last: Event | None = None
        #: The latest enriched event read of each device.
        self.latest: dict[str, Event] = {}
        self._expect: list[Expectation] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> EnrichedTail:
        self._thread = threading.Thread(target=self._run, name="enriched-tail", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def expect(self, description: str, predicate: Callable[[Event], bool]) -> Expectation:
        exp = Expectation(description, predicate)
        with self._lock:
            self._expect.append(exp)
        return exp

    def _run(self) -> None:
        try:
            self._consume()
        except BaseException as exc:  # noqa: BLE001 - reported by the operator's next wait
            log.exception("tail of %s failed", self.topic)
            self.error = exc

    def _consume(self) -> None:
        parts: list[int] = []
        while not parts and not self._stop.is_set():
            parts = partitions_of(self.settings, self.topic)
            if not parts:
                self._stop.wait(0.5)
        # librdkafka's own log lines go to the demo's log file, not over the story on the terminal.
        overrides: dict[str, Any] = {"enable.partition.eof": False, "logger": log}
        c = consumer(self.settings, **overrides)
        try:
            c.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
            while not self._stop.is_set():
                msgs = c.consume(1000, timeout=0.2)
                now = time.monotonic()
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("reading %s: %s", self.topic, err)
                        continue
                    self._offer(m.value(), now)
        finally:
            c.close()

    def _offer(self, value: bytes | None, now: float) -> None:
        if value is None:
            return
        try:
            event = json.loads(value)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if event.get("_kind") == "correction":  # an event written earlier, again: not the device's latest
            self.corrections += 1
            if self.on_correction is not None:
                self.on_correction(event)
        else:
            self.count += 1
            self.last = event
            device = event.get("device_id")
            if isinstance(device, str):
                self.latest[device] = event
        with self._lock:
            pending = [e for e in self._expect if e.seen_at is None]
            self._expect = pending
        for exp in pending:
            # Only events read after the change can show it.
            if exp.started is not None:
                exp.offer(event, now)
