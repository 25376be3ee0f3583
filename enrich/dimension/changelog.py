"""Following a changelog topic from the driver with one long-lived consumer.

The refresher publishes each run in one Kafka transaction and this consumer reads ``read_committed``,
so a partition's end as the consumer sees it (its partition-EOF event: the last stable offset) is
always a transaction boundary. :meth:`ChangelogFollower.read_to_end` hands over only records below
the last EOF seen and moves its positions only to EOF offsets: a read cut short (a cap on records
per fetch, a deadline) never pins a position inside a transaction, so no micro-batch sees part of a
refresh. Records fetched beyond the last EOF stay buffered until a later EOF covers them.

Where the end is, is asked with ListOffsets (read_committed: the last stable offset) only to know
that there is more to wait for: some brokers report the base offset of the last record batch + 1
(or 0 while a transaction is open), so the EOF event decides. That question goes through a second
consumer that never fetches: on the reading consumer's connection it waits behind the fetch long-poll
in flight (``fetch.wait.max.ms`` per partition, on every micro-batch's pin: 0.1-0.3 s measured with
three changelogs, 0.5 s with librdkafka's default).
``read_until`` (a replay to recorded positions, themselves boundaries) never overshoots.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from enrich.dimension.abc import Positions, Record
from refstream import kafka as rkafka
from refstream.errors import TransientError

log = logging.getLogger(__name__)

# No progress at all for this long (or the read's timeout, if longer) is a stall (TransientError):
# under load, a first fetch (connect, list offsets, a full fetch to decompress) has taken over a second.
STALL_FLOOR_S = 10.0


class ChangelogFollower:
    """A :class:`~enrich.dimension.abc.ChangeFeed` over a Kafka topic (read_committed)."""

    def __init__(self, settings: Mapping[str, str], topic: str) -> None:
        self.topic = topic
        self.partitions = rkafka.partitions_of(settings, topic)
        if not self.partitions:
            raise TransientError(f"changelog topic {topic} does not exist (yet)")
        overrides: dict[str, Any] = {"fetch.wait.max.ms": "100"}
        self._consumer = rkafka.consumer(settings, **overrides)
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in self.partitions])
        self._ends = rkafka.consumer(settings)  # never assigned: its ListOffsets wait for no fetch
        self._pos: Positions = {p: 0 for p in self.partitions}
        self._eof: dict[int, int] = {p: -1 for p in self.partitions}
        self._buf: dict[int, deque[Record]] = {p: deque() for p in self.partitions}

    def positions(self) -> Positions:
        return dict(self._pos)

    def close(self) -> None:
        self._consumer.close()
        self._ends.close()

    # ------------------------------------------------------------------------------------ reading

    def read_to_end(self, timeout: float) -> list[Record]:
        """Every committed record up to the current end of each partition; positions move only to
        transaction boundaries. Returns early (with what is complete) after ``timeout`` seconds once
        anything has arrived; raises :class:`TransientError` after ``max(timeout, STALL_FLOOR_S)``
        seconds without any progress."""
        target: Positions = {}
        for p in self.partitions:
            try:
                _, high = self._ends.get_watermark_offsets(TopicPartition(self.topic, p),
                                                               timeout=max(timeout, 1.0), cached=False)
            except KafkaException as exc:
                raise TransientError(f"cannot read the end of {self.topic}[{p}]: {exc}") from None
            target[p] = max(high, self._pos[p])
        deadline = time.monotonic() + timeout
        stall = max(timeout, STALL_FLOOR_S)
        last_progress = time.monotonic()
        progressed = False
        while not all(self._settled(p, target[p]) for p in self.partitions):
            got = self._fetch(0.1)
            now = time.monotonic()
            if got:
                last_progress, progressed = now, True
            elif all(self._eof[p] >= target[p] for p in self.partitions):
                break  # the end is reached; records beyond it are still arriving: wait for their EOF later
            elif now - last_progress > stall:  # known records that do not come: broker gone?
                raise TransientError(
                    f"changelog {self.topic}: no progress towards offsets {target} for {stall:.0f}s "
                    f"(at {self.positions()})")
            # A read that has seen nothing yet waits on (up to the stall limit): a short deadline
            # is for cutting a long read, not for calling a slow first fetch a stall.
            if now > deadline and progressed:
                log.debug("changelog %s: end not reached in %.1fs; stopping at %s", self.topic, timeout,
                          {p: self._eof[p] for p in self.partitions})
                break
        return self._take_committed()

    def _settled(self, p: int, target: int) -> bool:
        """Has ``p`` reported EOF at or beyond ``target`` and beyond every record fetched so far?"""
        buf = self._buf[p]
        return self._eof[p] >= target and (not buf or buf[-1].offset < self._eof[p])

    def pending(self) -> int:
        return sum(len(buf) for buf in self._buf.values())

    def _take_committed(self) -> list[Record]:
        """Buffered records below each partition's last EOF; the position moves to that EOF (a
        transaction boundary). Records beyond it stay buffered."""
        out: list[Record] = []
        for p in self.partitions:
            buf, end = self._buf[p], self._eof[p]
            while buf and buf[0].offset < end:
                out.append(buf.popleft())
            self._pos[p] = max(self._pos[p], end)
        return out

    def read_until(self, target: Mapping[int, int], timeout: float) -> list[Record]:
        out: list[Record] = []
        last_progress = time.monotonic()
        while True:
            pending = [p for p in self.partitions if not self._take(p, target.get(p, 0), out)]
            if not pending:
                return out
            got = self._fetch(0.1)
            if got:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > timeout:
                raise TransientError(
                    f"changelog {self.topic}: no progress towards offsets "
                    f"{ {p: target.get(p, 0) for p in pending} } for {timeout:.0f}s "
                    f"(at {self.positions()})")

    def read_until_available(self, target: Mapping[int, int], timeout: float, *, grace: float = 2.0
                             ) -> tuple[list[Record], Positions]:
        """:meth:`read_until`, except that a partition that ends below its target (records removed
        since the target was recorded: the topic was recreated or emptied) stops at its end instead
        of failing after ``timeout``. At its end means: partition EOF at the current position and
        no record fetched for ``grace`` seconds. Returns the records and ``{partition: end}`` of the
        partitions that ended short."""
        out: list[Record] = []
        short: Positions = {}
        last_progress = time.monotonic()
        while True:
            pending = [p for p in self.partitions
                       if p not in short and not self._take(p, target.get(p, 0), out)]
            if not pending:
                return out, short
            if self._fetch(0.1):
                last_progress = time.monotonic()
                continue
            idle = time.monotonic() - last_progress
            if idle > grace:
                for p in pending:
                    if not self._buf[p] and 0 <= self._eof[p] <= self._pos[p]:
                        short[p] = self._pos[p]
            if idle > timeout:
                raise TransientError(f"changelog {self.topic}: no progress towards offsets "
                                     f"{ {p: target.get(p, 0) for p in pending} } for {timeout:.0f}s "
                                     f"(at {self.positions()})")

    def _take(self, p: int, upto: int, out: list[Record]) -> bool:
        """Move buffered records of ``p`` below ``upto`` to ``out``; True when ``p`` reached ``upto``."""
        buf = self._buf[p]
        while buf and buf[0].offset < upto:
            rec = buf.popleft()
            out.append(rec)
            self._pos[p] = rec.offset + 1
        if self._pos[p] >= upto:
            return True
        if buf:  # the next fetched record is at or beyond upto: a gap (control record) below it
            self._pos[p] = upto
            return True
        if self._eof[p] >= upto:  # every record below the watermark was delivered
            self._pos[p] = upto
            return True
        return False

    def _fetch(self, timeout: float) -> int:
        msgs = self._consumer.consume(10_000, timeout=timeout)
        n = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._eof[rkafka.partition_of(m)] = rkafka.offset_of(m)
                    n += 1
                    continue
                if err.retriable() or err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
                    log.warning("changelog %s: %s", self.topic, err)
                    continue
                raise TransientError(f"changelog {self.topic}: {err}")
            part = rkafka.partition_of(m)
            self._buf[part].append(Record(part, rkafka.offset_of(m), m.key(), m.value(), m.headers() or [],
                                         _timestamp_ms(m)))
            n += 1
        return n


def _timestamp_ms(m: Message) -> int | None:
    kind, ts = m.timestamp()
    return ts if kind != TIMESTAMP_NOT_AVAILABLE and ts >= 0 else None
