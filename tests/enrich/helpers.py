"""Test helpers: publish changelogs with the contract codec, produce and read back events."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from enrich.sinks.kafka.ledger import Entry, Ledger
from refstream import contract
from refstream import kafka as rkafka
from refstream.contract import DatasetSchema, Message
from tests.timing import bound


def publish(settings: Mapping[str, str], topic: str, messages: Iterable[Message]) -> None:
    rkafka.ensure_topic(settings, topic, config=contract.TOPIC_CONFIG)
    p = Producer({**settings, "enable.idempotence": True, "linger.ms": 5})
    for m in messages:
        p.produce(topic, key=m.key, value=m.value, headers=m.headers)
    p.flush(30)


def changelog(schema: DatasetSchema, rows: Sequence[Mapping[str, Any]] = (), deletes: Sequence[Mapping[str, Any]] = (),
              version: int = 1, with_schema: bool = True) -> list[Message]:
    out = [contract.schema_message(schema)] if with_schema else []
    out += list(contract.upsert_messages(schema, rows, version))
    out += list(contract.delete_messages(schema, deletes, version))
    return out


def produce_events(settings: Mapping[str, str], topic: str, events: Iterable[Mapping[str, Any] | bytes],
                   key_field: str = "device_id", partitions: int = 1) -> None:
    rkafka.ensure_topic(settings, topic, partitions=partitions)
    p = Producer({**settings, "linger.ms": 5})
    for e in events:
        if isinstance(e, bytes):
            p.produce(topic, key=b"bad", value=e)
        else:
            key = str(e.get(key_field)).encode() if e.get(key_field) is not None else None
            p.produce(topic, key=key, value=json.dumps(e).encode())
    p.flush(30)


def read_all(settings: Mapping[str, str], topic: str) -> list[Any]:
    """Every committed record of ``topic`` (read_committed), to the end."""
    return [m for m in rkafka.read_to_end(settings, topic, timeout=bound(20))]


def read_settled(settings: Mapping[str, str], topic: str, expect: int, timeout: float = 30) -> list[Any]:
    """Every committed record of ``topic``, read again until there are at least ``expect`` of them or
    ``timeout`` passes (then the last read, for the caller's assertion to show). A transaction's commit
    returns before the broker has written its markers everywhere (they are asynchronous in Kafka too),
    so a ``read_committed`` read right after a commit can stop short of it."""
    deadline = time.monotonic() + bound(timeout)
    while True:
        got = read_all(settings, topic)
        if len(got) >= expect or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def ledger_entry(settings: Mapping[str, str], ledger: str, tid: str, scope: str,
                 ends: Sequence[tuple[str, int]] | None = None) -> Entry:
    """What the Kafka sink's ledger of ``tid`` (in ``scope``) on topic ``ledger`` says, the written
    ``ends`` of those partitions as the writer would ask for them."""
    book = Ledger(dict(settings), ledger, tid, scope, timeout=bound(30))
    try:
        return book.read(ends) if ends is not None else book.read()
    finally:
        book.close()


def open_transaction(settings: Mapping[str, str], tid: str, records: Iterable[tuple[str, int, bytes]]) -> Producer:
    """A transactional producer with ``records`` (topic, partition, value) sent in a transaction left
    open: the caller aborts it. A plain librdkafka producer, outside the embedded broker's
    one-open-transaction lock (``refstream.kafka.SERIAL_TXNS_ENV``): the writers under test must
    go on beside it."""
    other = Producer({**settings, "transactional.id": tid})
    other.init_transactions(30)
    other.begin_transaction()
    for topic, part, value in records:
        other.produce(topic, value, partition=part)
    other.flush(30)
    return other


def wait_for(predicate: Callable[[], bool], what: str, runner: threading.Thread, timeout: float = 120) -> None:
    """Poll ``predicate`` until it holds; fail at once if the job's thread ``runner`` has stopped."""
    deadline = time.monotonic() + bound(timeout)
    while time.monotonic() < deadline:
        assert runner.is_alive(), f"the job stopped while waiting for {what}"
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def parquet_job_config(settings: Mapping[str, str], unique: Callable[[str], str], out: Path,
                       checkpoint: Path) -> Any:
    """A job config: events ``device_id STRING, n INT`` joined with ``devices``, Parquet output."""
    from enrich import config

    return config.parse({
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, n INT", "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"parquet": {"path": str(out)}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(checkpoint),
        "trigger": "200ms",
    }, "test.yaml")
