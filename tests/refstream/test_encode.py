"""The bulk encoder gives the row-wise encoder's bytes for every type, null and edge value."""

from __future__ import annotations

import math
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream import contract as c
from refstream import encode as e
from refstream.errors import ContractError

TRICKY_TEXT = ["", "plain", 'quote " and \\ backslash', "".join(chr(i) for i in range(0x20)), "\x7f del",
               "line\u2028sep\u2029", "ünï ✓ 漢字 😀 \U0010ffff", "\\u0000 literally", '"', "\\", "\n", "é\t"]
FLOATS = [0.0, -0.0, 1.0, -1.5, 100.0, 0.1, 1e15, 1e16, -1e16, 1.2345e16, 9999999999999998.0, 1e-4, -1e-4,
          1e-5, 2.5e-05, 1e-7, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 123456789012345.6,
          math.nextafter(1e16, 0), math.nextafter(1e-4, 0), math.nextafter(1e-4, 1), 1e22, 1e100, -1e-100,
          math.nan, math.inf, -math.inf, None]
UTC2 = timezone(timedelta(hours=2))


def _pad(values: list, n: int) -> list:
    return (values * (n // len(values) + 1))[:n]


def every_type(n: int = 40) -> pa.Table:
    """A column of every Arrow type the contract maps, with nulls and edge values, ``n`` rows."""
    ints = [0, 1, -1, None, 2**63 - 1, -(2**63)]
    cols = {
        "id": pa.array(range(n), pa.int64()),
        "ok": pa.array(_pad([True, False, None], n)),
        "i8": pa.array(_pad([0, -128, 127, None], n), pa.int8()),
        "i16": pa.array(_pad([-32768, None, 5], n), pa.int16()),
        "i32": pa.array(_pad([2**31 - 1, None, -7], n), pa.int32()),
        "i64": pa.array(_pad(ints, n), pa.int64()),
        "u8": pa.array(_pad([255, None, 0], n), pa.uint8()),
        "u64": pa.array(_pad([2**64 - 1, None, 3], n), pa.uint64()),
        "f64": pa.array(_pad(FLOATS, n), pa.float64()),
        "f32": pa.array(_pad([0.1, 1e-5, 3.4e38, math.nan, None, -0.0, 16777217.0], n), pa.float32()),
        "f16": pa.array(_pad([np.float16(0.1), np.float16(65504), None], n), pa.float16()),
        "dec": pa.array(_pad([Decimal("1.50"), Decimal("-0.05"), Decimal("0.00"), None, Decimal("99999999.99")],
                             n), pa.decimal128(10, 2)),
        "dec0": pa.array(_pad([Decimal("0"), Decimal("-12345678901234567890"), None], n), pa.decimal128(38, 0)),
        "dec_big": pa.array(_pad([Decimal("1" * 45 + ".12345"), Decimal("-0.00001"), None], n),
                            pa.decimal256(50, 5)),
        "dec_neg_scale": pa.array(_pad([Decimal("12300"), None, Decimal("0")], n), pa.decimal128(5, -2)),
        "text": pa.array(_pad([*TRICKY_TEXT, None], n), pa.string()),
        "large_text": pa.array(_pad([None, *TRICKY_TEXT], n), pa.large_string()),
        "view_text": pa.array(_pad(["a\"b", None, "ü"], n), pa.string_view()),
        "dict_text": pa.array(_pad(["x", None, "y\n", "x"], n)).dictionary_encode(),
        "raw": pa.array(_pad([b"\x00\x01", b"", None, bytes(range(256))], n), pa.binary()),
        "large_raw": pa.array(_pad([b"\xff", None], n), pa.large_binary()),
        "fixed_raw": pa.array(_pad([b"abc", None, b"\x00\x00\x00"], n), pa.binary(3)),
        "day": pa.array(_pad([date(2024, 5, 1), date(1, 1, 1), date(9999, 12, 31), date(1969, 12, 31),
                              date(99, 1, 1), None], n), pa.date32()),
        "day64": pa.array(_pad([date(2024, 5, 1), None, date(1900, 2, 28)], n), pa.date64()),
        "t_s": pa.array(_pad([time(0, 0), time(23, 59, 59), None], n), pa.time32("s")),
        "t_ms": pa.array(_pad([time(1, 2, 3, 4000), None, time(0, 0, 0, 1000)], n), pa.time32("ms")),
        "t_us": pa.array(_pad([time(12), time(23, 59, 59, 999999), time(0, 0, 0, 1), None], n),
                         pa.time64("us")),
        "t_ns": pa.array(_pad([0, 5, 1_000_999, 86_399_999_999_999, None], n), pa.time64("ns")),
        "ts_s": pa.array(_pad([datetime(2024, 5, 1, 12), datetime(1, 1, 1), None], n), pa.timestamp("s")),
        "ts_ms": pa.array(_pad([datetime(1969, 12, 31, 23, 59, 59, 999000), None], n), pa.timestamp("ms")),
        "ts_us": pa.array(_pad([datetime(2024, 5, 1, 12, 0, 0, 123), datetime(9999, 12, 31, 23, 59, 59, 999999),
                                datetime(1, 1, 1), datetime(999, 1, 1, 0, 0, 1), None], n), pa.timestamp("us")),
        "ts_ns": pa.array(_pad([1_714_564_800_000_000_000, -1_000, None], n), pa.timestamp("ns")),
        "tz_utc": pa.array(_pad([datetime(2024, 5, 1, 14, tzinfo=UTC2), None,
                                 datetime(1970, 1, 1, tzinfo=UTC2)], n), pa.timestamp("us", tz="UTC")),
        "tz_paris": pa.array(_pad([1_714_564_800_123_456, -86_400_000_000, None], n),
                             pa.timestamp("us", tz="Europe/Paris")),
        "tz_offset": pa.array(_pad([1_714_564_800_000, None], n), pa.timestamp("ms", tz="+05:30")),
        "tz_ns": pa.array(_pad([1_714_564_800_000_001_000, None], n), pa.timestamp("ns", tz="UTC")),
        "dur_us": pa.array(_pad([timedelta(0), timedelta(hours=838, minutes=59, seconds=59),
                                 -timedelta(hours=838, minutes=59, seconds=59), timedelta(microseconds=-1),
                                 timedelta(seconds=-1.5), timedelta(days=3, microseconds=7), None], n),
                           pa.duration("us")),
        "dur_s": pa.array(_pad([0, -1, 3_000_000, None], n), pa.duration("s")),
        "dur_ms": pa.array(_pad([1, -1001, None], n), pa.duration("ms")),
        "dur_ns": pa.array(_pad([1_000, -2_000_000, None], n), pa.duration("ns")),
        "nothing": pa.nulls(n),
        "listy": pa.array(_pad([[1, 2], None, []], n), pa.list_(pa.int64())),
        'we"ird\nname ü': pa.array(_pad(["v", None], n)),
    }
    return pa.table(cols)


def rowwise(table: pa.Table, key: list[str]) -> tuple[list[bytes], list[bytes]]:
    rows = table.to_pylist()
    return [c.encode_key(key, r) for r in rows], [c.encode_row(r) for r in rows]


def bulk(table: pa.Table | pa.RecordBatch, key: list[str], **kw: int) -> tuple[list[bytes], list[bytes]]:
    keys: list[bytes] = []
    values: list[bytes] = []
    for k, v in e.encode_batches(table, key, **kw):
        keys += k
        values += v or []
    return keys, values


def assert_same(table: pa.Table, key: list[str], **kw: int) -> None:
    want_keys, want_values = rowwise(table, key)
    got_keys, got_values = bulk(table, key, **kw)
    for i, (got, want) in enumerate(zip(got_values, want_values, strict=True)):
        assert got == want, f"row {i}"
    assert got_keys == want_keys


def test_every_type_with_nulls_and_edges_matches_rowwise() -> None:
    assert_same(every_type(), ["id"])


def test_each_column_alone_matches_rowwise() -> None:
    # One column at a time, so a mismatch names its type.
    t = every_type(24)
    for name in t.column_names:
        one = t.select([name])
        assert bulk(one, [name])[1] == rowwise(one, [name])[1], name
        assert bulk(one, [name])[0] == rowwise(one, [name])[0], name


def test_keys_follow_declared_order_and_any_type() -> None:
    t = every_type()
    assert_same(t, ["text", "id"])
    assert_same(t, ["f64", "dec", "ts_us", "tz_paris", "raw", "dur_us", "ok"])
    assert bulk(t, ["i8", "id", "i8"])[0] == rowwise(t, ["i8", "id", "i8"])[0]  # a repeated key name counts once


def test_batches_and_chunks_keep_row_order() -> None:
    t = every_type(50)
    chunked = pa.concat_tables([t.slice(0, 7), t.slice(7, 30), t.slice(37)])
    assert chunked.column("id").num_chunks == 3
    assert_same(chunked, ["id"], batch_rows=8)
    assert_same(t.slice(3, 20), ["id"])  # an offset into the buffers


def test_record_batch_empty_table_and_no_columns() -> None:
    t = every_type(10)
    assert bulk(t.to_batches()[0], ["id"]) == rowwise(t, ["id"])
    assert bulk(t.slice(0, 0), ["id"]) == ([], [])
    empty_cols = pa.table({"a": [1, 2]}).drop_columns(["a"])
    assert empty_cols.num_rows == 2
    assert bulk(empty_cols, []) == rowwise(empty_cols, []) == ([b"{}", b"{}"], [b"{}", b"{}"])


def test_duplicate_column_names_take_the_rowwise_path() -> None:
    t = pa.Table.from_arrays([pa.array([1, 2]), pa.array(["a", "b"]), pa.array([3.5, None])], ["k", "x", "k"])
    assert_same(t, ["k"])


def test_missing_key_column_is_the_same_error() -> None:
    t = pa.table({"a": [1]})
    with pytest.raises(ContractError, match="row has no key column 'b'"):
        list(e.encode_batches(t, ["b"]))
    with pytest.raises(ContractError, match="row has no key column 'b'"):
        c.encode_key(["b"], t.to_pylist()[0])


def test_messages_from_arrow_match_messages_from_dicts() -> None:
    t = every_type(30)
    schema = c.DatasetSchema("d", ("id",), (c.Column("id", "int64"),))
    from_arrow = list(c.upsert_messages(schema, t, 4)) + list(c.delete_messages(schema, t.select(["id"]), 4))
    from_dicts = (list(c.upsert_messages(schema, t.to_pylist(), 4))
                  + list(c.delete_messages(schema, t.select(["id"]).to_pylist(), 4)))
    assert from_arrow == from_dicts
    assert from_arrow[-1].value is None and dict(from_arrow[-1].headers)["op"] == b"delete"


def test_contract_types_take_the_column_wise_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The value-by-value path is the fallback, not the rule: the columns a database read gives must not use it.
    t = every_type().select(["id", "ok", "i32", "f64", "f32", "dec", "dec_big", "text", "large_text", "dict_text",
                             "raw", "day", "day64", "t_us", "t_ns", "ts_s", "ts_us", "ts_ns", "tz_utc",
                             "tz_paris", "dur_us", "dur_s", "nothing"])
    want = rowwise(t, ["id"])

    def no_fallback(arr: pa.Array) -> None:
        raise AssertionError(f"{arr.type} took the row-wise path")

    real = e._fast_fragments
    monkeypatch.setattr(e, "_fast_fragments", lambda arr: real(arr) or no_fallback(arr))
    assert bulk(t, ["id"]) == want


def test_values_outside_python_ranges_fail_as_rowwise_does() -> None:
    # Arrow holds dates Python cannot; the bulk path must not invent a text for them.
    for t in (pa.table({"d": pa.array([2_932_897], pa.date32())}),
              pa.table({"ts": pa.array([2**62], pa.timestamp("us"))})):
        with pytest.raises((ValueError, OverflowError)) as rowwise_error:
            t.to_pylist()
        with pytest.raises(rowwise_error.type):
            bulk(t, t.column_names)
    # Times beyond a day wrap around in Python; the bulk path gives the same text.
    assert_same(pa.table({"t": pa.array([86_400, -1, 90_000], pa.time32("s"))}), ["t"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.none(), min_size=1, max_size=200))
def test_any_floats_match_rowwise(values: list[float | None]) -> None:
    assert_same(pa.table({"f": pa.array(values, pa.float64())}), ["f"])


def test_many_random_floats_match_repr() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**64, 200_000, dtype=np.uint64).view(np.float64)
    values = np.concatenate([bits, rng.normal(50, 20, 50_000), np.round(rng.normal(0, 1e6, 50_000), 2),
                             rng.uniform(-2e-4, 2e-4, 20_000), rng.uniform(5e15, 2e16, 20_000)])
    frags = e.fragments(pa.array(values)).to_pylist()
    want = [e.dumps(e.fix_floats(v)).decode() for v in values.tolist()]
    bad = [(v, g, w) for v, g, w in zip(values.tolist(), frags, want, strict=True) if g != w]
    assert not bad, bad[:5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text() | st.none(), min_size=1, max_size=50))
