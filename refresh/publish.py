"""Publishing a change set: one Kafka transaction per run, every delivery report checked.

:meth:`Publisher.publish` returns only when the broker acknowledged every message and the
transaction committed; otherwise it aborts the transaction and raises
:class:`refresh.errors.PublishError` (transient), and the caller commits nothing, so the next run
publishes the same changes again. Readers that read ``read_committed`` (every refstream consumer)
see a run's records all at once or not at all: never a change set half applied.

The ``transactional.id`` is stable per dataset (see :func:`transactional_id`): a restarted refresher
initialising it fences a predecessor that may still be writing and aborts its open transaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from refresh.errors import PublishError, Stopped
from refstream import kafka
from refstream.contract import H_VALID_FROM, TOPIC_CONFIG, Message, MessageBatch
from refstream.kafka import ensure_topic, partitions_of

__all__ = ["Publisher", "transactional_id"]

log = logging.getLogger(__name__)

# Producers created ahead of a publish (see Publisher.warm_up), by settings.
_warm: dict[tuple[tuple[str, str], ...], _Client] = {}
_warm_lock = threading.Lock()


class _Client:
    """A producer and the delivery failures it reported.

    Delivery reports come for failures only (``delivery.report.only.error``), through one callback
    set at creation: no Python call per acknowledged message. A publish is complete when the queue
    is empty after ``flush()`` and no failure was reported (every message got a report or an ack),
    and, with a transaction, when it committed."""

    def __init__(self, settings: Mapping[str, str]) -> None:
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.producer = kafka.producer(settings, role="publisher", on_delivery=self._on_delivery,
                                       **{"delivery.report.only.error": True})

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            with self._lock:
                self.errors.append(f"{msg.topic()}[{msg.partition()}] key {msg.key()!r}: {err}")


def transactional_id(refresher_id: str, dataset: str) -> str:
    """The ``transactional.id`` a refresher publishes ``dataset`` with: the same across restarts."""
    return f"{refresher_id}.{dataset}"


def _settings_key(settings: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in settings.items()))


def _new_producer(settings: Mapping[str, str]) -> _Client:
    return _Client(settings)


class Publisher:
    """Produces change sets to dataset topics. One per run; not shared between threads.

    With ``transactional.id`` in ``settings`` each :meth:`publish` is one transaction; without it
    (tools that load topics) messages are only acknowledged one by one."""

    def __init__(self, settings: Mapping[str, str], *, topic_timeout: float = 10.0,
                 txn_timeout: float = 60.0) -> None:
        self.settings = dict(settings)
        # Admin clients (topic checks) get the settings without the producer-only transactional.id.
        self.transactional_id: str | None = self.settings.pop("transactional.id", None)
        self.topic_timeout = topic_timeout
        self.txn_timeout = txn_timeout
        self._txn_ready = False
        self._client: _Client | None = None

    @classmethod
    def warm_up(cls, settings: Mapping[str, str]) -> None:
        """Create the producer of the next publish with ``settings`` now, e.g. before a long read.

        An idempotent producer cannot send before the broker gave it a producer id, and librdkafka
        asks for one only after a first retry timer (0.5-1 s after the producer is created); done
        ahead, that wait overlaps the read instead of adding to the run. Errors are left to the publish."""
        key = _settings_key(settings)
        with _warm_lock:
            if key in _warm:
                return
        try:
            p = _new_producer(settings)
        except KafkaException:
            return
        with _warm_lock:
            if key in _warm:  # another thread was quicker
                stale = [p]
            else:
                # At most one waiting producer (a config has one broker list): one for other
                # settings is let go rather than left reconnecting forever.
                stale = list(_warm.values())
                _warm.clear()
                _warm[key] = p
        del stale  # released outside the lock (destroying a producer may take a moment)

    def _producer_settings(self) -> dict[str, str]:
        if self.transactional_id is None:
            return self.settings
        return {**self.settings, "transactional.id": self.transactional_id}

    def producer(self) -> Producer:
        return self._get_client().producer

    def _get_client(self) -> _Client:
        if self._client is None:
            with _warm_lock:
                self._client = _warm.pop(_settings_key(self._producer_settings()), None)
        if self._client is None:
            try:
                self._client = _new_producer(self._producer_settings())
            except KafkaException as exc:
                raise PublishError(f"cannot create a Kafka producer: {exc}") from None
        return self._client

    def prepare(self, topic: str, partitions: int = 1, config: Mapping[str, str] | None = None) -> list[int]:
        """Create ``topic`` if missing (with ``config``, default :data:`TOPIC_CONFIG`); returns its
        partitions. Unreachable broker -> TransientError."""
        ensure_topic(self.settings, topic, partitions=partitions, config=config or TOPIC_CONFIG,
                     timeout=self.topic_timeout)
        parts = partitions_of(self.settings, topic, timeout=self.topic_timeout)
        if not parts:
            raise PublishError(f"topic {topic} has no partitions (metadata not available)")
        return parts

    def publish(self, topic: str, messages: Iterable[Message | MessageBatch], *,
                to_every_partition: Iterable[Message] = (), last_to_every_partition: Iterable[Message] = (),
                partitions: list[int] | None = None, flush_timeout: float = 120.0,
                stop: threading.Event | None = None) -> int:
        """Produce ``to_every_partition`` (schema records) to each partition, then ``messages`` (records
        or batches of records) by key, then ``last_to_every_partition`` (completeness records) to each
        partition; wait until every one is delivered and commit the transaction. Returns the number of
        messages published. On any failure (or ``stop``) the transaction is aborted: nothing becomes
        visible."""
        p = self.producer()
        last = list(last_to_every_partition)
        if self.transactional_id is None:
            return self._produce_all(p, topic, messages, to_every_partition, last, partitions, flush_timeout,
                                     stop)
        self._begin(p, topic)
        try:
            sent = self._produce_all(p, topic, messages, to_every_partition, last, partitions, flush_timeout,
                                     stop)
            self._commit(p, topic, sent)
        except BaseException:
            self._abort(p, topic)
            raise
        return sent

    def _produce_all(self, p: Producer, topic: str, messages: Iterable[Message | MessageBatch],
                     to_every_partition: Iterable[Message], last_to_every_partition: list[Message],
                     partitions: list[int] | None, flush_timeout: float, stop: threading.Event | None) -> int:
        errors = self._get_client().errors
        errors.clear()
        sent = 0
        for m in to_every_partition:
            for part in partitions or [0]:
                self._produce(p, topic, m.key, m.value, m.headers, part)
                sent += 1
        since_poll = 0
        for rec in messages:
            if isinstance(rec, MessageBatch):
                sent += self._produce_batch(p, topic, rec)
                since_poll += len(rec)
            else:
                self._produce(p, topic, rec.key, rec.value, rec.headers, None)
                sent += 1
                since_poll += 1
            if since_poll >= 10_000:
                since_poll = 0
                p.poll(0)
                if stop is not None and stop.is_set():
                    p.flush(5)
                    raise Stopped(f"topic {topic}: stopped while publishing ({sent} produced); "
                                  f"nothing committed")
                if errors:
                    break
        if not errors:
            # After every record of the run on each partition: what they say holds for all of them.
            for m in last_to_every_partition:
                for part in partitions or [0]:
                    self._produce(p, topic, m.key, m.value, m.headers, part)
                    sent += 1
        def outstanding() -> int:
            # The queue's length counts the client's own events too (a down broker's errors, one per
            # reconnect): no more messages are pending than have had no failure reported.
            return max(0, min(len(p), sent - len(errors)))

        deadline = time.monotonic() + flush_timeout
        while outstanding() > 0 and time.monotonic() < deadline:
            p.flush(min(1.0, max(0.0, deadline - time.monotonic())))
            if stop is not None and stop.is_set() and errors:
                break
        pending = outstanding()
        if errors or pending:
            first = errors[0] if errors else "no delivery report"
            raise PublishError(f"topic {topic}: {sent - len(errors) - pending}/{sent} messages acknowledged "
                               f"({len(errors)} failed, {pending} pending); first error: {first}")
        return sent

    def _produce_batch(self, p: Producer, topic: str, batch: MessageBatch) -> int:
        """Produce a batch with one ``produce()`` call per record and nothing else per record (the
        producer's batch API cannot carry headers); a full local queue waits for the broker."""
        produce = p.produce
        h: Any = batch.headers  # the client's stubs want a list of (str, str | bytes | None)
        keys, values, valid_from = batch.keys, batch.values, batch.valid_from
        i, n = 0, len(keys)
        while i < n:
            try:
                if valid_from is None:
                    while i < n:
                        produce(topic, values[i], keys[i], headers=h)
                        i += 1
                else:  # a header list per record: its own valid_from last
                    while i < n:
                        produce(topic, values[i], keys[i], headers=[*h, (H_VALID_FROM, valid_from[i])])
                        i += 1
            except BufferError:
                p.poll(0.05)  # local queue full: let the broker's acknowledgements drain it
            except KafkaException as exc:
                raise PublishError(f"topic {topic}: produce failed: {exc}") from None
        return n

    # ---------------------------------------------------------------------------- transactions

    def _begin(self, p: Producer, topic: str) -> None:
        try:
            if not self._txn_ready:
                # Fences any earlier producer of this transactional.id and aborts its open transaction.
                p.init_transactions(self.topic_timeout)  # a round trip, like the topic checks
                self._txn_ready = True
            p.begin_transaction()
        except KafkaException as exc:
            raise PublishError(f"topic {topic}: cannot start a transaction as {self.transactional_id}: "
                               f"{exc.args[0] if exc.args else exc}") from None

    def _commit(self, p: Producer, topic: str, sent: int) -> None:
        deadline = time.monotonic() + self.txn_timeout
        while True:
            try:
                p.commit_transaction(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.retriable() and time.monotonic() < deadline:
                    continue  # the commit's outcome is unknown: committing again is what resolves it
                raise PublishError(f"topic {topic}: transaction of {sent} messages not committed: "
                                   f"{err if err is not None else exc}") from None

    def _abort(self, p: Producer, topic: str) -> None:
        try:
            p.abort_transaction(self.txn_timeout)
            log.info("topic %s: transaction aborted; nothing of this run is visible", topic)
        except KafkaException as exc:
            # Still invisible to read_committed readers: the broker aborts it after
            # transaction.timeout.ms, or the next run's init_transactions does at once.
            log.warning("topic %s: aborting the transaction failed (%s); the next run fences it", topic,
                        exc.args[0] if exc.args else exc)
        self._client = None  # a producer in an unknown transaction state is not reused

    def _produce(self, p: Producer, topic: str, key: bytes, value: bytes | None, headers: list[tuple[str, bytes]],
                 partition: int | None) -> None:
        kwargs: dict[str, Any] = {"key": key, "value": value, "headers": headers}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                p.produce(topic, **kwargs)
                return
            except BufferError:
                p.poll(0.05)  # local queue full: let delivery reports drain it
            except KafkaException as exc:
                raise PublishError(f"topic {topic}: produce failed: {exc}") from None

    def close(self) -> None:
        if self._client is not None:
            if self.transactional_id is None:
                self._client.producer.flush(5)
            self._client = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
