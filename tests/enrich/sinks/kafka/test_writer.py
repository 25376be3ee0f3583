"""Kafka output: the transactional micro-batch writer (exactly-once)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from confluent_kafka import KafkaException, Producer

from enrich.query import read_stream
from enrich.sinks.kafka.writer import TransactionalBatchWriter, transactional_id_for
from refstream.kafka import ensure_topic, read_to_end
from tests.timing import bound

HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def table(prefix: str, n: int, *, headers: bool = False) -> pa.Table:
    cols = {"key": pa.array([None if i % 5 == 0 else b"k%d" % i for i in range(n)], pa.binary()),
            "value": pa.array([b"%s-%d" % (prefix.encode(), i) for i in range(n)], pa.binary())}
    if headers:
        cols["headers"] = pa.array([[("h", b"%d" % i)] if i % 2 else None for i in range(n)], HEADERS)
    return pa.table(cols)


def values(kafka: dict[str, str], topic: str) -> list[bytes]:
    return [m.value() for m in read_to_end(kafka, topic)]


def test_batches_are_written_once_and_a_replayed_batch_id_is_skipped(kafka, unique):
    topic = unique("out")
    ensure_topic(kafka, topic, partitions=3)
    tid = unique("tid")
    with TransactionalBatchWriter(kafka, topic, tid) as w:
        assert w.last_committed_batch() is None
        assert w.write(0, table("b0", 100, headers=True)) == 100
        assert w.write(1, table("b1", 50)) == 50
        assert w.write(1, table("b1", 50)) == 0  # same process, same batch again
        assert w.write(2, table("empty", 0)) == 0
    # A restarted job: a new writer with the same transactional id learns where it stopped.
    with TransactionalBatchWriter(kafka, topic, tid) as w:
        assert w.last_committed_batch() == 1
        assert w.write(0, table("b0", 100)) == 0
        assert w.write(1, table("b1", 50)) == 0
        assert w.write(2, table("b2", 10)) == 10
    msgs = list(read_to_end(kafka, topic))
    got = sorted(m.value() for m in msgs)
    want = sorted([b"b0-%d" % i for i in range(100)] + [b"b1-%d" % i for i in range(50)]
                  + [b"b2-%d" % i for i in range(10)])
    assert got == want
    b0 = {m.value(): m for m in msgs if m.value().startswith(b"b0-")}
    assert b0[b"b0-3"].key() == b"k3" and b0[b"b0-3"].headers() == [("h", b"3")]
    assert b0[b"b0-5"].key() is None and b0[b"b0-4"].headers() is None
    # Equal keys go to equal partitions (keyed output keeps per-key order).
    parts = {}
    for m in msgs:
        if m.key() is not None:
            parts.setdefault(m.key(), set()).add(m.partition())
    assert all(len(p) == 1 for p in parts.values())


def test_crash_before_commit_then_replay_is_seen_once_and_the_zombie_is_fenced(kafka, unique):
    topic = unique("out-crash")
    ensure_topic(kafka, topic, partitions=2)
    tid = unique("tid")
    zombie = TransactionalBatchWriter(kafka, topic, tid)
    assert zombie.write(0, table("b0", 20)) == 20
    # Batch 1 is produced but the process "dies" before committing.
    zombie._producer.begin_transaction()
    b1 = table("b1", 30)
    zombie._produce_all(b1.column("value").to_pylist(), b1.column("key").to_pylist(), None)
    zombie._producer.flush(10)
    # The restarted job replays batch 1 with the same id; the zombie's transaction is aborted.
    fresh = TransactionalBatchWriter(kafka, topic, tid)
    assert fresh.last_committed_batch() == 0
    # Apache Kafka aborted the zombie's records: all 30 are written. A broker that exposed them
    # instead gets only the missing ones.
    fresh.write(1, b1)
    # The zombie wakes up and tries to finish its transaction: fenced, nothing of it becomes visible.
    # (Apache Kafka answers PRODUCER_FENCED; the test broker lets the request time out.)
    with pytest.raises(KafkaException):
        zombie._producer.commit_transaction(5)
    got = values(kafka, topic)
    assert sorted(got) == sorted([b"b0-%d" % i for i in range(20)] + [b"b1-%d" % i for i in range(30)])


def test_the_ledger_is_per_writer_and_scope(kafka, unique):
    """Another writer's batches on the same topic leave a writer's ledger alone; another scope (a
    fresh checkpoint) starts empty."""
    topic = unique("out-ledger")
    ensure_topic(kafka, topic, partitions=1)
    mine, other = unique("tid-mine"), unique("tid-other")
    with TransactionalBatchWriter(kafka, topic, mine, scope="run-1") as w:
        w.write(7, table("m", 3))
    with TransactionalBatchWriter(kafka, topic, other) as o:
        for b in range(12):
            o.write(b, table("o", 1))
    with TransactionalBatchWriter(kafka, topic, mine, scope="run-1") as w:
        assert w.last_committed_batch() == 7
    # A fresh checkpoint (another scope) starts from batch 0 and must not be taken for a replay.
    with TransactionalBatchWriter(kafka, topic, mine, scope="run-2") as w:
        assert w.last_committed_batch() is None
        assert w.write(0, table("fresh", 2)) == 2


def test_transactional_ids_are_stable_per_identity_and_topic():
    a = transactional_id_for("scope", "out")
    assert a == transactional_id_for("scope", "out")
    assert a != transactional_id_for("scope2", "out")
    assert a != transactional_id_for("scope", "out2")


def test_foreach_batch_failure_after_commit_and_restart_writes_each_event_once(spark, kafka, unique, tmp_path):
    src, out = unique("fb-in"), unique("fb-out")
    ensure_topic(kafka, src, partitions=2)
    ensure_topic(kafka, out, partitions=2)
    p = Producer(kafka)
    for i in range(600):
        p.produce(src, b"e%d" % i, partition=i % 2)
    p.flush(10)
    cp = str(tmp_path / "cp")
    tid = transactional_id_for(cp, out)
    crash = {"armed": True}

    def run() -> Exception | None:
        w = TransactionalBatchWriter(kafka, out, tid)

        def sink(df, batch_id: int) -> None:  # noqa: ANN001 - Spark passes a DataFrame
            w.write(batch_id, df.selectExpr("key", "value").toArrow())
            if batch_id == 1 and crash["armed"]:
                crash["armed"] = False
                raise RuntimeError("crash after the Kafka commit, before Spark's commit")

        df = read_stream(spark, kafka, [src], starting_offsets="earliest", max_offsets_per_trigger=200)
        q = (df.writeStream.foreachBatch(sink).option("checkpointLocation", cp)
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination(bound(180))
        except Exception as exc:  # noqa: BLE001 - the planned crash surfaces here
            return exc
        finally:
            w.close()
        return q.exception()

    first = run()  # batch 1 reached Kafka, Spark never recorded it
    assert first is not None and "crash after the Kafka commit" in str(first), first
    again = run()  # replays batch 1 (skipped), then batch 2
    assert again is None, str(again)  # the exception's repr leaves its message out
    got = values(kafka, out)
    assert len(got) == 600 and sorted(got) == sorted(b"e%d" % i for i in range(600))
