"""The ``refstream-kafka`` streaming source: Spark's Kafka source rebuilt on the Python Data Source API.

Driver side (:class:`KafkaStreamReader`, one long-lived instance per query): discovers partitions,
finds end offsets with :class:`~enrich.source.offsets.EndOffsetProbe`, applies admission control
(``maxOffsetsPerTrigger`` through ``latestOffset(start, limit)``) and plans one task per partition
range. Executor side (:func:`~enrich.source.fetch.read_range`): reads each range exactly into Arrow
batches. Spark checkpoints the offsets; the source keeps no state of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import KafkaException, TopicCollection
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from enrich.source.fetch import RANGE_DDL, SCHEMA_DDL, OffsetRange, range_batch, read_range
from enrich.source.offsets import (
    TP,
    EndOffsetProbe,
    ProbeResult,
    check_reset,
    check_retention,
    from_json_offsets,
    rate_limit,
    resolve_start,
    starts_of,
    to_json_offsets,
    topic_ids_of,
)
from enrich.source.options import SourceOptions
from enrich.worker import settle
from refstream.errors import TransientError
from refstream.kafka import admin

log = logging.getLogger(__name__)

FORMAT = "refstream-kafka"
_ZERO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"  # the null Uuid: a broker that gives topics no id


class KafkaDataSource(DataSource):
    """``spark.readStream.format("refstream-kafka")``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return RANGE_DDL if SourceOptions.parse(self.options).ranges else SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(SourceOptions.parse(self.options))

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaBatchReader(SourceOptions.parse(self.options))


