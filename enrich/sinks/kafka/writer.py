"""The transaction helpers of the Kafka output, and its writer of whole micro-batches for
``foreachBatch`` on the driver (the dead letters of the other sinks).

:class:`TransactionalBatchWriter` produces each micro-batch in ONE Kafka transaction and records the
batch id in its ledger in the same transaction (:mod:`enrich.sinks.kafka.ledger`), so "batch n is in
Kafka" and "the ledger says n" are the same fact. After a crash Spark replays the last uncommitted
batch with the same batch id; the writer reads its ledger and skips every batch id at or below it.
A read_committed consumer therefore sees each event once.

The transactional id must be stable for one query (same checkpoint -> same id: see
:func:`transactional_id_for`; the job keeps the id it derived in the checkpoint itself): ``init_transactions`` then fences a zombie instance of the previous
run and aborts whatever it left open.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from types import TracebackType

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import KafkaError, KafkaException, Producer

from enrich.sinks.kafka.ledger import Ledger, ensure_ledger
from enrich.source.fetch import OffsetRange, read_range
from enrich.source.offsets import EndOffsetProbe
from refstream.errors import TerminalError, TransientError
from refstream.kafka import TRANSACTION_TIMEOUT_MS, producer

log = logging.getLogger(__name__)

#: Bytes a record costs besides its key, value and headers when librdkafka checks it against
#: ``message.max.bytes`` (record framing; generous: a record near the limit is refused, never the batch).
RECORD_OVERHEAD = 1024
DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's


def fitting(recs: pa.Table, limit: int) -> pa.Array:
    """Per record (``key``, ``value``): whether it is at most ``limit`` bytes, what the broker takes."""
    size = pc.add(pc.fill_null(pc.binary_length(recs.column("key")), 0),
                  pc.fill_null(pc.binary_length(recs.column("value")), 0))
    return pc.less_equal(size, limit).combine_chunks()


def record_limit(settings: Mapping[str, object]) -> int:
    """The largest key + value + headers size a producer with ``settings`` accepts in one record."""
    return int(str(settings.get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES))) - RECORD_OVERHEAD


def transactional_id_for(identity: str, topic: str) -> str:
    """A transactional id that is stable for one streaming query and output topic, and differs
    between queries: a restarted query fences its previous incarnation, and queries of different
    identities do not fence each other. ``identity``: the query's, drawn at random at its
    checkpoint's first start and recorded there (:mod:`enrich.sinks.identity`), never its path: two
    deployments whose checkpoints have the same path in their containers would share ids and fence
    each other."""
    digest = hashlib.sha256(f"{identity}\0{topic}".encode()).hexdigest()
    return f"refstream-enrich-{digest[:20]}"


def produce_all(producer: Producer, topic: str, values: list, keys: list | None, headers: list | None) -> None:
    """Produce ``values`` (with ``keys`` and ``headers``, None for none) to ``topic``, in order,
    waiting for room in the local queue when it is full."""
    produce, poll = producer.produce, producer.poll
    if keys is None:
        keys = [None] * len(values)
    if headers is not None and any(headers):
        for i, (value, key, hdr) in enumerate(zip(values, keys, headers, strict=True)):
            while True:
                try:
                    produce(topic, value, key, headers=hdr or None)
                    break
                except BufferError:
                    poll(0.05)  # local queue full: let librdkafka send
            if i & 0x3FFF == 0:
                poll(0)
        return
    # The hot path (no headers): one produce call per record, delivery reports served in chunks.
    step = 0x4000
    for lo in range(0, len(values), step):
        for value, key in zip(values[lo:lo + step], keys[lo:lo + step], strict=True):
            try:
                produce(topic, value, key)
            except BufferError:
                while True:
                    poll(0.05)  # local queue full: let librdkafka send
                    try:
                        produce(topic, value, key)
                        break
                    except BufferError:
                        continue
        poll(0)


def commit(producer: Producer, timeout: float, what: str) -> None:
    """``commit_transaction``, retried while the error is retriable and ``timeout`` lasts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            producer.commit_transaction(max(1.0, deadline - time.monotonic()))
            return
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is not None and err.retriable() and time.monotonic() < deadline:
                log.warning("commit of transaction on %s failed (%s); retrying", what, err)
                continue
            raise


