"""The refstream-kafka streaming source against a real broker and a real local Spark."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession
from pyspark.sql.streaming.datasource import ReadAllAvailable

from enrich.query import read_stream
from enrich.source import source_options
from enrich.source.fetch import OffsetRange, lost_offsets
from enrich.source.kafka import KafkaStreamReader
from enrich.source.offsets import (
    TOPIC_IDS,
    EndOffsetProbe,
    ProbeResult,
    check_retention,
    from_json_offsets,
    parse_starting_offsets,
    rate_limit,
    to_json_offsets,
    topic_ids_of,
)
from enrich.source.options import SourceOptions
from refstream.errors import ConfigError, DataError, TransientError
from refstream.kafka import admin, ensure_topic, read_to_end
from tests.timing import bound


def produce(settings: dict[str, str], topic: str, rows: list[tuple[bytes | None, bytes, int]],
            headers: dict[int, list[tuple[str, bytes]]] | None = None) -> dict[tuple[int, int], tuple]:
    """Produce ``(key, value, partition)`` rows; returns {(partition, offset): (key, value)}."""
    delivered: dict[tuple[int, int], tuple] = {}

    def on_delivery(err, msg):  # noqa: ANN001 - librdkafka callback
        assert err is None, err
        delivered[(msg.partition(), msg.offset())] = (msg.key(), msg.value())

    p = Producer({**settings, "linger.ms": 5, "enable.idempotence": True})
    for i, (key, value, part) in enumerate(rows):
        p.produce(topic, value, key=key, partition=part, on_delivery=on_delivery,
                  headers=(headers or {}).get(i))
        if i % 10000 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    return delivered


def run_available_now(spark: SparkSession, df, name: str, checkpoint: str) -> list:  # noqa: ANN001
    q = (df.writeStream.format("memory").queryName(name).option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    assert q.awaitTermination(bound(180)), "query did not finish"
    assert q.exception() is None
    return q.recentProgress


def rows_of(spark: SparkSession, name: str) -> list:
    return spark.sql(f"SELECT * FROM {name}").collect()


def test_reads_every_record_of_every_partition_exactly_once(spark, kafka, unique, tmp_path):
    topic = unique("src-all")
    ensure_topic(kafka, topic, partitions=4)
    n = 8000
    rows = [(None if i % 7 == 0 else b"k%d" % i, b"value-%06d" % i, i % 4) for i in range(n)]
    hdrs = {3: [("trace", b"abc"), ("n", b"1")]}
    before = time.time()
    produced = produce(kafka, topic, rows, hdrs)
    df = read_stream(spark, kafka, [topic], starting_offsets="earliest")
    assert df.isStreaming
    assert [f.name for f in df.schema.fields] == ["key", "value", "topic", "partition", "offset", "timestamp",
                                                 "timestampType", "headers"]
    name = unique("q").replace("-", "_")
    run_available_now(spark, df, name, str(tmp_path / "cp"))

    got = rows_of(spark, name)
    assert len(got) == n
    by_pos = {(r.partition, r.offset): r for r in got}
    assert len(by_pos) == n  # no duplicates
    assert {p: (r.key, r.value) for p, r in by_pos.items()} == produced
    assert {r.topic for r in got} == {topic}
    assert all(r.timestampType == 0 and before - 5 <= r.timestamp.timestamp() <= time.time() + 5 for r in got)
    with_headers = [r for r in got if r.headers]
    assert len(with_headers) == 1 and with_headers[0].value == b"value-000003"
    assert [(h.key, h.value) for h in with_headers[0].headers] == [("trace", b"abc"), ("n", b"1")]


def test_admission_control_limits_each_batch(spark, kafka, unique, tmp_path):
    topic = unique("src-limit")
    ensure_topic(kafka, topic, partitions=3)
    produce(kafka, topic, [(None, b"v%d" % i, i % 3) for i in range(3000)])
    df = read_stream(spark, kafka, [topic], starting_offsets="earliest", max_offsets_per_trigger=700)
    name = unique("q").replace("-", "_")
    progress = run_available_now(spark, df, name, str(tmp_path / "cp"))
    sizes = [p["numInputRows"] for p in progress if p["numInputRows"]]
    assert sum(sizes) == 3000
    assert max(sizes) <= 700 and len(sizes) >= 5
    assert len({(r.partition, r.offset) for r in rows_of(spark, name)}) == 3000


def test_restart_from_checkpoint_continues_without_loss_or_duplicates(spark, kafka, unique, tmp_path):
    topic = unique("src-restart")
    ensure_topic(kafka, topic, partitions=2)
    old = produce(kafka, topic, [(None, b"old%d" % i, i % 2) for i in range(100)])
    out, cp = str(tmp_path / "out"), str(tmp_path / "cp")

    def run() -> None:
        df = read_stream(spark, kafka, [topic], starting_offsets="latest", max_offsets_per_trigger=300)
        q = (df.select("value", "partition", "offset").writeStream.format("parquet")
             .option("path", out).option("checkpointLocation", cp).trigger(availableNow=True).start())
        assert q.awaitTermination(bound(180)) and q.exception() is None

    run()  # starts at "latest": nothing produced before the first start is read
    first = produce(kafka, topic, [(None, b"a%d" % i, i % 2) for i in range(1000)])
    run()
    second = produce(kafka, topic, [(None, b"b%d" % i, i % 2) for i in range(500)])
    run()
    got = spark.read.parquet(out).collect()
    positions = [(r.partition, r.offset) for r in got]
    assert len(positions) == len(set(positions)) == 1500
    assert {(r.partition, r.offset): r.value for r in got} == {k: v for k, (_, v) in {**first, **second}.items()}
    assert not set(positions) & set(old)


def test_topics_and_partitions_that_appear_later_are_read_from_their_beginning(spark, kafka, unique, tmp_path):
    first, later = unique("src-first"), unique("src-later")
    ensure_topic(kafka, first, partitions=1)
    produce(kafka, first, [(None, b"f%d" % i, 0) for i in range(10)])
    out, cp = str(tmp_path / "out"), str(tmp_path / "cp")

    def run() -> None:
        df = read_stream(spark, kafka, [first, later], starting_offsets="latest")
        q = (df.select("topic", "value").writeStream.format("parquet").option("path", out)
             .option("checkpointLocation", cp).trigger(availableNow=True).start())
        assert q.awaitTermination(bound(180)) and q.exception() is None

    run()  # `later` does not exist yet; `first` starts at its end
    ensure_topic(kafka, later, partitions=2)
    produce(kafka, later, [(None, b"l%d" % i, i % 2) for i in range(20)])
    produce(kafka, first, [(None, b"f-new", 0)])
    run()
    got = sorted((r.topic, bytes(r.value)) for r in spark.read.parquet(out).collect())
    assert got == sorted([(first, b"f-new")] + [(later, b"l%d" % i) for i in range(20)])


def test_transactions_committed_visible_aborted_hidden_and_tail_does_not_hang(spark, kafka, unique, tmp_path):
    topic = unique("src-txn")
    ensure_topic(kafka, topic, partitions=2)
    p = Producer({**kafka, "transactional.id": unique("txn-test")})
    p.init_transactions()
    expected = set()
    for t in range(6):
        p.begin_transaction()
        for i in range(50):
            value = b"t%d-%d" % (t, i)
            p.produce(topic, value, partition=i % 2)
            if t % 3 != 1:
                expected.add(value)
        if t % 3 == 1:
            p.abort_transaction()
        else:
            p.commit_transaction()
    # Every partition now ends with a transaction marker: a range's last offsets hold no record.
    df = read_stream(spark, kafka, [topic], starting_offsets="earliest", max_offsets_per_trigger=120)
    name = unique("q").replace("-", "_")
    started = time.monotonic()
    run_available_now(spark, df, name, str(tmp_path / "cp"))
    assert time.monotonic() - started < bound(90)
    got = [r.value for r in rows_of(spark, name)]
    assert len(got) == len(expected) and set(got) == expected


def test_end_offsets_probe_finds_true_end_and_respects_open_transactions(kafka, unique):
    topic = unique("src-probe")
    ensure_topic(kafka, topic, partitions=1)
    produce(kafka, topic, [(None, b"x%d" % i, 0) for i in range(500)])  # few large batches
    probe = EndOffsetProbe(kafka)
    try:
        tps = probe.partitions([topic])
        assert tps == [(topic, 0)]
        assert probe.probe(tps).end == {(topic, 0): 500}
        p = Producer({**kafka, "transactional.id": unique("txn-open")})
        p.init_transactions()
        p.begin_transaction()
        for i in range(10):
            p.produce(topic, b"open%d" % i, partition=0)
        p.flush()
        # An open transaction: a read_committed reader must not be asked to go past it.
        assert probe.probe(tps, {(topic, 0): 500}).end == {(topic, 0): 500}
        p.commit_transaction()
        end = probe.probe(tps, {(topic, 0): 500}).end[(topic, 0)]
        assert end > 510  # ten records plus the commit marker
        assert len(list(read_to_end(kafka, topic))) == 510
        assert probe.partitions([unique("missing")]) == []
    finally:
        probe.close()


def test_rate_limit_shares_in_proportion_and_sums_exactly():
    a, b, c = ("t", 0), ("t", 1), ("t", 2)
    assert rate_limit({a: 0, b: 0}, {a: 10, b: 20}, 100) == {a: 10, b: 20}
    capped = rate_limit({a: 0, b: 100, c: 5}, {a: 1000, b: 400, c: 5}, 130)
    assert capped[c] == 5 and sum(capped[t] - s for t, s in {a: 0, b: 100, c: 5}.items()) == 130
    assert capped[a] == 100 and capped[b] == 130
    tiny = rate_limit({a: 0, b: 0, c: 0}, {a: 1, b: 1, c: 1}, 2)
    assert sum(tiny.values()) == 2


def test_offsets_json_is_canonical_and_starting_offsets_are_validated():
    assert to_json_offsets({("b", 10): 1, ("a", 2): 3, ("b", 9): 4}) == {"a": {"2": 3}, "b": {"9": 4, "10": 1}}
    assert list(to_json_offsets({("b", 10): 1, ("b", 9): 4})["b"]) == ["9", "10"]
    assert parse_starting_offsets("earliest", ["t"]) == -2
    assert parse_starting_offsets('{"t": {"0": 5, "1": -1}}', ["t"]) == {("t", 0): 5, ("t", 1): -1}
    with pytest.raises(ConfigError, match="not subscribed"):
        parse_starting_offsets('{"u": {"0": 5}}', ["t"])
    with pytest.raises(ConfigError, match="startingOffsets"):
        parse_starting_offsets("yesterday", ["t"])


def test_missing_options_are_named(spark):
    from enrich.source import register

    register(spark)
    bad: list[Callable[[], object]] = [
        lambda: spark.readStream.format("refstream-kafka").option("subscribe", "t").load(),
        lambda: spark.readStream.format("refstream-kafka").option("kafka.bootstrap.servers", "x:1").load(),
    ]
    for make, needle in zip(bad, ["kafka.bootstrap.servers", "subscribe"], strict=True):
        with pytest.raises(Exception, match=needle):
            df = make()
            df.writeStream.format("memory").queryName("never").start().awaitTermination(bound(30))


def test_builtin_switch_uses_sparks_kafka_format_with_the_same_options(spark, kafka):
    from enrich.source import source_options

    opts = source_options(kafka, ["a", "b"], starting_offsets="earliest", max_offsets_per_trigger=5)
    assert opts == {"kafka.bootstrap.servers": kafka["bootstrap.servers"], "subscribe": "a,b",
                    "startingOffsets": "earliest", "maxOffsetsPerTrigger": "5"}
    # This machine has no spark-sql-kafka connector: the switch must reach Spark's "kafka" format.
    with pytest.raises(Exception, match=r"(?i)find (the )?data source: kafka"):
        read_stream(spark, kafka, ["a"], builtin=True)


def recreate(settings: dict[str, str], topic: str, partitions: int = 1) -> None:
    """Delete ``topic`` and create it again (empty, offsets from 0, a new topic id)."""
    client = admin(settings)
    client.delete_topics([topic])[topic].result()
    deadline = time.monotonic() + bound(30)
    while topic in client.list_topics(timeout=bound(10)).topics:
        assert time.monotonic() < deadline, f"{topic} still listed after its deletion"
        time.sleep(0.1)
    ensure_topic(settings, topic, partitions=partitions)


def test_recreated_or_truncated_topic_is_detected_and_handled_by_on_offset_reset(kafka, unique):
    """The driver side of the source, one trigger at a time, against a topic deleted and recreated
    (the Spark query over it is exercised by the job's test; librdkafka clients that knew a topic
    may crash when it is recreated on the test broker, so no long-lived client sees it here)."""
    topic = unique("src-reset")
    ensure_topic(kafka, topic, partitions=1)
    produce(kafka, topic, [(None, b"old%d" % i, 0) for i in range(30)])
    tp = (topic, 0)

    def trigger(policy: str, start: dict) -> tuple[dict, list[tuple[int, int]]]:
        opts = source_options(kafka, [topic], starting_offsets="earliest")
        reader = KafkaStreamReader(SourceOptions.parse({**opts, "onOffsetReset": policy}))
        try:
            start = start or reader.initialOffset()
            end = reader.latestOffset(start, ReadAllAvailable())
            return end, [(r.start, r.end) for r in reader.partitions(start, end)]
        finally:
            reader.stop()

    end, ranges = trigger("fail", {})
    assert ranges == [(0, 30)] and topic_ids_of(end).get(topic)
    # Recreated with fewer records than the checkpointed position.
    recreate(kafka, topic)
    produce(kafka, topic, [(None, b"new%d" % i, 0) for i in range(10)])
    with pytest.raises(DataError, match=rf"^topic {topic} partition 0 was deleted and recreated \(topic id"):
        trigger("fail", end)
    no_ids = {k: v for k, v in end.items() if k != TOPIC_IDS}  # a checkpoint from a broker without topic ids
    with pytest.raises(DataError, match=rf"^topic {topic} partition 0 ends at offset 10 now, below the "
                                        r"checkpointed position 30 \(offsets went backwards"):
        trigger("fail", no_ids)
    again, ranges = trigger("earliest", end)  # re-read the new topic from its start
    assert ranges == [(0, 10)] and from_json_offsets(again) == {tp: 10}
    assert trigger("fail", again)[1] == []  # and go on from there
    # Recreated with more records than the position: only the topic id tells.
    recreate(kafka, topic)
    produce(kafka, topic, [(None, b"newer%d" % i, 0) for i in range(50)])
    with pytest.raises(DataError, match=rf"^topic {topic} partition 0 was deleted and recreated"):
        trigger("fail", again)
    skipped, ranges = trigger("latest", again)  # skip to its end
    assert ranges == [] and from_json_offsets(skipped) == {tp: 50}
    produce(kafka, topic, [(None, b"tail%d" % i, 0) for i in range(5)])
    assert trigger("fail", skipped)[1] == [(50, 55)]


def test_offsets_deleted_before_they_were_read_stop_the_query_or_are_skipped_and_counted():
    """Retention cannot be produced on the test broker (no deletion of records, a recreated topic
    starts at 0 again): the decisions are checked on what the probe and a fetch report."""
    tp = ("ev", 0)
    with pytest.raises(DataError, match=r"^topic ev partition 0: offsets \[5, 20\) were deleted \(retention\)"):
        check_retention({tp: 5}, {tp: 20}, fail_on_data_loss=True)
    assert check_retention({tp: 5}, {tp: 20}, fail_on_data_loss=False) == ({tp: 20}, {tp: 15})
    assert check_retention({tp: 20}, {tp: 20}, fail_on_data_loss=True) == ({}, {})

    def reader(fail: bool, end: int, low: int) -> KafkaStreamReader:
        opts = SourceOptions.parse({"kafka.bootstrap.servers": "unused:1", "subscribe": "ev",
                                    "failOnDataLoss": str(fail).lower()})
        r = KafkaStreamReader(opts)
        r._ends = lambda known: ProbeResult({tp: end}, {tp: low}, {tp: end})  # type: ignore[method-assign]
        r._topic_ids = dict  # type: ignore[method-assign]
        return r

    start = {"ev": {"0": 5}}
    with pytest.raises(DataError, match=r"offsets \[5, 20\) were deleted"):
        reader(True, 30, 20).latestOffset(start, ReadAllAvailable())
    r = reader(False, 30, 20)
    end = r.latestOffset(start, ReadAllAvailable())
    assert [(p.start, p.end) for p in r.partitions(start, end)] == [(20, 30)] and r.lost == {tp: 15}
    # A partition whose whole range is gone (empty now) is detected too.
    with pytest.raises(DataError, match=r"offsets \[5, 20\) were deleted"):
        reader(True, 20, 20).latestOffset(start, ReadAllAvailable())
    r = reader(False, 20, 20)
    end = r.latestOffset(start, ReadAllAvailable())
    assert r.partitions(start, end) == [] and from_json_offsets(end) == {tp: 20} and r.lost == {tp: 15}
    # Executors: records deleted between planning and reading, a range with nothing left included.
    rng = OffsetRange("ev", 0, 5, 10)
    assert lost_offsets(rng, None, 12) == (5, 10)   # empty: the whole range is gone
    assert lost_offsets(rng, 7, 7) == (5, 7)
    assert lost_offsets(rng, 7, 5) is None          # transaction markers or aborted records, not loss
    assert lost_offsets(rng, None, 0) is None


def test_a_silent_broker_means_no_new_batch_until_the_poll_timeout(tmp_path) -> None:
    """Nothing listens at the bootstrap address: the first trigger answers the start offsets (no new
    batch) and the one after the poll timeout fails naming the option; an available-now run fails at
    the first (an unanswered trigger would end it early)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {**source_options({"bootstrap.servers": f"127.0.0.1:{port}"}, ["ev"]), "kafkaConsumer.pollTimeoutMs": "1000"}
    start = to_json_offsets({("ev", 0): 7})
    reader = KafkaStreamReader(SourceOptions.parse(opts))
    try:
        assert reader.latestOffset(start, ReadAllAvailable()) == start
        with pytest.raises(TransientError, match=r"ev: the broker has not answered for \d+s \(kafkaConsumer.pollTimeoutMs\)"):
            reader.latestOffset(start, ReadAllAvailable())
        reader._available_now = {("ev", 0): 9}
        with pytest.raises(TransientError, match="cannot read metadata of topic ev"):
            reader.latestOffset(start, ReadAllAvailable())
    finally:
        if reader._probe is not None:
            reader._probe.close()
