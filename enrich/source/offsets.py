"""Kafka offsets as Spark checkpoints them, admission control, and the driver-side end-offset probe.

Offset JSON (what Spark writes to ``<checkpoint>/offsets``): ``{topic: {partition: next_offset}}``,
partitions as strings, both levels sorted so that equal positions always serialise to equal JSON
(Spark compares offsets as JSON text to decide whether a batch has new data).

End offsets: the end of a partition for a ``read_committed`` reader is its last stable offset (LSO).
ListOffsets("latest") gives it on Apache Kafka, but some Kafka-protocol brokers answer with the base
offset of the last record batch + 1. :class:`EndOffsetProbe` therefore trusts only Fetch responses:
it positions a consumer one record before the best known end (``max(ListOffsets, start) - 1``),
consumes, and takes the offset at which librdkafka reports partition EOF - that is where a
``read_committed`` fetch stops, i.e. the LSO. A probe reads at most about one record batch per
partition, never the data itself, and has a deadline; a partition that gave no answer in time keeps
its start offset (no progress this trigger, never a wrong end).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from refstream.errors import ConfigError, DataError, TransientError
from refstream.kafka import consumer, offset_of, partition_of, topic_of

log = logging.getLogger(__name__)

TP = tuple[str, int]
"""A topic partition: (topic, partition)."""

EARLIEST = -2
LATEST = -1


#: Keys of the offset JSON that are not topics (Kafka topic names cannot contain ``@``).
TOPIC_IDS = "@topic_ids"
"""``{topic: id}``: the broker's id of each topic when its offsets were taken (a recreated topic has a new one)."""
STARTS = "@starts"
"""``{topic: {partition: offset}}`` in a batch's end: partitions whose range in that batch starts
there instead of at the previous batch's end (a reset topic, or skipped lost offsets)."""


def to_json_offsets(positions: Mapping[TP, int], *, topic_ids: Mapping[str, str] | None = None,
                    starts: Mapping[TP, int] | None = None) -> dict[str, Any]:
    """``{(topic, p): offset}`` -> Spark offset dict, in canonical (sorted) order, with the optional
    :data:`TOPIC_IDS` and :data:`STARTS` entries."""
    out: dict[str, Any] = {}
    for topic, part in sorted(positions):
        out.setdefault(topic, {})[str(part)] = int(positions[(topic, part)])
    if topic_ids:
        out[TOPIC_IDS] = {t: topic_ids[t] for t in sorted(topic_ids)}
    if starts:
        out[STARTS] = {t: {str(p): int(o) for (tt, p), o in sorted(starts.items()) if tt == t}
                       for t in sorted({t for t, _ in starts})}
    return out


def from_json_offsets(offsets: Mapping[str, Any]) -> dict[TP, int]:
    """Spark offset dict -> ``{(topic, p): offset}`` (the ``@`` entries left out)."""
    return {(topic, int(part)): int(off) for topic, parts in offsets.items() if not topic.startswith("@")
            for part, off in parts.items()}


def topic_ids_of(offsets: Mapping[str, Any]) -> dict[str, str]:
    """The :data:`TOPIC_IDS` entry of an offset dict (empty for offsets written without it)."""
    return dict(offsets.get(TOPIC_IDS) or {})


def starts_of(offsets: Mapping[str, Any]) -> dict[TP, int]:
    """The :data:`STARTS` entry of an offset dict."""
    return {(t, int(p)): int(o) for t, parts in (offsets.get(STARTS) or {}).items() for p, o in parts.items()}