def abort(producer: Producer, timeout: float, what: str) -> None:
    try:
        producer.abort_transaction(min(timeout, 15.0))
    except KafkaException as exc:
        log.warning("abort of transaction on %s failed: %s", what, exc)


def classify(exc: KafkaException, what: str, transactional_id: str, topic: str, *,
             open_for: float | None = None, timeout_ms: int | None = None) -> Exception:
    """A fenced or fatally failed producer is terminal, unless its transaction had been open for
    most of its timeout (``open_for`` seconds of ``timeout_ms``): the broker then aborted it and
    bumped the epoch, which fences the producer too, and the batch is worth trying again. Anything
    else is transient."""
    err = _kafka_error(exc)
    if err is not None and (err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                                          KafkaError.INVALID_PRODUCER_EPOCH)):
        timeout = (timeout_ms if timeout_ms is not None else TRANSACTION_TIMEOUT_MS) / 1000
        if open_for is not None and open_for >= 0.9 * timeout:
            return TransientError(f"{what}: the transaction of {transactional_id} on {topic} was open {open_for:.0f}s, "
                                  f"past its timeout (transaction.timeout.ms {timeout:.0f}s), and the broker aborted "
                                  f"it; the batch is written again: {err}")
        return TerminalError(f"{what}: transactional id {transactional_id} was fenced or failed "
                             f"fatally (another instance of this query is running?): {err}")
    return TransientError(f"{what}: Kafka transaction on {topic} failed: {exc}")


def visible_ends(settings: Mapping[str, str], topics: list[str]) -> dict[tuple[str, int], int]:
    """The read_committed end of every partition of ``topics``."""
    probe = EndOffsetProbe(settings)
    try:
        return probe.probe(probe.partitions(topics)).end
    finally:
        probe.close()


def written_ends(settings: Mapping[str, str], topics: list[str], *, kept: bool = False
                 ) -> dict[tuple[str, int], int]:
    """The end of what is written to every partition of ``topics``, committed or not (the high
    watermark): what a transaction about to begin writes lands at or past it. Unlike
    :func:`visible_ends` it does not wait for the open transactions of other writers, whose
    records lie between the read_committed end and this one. ``kept``: probe with this process's
    kept probe (:func:`_kept_probe`: the tasks' slot setup, once per task and batch)."""
    probing = {**settings, "isolation.level": "read_uncommitted"}
    if kept:
        return _kept_probe(probing, topics)
    probe = EndOffsetProbe(probing)
    try:
        return probe.probe(probe.partitions(topics)).end
    finally:
        probe.close()


# A Python worker's probe, kept between its tasks: a new probe's consumer connecting and reading
# metadata took about 90 of its 120 ms against the test broker, on every slot's setup of every batch.
# One at a time (the settings of the last call): a job's workers probe one cluster.
_KEPT: dict[str, tuple[tuple[tuple[str, str], ...], EndOffsetProbe]] = {}
_KEPT_LOCK = threading.Lock()


def _kept_probe(settings: Mapping[str, str], topics: list[str]) -> dict[tuple[str, int], int]:
    key = tuple(sorted(settings.items()))
    with _KEPT_LOCK:  # a task's setup runs in a thread of its own; one probe at a time
        held = _KEPT.get("probe")
        if held is not None and held[0] != key:
            held[1].close()
            held = None
        if held is None:
            held = _KEPT["probe"] = (key, EndOffsetProbe(dict(settings)))
        try:
            return held[1].probe(held[1].partitions(topics)).end
        except BaseException:
            _KEPT.pop("probe", None)  # the next call starts a new one
            held[1].close()
            raise


