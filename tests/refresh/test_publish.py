"""Each run is one Kafka transaction; changing ``key:`` re-keys the topic (real MariaDB, real broker).

- A publish that fails half way is aborted and commits no state; the next run publishes the whole
  change set.
- A refresher that dies half way through a publish leaves an open transaction nobody sees; the next
  run's producer (same transactional.id) fences it, so later records are not held back behind it.
- A re-key tombstones every old key and publishes every row under the new key: the topic, read with
  the contract (last record per key), is the table under the new key.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError, TopicPartition

from refresh.errors import PublishError
from refresh.publish import Publisher
from refresh.runner import Refresher
from refresh.stores.files import FileStateStore
from refstream import contract
from refstream import kafka as rkafka
from refstream.contract import MessageBatch
from tests.refresh.conftest import execute, read_topic, schemas, table_view
from tests.timing import bound

ROWS = 2000
ROOT = Path(__file__).resolve().parents[2]


def mysql_dataset(url: str, table: str, topic: str, key: list[str] | None = None) -> dict[str, Any]:
    return {"source": {"url": url, "table": table}, "key": key or ["id"], "topic": topic}


def uncommitted(kafka: dict[str, str], topic: str) -> list[Any]:
    """Every record in the log, aborted or open transactions included (read_uncommitted)."""
    c = rkafka.consumer(kafka, **{"isolation.level": "read_uncommitted"})
    out: list[Any] = []
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        for _ in range(200):
            for m in c.consume(10_000, 0.2):
                if m.error() is None:
                    out.append(m)
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    return out
        raise AssertionError(f"no end of {topic}")
    finally:
        c.close()


# A refresher process that dies (no abort, no commit) once half the change set is on the broker.
CRASH = """
import os, sys
from refresh.config import load_config
from refresh.publish import Publisher
from refresh.runner import Refresher

from refstream.contract import MessageBatch

class Crash(Publisher):
    def _produce_batch(self, p, topic, batch):
        n = int(sys.argv[3])  # the change set is one batch: produce its first n records, then die
        super()._produce_batch(p, topic, MessageBatch(batch.keys[:n], batch.values[:n], batch.headers))
        p.flush(10)
        os._exit(3)