def test_any_text_matches_rowwise(values: list[str | None]) -> None:
    assert_same(pa.table({"s": pa.array(values, pa.string()), "k": pa.array(range(len(values)))}), ["s", "k"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.datetimes() | st.none(), min_size=1, max_size=50),
       st.lists(st.timedeltas(min_value=timedelta(days=-10**5), max_value=timedelta(days=10**5)) | st.none(),
                min_size=1, max_size=50),
       st.lists(st.decimals(allow_nan=False, allow_infinity=False, places=4,
                            min_value=-10**20, max_value=10**20) | st.none(), min_size=1, max_size=50))
def test_any_temporal_and_decimal_values_match_rowwise(stamps: list, spans: list, decimals: list) -> None:
    n = min(len(stamps), len(spans), len(decimals))
    t = pa.table({"ts": pa.array(stamps[:n], pa.timestamp("us")),
                  "tz": pa.array(stamps[:n], pa.timestamp("us")).cast(pa.timestamp("us", tz="Asia/Kolkata")),
                  "day": pa.array([s and s.date() for s in stamps[:n]], pa.date32()),
                  "tod": pa.array([s and s.time() for s in stamps[:n]], pa.time64("us")),
                  "dur": pa.array(spans[:n], pa.duration("us")),
                  "dec": pa.array(decimals[:n], pa.decimal128(30, 4))})
    try:
        want = rowwise(t, ["ts"])
    except (ValueError, OverflowError):
        return  # a zone shift beyond year 9999: the row-wise path cannot encode it either
    assert bulk(t, ["ts"]) == want