def settled_ends(settings: Mapping[str, str], topics: list[str], timeout: float,
                 poll: float = 0.5) -> dict[tuple[str, int], int]:
    """The read_committed ends of ``topics`` once they reach the written ends probed now, so that
    every transaction older than this call has ended (committed or aborted); after ``timeout``
    seconds, the read_committed ends as they are (a transaction still open is logged)."""
    target = written_ends(settings, topics)
    deadline = time.monotonic() + timeout
    while True:
        ends = visible_ends(settings, topics)
        behind = {tp: (ends.get(tp, 0), end) for tp, end in target.items() if ends.get(tp, 0) < end}
        if not behind or time.monotonic() >= deadline:
            if behind:
                log.warning("transactions still open on %s after %.0fs: records they hold are not counted",
                            ", ".join(f"{t}/{p}" for t, p in sorted(behind)), timeout)
            return ends
        time.sleep(poll)


def read_identities(settings: Mapping[str, str], before: Mapping[tuple[str, int], int],
                    after: Mapping[tuple[str, int], int], timeout: float = 60.0) -> Counter[tuple]:
    """The records between ``before`` and ``after`` (per partition), as :func:`identity` counts."""
    seen: Counter[tuple] = Counter()
    for (topic, part), end in after.items():
        start = before.get((topic, part), 0)
        if end <= start:
            continue
        for batch in read_range(settings, OffsetRange(topic, part, start, end), poll_timeout_s=timeout):
            cols = batch.to_pydict()
            for k, v, h in zip(cols["key"], cols["value"], cols["headers"], strict=True):
                seen[identity(k, v, None if h is None else [(e["key"], e["value"]) for e in h])] += 1
    return seen


def identity(key: bytes | None, value: bytes, headers: list | None) -> tuple:
    return (key, value, tuple(map(tuple, headers)) if headers else None)


def _kafka_error(exc: KafkaException) -> KafkaError | None:
    err = exc.args[0] if exc.args else None
    return err if isinstance(err, KafkaError) else None


