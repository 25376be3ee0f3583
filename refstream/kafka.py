"""Kafka helpers shared by both parts: topic creation and reading a topic to its end.

Reading "to the end" never trusts ListOffsets alone: some Kafka-protocol brokers report the base
offset of the last record batch + 1 as the end. We consume with ``enable.partition.eof`` and stop at
the EOF event, which comes from the high watermark in Fetch responses (right on every broker).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from refstream.errors import TransientError

log = logging.getLogger(__name__)


def admin(settings: Mapping[str, str]) -> AdminClient:
    return AdminClient(dict(settings))


def ensure_topic(settings: Mapping[str, str], topic: str, *, partitions: int = 1,
                 config: Mapping[str, str] | None = None, timeout: float = 15.0) -> bool:
    """Create ``topic`` if missing; returns True when it was created. Broker errors are transient."""
    client = admin(settings)
    try:
        md = client.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TransientError(f"cannot reach Kafka at {settings.get('bootstrap.servers')}: {exc}") from None
    if topic in md.topics and md.topics[topic].error is None:
        return False
    futures = client.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                                             config=dict(config or {}))], operation_timeout=timeout)
    try:
        futures[topic].result(timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise TransientError(f"cannot create topic {topic}: {exc}") from None
    log.info("created topic %s (%d partitions, %s)", topic, partitions, dict(config or {}))
    _wait_for_metadata(client, topic, timeout)
    return True


def _wait_for_metadata(client: AdminClient, topic: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = client.list_topics(topic, timeout=timeout)
        t = md.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return
        time.sleep(0.1)


def partitions_of(settings: Mapping[str, str], topic: str, timeout: float = 10.0) -> list[int]:
    """Partitions of ``topic``, [] when it does not exist. Asks for all topics' metadata: a request
    naming the topic makes some brokers (Tansu, Kafka with auto.create.topics.enable) create it with
    the broker's defaults, so a reader polling early would create the writer's topic wrongly."""
    try:
        md = admin(settings).list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TransientError(f"cannot reach Kafka: {exc}") from None
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        return []
    return sorted(t.partitions)


def consumer(settings: Mapping[str, str], **extra: Any) -> Consumer:
    """A consumer that never joins a group (offsets are tracked by the caller)."""
    conf = {"group.id": f"refstream-{uuid.uuid4().hex[:12]}", "enable.auto.commit": False,
            "enable.partition.eof": True, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest", **settings, **extra}
    return Consumer(conf)


def read_to_end(settings: Mapping[str, str], topic: str, start: Mapping[int, int] | None = None,
                *, batch: int = 5000, timeout: float = 30.0) -> Iterator[Message]:
    """Yield every record of ``topic`` from ``start`` (partition -> offset; default: beginning) until
    each partition reports EOF. Raises :class:`TransientError` if the end is not reached in ``timeout``
    seconds without progress."""
    parts = partitions_of(settings, topic)
    if not parts:
        return
    c = consumer(settings)
    try:
        c.assign([TopicPartition(topic, p, (start or {}).get(p, OFFSET_BEGINNING)) for p in parts])
        pending = set(parts)
        last_progress = time.monotonic()
        while pending:
            msgs = c.consume(batch, timeout=0.2)
            if not msgs and time.monotonic() - last_progress > timeout:
                raise TransientError(f"no progress reading {topic} partitions {sorted(pending)} "
                                     f"for {timeout:.0f}s")
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(m.partition())
                        continue
                    if err.retriable() or err.code() == KafkaError._TRANSPORT:
                        raise TransientError(f"reading {topic}: {err}")
                    raise KafkaException(err)
                last_progress = time.monotonic()
                pending.add(m.partition())  # EOF then more data (a producer is writing): keep going
                yield m
    finally:
        c.close()
