"""Following a changelog on the real broker, and pinning dimension versions per batch."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from enrich.dimension import changelog as changelog_mod
from enrich.dimension.changelog import ChangelogFollower
from enrich.dimension.manager import Dimensions
from enrich.dimension.ship import Shipped, Shipper
from enrich.dimension.store import DimensionState
from enrich.dimension.versions import FileVersionLog
from enrich.ipc import from_ipc
from refstream import contract
from refstream import kafka as rkafka
from refstream.contract import Column, DatasetSchema
from refstream.errors import TransientError
from tests.enrich.helpers import changelog, publish
from tests.timing import bound

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))


def owners(state: DimensionState) -> dict[str, str | None]:
    state.compact()
    assert state.base is not None
    return {r["device_id"]: r["owner"] for r in state.base.to_pylist()}


def test_read_to_end_then_until_never_overshoots(kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("ref.devices")
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": f"d{i}", "owner": "a"} for i in range(50)]))
    f = ChangelogFollower(kafka, topic)
    try:
        recs = f.read_to_end(10)
        assert len(recs) == 51 and f.positions() == {0: 51}
        assert f.read_to_end(10) == [] and f.positions() == {0: 51}
        publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "b"}, {"device_id": "d2", "owner": "c"}],
                                        version=2, with_schema=False))
        # Ask for the first new record only: the second must stay for later.
        assert [r.offset for r in f.read_until({0: 52}, 10)] == [51]
        assert f.positions() == {0: 52}
        assert [r.offset for r in f.read_to_end(10)] == [52]
    finally:
        f.close()


def test_read_to_end_applies_the_whole_last_record_batch(kafka: dict[str, str],
                                                          unique: Callable[[str], str]) -> None:
    """The embedded broker lists the end of a partition as the base offset of its last record batch
    + 1: with every record in one batch that is offset 1. Bootstrap must still see every record."""
    topic = unique("ref.devices")
    rows = [{"device_id": f"d{i}", "owner": "a"} for i in range(25_000)]
    publish(kafka, topic, changelog(SCHEMA))
    # One large lz4 batch: more records than one consume() call hands over.
    p = Producer({**kafka, "linger.ms": 2000, "batch.size": 4_000_000, "batch.num.messages": 100_000,
                  "message.max.bytes": 8_000_000, "compression.type": "lz4"})
    for m in contract.upsert_messages(SCHEMA, rows, 1):
        p.produce(topic, key=m.key, value=m.value, headers=m.headers)
    assert p.flush(30) == 0
    f = ChangelogFollower(kafka, topic)
    try:
        s = DimensionState("devices")
        s.apply(f.read_to_end(10))
        assert f.positions() == {0: 25_001}
        assert len(owners(s)) == 25_000
        assert f.read_to_end(10) == []
    finally:
        f.close()


def test_transactional_changelog_gaps_are_crossed(kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("ref.devices")
    publish(kafka, topic, [contract.schema_message(SCHEMA)])
    p = Producer({**kafka, "transactional.id": unique("tx")})
    p.init_transactions(10)
    for owner in ("x", "y"):
        p.begin_transaction()
        for m in contract.upsert_messages(SCHEMA, [{"device_id": "d1", "owner": owner}], 1):
            p.produce(topic, key=m.key, value=m.value, headers=m.headers)
        p.commit_transaction(10)
    f = ChangelogFollower(kafka, topic)
    try:
        s = DimensionState("devices")
        s.apply(f.read_to_end(10))
        assert owners(s) == {"d1": "y"}
        end = f.positions()[0]
        assert end >= 3
        assert f.read_until({0: end}, 2) == []  # the commit markers at the end do not make it wait
    finally:
        f.close()


def test_pinned_versions_replay_exactly(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                                       tmp_path: Path) -> None:
    topic = unique("ref.devices")
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "v1"}]))

    def dims() -> Dimensions:
        return Dimensions({"devices": topic}, {"devices": None}, lambda t: ChangelogFollower(kafka, t),
                          FileVersionLog(tmp_path / "dimensions"), Shipper(spark.sparkContext), timeout=bound(10))

    def owner(shipped: Shipped) -> str:
        # What executors see: the broadcast overlay wins over the broadcast base.
        if shipped.overlay is not None:
            return from_ipc(shipped.overlay.value).to_pylist()[0]["owner"]
        return from_ipc(shipped.base.value).to_pylist()[0]["owner"]

    first = dims()
    assert owner(first.pin(0)["devices"]) == "v1"
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "v2"}], version=2, with_schema=False))
    assert owner(first.pin(1)["devices"]) == "v2"
    first.close()
    # A change lands after batch 1 was pinned, then the job "crashes" and batch 1 is replayed:
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "v3"}], version=3, with_schema=False))
    again = dims()
    again.bootstrap()
    one = again.pin(1)["devices"]
    assert owner(one) == "v2", "a replayed batch uses the version it used before"
    two = again.pin(2)["devices"]
    assert owner(two) == "v3"
    # Replaying an older batch than the state holds rebuilds the dimension to that batch's version;
    # the rebuilt state restarts its generations, so nothing shipped before may be reused.
    zero = again.pin(0)["devices"]
    assert owner(zero) == "v1"
    assert zero.base_id not in {one.base_id, two.base_id}, "executors cache lookups by id"
    assert owner(again.pin(2)["devices"]) == "v3"
    again.close()


def test_a_new_checkpoints_bootstrap_stops_at_the_start_positions_given(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A fork bootstraps a dataset to its savepoint's positions (``start``) and its first pin reads
    on from there; a checkpoint with a recorded batch ignores ``start``, as does a dataset not in it."""
    topic, other = unique("ref.devices"), unique("ref.others")
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "v1"}]))
    publish(kafka, other, changelog(SCHEMA, [{"device_id": "d1", "owner": "o1"}]))

    def dims(name: str, start: dict[str, dict[int, int]] | None = None) -> Dimensions:
        return Dimensions({"devices": topic, "others": other}, {"devices": None, "others": None},
                          lambda t: ChangelogFollower(kafka, t), FileVersionLog(tmp_path / name),
                          Shipper(spark.sparkContext), timeout=bound(10), start=start)

    saved = dims("original")
    saved.pin(0)
    saved.close()
    at = FileVersionLog(tmp_path / "original").get(0)
    assert at is not None
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "v2"}], version=2, with_schema=False))
    publish(kafka, other, changelog(SCHEMA, [{"device_id": "d1", "owner": "o2"}], version=2, with_schema=False))

    fork = dims("fork", {"devices": at["devices"]})
    fork.bootstrap()
    assert owners(fork.state("devices")) == {"d1": "v1"}    # to the start positions
    assert owners(fork.state("others")) == {"d1": "o2"}     # not in start: to the end
    fork.pin(0)
    assert owners(fork.state("devices")) == {"d1": "v2"}    # the first pin reads on
    fork.close()
    again = dims("fork", {"devices": at["devices"]})        # batch 0 recorded: its positions win
    again.bootstrap()
    assert owners(again.state("devices")) == {"d1": "v2"}
    again.close()