class TransactionalBatchWriter:
    """Writes whole micro-batches to ``topic`` exactly once.

    ``settings``: librdkafka settings (``bootstrap.servers``...). ``scope``: optional identity of the
    query incarnation (e.g. the streaming query id); a ledger of another scope does not count, so a
    query started on a fresh checkpoint (batch ids from 0 again) is not mistaken for a replay.
    """

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str, *,
                 scope: str | None = None, timeout: float = 60.0) -> None:
        self.topic = topic
        self.transactional_id = transactional_id
        self.scope = scope
        self._settings = dict(settings)
        self._timeout = timeout
        self.record_limit = record_limit(self._settings)
        self.ledger_topic = ensure_ledger(self._settings, topic)
        self._ledger = Ledger(self._settings, self.ledger_topic, transactional_id, scope, timeout=timeout)
        self._producer = producer(self._settings, role="transactional", **{"transactional.id": transactional_id})
        before = self._visible_ends()
        try:
            # Fences an older producer with this id and completes or aborts its open transaction.
            self._producer.init_transactions(timeout)
            self._last = self._ledger.read().committed
        except KafkaException as exc:
            raise self._classify(exc, "init_transactions") from None
        self._leaked = self._read_leaked(before, self._visible_ends())
        log.info("transactional writer %s -> %s ready; last committed batch %s", transactional_id, topic,
                 self._last)

    # -- ledger ------------------------------------------------------------------------------------

    def last_committed_batch(self) -> int | None:
        """The highest batch id committed by this transactional id (and scope), or None."""
        return self._last

    def _visible_ends(self) -> dict[tuple[str, int], int]:
        return visible_ends(self._settings, [self.topic])

    def _read_leaked(self, before: Mapping[tuple[str, int], int], after: Mapping[tuple[str, int], int]
                     ) -> Counter[tuple]:
        """Records that became visible while this writer fenced its predecessor.

        Apache Kafka aborts the open transaction of a fenced producer: nothing appears. Some
        Kafka-protocol brokers instead expose it, so a batch the previous run was writing when it
        died is (partly) visible although its ledger never committed. Those records are remembered
        and left out when Spark replays that batch (its content is the same: same input, same
        output), so a read_committed consumer still sees each record once."""
        leaked = read_identities(self._settings, before, after, self._timeout)
        if leaked:
            log.warning("%d records of an unfinished transaction on %s became visible when the previous "
                        "writer was fenced; they will not be written again", sum(leaked.values()), self.topic)
        return leaked

    # -- writing -----------------------------------------------------------------------------------

    def write_fitting(self, batch_id: int, recs: pa.Table, what: str) -> tuple[int, pa.Table]:
        """:meth:`write` of the records (``key``, ``value``) the broker takes. One larger than a record
        may be (``message.max.bytes``) fails no batch: it is left out, logged naming ``what``, and
        returned with the others left out (``key``, ``value``: the same on a replay), for the caller
        to dead-letter. Returns the records written (0: a replay) and those left out."""
        fits = fitting(recs, self.record_limit)
        left = recs.filter(pc.invert(fits))
        if left.num_rows:
            log.warning("batch %d: %s: %d record(s) not written to %s, larger than a record may be (%d bytes, "
                        "message.max.bytes)", batch_id, what, left.num_rows, self.topic,
                        self.record_limit)
            recs = recs.filter(fits)
        return self.write(batch_id, recs), left

    def write(self, batch_id: int, table: pa.Table | pa.RecordBatch) -> int:
        """Produce ``table`` (columns ``value`` BINARY, optional ``key`` BINARY and ``headers``
        ARRAY<STRUCT<key STRING, value BINARY>>) and ``batch_id`` in its ledger in one transaction.
        Returns the number of records written: 0 for a batch id already committed (a replay) or an
        empty table. Raises :class:`TransientError` when the transaction was aborted (the caller
        fails the batch; Spark retries it) and :class:`TerminalError` when this writer was fenced."""
        if self._last is not None and batch_id <= self._last:
            log.info("batch %d already committed to %s (last %d): skipped", batch_id, self.topic, self._last)
            return 0
        n = table.num_rows
        if n == 0:
            return 0
        names = table.schema.names
        if "value" not in names:
            raise TerminalError(f"batch {batch_id} for {self.topic}: no 'value' column in {names}")
        values = table.column("value").to_pylist()
        keys = table.column("key").to_pylist() if "key" in names else None
        headers = None
        if "headers" in names:
            headers = [None if h is None else [(e["key"], e["value"]) for e in h]
                       for h in table.column("headers").to_pylist()]
        if self._leaked:
            if batch_id == (self._last if self._last is not None else -1) + 1:
                values, keys, headers = self._without_leaked(values, keys, headers)
            self._leaked = Counter()
        started = time.monotonic()
        p = self._producer
        try:
            p.begin_transaction()
            self._produce_all(values, keys, headers)
            # Data before the ledger: a broker that exposes a dead writer's transaction must never
            # show the batch committed without all of its records.
            p.flush(self._timeout)
            self._ledger.commit_in(p, batch_id)
            self._commit()
        except KafkaException as exc:
            err = self._classify(exc, f"batch {batch_id}")
            if not isinstance(err, TerminalError):
                self._abort()
            raise err from None
        self._last = batch_id
        log.info("batch %d: %d records to %s in %.2fs", batch_id, len(values), self.topic,
                 time.monotonic() - started)
        return len(values)

    def _produce_all(self, values: list, keys: list | None, headers: list | None) -> None:
        produce_all(self._producer, self.topic, values, keys, headers)

    def _without_leaked(self, values: list, keys: list | None, headers: list | None
                        ) -> tuple[list, list | None, list | None]:
        left = Counter(self._leaked)
        keep = []
        for i, v in enumerate(values):
            ident = identity(keys[i] if keys is not None else None, v, headers[i] if headers is not None else None)
            if left[ident] > 0:
                left[ident] -= 1
            else:
                keep.append(i)
        log.warning("replay on %s: %d of %d records were already visible, writing %d", self.topic,
                    len(values) - len(keep), len(values), len(keep))
        return ([values[i] for i in keep], None if keys is None else [keys[i] for i in keep],
                None if headers is None else [headers[i] for i in keep])

    def _commit(self) -> None:
        commit(self._producer, self._timeout, self.topic)

    def _abort(self) -> None:
        abort(self._producer, self._timeout, self.topic)

    def _classify(self, exc: KafkaException, what: str) -> Exception:
        return classify(exc, what, self.transactional_id, self.topic)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and release the producer (an open transaction is aborted by the broker later)."""
        self._producer.flush(self._timeout)
        self._ledger.close()

    def __enter__(self) -> TransactionalBatchWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
