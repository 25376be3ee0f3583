"""A partitioned dimension's bucket, in pure Arrow: changelog records applied in order, the last
change of a key winning, tombstones, schema records, and the lookup the processor makes."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pyarrow as pa
import pytest

from enrich.columns import KEY_BYTES
from enrich.joins import JoinSpec
from enrich.joins.partitioned import (
    PartitionedDim,
    Version,
    VersionCache,
    apply_changes,
    conform,
    lookup,
    partitioned_dim,
)
from refstream import contract
from refstream.contract import Column, DatasetSchema
from refstream.errors import ContractError

SCHEMA = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("owner", "string"),
                                            Column("limit", "float64")))


def make_dim(columns: tuple[str, ...] = ("owner", "limit")) -> PartitionedDim:
    """What ``enrich.joins.resolve`` makes of ``on: device_id`` (it needs a JVM to parse types)."""
    types = {"owner": pa.string(), "limit": pa.float64()}
    spec = JoinSpec(dataset="devices", pairs=(("device_id", "id"),), key_types=(pa.int64(),),
                    columns=tuple((c, c) for c in columns), out_types=tuple(types[c] for c in columns),
                    matched="_devices_matched", inner=False)
    return partitioned_dim(0, "devices", "ref.devices", SCHEMA, spec, inner=False)


def records(*messages: contract.Message, partition: int = 0, first: int = 0) -> pa.Table:
    ms = list(messages)
    return pa.table({"partition": pa.array([partition] * len(ms), pa.int32()),
                     "offset": pa.array(range(first, first + len(ms)), pa.int64()),
                     "key": pa.array([m.key for m in ms], pa.binary()),
                     "value": pa.array([m.value for m in ms], pa.binary())})


def upserts(*rows: dict, version: int = 1) -> list[contract.Message]:
    return list(contract.upsert_messages(SCHEMA, list(rows), version))


def rows_of(stored: pa.Table) -> dict:
    return {r["id"]: (r["owner"], r["limit"]) for r in stored.drop_columns([KEY_BYTES]).to_pylist()}


def test_changes_apply_in_changelog_order_last_change_of_a_key_wins() -> None:
    dim = make_dim()
    batch = records(contract.schema_message(SCHEMA),
                    *upserts({"id": 1, "owner": "a", "limit": 1.0}, {"id": 2, "owner": "b", "limit": 2.0}),
                    contract.heartbeat_message("devices", 1, datetime(2026, 1, 1, tzinfo=UTC)),
                    *upserts({"id": 1, "owner": "a2", "limit": None}))
    # Delivered out of order (a shuffle): applied by (partition, offset).
    shuffled = batch.take(pa.array([3, 0, 4, 2, 1]))
    stored, schema = apply_changes(dim, dim.empty(), SCHEMA, shuffled)
    assert rows_of(stored) == {1: ("a2", None), 2: ("b", 2.0)} and schema == SCHEMA
    assert stored.schema == dim.stored

    # The next batch: a tombstone and a re-insert after it; an upsert then its tombstone.
    more = records(*contract.delete_messages(SCHEMA, [{"id": 2}], 2), *upserts({"id": 3, "owner": "c"}),
                   *contract.delete_messages(SCHEMA, [{"id": 3}], 2), *upserts({"id": 2, "owner": "b2"}), first=5)
    stored, _ = apply_changes(dim, stored, schema, more)
    assert rows_of(stored) == {1: ("a2", None), 2: ("b2", None)}
    # Nothing to apply: the same rows back.
    assert apply_changes(dim, stored, schema, records())[0] is stored


def test_schema_records_decode_what_follows_and_guard_the_plan() -> None:
    dim = make_dim()
    wider = DatasetSchema("devices", ("id",), (*SCHEMA.columns, Column("site", "string")), version=2)
    stored, schema = apply_changes(dim, dim.empty(), SCHEMA, records(
        *upserts({"id": 1, "owner": "a", "limit": 1.5}),
        contract.schema_message(wider),
        *contract.upsert_messages(wider, [{"id": 2, "owner": "b", "limit": 2.5, "site": "x"}], 2)))
    assert rows_of(stored) == {1: ("a", 1.5), 2: ("b", 2.5)} and schema == wider

    rekeyed = DatasetSchema("devices", ("owner",), SCHEMA.columns, version=3)
    with pytest.raises(ContractError, match=r"dataset devices: its key changed from \['id'\] to \['owner'\]"):
        apply_changes(dim, stored, schema, records(contract.schema_message(rekeyed)))
    narrower = DatasetSchema("devices", ("id",), SCHEMA.columns[:2], version=3)
    with pytest.raises(ContractError, match=r"column\(s\) limit selected by a join are no longer in the published"):
        apply_changes(dim, stored, schema, records(contract.schema_message(narrower)))


def test_a_value_that_does_not_fit_keeps_its_key_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    dim = make_dim()
    bad = contract.Message(contract.encode_key(["id"], {"id": 7}), b'{"id": 7, "owner": "x", "limit": "lots"}',
                           contract.headers(contract.OP_UPSERT, "devices", 1))
    with caplog.at_level(logging.ERROR):
        stored, _ = apply_changes(dim, dim.empty(), SCHEMA, records(*upserts({"id": 1, "owner": "a"}), bad))
    assert rows_of(stored) == {1: ("a", None), 7: (None, None)}
    assert any("dataset devices: key" in r.getMessage() for r in caplog.records)


def test_lookup_is_the_broadcast_join() -> None:
    dim = make_dim(columns=("owner",))
    stored, _ = apply_changes(dim, dim.empty(), SCHEMA, records(*upserts({"id": 1, "owner": "a"},
                                                                          {"id": 2, "owner": "b"})))
    events = pa.table({"device_id": pa.array([2, None, 5, 1], pa.int64()),
                       "_error": pa.array([None, "bad", None, None], pa.string())})
    out = lookup(dim, events, Version(dim, stored, SCHEMA), "_error")
    assert out.column("owner").to_pylist() == ["b", None, None, "a"]
    assert out.column("_devices_matched").to_pylist() == [True, False, False, True]
    assert lookup(dim, events, Version(dim, dim.empty(), SCHEMA), "_error").column("owner").to_pylist() == [None] * 4
    # Stored rows of older types are brought to the planned ones.
    old = stored.set_column(stored.schema.get_field_index("id"), "id", stored.column("id").cast(pa.int32()))
    assert conform(dim, old).equals(stored)


def test_the_version_cache_keeps_the_recently_used_within_its_bytes() -> None:
    dim = make_dim()
    versions = {}
    for i in range(4):
        stored, _ = apply_changes(dim, dim.empty(), SCHEMA, records(*upserts(*({"id": j, "owner": "o"}
                                                                                for j in range(i * 100, i * 100 + 100)))))
        versions[f"t{i}"] = Version(dim, stored, SCHEMA)
    assert versions["t1"].nbytes == versions["t3"].nbytes
    cache = VersionCache(limit=sum(versions[t].nbytes for t in ("t0", "t1", "t2")))
    for token in ("t0", "t1", "t2"):
        cache.put(token, versions[token])
    assert cache.get("t0") is versions["t0"]           # t0 is now the most recently used
    cache.put("t3", versions["t3"])                      # over the limit: t1, the least recent, goes
    assert cache.get("t1") is None and [cache.get(t) is versions[t] for t in ("t0", "t2", "t3")] == [True] * 3
    versions["t3"].index  # noqa: B018 - built: the version now counts its index too
    cache.put("t3", versions["t3"])
    assert len(cache) < 3 and cache.get("t3") is versions["t3"]
    cache.resize(1)                                      # smaller: the least recent go at once
    assert len(cache) == 1 and cache.get("t3") is versions["t3"]


@pytest.mark.parametrize(("environ", "limit"), [
    ({"PYSPARK_EXECUTOR_MEMORY_MB": "4096"}, 2048 << 20),    # spark.executor.pyspark.memory 8g over 2 cores
    ({"PYSPARK_EXECUTOR_MEMORY_MB": "300"}, 150 << 20),
    ({}, 512 << 20),                                          # not set: Spark bounds no Python worker
    ({"PYSPARK_EXECUTOR_MEMORY_MB": "lots"}, 512 << 20),
])
def test_the_version_cache_takes_half_of_the_python_workers_memory(environ: dict[str, str], limit: int) -> None:
    """Spark gives each Python worker ``spark.executor.pyspark.memory`` divided by the executor's
    cores, in its environment (and as its address-space limit); the cache takes half of it."""
    from enrich.joins.partitioned import cache_limit

    assert cache_limit(environ) == limit


def test_an_as_of_bucket_keeps_versions_pruned_and_looks_events_up_at_their_time() -> None:
    import dataclasses
    from datetime import timedelta

    from enrich.columns import DELETED, VALID_FROM
    from enrich.joins.asof import CLIPPED

    base = make_dim()
    dim = partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(base.join, time="ts"),
                          inner=False, history=timedelta(days=2))
    assert dim.stored.names[-2:] == [VALID_FROM, DELETED]
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at(days: float, *messages: contract.Message, first: int) -> pa.Table:
        t = records(*messages, first=first)
        stamp = contract.format_time(t0 + timedelta(days=days))
        return (t.append_column("valid_from", pa.array([stamp] * t.num_rows))
                .append_column("timestamp", pa.array([None] * t.num_rows, pa.timestamp("us", tz="UTC"))))

    stored, schema = apply_changes(dim, dim.empty(), SCHEMA, at(0, contract.schema_message(SCHEMA), *upserts(
        {"id": 1, "owner": "a0", "limit": 1.0}, {"id": 2, "owner": "b0", "limit": 2.0}), first=0))
    stored, schema = apply_changes(dim, stored, schema, at(1, *upserts({"id": 1, "owner": "a1", "limit": 1.0}),
                                                          first=3))
    deleted = contract.delete_messages(SCHEMA, [{"id": 2}], 2, valid_from=t0 + timedelta(days=3))
    stored, schema = apply_changes(dim, stored, schema, at(3, *deleted, *upserts({"id": 1, "owner": "a3",
                                                                                    "limit": 1.0}), first=4))
    # 1's newest is day 3, its cut day 1: a0 (until day 1) goes, a1 holds at the cut; 2 keeps both.
    assert sorted(zip(stored.column("id").to_pylist(), stored.column("owner").to_pylist(), strict=True),
                  key=str) == [(1, "a1"), (1, "a3"), (2, "b0"), (2, None)]
    events = pa.table({"device_id": pa.array([1, 1, 1, 2, 2], pa.int64()),
                       "ts": pa.array([t0 + timedelta(days=d) for d in (0.5, 2, 4, 2, 4)], pa.timestamp("us", tz="UTC"))})
    out = lookup(dim, events, Version(dim, stored, schema), None)
    assert out.column("owner").to_pylist() == ["a1", "a1", "a3", "b0", None]
    assert out.column(CLIPPED).to_pylist() == [True, False, False, False, False]
    assert out.column("_devices_matched").to_pylist() == [True, True, True, True, False]