def test_a_read_cut_short_never_pins_a_position_inside_a_transaction(kafka: dict[str, str],
                                                                     unique: Callable[[str], str]) -> None:
    """A committed refresh larger than one fetch, then one still open. The embedded broker lists the
    end as 0 while a transaction is open, and every read here stops at its deadline after one fetch:
    positions may only ever be before the committed transaction or after it, never inside it."""
    topic = unique("ref.devices")
    publish(kafka, topic, [contract.schema_message(SCHEMA)])
    p = rkafka.producer(kafka, role="publisher", **{"transactional.id": unique("tx")})
    p.init_transactions(10)
    p.begin_transaction()
    for m in contract.upsert_messages(SCHEMA, [{"device_id": f"d{i}", "owner": "a"} for i in range(30_000)], 1):
        p.produce(topic, key=m.key, value=m.value, headers=m.headers)
    p.commit_transaction(30)
    end = 30_002  # schema record, 30,000 upserts, the commit marker
    p.begin_transaction()
    for m in contract.upsert_messages(SCHEMA, [{"device_id": f"d{i}", "owner": "b"} for i in range(10)], 2):
        p.produce(topic, key=m.key, value=m.value, headers=m.headers)
    assert p.flush(10) == 0  # produced, not committed
    f = ChangelogFollower(kafka, topic)
    try:
        s = DimensionState("devices")
        seen = []
        for _ in range(200):
            s.apply(f.read_to_end(0.001))
            seen.append(f.positions()[0])
            assert seen[-1] in (0, end), f"pinned inside the transaction: {seen}"
            if seen[-1] == end:
                break
        assert seen[-1] == end
        assert set(owners(s).values()) == {"a"} and len(owners(s)) == 30_000
        assert f.read_to_end(0.5) == [] and f.positions() == {0: end}  # the open transaction stays unseen
        p.commit_transaction(10)
        s.apply(f.read_to_end(10))
        assert f.positions() == {0: end + 11}
        assert sum(o == "b" for o in owners(s).values()) == 10
    finally:
        f.close()