Refresher(load_config(sys.argv[1]), publisher_factory=Crash, progress=False).run(sys.argv[2])
"""


def test_a_refresher_dying_half_way_shows_nothing_and_the_next_run_fences_it(make_config, mysql_engine,
                                                                             mysql_url, unique, kafka):
    t, topic = unique("half"), unique("ref.half")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)",
            f"INSERT INTO {t} SELECT seq, 1 FROM seq_1_to_{ROWS}")
    cfg = make_config({"h": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("h")
    before = read_topic(kafka, topic)
    execute(mysql_engine, f"UPDATE {t} SET v = 2")

    crashed = subprocess.run([sys.executable, "-c", CRASH, str(cfg.path), "h", str(ROWS // 2)], cwd=ROOT,
                             timeout=bound(120), capture_output=True, text=True)
    assert crashed.returncode == 3, crashed.stderr[-2000:]
    assert len(uncommitted(kafka, topic)) >= len(before) + ROWS // 2, "the first half reached the broker"
    assert read_topic(kafka, topic) == before, "a read_committed reader sees nothing of the unfinished run"
    assert FileStateStore(cfg.state_dir).load("h").version == 1

    # The next run's producer (same transactional.id) fences the dead one: its transaction is aborted,
    # else it would hold every later record of the partition back from read_committed readers.
    r = Refresher(cfg).run("h")
    assert (r.version, r.updates) == (3, ROWS)
    assert table_view(read_topic(kafka, topic)) == {f'{{"id":{i}}}': {"id": i, "v": 2} for i in range(1, ROWS + 1)}


def test_a_publish_failing_half_way_commits_nothing(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("fail"), unique("ref.fail")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)",
            f"INSERT INTO {t} SELECT seq, 1 FROM seq_1_to_{ROWS}")
    cfg = make_config({"f": mysql_dataset(mysql_url, t, topic)}, retry={"attempts": 1})
    Refresher(cfg).run("f")
    before = read_topic(kafka, topic)
    execute(mysql_engine, f"UPDATE {t} SET v = 2")

    class FailsHalfWay(Publisher):
        def _produce_batch(self, p: Any, topic: str, batch: MessageBatch) -> int:
            half = ROWS // 2  # the change set is one batch: its first half reaches the broker
            super()._produce_batch(p, topic, MessageBatch(batch.keys[:half], batch.values[:half], batch.headers))
            p.flush(10)
            raise PublishError(f"topic {topic}: injected failure")

    with pytest.raises(PublishError, match="injected failure"):
        Refresher(cfg, publisher_factory=FailsHalfWay).run("f")
    assert FileStateStore(cfg.state_dir).load("f").version == 1
    if aborts_hidden(kafka):  # Apache Kafka; the embedded broker hands aborted records to every reader
        assert read_topic(kafka, topic) == before
    r = Refresher(cfg).run("f")
    assert (r.version, r.updates) == (3, ROWS)
    assert table_view(read_topic(kafka, topic)) == {f'{{"id":{i}}}': {"id": i, "v": 2} for i in range(1, ROWS + 1)}


def aborts_hidden(kafka: dict[str, str]) -> bool:
    """Does the broker keep aborted transactions from read_committed readers?"""
    topic = f"probe-abort-{uuid.uuid4().hex[:10]}"
    rkafka.ensure_topic(kafka, topic)
    p = rkafka.producer(kafka, role="publisher", **{"transactional.id": topic})
    p.init_transactions(10)
    p.begin_transaction()
    p.produce(topic, key=b"k", value=b"v")
    p.flush(10)
    p.abort_transaction(10)
    return not list(rkafka.read_to_end(kafka, topic))


def test_changing_the_key_re_keys_the_topic(make_config, mysql_engine, mysql_url, unique, kafka, caplog):
    t, topic = unique("rekey"), unique("ref.rekey")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, code VARCHAR(12) NOT NULL UNIQUE, v INT)",
            f"INSERT INTO {t} SELECT seq, CONCAT('c', seq), 1 FROM seq_1_to_{ROWS}")
    Refresher(make_config({"r": mysql_dataset(mysql_url, t, topic)})).run("r")
    execute(mysql_engine, f"UPDATE {t} SET v = 2 WHERE id <= 10", f"DELETE FROM {t} WHERE id > {ROWS - 5}")
    cfg = make_config({"r": mysql_dataset(mysql_url, t, topic, key=["code"])})
    caplog.set_level(logging.INFO)
    r = Refresher(cfg).run("r")
    assert "dataset r: re-key ['id'] -> ['code']" in caplog.text
    assert (r.deletes, r.inserts, r.schema_changed) == (ROWS, ROWS - 5, True)

    records = read_topic(kafka, topic)
    assert schemas(records)[-1].key == ("code",)
    with mysql_engine.connect() as conn:
        table = {contract.encode_key(["code"], dict(row._mapping)).decode(): dict(row._mapping)
                 for row in conn.execute(sa.text(f"SELECT id, code, v FROM {t}"))}
    view = table_view(records)  # the contract: the last record of every key
    assert view == table
    assert all(json.loads(k).keys() == {"code"} for k in view), "no old key survives"
    assert r.published == 1 + ROWS + (ROWS - 5)  # the schema record, one tombstone per old key, the rows

    # The next run under the new key finds nothing to do.
    again = Refresher(cfg).run("r")
    assert (again.published, again.deletes, again.inserts) == (0, 0, 0)


def test_delivery_failures_are_reported_without_a_callback_per_acknowledged_message() -> None:
    """Delivery reports come for failures only; a message that is never delivered fails the publish
    and is counted, whether it came alone or in a batch."""
    from refstream.contract import Message as Record

    pub = Publisher({"bootstrap.servers": "127.0.0.1:9", "message.timeout.ms": "1500"})
    batch = MessageBatch([b"k1", b"k2"], [b"1", None], [("op", b"upsert")])
    with pytest.raises(PublishError, match=r"topic t: 0/3 messages acknowledged \(3 failed, 0 pending\); "
                                           r"first error: t\[\w+\] key b'k\d': .*timed out"):
        pub.publish("t", [batch, Record(b"k3", b"3", [])], flush_timeout=20)
    pub.close()


def test_records_carry_their_own_valid_from_and_the_last_ones_close_every_partition(kafka, unique) -> None:
    topic = unique("ref.last")
    schema = contract.DatasetSchema("d", ("k",), (contract.Column("k", "int64"),))
    times = [datetime(2024, 5, 1, tzinfo=UTC) + timedelta(seconds=i) for i in range(6)]
    beat = contract.heartbeat_message("d", 1, times[0], times[0])
    with Publisher({**kafka, "transactional.id": topic}) as pub:
        parts = pub.prepare(topic, 2)
        sent = pub.publish(topic, contract.upsert_batches(schema, [{"k": i} for i in range(6)], 1, valid_from=times),
                           to_every_partition=[contract.schema_message(schema)], last_to_every_partition=[beat],
                           partitions=parts)
    assert sent == 2 + 6 + 2
    records = read_topic(kafka, topic, heartbeats=True)
    assert {json.loads(r.key)["k"]: r.headers["valid_from"] for r in records if r.op == "upsert"} == {
        i: contract.format_time(t) for i, t in enumerate(times)}
    for part in parts:  # on each partition: the schema record first, the heartbeat last
        ops = [r.op for r in sorted(records, key=lambda r: r.offset) if r.partition == part]
        assert ops[0] == "schema" and ops[-1] == "heartbeat" and ops.count("heartbeat") == 1
