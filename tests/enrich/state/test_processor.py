"""The stateful processor through PySpark's TwsTester (no JVM): packed rows in and out, state per bucket
as bytes, timers."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql.streaming.tws_tester import TwsTester

from enrich import packed
from enrich.columns import FLAT, LATE, TS_US
from enrich.ipc import from_ipc, to_ipc
from enrich.joins import JoinSpec
from enrich.joins.partitioned import PartitionedDim, partitioned_dim
from enrich.state import engine
from enrich.state.cache import LOCAL_DIRS, TableCache
from enrich.state.engine import StateSpec
from enrich.state.processor import DeviceStateProcessor
from enrich.state.stored import DELTAS, HELD, STATE_NAME, bucket_table
from refstream.contract import Column, DatasetSchema

HOUR_US = 3600 * 10**6
T0_US = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp()) * 10**6
SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp=TS_US, ttl_us=HOUR_US,
                 aggregates=(("temperature", ("max", "mean"), pa.float64()), ("battery", ("last",), pa.int32())),
                 timestamp_type=pa.int64())
COLUMNS = ("device_id", "temperature", "battery", "_error", "_partition", "_offset")


def rows(spec: list[tuple], first_offset: int = 0) -> pa.Table:
    """(device, seconds after T0, temperature, battery[, error]) events, offsets counting up, as the
    plan packs them (every column but ``_bucket``)."""
    return pa.table({
        "device_id": pa.array([r[0] for r in spec], pa.string()),
        "temperature": pa.array([r[2] for r in spec], pa.float64()),
        "battery": pa.array([r[3] for r in spec], pa.int32()),
        "_error": pa.array([r[4] if len(r) > 4 else None for r in spec], pa.string()),
        "_partition": pa.array([0] * len(spec), pa.int32()),
        "_offset": pa.array(range(first_offset, first_offset + len(spec)), pa.int64()),
        TS_US: pa.array([T0_US + r[1] * 10**6 for r in spec], pa.int64()),
    })


def packed_input(*chunks: pa.Table) -> pd.DataFrame:
    """Packed rows of bucket 3 as PySpark hands them over (a name starting with "_" becomes "_<i>")."""
    return pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(c) for c in chunks]})


def run(t: TwsTester, *chunks: pa.Table) -> pd.DataFrame:
    """One call of bucket 3 with ``chunks``; the unpacked output as pandas (nullable dtypes)."""
    out = t.testInPandas(3, packed_input(*chunks))
    table = pa.concat_tables([from_ipc(v) for v in out[packed.ROWS]])
    return table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(),
                                         pa.bool_(): pd.BooleanDtype()}.get)


def make_tester() -> TwsTester:
    # Every row reaches the processor (the plan drops Spark's watermark column before the step): the
    # extractor puts every row past the watermark so that the tester does not filter late rows either.
    processor = DeviceStateProcessor(SPEC, COLUMNS)
    return TwsTester(processor, timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)


def stored(t: TwsTester) -> pa.Table:
    """Bucket 3's table as stored: the base, then the changes stored since, in order."""
    value = t.peekValueState(STATE_NAME, 3)
    return bucket_table(SPEC, value[0] if value is not None else None, t.peekListState(DELTAS, 3))


def test_one_call_per_bucket_keeps_every_device() -> None:
    t = make_tester()
    batch = rows([("a", 10, 20.0, 5), ("b", 5, None, None), ("a", 1, 10.0, None),
                  ("c", 2, 1.0, 1, "required field n is null")])
    # As a shuffle may deliver them: in two chunks, out of order.
    out = run(t, batch.take([2, 0]), batch.take([3, 1]))
    # Rows leave in source order; the dead letter passes through without state.
    assert out["_offset"].tolist() == [0, 1, 2, 3]
    assert list(out.columns) == [*COLUMNS, *[FLAT + f.name for f in SPEC.output_type()], LATE]
    assert out[FLAT + "events"].tolist()[:3] == [2, 1, 1] and pd.isna(out[FLAT + "events"][3])
    maxima = out[FLAT + "temperature_max"]
    assert maxima[0] == 20.0 and pd.isna(maxima[1]) and maxima[2] == 10.0
    assert out[FLAT + "temperature_mean"][0] == 15.0 and pd.isna(out[FLAT + "temperature_mean"][1])
    assert out[FLAT + "battery_last"][0] == 5 and out[FLAT + "first_seen"][0] == T0_US + 1 * 10**6
    assert out[LATE].tolist() == [False] * 4
    assert stored(t).column(engine.KEY).to_pylist() == ["a", "b"]
    # The next batch continues from the stored bytes.
    out = run(t, rows([("a", 11, 30.0, None)], 4))
    assert out[FLAT + "events"].tolist() == [3] and out[FLAT + "temperature_mean"].tolist() == [20.0]
    assert out[FLAT + "battery_last"].tolist() == [5]