def test_bootstrap_reads_on_a_changelog_longer_than_its_timeout(spark: SparkSession, kafka: dict[str, str],
                                                                 unique: Callable[[str], str], tmp_path: Path) -> None:
    """A read stopped by its deadline hands out nothing before the partition's end, schema record
    included: bootstrap reads on while records arrive instead of reporting no schema record."""
    topic = unique("ref.devices")
    publish(kafka, topic, changelog(SCHEMA))
    p = Producer({**kafka, "linger.ms": 100, "compression.type": "lz4", "queue.buffering.max.messages": 500_000})
    for m in contract.upsert_messages(SCHEMA, [{"device_id": f"d{i}", "owner": "a"} for i in range(400_000)], 1):
        p.produce(topic, key=m.key, value=m.value, headers=m.headers)
    assert p.flush(60) == 0
    dims = Dimensions({"devices": topic}, {"devices": None}, lambda t: ChangelogFollower(kafka, t),
                      FileVersionLog(tmp_path / "dimensions"), Shipper(spark.sparkContext), timeout=1.0)
    try:
        dims.bootstrap()
        assert len(dims.state("devices")) == 400_000
    finally:
        dims.close()


def _slow_first_fetches(f: ChangelogFollower, for_s: float) -> None:
    """Make ``f``'s fetches deliver nothing for ``for_s`` seconds, as a loaded machine's first fetch
    (connect, list offsets, a full fetch to decompress) can, then fetch for real."""
    real, until = f._fetch, time.monotonic() + for_s

    def fetch(timeout: float) -> int:
        if time.monotonic() < until:
            time.sleep(timeout)
            return 0
        return real(timeout)
    f._fetch = fetch  # type: ignore[method-assign]


def test_a_short_read_waits_for_a_slow_first_fetch(kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    """A deadline shorter than the first fetch cuts nothing: with nothing seen yet the read waits
    on (up to the stall limit) instead of reporting no progress."""
    topic = unique("ref.devices")
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": f"d{i}", "owner": "a"} for i in range(50)]))
    f = ChangelogFollower(kafka, topic)
    try:
        _slow_first_fetches(f, 2.0)
        t0 = time.monotonic()
        recs = f.read_to_end(0.5)
        assert time.monotonic() - t0 >= 2.0
        while f.pending() or not recs:  # cut by its deadline once records arrived: read on
            recs += f.read_to_end(10)
        assert len(recs) == 51 and f.positions() == {0: 51}
    finally:
        f.close()


def test_no_progress_past_the_stall_limit_is_a_transient_error(kafka: dict[str, str], unique: Callable[[str], str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    topic = unique("ref.devices")
    publish(kafka, topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "a"}]))
    monkeypatch.setattr(changelog_mod, "STALL_FLOOR_S", 1.0)
    f = ChangelogFollower(kafka, topic)
    try:
        _slow_first_fetches(f, 5.0)
        t0 = time.monotonic()
        with pytest.raises(TransientError, match=rf"changelog {topic}: no progress towards offsets .* for 1s"):
            f.read_to_end(0.5)
        assert 1.0 <= time.monotonic() - t0 < bound(3.0)
    finally:
        f.close()
