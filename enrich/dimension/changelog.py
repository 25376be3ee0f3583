"""Following a changelog topic from the driver with one long-lived consumer.

The end of a partition is the larger of what ListOffsets reports and what the last partition-EOF
event said (EOF comes from the high watermark of a Fetch response, which is right on every broker;
ListOffsets alone is not: some brokers report the base offset of the last record batch + 1).
Records fetched beyond a requested position are kept for later, so ``read_until`` never overshoots.
``read_to_end`` goes on past the reported end until partition EOF (or an empty fetch), so records of
the last batch beyond an understated end are applied now, not one micro-batch later.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from enrich.dimension.abc import Positions, Record
from refstream import kafka as rkafka
from refstream.errors import TransientError

log = logging.getLogger(__name__)


class ChangelogFollower:
    """A :class:`~enrich.dimension.abc.ChangeFeed` over a Kafka topic (read_committed)."""

    def __init__(self, settings: Mapping[str, str], topic: str) -> None:
        self.topic = topic
        self.partitions = rkafka.partitions_of(settings, topic)
        if not self.partitions:
            raise TransientError(f"changelog topic {topic} does not exist (yet)")
        self._consumer = rkafka.consumer(settings, **{"fetch.wait.max.ms": "100"})
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in self.partitions])
        self._pos: Positions = {p: 0 for p in self.partitions}
        self._eof: dict[int, int] = {p: -1 for p in self.partitions}
        self._buf: dict[int, deque[Record]] = {p: deque() for p in self.partitions}

    def positions(self) -> Positions:
        return dict(self._pos)

    def close(self) -> None:
        self._consumer.close()

    # ------------------------------------------------------------------------------------ reading

    def read_to_end(self, timeout: float) -> list[Record]:
        target: Positions = {}
        for p in self.partitions:
            try:
                _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                               timeout=timeout, cached=False)
            except KafkaException as exc:
                raise TransientError(f"cannot read the end of {self.topic}[{p}]: {exc}") from None
            target[p] = max(high, self._pos[p])
        out = self.read_until(target, timeout)
        # ListOffsets may understate the end (the rest of the last record batch is beyond it): read on
        # until every partition has reported EOF at its position, or a fetch comes back empty (the
        # fetched data is drained; on a topic written continuously EOF may never come).
        deadline = time.monotonic() + timeout
        while True:
            out.extend(self._take_all())
            if all(self._eof[p] >= self._pos[p] for p in self.partitions):
                return out
            if not self._fetch(0.1) or time.monotonic() > deadline:
                out.extend(self._take_all())
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

    def _take_all(self) -> list[Record]:
        out: list[Record] = []
        for p in self.partitions:
            buf = self._buf[p]
            while buf:
                rec = buf.popleft()
                out.append(rec)
                self._pos[p] = rec.offset + 1
            self._pos[p] = max(self._pos[p], self._eof[p])
        return out

    def _fetch(self, timeout: float) -> int:
        msgs = self._consumer.consume(10_000, timeout=timeout)
        n = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._eof[m.partition()] = m.offset()
                    n += 1
                    continue
                if err.retriable() or err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
                    log.warning("changelog %s: %s", self.topic, err)
                    continue
                raise TransientError(f"changelog {self.topic}: {err}")
            self._buf[m.partition()].append(
                Record(m.partition(), m.offset(), m.key(), m.value(), m.headers() or []))
            n += 1
        return n
