"""The stateful processor through PySpark's TwsTester (no JVM): state per bucket as bytes, timers."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import pyarrow as pa
from pyspark.sql.streaming.tws_tester import TwsTester

from enrich.state import engine
from enrich.state.engine import StateSpec
from enrich.state.processor import FLAT, LATE, STATE_NAME, TS_US, DeviceStateProcessor

HOUR_US = 3600 * 10**6
T0_US = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp()) * 10**6
SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp=TS_US, ttl_us=HOUR_US,
                 aggregates=(("temperature", ("max", "mean"), pa.float64()), ("battery", ("last",), pa.int32())),
                 timestamp_type=pa.int64())
COLUMNS = ("device_id", "temperature", "battery", "_error", "_partition", "_offset")


def rows(spec: list[tuple], first_offset: int = 0) -> pd.DataFrame:
    """(device, seconds after T0, temperature, battery[, error]) rows, offsets counting up; columns
    named as Spark hands them over (a name starting with "_" becomes "_<position>")."""
    df = pd.DataFrame({
        "device_id": [r[0] for r in spec],
        "temperature": [r[2] for r in spec],
        "battery": pd.array([r[3] for r in spec], dtype="Int32"),
        "_error": [r[4] if len(r) > 4 else None for r in spec],
        "_partition": [0] * len(spec),
        "_offset": list(range(first_offset, first_offset + len(spec))),
        "_bucket": [3] * len(spec),
        TS_US: [T0_US + r[1] * 10**6 for r in spec],
    })
    df.columns = [f"_{i}" if c.startswith("_") else c for i, c in enumerate(df.columns)]
    return df


def make_tester() -> TwsTester:
    # Every row reaches the processor (the plan drops Spark's watermark column before the step): the
    # extractor puts every row past the watermark so that the tester does not filter late rows either.
    processor = DeviceStateProcessor(SPEC, (*COLUMNS, "_bucket", TS_US), COLUMNS)
    return TwsTester(processor, timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)


def stored(t: TwsTester) -> pa.Table:
    value = t.peekValueState(STATE_NAME, 3)
    return engine.state_from_ipc(value[0], SPEC) if value is not None else SPEC.empty()


def test_one_call_per_bucket_keeps_every_device() -> None:
    t = make_tester()
    batch = rows([("a", 10, 20.0, 5), ("b", 5, None, None), ("a", 1, 10.0, None),
                  ("c", 2, 1.0, 1, "required field n is null")])
    out = t.testInPandas(3, batch.iloc[[2, 0, 3, 1]].reset_index(drop=True))   # as a shuffle may deliver them
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
    out = t.testInPandas(3, rows([("a", 11, 30.0, None)], 4))
    assert out[FLAT + "events"].tolist() == [3] and out[FLAT + "temperature_mean"].tolist() == [20.0]
    assert out[FLAT + "battery_last"].tolist() == [5]


def test_timer_drops_expired_devices_and_late_events_are_flagged() -> None:
    t = make_tester()
    t.testInPandas(3, rows([("a", 0, 1.0, 1), ("b", 1800, 2.0, 2)]))
    # One timer per bucket, at the next device's expiry (a: T0 + 1h), in milliseconds.
    assert list(t.handle.listTimers()) == [(T0_US + HOUR_US) // 1000]
    t.setWatermark((T0_US + HOUR_US) // 1000)
    assert stored(t).column(engine.KEY).to_pylist() == ["b"]
    assert list(t.handle.listTimers()) == [(T0_US + 1800 * 10**6 + HOUR_US) // 1000]
    out = t.testInPandas(3, rows([("b", 3000, 9.0, 9), ("a", 3601, 4.0, None), ("b", 3600, 9.0, 9)], 2))
    assert out[LATE].tolist() == [True, False, True]
    assert pd.isna(out[FLAT + "events"][0]) and out[FLAT + "events"][1] == 1     # a starts afresh
    assert stored(t).column(engine.EVENTS).to_pylist() == [1, 1]
    t.setWatermark((T0_US + 3601 * 10**6 + HOUR_US) // 1000)
    assert t.peekValueState(STATE_NAME, 3) is None and list(t.handle.listTimers()) == []



def test_output_converts_with_pysparks_own_conversion() -> None:
    # PySpark turns the processor's pandas output into Arrow with this; pandas 3's Arrow-backed
    # strings, and a string column of nulls only (float64 in pandas), would make it fail.
    from pyspark.sql.conversion import PandasToArrowConversion
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    t = make_tester()
    no_errors = t.testInPandas(3, rows([("a", 1, 1.0, 1)]).astype({"_3": "float64"}))
    out = t.testInPandas(3, rows([("a", 10, 20.0, 5), ("b", 5, None, None), ("c", 2, 1.0, 1, "bad")], 1))
    schema = StructType([StructField("device_id", StringType()), StructField("temperature", DoubleType()),
                         StructField("battery", IntegerType()), StructField("_error", StringType()),
                         StructField("_partition", IntegerType()), StructField("_offset", LongType()),
                         *[StructField(FLAT + f.name, from_arrow_type(f.type)) for f in SPEC.output_type()],
                         StructField(LATE, BooleanType())])
    wrapped = StructType([StructField("_0", schema)])  # as the worker calls it

    def convert(df: pd.DataFrame) -> list[dict]:
        batch = PandasToArrowConversion.convert([df], wrapped, timezone="UTC", arrow_cast=True,
                                                assign_cols_by_name=True)
        return [r["_0"] for r in batch.to_pylist()]

    assert [(r["_error"], r[FLAT + "events"]) for r in convert(no_errors)] == [(None, 1)]
    assert [(r["device_id"], r["_error"], r[FLAT + "events"], r[FLAT + "battery_last"]) for r in convert(out)] == [
        ("a", None, 2, 5), ("b", None, 1, None), ("c", "bad", None, None)]


def test_a_bucket_of_dead_letters_only_keeps_no_state() -> None:
    t = make_tester()
    out = t.testInPandas(3, rows([(None, 1, 1.0, 1, "state.key device_id is null")]))
    assert out["_error"].tolist() == ["state.key device_id is null"] and pd.isna(out[FLAT + "events"][0])
    assert out[LATE].tolist() == [False]
    assert t.peekValueState(STATE_NAME, 3) is None and list(t.handle.listTimers()) == []