class KafkaBatchReader(DataSourceReader):
    """``spark.read.format("refstream-kafka")``: every committed record of the subscribed topics from
    each partition's log start to its end when planned (``startingOffsets`` is not read), in
    ``splits`` tasks per partition. Used by the job to scan a changelog on the executors
    (``enrich.joins.partitioned.published_schema``)."""

    def __init__(self, options: SourceOptions, splits: int = 1) -> None:
        self.options, self.splits = options, max(1, splits)

    def partitions(self) -> Sequence[InputPartition]:
        probe = EndOffsetProbe(self.options.settings)
        try:
            res = probe.probe(probe.partitions(self.options.topics))
        finally:
            probe.close()
        out: list[InputPartition] = []
        for (topic, part), end in sorted(res.end.items()):
            lo = max(res.low.get((topic, part), 0), 0)
            step = max(1, -(-(end - lo) // self.splits))
            out.extend(OffsetRange(topic, part, a, min(a + step, end)) for a in range(lo, end, step))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, OffsetRange):  # no partitions planned: Spark reads one empty one
            return iter(())
        settle()
        return read_range(self.options.settings, partition, poll_timeout_s=self.options.poll_timeout_s,
                          fail_on_data_loss=self.options.fail_on_data_loss)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets: ``{topic: {partition: next offset}}``. Pickled to executors for :meth:`read`, so
    the driver-side probe is created lazily and never pickled."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._probe: EndOffsetProbe | None = None
        self._available_now: dict[TP, int] | None = None
        self._latest: dict[TP, int] | None = None
        self.lost: dict[TP, int] = {}  # offsets skipped as deleted (failOnDataLoss=false), per partition
        self._silent_since: float | None = None  # monotonic time of the first unanswered trigger

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_probe": None, "_available_now": None, "_latest": None, "lost": {},
                "_silent_since": None}

    # -- driver side -------------------------------------------------------------------------------

    @property
    def _request_timeout(self) -> float:
        """Of the driver's metadata requests: 10 s, or the poll timeout when that is shorter."""
        return min(10.0, self.options.poll_timeout_s)

    def _prober(self) -> EndOffsetProbe:
        if self._probe is None:
            self._probe = EndOffsetProbe(self.options.settings, timeout=self._request_timeout)
        return self._probe

    def _ends(self, known: dict[TP, int]) -> ProbeResult:
        """End, log start and high watermark of every current partition of the subscribed topics."""
        probe = self._prober()
        return probe.probe(probe.partitions(self.options.topics), known)

    def _topic_ids(self) -> dict[str, str]:
        """The broker's id of each subscribed topic that has one (a recreated topic gets a new id)."""
        client = admin(self.options.settings)
        out: dict[str, str] = {}
        try:
            futures = client.describe_topics(TopicCollection(list(self.options.topics)),
                                             request_timeout=self._request_timeout)
        except KafkaException as exc:
            log.debug("describe_topics failed: %s", exc)
            return out
        for topic, fut in futures.items():
            try:
                tid = fut.result().topic_id
            except KafkaException:  # missing topic, or a broker without the API: unknown
                continue
            if tid is not None and str(tid) != _ZERO_TOPIC_ID:
                out[topic] = str(tid)
        return out

    def initialOffset(self) -> dict:
        offsets = resolve_start(self._prober(), self.options.topics, self.options.starting)
        log.info("initial offsets of %s: %s", ",".join(self.options.topics), offsets)
        return to_json_offsets(offsets, topic_ids=self._topic_ids())

    def prepareForTriggerAvailableNow(self) -> None:
        # Trigger.AvailableNow: stop at what exists now, however many batches admission control needs.
        self._available_now = self._ends({}).end
        log.info("available-now target offsets: %s", self._available_now)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next batch. A broker that does not answer (a restart, a network cut) means
        no new batch this trigger: the query waits for it, logging once, up to the poll timeout
        (``kafkaConsumer.pollTimeoutMs``), and then fails. An available-now run fails at once: it
        would otherwise end early, taking an unanswered trigger for the end of the input."""
        try:
            end = self._latest_offset(start, limit)
        except TransientError as exc:
            if self._available_now is not None:
                raise
            now, topics = time.monotonic(), ",".join(self.options.topics)
            if self._silent_since is None:
                self._silent_since = now
                log.warning("%s: the broker does not answer (%s); no new batch until it does, for at most %.0fs",
                            topics, exc, self.options.poll_timeout_s)
            elif now - self._silent_since > self.options.poll_timeout_s:
                raise TransientError(f"{topics}: the broker has not answered for {now - self._silent_since:.0f}s "
                                     f"(kafkaConsumer.pollTimeoutMs): {exc}") from None
            return start
        if self._silent_since is not None:
            log.warning("%s: the broker answers again after %.0fs", ",".join(self.options.topics),
                        time.monotonic() - self._silent_since)
            self._silent_since = None
        return end

    def _latest_offset(self, start: dict, limit: ReadLimit) -> dict:
        begin = from_json_offsets(start)
        old_ids = topic_ids_of(start)
        # A topic whose id cannot be read now keeps the one recorded (a deleted topic has none).
        ids = {**old_ids, **self._topic_ids()}
        res = self._ends(begin)
        present = {tp: off for tp, off in begin.items() if tp in res.end}
        starts = check_reset(present, low=res.low, high=res.high, old_ids=old_ids, ids=ids,
                             on_reset=self.options.on_offset_reset)
        skipped, lost = check_retention({tp: off for tp, off in present.items() if tp not in starts}, res.low,
                                        fail_on_data_loss=self.options.fail_on_data_loss)
        starts.update(skipped)
        for tp, n in lost.items():
            self.lost[tp] = self.lost.get(tp, 0) + n
        if lost:
            log.warning("offsets lost to retention and skipped since the query started: %d (%s)",
                        sum(self.lost.values()), {f"{t}/{p}": n for (t, p), n in sorted(self.lost.items())})
        first = {**begin, **starts}  # where this batch's range of each partition begins
        end = res.end
        if self._available_now is not None:
            # Partitions created after the target was taken start at 0 and wait for the next run.
            end = {tp: min(off, self._available_now.get(tp, 0)) for tp, off in end.items()}
        # New partitions start at their beginning; a partition never moves backwards (a reset one
        # moves through ``starts``, recorded in the end offsets for :meth:`partitions`).
        end = {tp: max(off, first.get(tp, 0)) for tp, off in end.items()}
        for tp in starts:
            if tp in res.high:  # a reset partition ends at its high watermark at most, whatever was known
                end[tp] = max(min(end[tp], res.high[tp]), starts[tp])
        for tp, off in begin.items():
            end.setdefault(tp, off)  # a partition that vanished from metadata keeps its position
        self._latest = dict(end)
        if isinstance(limit, ReadMaxRows):
            end = rate_limit({tp: first.get(tp, 0) for tp in end}, end, limit.max_rows)
        return to_json_offsets(end, topic_ids=ids, starts=starts)

    def reportLatestOffset(self) -> dict | None:
        return to_json_offsets(self._latest) if self._latest is not None else None

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        begin = {**from_json_offsets(start), **starts_of(end)}
        out: list[InputPartition] = []
        split = self.options.max_records_per_partition
        for (topic, part), stop in sorted(from_json_offsets(end).items()):
            lo = begin.get((topic, part), 0)
            if stop <= lo:
                continue
            step = split or stop - lo
            for a in range(lo, stop, step):
                out.append(OffsetRange(topic, part, a, min(a + step, stop)))
        return out

    def commit(self, end: dict) -> None:
        # Spark's checkpoint is the source of truth; nothing to commit on the Kafka side.
        pass

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    # -- executor side -----------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange)
        if self.options.ranges:
            return iter([range_batch(partition)])
        settle()
        return read_range(self.options.settings, partition, poll_timeout_s=self.options.poll_timeout_s,
                          fail_on_data_loss=self.options.fail_on_data_loss)