def test_timer_drops_expired_devices_and_late_events_are_flagged() -> None:
    t = make_tester()
    run(t, rows([("a", 0, 1.0, 1), ("b", 1800, 2.0, 2)]))
    # One timer per bucket, at the next device's expiry (a: T0 + 1h), in milliseconds.
    assert list(t.handle.listTimers()) == [(T0_US + HOUR_US) // 1000]
    t.setWatermark((T0_US + HOUR_US) // 1000)
    assert stored(t).column(engine.KEY).to_pylist() == ["b"]
    assert list(t.handle.listTimers()) == [(T0_US + 1800 * 10**6 + HOUR_US) // 1000]
    out = run(t, rows([("b", 3000, 9.0, 9), ("a", 3601, 4.0, None), ("b", 3600, 9.0, 9)], 2))
    assert out[LATE].tolist() == [True, False, True]
    assert pd.isna(out[FLAT + "events"][0]) and out[FLAT + "events"][1] == 1     # a starts afresh
    assert stored(t).column(engine.EVENTS).to_pylist() == [1, 1]
    t.setWatermark((T0_US + 3601 * 10**6 + HOUR_US) // 1000)
    assert t.peekValueState(STATE_NAME, 3) is None and list(t.handle.listTimers()) == []



def test_event_columns_keep_their_exact_arrow_types() -> None:
    # Packed, no event column goes through pandas: an integer with nulls beyond 2**53 and a time
    # outside pandas' nanosecond range (year 2500) come out as they went in.
    t = make_tester()
    big = 2**62 + 1
    batch = rows([("a", 1, 1.0, 1), ("b", 2, None, None)]).append_column(
        "n", pa.array([big, None], pa.int64())).append_column(
        "when", pa.array([datetime(2500, 1, 1, tzinfo=UTC), None], pa.timestamp("us", tz="UTC")))
    processor = DeviceStateProcessor(SPEC, (*COLUMNS, "n", "when"))
    t = TwsTester(processor, timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
    out = t.testInPandas(3, packed_input(batch))
    table = from_ipc(out[packed.ROWS][0])
    assert table.column("n").to_pylist() == [big, None]
    assert table.column("when").type == pa.timestamp("us", tz="UTC")
    assert table.column("when").to_pylist() == [datetime(2500, 1, 1, tzinfo=UTC), None]
    assert table.column(FLAT + "events").to_pylist() == [1, 1]


def test_a_bucket_of_dead_letters_only_keeps_no_state() -> None:
    t = make_tester()
    out = run(t, rows([(None, 1, 1.0, 1, "state.key device_id is null")]))
    assert out["_error"].tolist() == ["state.key device_id is null"] and pd.isna(out[FLAT + "events"][0])
    assert out[LATE].tolist() == [False]
    assert t.peekValueState(STATE_NAME, 3) is None and list(t.handle.listTimers()) == []


def _owner_dim() -> PartitionedDim:
    """A partitioned join on ``device_id`` adding ``owner``, as the pipeline plans it."""
    schema = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
    spec = JoinSpec(dataset="devices", pairs=(("device_id", "device_id"),), key_types=(pa.string(),),
                    columns=(("owner", "owner"),), out_types=(pa.string(),), matched="_devices_matched", inner=False)
    return partitioned_dim(0, "devices", "ref.devices", schema, spec, inner=False)


def test_a_partitioned_dimension_is_applied_before_the_events_and_cached_per_version() -> None:
    from enrich.joins import partitioned as dimension
    from refstream import contract

    dim = _owner_dim()
    schema = dim.schema
    t = TwsTester(DeviceStateProcessor(SPEC, COLUMNS, dims=(dim,)), timeMode="EventTime",
                  eventTimeExtractor=lambda _: 2**62)

    def changes(rows: list[dict], first: int) -> pa.Table:
        ms = ([contract.schema_message(schema)] if first == 0 else []) + list(contract.upsert_messages(schema, rows, 1))
        table = pa.table({"partition": pa.array([0] * len(ms), pa.int32()),
                          "offset": pa.array(range(first, first + len(ms)), pa.int64()),
                          "key": pa.array([m.key for m in ms], pa.binary()),
                          "value": pa.array([m.value for m in ms], pa.binary())})
        return table.replace_schema_metadata({b"refstream.kind": dim.kind.encode()})

    def owners(*chunks: pa.Table) -> list[str | None]:
        out = run(t, *chunks)
        return [None if pd.isna(o) else o for o in out["owner"]]

    # Changelog records and events in one call: the records come first, whatever the chunks' order.
    assert owners(rows([("a", 0, 1.0, 1), ("b", 1, 2.0, 2)]), changes([{"device_id": "a", "owner": "ann"}], 0)) \
        == ["ann", None]
    token = t.peekValueState(dim.state_name + "v", 3)
    assert token is not None and dimension.CACHE.get(token[0]) is not None
    # No records: the version comes from this worker's cache, not from the stored rows (spoiled here).
    t.updateValueState(dim.state_name, 3, (b"not arrow", schema.to_json()))
    assert owners(rows([("a", 2, 1.0, 1)], 2)) == ["ann"]
    # A change: a new token; the rows are read (put back) and the change applied.
    t.updateValueState(dim.state_name, 3, (to_ipc(dimension.CACHE.get(token[0]).rows), schema.to_json()))  # type: ignore[union-attr]
    assert owners(changes([{"device_id": "b", "owner": "bob"}], 5), rows([("b", 3, 1.0, 1)], 3)) == ["bob"]
    assert t.peekValueState(dim.state_name + "v", 3) != token
    # The cache emptied (another worker): the stored rows are read.
    dimension.CACHE._items.clear()
    assert owners(rows([("a", 4, 1.0, 1), ("b", 5, 1.0, 1)], 4)) == ["ann", "bob"]


def test_the_dimension_cache_is_sized_from_the_python_workers_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark puts ``spark.executor.pyspark.memory`` / executor cores in the worker's environment; the
    processor sizes this worker's version cache from it before it uses the cache."""
    from enrich.joins import partitioned as dimension

    monkeypatch.setattr(dimension.CACHE, "limit", dimension.CACHE.limit)  # put back after the test
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", "100")
    t = TwsTester(DeviceStateProcessor(SPEC, COLUMNS, dims=(_owner_dim(),)), timeMode="EventTime",
                  eventTimeExtractor=lambda _: 2**62)
    run(t, rows([("a", 0, 1.0, 1)]))
    assert dimension.CACHE.limit == 50 << 20


def test_a_bucket_table_is_read_from_the_executor_cache_when_it_holds_the_stored_version(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(LOCAL_DIRS, str(tmp_path))
    cache = TableCache("run-1")
    t = TwsTester(DeviceStateProcessor(SPEC, COLUMNS, cache=cache), timeMode="EventTime",
                  eventTimeExtractor=lambda _: 2**62)
    run(t, rows([("a", 0, 1.0, 1), ("b", 1, 2.0, 2)]))
    token = t.peekValueState(STATE_NAME + "v", 3)[0]
    files = list(cache.directory().iterdir())
    assert [f.name for f in files] == [token]
    assert files[0].read_bytes() == t.peekValueState(STATE_NAME, 3)[0]  # the stored bytes, as stored
    # A hit reads the file, not the state store: a file naming the token with other contents shows it.
    other = engine.apply(SPEC, SPEC.empty(), rows([("a", 0, 1.0, 1)] * 5), None).state
    files[0].write_bytes(engine.state_to_ipc(other))
    out = run(t, rows([("a", 2, 1.0, 1)], 2))
    assert out[FLAT + "events"].tolist() == [6]
    # Each store replaces the bucket's file: one file, the new token's.
    token = t.peekValueState(STATE_NAME + "v", 3)[0]
    assert [f.name for f in cache.directory().iterdir()] == [token]
    # A miss (a new run, another executor, a retried task) reads the state store.
    (cache.directory() / token).unlink()
    out = run(t, rows([("a", 3, 1.0, 1), ("b", 3, 1.0, 1)], 3))
    assert out[FLAT + "events"].tolist() == [7, 2]  # the store kept what changed: a's row, b as it was
    # A bucket left without devices keeps neither a token nor a file.
    t.setWatermark((T0_US + 3 * 10**6 + HOUR_US) // 1000)
    assert t.peekValueState(STATE_NAME, 3) is None and t.peekValueState(STATE_NAME + "v", 3) is None
    assert list(cache.directory().iterdir()) == []


def test_a_batch_stores_what_it_changed_until_the_changes_outweigh_the_base() -> None:
    t = make_tester()
    run(t, rows([(f"d{i}", 0, 1.0, 1) for i in range(4)]))
    base = t.peekValueState(STATE_NAME, 3)
    assert base is not None and t.peekListState(DELTAS, 3) == []
    run(t, rows([("d0", 1, 2.0, 2)], 4))
    assert t.peekValueState(STATE_NAME, 3) == base and len(t.peekListState(DELTAS, 3)) == 1
    run(t, rows([("d1", 2, 2.0, 2), ("d2", 2, 2.0, 2), ("d0", 2, 3.0, 3)], 5))  # 3 rows changed since the base of 4
    deltas = t.peekListState(DELTAS, 3)
    assert t.peekValueState(STATE_NAME, 3) == base and len(deltas) == 2
    # The changes are applied in the order they were stored, whatever order a reader returns them in
    # (Spark's state reader, for the lookup): d0's second change wins.
    for given in (deltas, deltas[::-1]):
        table = bucket_table(SPEC, base[0], given)
        assert dict(zip(table.column(engine.KEY).to_pylist(), table.column(engine.EVENTS).to_pylist(),
                        strict=True)) == {"d0": 3, "d1": 2, "d2": 2, "d3": 1}
    run(t, rows([("d3", 3, 2.0, 2), ("d4", 3, 1.0, 1)], 7))  # 5 would outweigh it: a new base
    assert t.peekValueState(STATE_NAME, 3) != base and t.peekListState(DELTAS, 3) == []
    table = stored(t)
    assert dict(zip(table.column(engine.KEY).to_pylist(), table.column(engine.EVENTS).to_pylist(),
                    strict=True)) == {"d0": 3, "d1": 2, "d2": 2, "d3": 2, "d4": 1}
    # Expiry stores the keys it dropped; the devices the next call sees are the ones stored.
    t.setWatermark((T0_US + 2 * 10**6 + HOUR_US) // 1000)
    assert sorted(stored(t).column(engine.KEY).to_pylist()) == ["d3", "d4"]
    out = run(t, rows([("d0", 7000, 1.0, 1), ("d4", 7000, 1.0, 1)], 9))
    assert out[FLAT + "events"].tolist() == [1, 2]


def test_a_forks_initial_state_is_continued_and_its_watermark_floor_flags_late_events() -> None:
    """A forked job's first batch: the bucket's devices from the savepoint (in two hand-overs, as
    PySpark may split them) are continued, and an event at or before the savepoint's watermark (the
    floor) is late although Spark's own watermark has not reached it."""
    first = engine.apply(SPEC, SPEC.empty(), rows([("a", 1, 10.0, 1), ("a", 2, 20.0, None)]).select(
        ["device_id", TS_US, "_partition", "_offset", "temperature", "battery"]), None).state
    second = engine.apply(SPEC, SPEC.empty(), rows([("b", 3, 5.0, 7)]).select(
        ["device_id", TS_US, "_partition", "_offset", "temperature", "battery"]), None).state
    initial = [(3, pd.DataFrame({"kind": [STATE_NAME], "table": [to_ipc(t)], "schema": [None]}))
               for t in (first, second)]
    processor = DeviceStateProcessor(SPEC, COLUMNS, floor_us=T0_US + 100 * 10**6)
    t = TwsTester(processor, timeMode="EventTime", eventTimeExtractor=lambda _: 2**62, initialStatePandas=initial)
    assert sorted(stored(t).column(engine.KEY).to_pylist()) == ["a", "b"]
    assert list(t.handle.listTimers()) == [(T0_US + 2 * 10**6 + HOUR_US) // 1000]   # a expires first
    out = run(t, rows([("a", 50, 99.0, 9), ("a", 101, 30.0, None), ("b", 102, None, None)], 10))
    assert out[LATE].tolist() == [True, False, False]
    assert out[FLAT + "events"].tolist()[1:] == [3, 2]
    assert out[FLAT + "temperature_mean"][1] == 20.0 and out[FLAT + "temperature_max"][2] == 5.0
    assert out[FLAT + "battery_last"].tolist()[1:] == [1, 7]
    # Without the floor the same event is applied: the floor is what makes it late.
    plain = TwsTester(DeviceStateProcessor(SPEC, COLUMNS), timeMode="EventTime", eventTimeExtractor=lambda _: 2**62,
                      initialStatePandas=initial)
    assert run(plain, rows([("a", 50, 99.0, 9)], 10))[LATE].tolist() == [False]


def test_held_events_wait_in_the_bucket_and_count_in_the_state_when_released(monkeypatch: pytest.MonkeyPatch) -> None:
    from enrich.state import processor as proc
    from enrich.state.wait import BatchFacts, WaitSpec

    facts = {"now": BatchFacts(T0_US // 1000, {"owners": T0_US + 10 * 10**6})}
    monkeypatch.setattr(proc, "_batch_facts", lambda: facts["now"])
    t = TwsTester(DeviceStateProcessor(SPEC, COLUMNS, waits=WaitSpec.of({"owners": pd.Timedelta(minutes=15)})),
                  timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
    tick = pd.DataFrame({"_0": [3], "rows": [packed.marker("tick")]})

    def call(frame: pd.DataFrame) -> pd.DataFrame:
        out = t.testInPandas(3, frame)
        return pa.concat_tables([from_ipc(v) for v in out[packed.ROWS]]).to_pandas() if len(out) else pd.DataFrame()

    # Complete as of 10s: the event at 5s goes on, those at 20s and 30s wait; the dead letter never does.
    out = call(packed_input(rows([("a", 5, 1.0, 1), ("a", 20, 2.0, 2), ("b", 30, 3.0, 3),
                                  ("c", 1, 1.0, 1, "required field n is null")])))
    assert out["_offset"].tolist() == [0, 3] and out["_provisional"].tolist() == [False, False]
    assert out[FLAT + "events"].tolist()[0] == 1
    assert t.peekValueState(HELD, 3) is not None
    # A tick alone: complete as of 25s now, the event at 20s is released final and counted then.
    facts["now"] = BatchFacts(T0_US // 1000 + 1000, {"owners": T0_US + 25 * 10**6})
    out = call(tick)
    assert out["_offset"].tolist() == [1] and out["_provisional"].tolist() == [False]
    assert out[FLAT + "events"].tolist() == [2] and out[FLAT + "temperature_max"].tolist() == [2.0]
    assert call(tick).empty  # nothing new to release
    # 15 minutes after the first read, with no more completeness: the last one goes, provisional.
    facts["now"] = BatchFacts(T0_US // 1000 + 15 * 60_000, {"owners": T0_US + 25 * 10**6})
    out = call(tick)
    assert out["_offset"].tolist() == [2] and out["_provisional"].tolist() == [True]
    assert out[FLAT + "events"].tolist() == [1]
    assert t.peekValueState(HELD, 3) is None
    assert stored(t).column(engine.KEY).to_pylist() == ["a", "b"]


def test_rows_held_under_an_earlier_plan_fit_this_batchs_events() -> None:
    from enrich.state.processor import _conform

    held = pa.table({"device_id": ["a"], "n": pa.array([1], pa.int32())})
    now = pa.schema([("device_id", pa.string()), ("n", pa.int64()), ("extra", pa.string())])
    got = _conform(held, now, ())
    assert got.schema == now and got.to_pylist() == [{"device_id": "a", "n": 1, "extra": None}]
    assert _conform(held, None, ("device_id", "extra")).column("extra").null_count == 1  # a tick alone