def check_retention(begin: Mapping[TP, int], low: Mapping[TP, int], *, fail_on_data_loss: bool
                    ) -> tuple[dict[TP, int], dict[TP, int]]:
    """Find the partitions of ``begin`` (checkpointed positions) whose log start (``low``) moved
    past their position: ``[position, log start)`` was deleted (retention) before it was read, also
    when nothing is left at all. With ``fail_on_data_loss`` a :class:`DataError` names topic,
    partition and offsets; otherwise they are skipped with a warning. Returns ``(starts, lost)``:
    where the next range of such partitions begins, and how many offsets each one skipped."""
    starts: dict[TP, int] = {}
    lost: dict[TP, int] = {}
    for tp, pos in sorted(begin.items()):
        lo = low.get(tp)
        if lo is None or lo <= pos:
            continue
        gone = f"topic {tp[0]} partition {tp[1]}: offsets [{pos}, {lo}) were deleted (retention) before they were read"
        if fail_on_data_loss:
            raise DataError(f"{gone}; set failOnDataLoss (events.fail_on_data_loss) to false to skip them")
        starts[tp], lost[tp] = lo, lo - pos
        log.warning("%s: %d offsets skipped (fail_on_data_loss is false)", gone, lo - pos)
    return starts, lost


def check_reset(begin: Mapping[TP, int], *, low: Mapping[TP, int], high: Mapping[TP, int],
                old_ids: Mapping[str, str], ids: Mapping[str, str], on_reset: str) -> dict[TP, int]:
    """Find the partitions of ``begin`` (checkpointed positions) that were *reset*: their topic id
    changed (``old_ids`` then, ``ids`` now), or their high watermark (``high``, absent when unknown)
    is below their position - the topic was deleted and recreated, or its offsets went backwards.
    ``on_reset``: ``fail`` raises a :class:`DataError` naming topic and partition, ``earliest``
    restarts the partition at its log start (``low``), ``latest`` at its end. Returns where the next
    range of each reset partition begins.

    Without a topic id (a broker that gives none), a topic recreated with at least as many records
    as the old position cannot be told apart from the old one."""
    starts: dict[TP, int] = {}
    for tp, pos in sorted(begin.items()):
        topic, part = tp
        hi, lo = high.get(tp), low.get(tp)
        old, new = old_ids.get(topic), ids.get(topic)
        if old and new and old != new:
            reason = f"was deleted and recreated (topic id {old} -> {new})"
        elif hi is not None and hi < pos:
            reason = (f"ends at offset {hi} now, below the checkpointed position {pos} (offsets went backwards: "
                      "the topic was deleted and recreated, or truncated)")
        else:
            continue
        where = f"topic {topic} partition {part} {reason}"
        if on_reset == "fail":
            raise DataError(f"{where}; the job stops rather than skip or re-read events: set onOffsetReset "
                            "(events.on_offset_reset) to earliest or latest to go on")
        first, last = max(lo or 0, 0), max(hi or 0, 0)
        starts[tp] = first if on_reset == "earliest" else last
        log.warning("%s; on_offset_reset=%s: reading it from offset %d (its offsets now are [%d, %d))", where,
                    on_reset, starts[tp], first, last)
    return starts


def parse_starting_offsets(value: str, topics: Iterable[str], option: str = "startingOffsets"
                           ) -> int | dict[TP, int]:
    """``earliest`` / ``latest`` -> :data:`EARLIEST` / :data:`LATEST`; a JSON object
    ``{"topic": {"0": 23, "1": -2}}`` (-2 earliest, -1 latest) -> per-partition offsets.
    Partitions of a subscribed topic missing from the JSON start at the earliest offset."""
    v = value.strip()
    if v.lower() == "earliest":
        return EARLIEST
    if v.lower() == "latest":
        return LATEST
    try:
        parsed = json.loads(v)
        out = {(str(t), int(p)): int(o) for t, parts in parsed.items() for p, o in parts.items()}
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(f"option {option}: expected earliest, latest or JSON like "
                          f'{{"topic": {{"0": 23}}}}, got {value!r}') from None
    unknown = sorted({t for t, _ in out} - set(topics))
    if unknown:
        raise ConfigError(f"option {option}: topics {unknown} are not subscribed")
    bad = [f"{t}/{p}={o}" for (t, p), o in out.items() if o < EARLIEST]
    if bad:
        raise ConfigError(f"option {option}: invalid offsets {bad} (use >= 0, -2 earliest, -1 latest)")
    return out


def resolve_start(probe: EndOffsetProbe, topics: Iterable[str], start: int | Mapping[TP, int]) -> dict[TP, int]:
    """The offset each current partition of ``topics`` starts at for ``start`` (:data:`EARLIEST`,
    :data:`LATEST`, or per-partition offsets as :func:`parse_starting_offsets` returns them)."""
    tps = probe.partitions(topics)
    if start == EARLIEST:
        return {tp: max(probe.listed_end(tp)[0], 0) for tp in tps}
    if start == LATEST:
        return probe.probe(tps).end
    assert isinstance(start, Mapping)
    want = {tp: start.get(tp, EARLIEST) for tp in tps}
    ends = probe.probe([tp for tp, o in want.items() if o == LATEST]).end
    return {tp: (ends[tp] if o == LATEST else max(o, 0)) for tp, o in want.items()}


def rate_limit(start: Mapping[TP, int], end: Mapping[TP, int], max_offsets: int) -> dict[TP, int]:
    """Cap ``end`` so that at most ``max_offsets`` offsets are admitted in total, shared in
    proportion to each partition's backlog (as Spark's Kafka source does). The caps sum to exactly
    ``min(max_offsets, backlog)``; a partition with backlog never starves for rounding."""
    lag = {tp: max(0, end[tp] - start.get(tp, 0)) for tp in end}
    total = sum(lag.values())
    if total <= max_offsets:
        return dict(end)
    share = {tp: max_offsets * n // total for tp, n in lag.items()}
    rest = max_offsets - sum(share.values())
    # Hand out what rounding left over, largest remainders first (deterministic order).
    for tp in sorted(lag, key=lambda t: (-(max_offsets * lag[t] % total), t)):
        if rest <= 0:
            break
        if share[tp] < lag[tp]:
            share[tp] += 1
            rest -= 1
    return {tp: start.get(tp, 0) + share[tp] for tp in end}


@dataclass(frozen=True)
class ProbeResult:
    """Per partition: the end for a read_committed reader, the log start offset, and the high
    watermark seen in Fetch responses (absent when no fetch answered)."""

    end: dict[TP, int]
    low: dict[TP, int]
    high: dict[TP, int] = field(default_factory=dict)


class EndOffsetProbe:
    """A driver-side consumer that finds the partitions of the subscribed topics and their true ends.

    Not thread-safe; one per stream reader. :meth:`close` releases the consumer.
    """

    def __init__(self, settings: Mapping[str, str], *, deadline: float = 5.0, timeout: float = 10.0) -> None:
        self._settings = dict(settings)
        self._deadline = deadline
        self._timeout = timeout  # of a metadata or ListOffsets request
        self._consumer: Consumer | None = None

    def _client(self) -> Consumer:
        if self._consumer is None:
            self._consumer = consumer(self._settings, role="probe")
        return self._consumer

    def partitions(self, topics: Iterable[str]) -> list[TP]:
        """Current partitions of ``topics`` (a topic that does not exist yet has none)."""
        c = self._client()
        out: list[TP] = []
        for topic in topics:
            try:
                md = c.list_topics(topic, timeout=self._timeout)
            except KafkaException as exc:
                raise TransientError(f"cannot read metadata of topic {topic}: {exc}") from None
            t = md.topics.get(topic)
            if t is None or t.error is not None:
                if t is not None and t.error is not None and t.error.code() not in (
                        KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.LEADER_NOT_AVAILABLE):
                    raise TransientError(f"metadata of topic {topic}: {t.error}")
                continue
            out.extend((topic, p) for p in sorted(t.partitions))
        return out

    def listed_end(self, tp: TP) -> tuple[int, int]:
        """(low, high) from ListOffsets; the high value is only a hint (see module docstring)."""
        try:
            return self._client().get_watermark_offsets(TopicPartition(*tp), timeout=self._timeout, cached=False)
        except KafkaException as exc:
            raise TransientError(f"cannot list offsets of {tp[0]}/{tp[1]}: {exc}") from None

    def probe(self, tps: Iterable[TP], known: Mapping[TP, int] | None = None) -> ProbeResult:
        """True ends of ``tps``. ``known`` holds offsets known to be <= the end (e.g. the batch
        start); a partition that does not answer before the deadline gets ``known`` (or its listed
        end when nothing is known)."""
        tps = list(tps)
        known = dict(known or {})
        if not tps:
            return ProbeResult({}, {})
        c = self._client()
        listed = {tp: self.listed_end(tp) for tp in tps}
        assignment = []
        asked: dict[TP, int] = {}
        for tp in tps:
            low, high = listed[tp]
            asked[tp] = max(high, known.get(tp, 0))
            pos = asked[tp] - 1
            assignment.append(TopicPartition(tp[0], tp[1], pos if pos >= max(low, 0) else OFFSET_BEGINNING))
        ends: dict[TP, int] = {}
        seen: dict[TP, int] = {}
        t0 = time.monotonic()
        c.assign(assignment)
        try:
            deadline = time.monotonic() + self._deadline
            while len(ends) < len(tps) and time.monotonic() < deadline:
                msgs = c.consume(1000, timeout=0.02)
                for m in msgs:
                    tp = (topic_of(m), partition_of(m))
                    err = m.error()
                    if err is None:
                        seen[tp] = max(seen.get(tp, 0), offset_of(m) + 1)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        ends[tp] = max(offset_of(m), ends.get(tp, 0))
                        # Paused partitions stop prefetching data nobody reads.
                        c.pause([TopicPartition(*tp)])
                    elif err.fatal() or not (err.retriable() or err.code() == KafkaError._TRANSPORT):
                        raise TransientError(f"probing end of {tp[0]}/{tp[1]}: {err}")
                if len(msgs) == 1000:
                    continue  # more fetched records are queued: a record batch may be half delivered
                if not msgs:
                    for tp in tps:
                        if tp in ends or tp in seen:
                            continue
                        _, hw = c.get_watermark_offsets(TopicPartition(*tp), cached=True)
                        if hw is not None and 0 <= hw < asked[tp]:
                            # Asked past the high watermark: the partition went backwards (recreated
                            # topic); some brokers answer such a fetch with nothing, not an error.
                            ends[tp] = hw
                            c.pause([TopicPartition(*tp)])
                # A record past the asked-for end means what existed when we asked has been read
                # (whole record batches: the queue is drained). While producers write continuously,
                # EOF may not come before the deadline (every fetch brings new records); every
                # offset below a delivered read_committed record is stable: a correct end.
                for tp, off in seen.items():
                    if tp not in ends and off > asked[tp]:
                        ends[tp] = off
                        c.pause([TopicPartition(*tp)])
            lows, highs = {}, {}
            for tp in tps:
                low, high = c.get_watermark_offsets(TopicPartition(*tp), cached=True)
                lows[tp] = low if low is not None and low >= 0 else listed[tp][0]
                if high is not None and high >= 0:
                    highs[tp] = high  # from Fetch: right on every broker (ListOffsets may not be)
        finally:
            # Pause state outlives the assignment in librdkafka: undo it before the next probe.
            c.resume(assignment)
            c.unassign()
        log.debug("probe of %d partitions took %.3fs", len(tps), time.monotonic() - t0)
        missing = [tp for tp in tps if tp not in ends]
        for tp in missing:
            # Every offset below a delivered read_committed record is stable: a safe end.
            fallback = known.get(tp, listed[tp][1])
            ends[tp] = max(fallback, seen.get(tp, fallback))
        if missing:
            log.warning("no end-of-partition answer within %.1fs for %s; using %s", self._deadline,
                        missing, {tp: ends[tp] for tp in missing})
        return ProbeResult(ends, lows, highs)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


__all__ = ["EARLIEST", "LATEST", "STARTS", "TOPIC_IDS", "TP", "EndOffsetProbe", "ProbeResult", "check_reset", "check_retention",
           "from_json_offsets", "parse_starting_offsets", "rate_limit", "resolve_start", "starts_of", "to_json_offsets",
           "topic_ids_of"]
