"""JSON encoding of change rows, row by row and in bulk.

The row-wise functions (:func:`dumps`, :func:`fix_floats`) define the contract's bytes: the standard
library's ``json`` with compact separators, ``ensure_ascii=False`` and the :func:`default` hook for the
types JSON lacks. :func:`encode_batches` produces the same bytes for a whole Arrow table at once: every
column becomes an array of JSON fragments with Arrow compute kernels (floats through orjson's numpy
serialiser), and the fragments of a row are joined by one kernel call. A column whose values the fast
path cannot reproduce exactly (an unknown type, nanoseconds, values outside Python's date range, floats
whose shortest repr Python writes in exponent form) is encoded value by value with :func:`dumps`, so the
result never depends on which path ran.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator, Sequence
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from refstream.errors import ContractError

__all__ = [
    "BATCH_ROWS",
    "default",
    "dumps",
    "encode_batch",
    "encode_batches",
    "fix_floats",
    "fragments",
    "timedelta_str",
]

#: Rows encoded per kernel pass: large enough to amortise the per-call cost of the kernels, small enough
#: that a batch's JSON stays a few tens of MB and publishing can start early.
BATCH_ROWS = 65_536

# ---------------------------------------------------------------------------------- row-wise (exact)


def default(v: Any) -> Any:
    """``json.dumps`` hook: the contract's text form of the values JSON has no type for."""
    if isinstance(v, Decimal):
        return format(v, "f") if v.is_finite() else str(v)
    if isinstance(v, datetime):
        if v.tzinfo is not None:
            v = v.astimezone(UTC)
        return v.isoformat()
    if isinstance(v, date | time):
        return v.isoformat()
    if isinstance(v, timedelta):
        return timedelta_str(v)
    if isinstance(v, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(v)).decode("ascii")
    raise TypeError(f"value {v!r} of type {type(v).__name__} has no changelog encoding")


def timedelta_str(v: timedelta) -> str:
    # MySQL TIME arrives as timedelta (it may exceed 24h or be negative).
    total = v.days * 86400 + v.seconds
    sign = "-" if total < 0 else ""
    total = abs(total)
    s = f"{sign}{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"
    return s + (f".{v.microseconds:06d}" if v.microseconds else "")


def fix_floats(v: Any) -> Any:
    """Non-finite floats as the contract's strings (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def dumps(obj: Any) -> bytes:
    """The contract's JSON bytes of ``obj``."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=default,
                      allow_nan=False).encode("utf-8")


# ------------------------------------------------------------------------------------------- bulk


def encode_batches(rows: pa.Table | pa.RecordBatch, key: Sequence[str], *, values: bool = True,
                   batch_rows: int = BATCH_ROWS) -> Iterator[tuple[list[bytes], list[bytes] | None]]:
    """Key bytes and (if ``values``) value bytes of every row of ``rows``, one pair of lists per batch.

    Byte for byte what ``contract.encode_key(key, row)`` and ``contract.encode_row(row)`` give for the rows
    of ``rows.to_pylist()``. Raises :class:`ContractError` if a key column is missing.
    """
    batches = rows.to_batches(max_chunksize=batch_rows) if isinstance(rows, pa.Table) else [rows]
    for b in batches:
        if b.num_rows:
            yield encode_batch(b, key, values=values)


def encode_batch(batch: pa.RecordBatch, key: Sequence[str], *,
                 values: bool = True) -> tuple[list[bytes], list[bytes] | None]:
    """Key and value bytes of the rows of one batch (see :func:`encode_batches`)."""
    names = batch.schema.names
    key = list(dict.fromkeys(key))  # as the dict of the row-wise path: a repeated name counts once
    for k in key:
        if k not in names:
            raise ContractError(f"row has no key column {KeyError(k)}")
    if len(set(names)) != len(names):
        # Duplicate names collapse in a row dict; rare enough to take the row-wise path.
        rows = batch.to_pylist()
        return ([dumps({k: fix_floats(r[k]) for k in key}) for r in rows],
                [dumps({k: fix_floats(v) for k, v in r.items()}) for r in rows] if values else None)
    wanted = names if values else key
    frags = {n: fragments(batch.column(n)) for n in wanted}
    keys = _join_objects(key, frags, batch.num_rows)
    return keys, (_join_objects(names, frags, batch.num_rows) if values else None)


def _join_objects(names: Sequence[str], frags: dict[str, pa.Array], n: int) -> list[bytes]:
    if not names:
        return [b"{}"] * n
    args: list[Any] = []
    for i, name in enumerate(names):
        prefix = ("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False) + ":"
        args.append(pa.scalar(prefix, pa.large_string()))
        args.append(frags[name])
    args.append(pa.scalar("}", pa.large_string()))
    joined = pc.binary_join_element_wise(*args, pa.scalar("", pa.large_string()))
    return joined.view(pa.large_binary()).to_pylist()


def fragments(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The JSON text of every value of ``arr`` (``null`` for nulls) as a large_string array without nulls."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    frag = _fast_fragments(arr)
    if frag is None:
        frag = pa.array([dumps(fix_floats(v)).decode("utf-8") for v in arr.to_pylist()], pa.large_string())
    return frag


def _fast_fragments(arr: pa.Array) -> pa.Array | None:
    """Fragments computed column-wise, or None where only the value-by-value path is exact."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_null(t):
        return pa.array(["null"] * len(arr), pa.large_string())
    if pa.types.is_boolean(t):
        s = pc.if_else(arr, "true", "false")
    elif pa.types.is_integer(t):
        s = pc.cast(arr, pa.string())
    elif pa.types.is_floating(t):
        return _float_fragments(arr)
    elif pa.types.is_decimal(t):
        if t.scale < 0:  # Arrow writes these with an exponent; format(v, "f") does not
            return None
        s = _quote(pc.cast(arr, pa.string()))
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        s = _json_strings(pc.cast(arr, pa.large_string()))
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
            or pa.types.is_binary_view(t):
        s = _quote(pa.array([None if v is None else base64.b64encode(v).decode("ascii")
                             for v in arr.to_pylist()], pa.large_string()))
    elif pa.types.is_date(t):
        s = _date_fragments(arr)
    elif pa.types.is_time(t):
        s = _time_fragments(arr)
    elif pa.types.is_timestamp(t):
        s = _timestamp_fragments(arr)
    elif pa.types.is_duration(t):
        s = _duration_fragments(arr)
    else:
        return None
    if s is None:
        return None
    return pc.cast(pc.fill_null(s, "null"), pa.large_string())


def _quote(s: pa.Array) -> pa.Array:
    q = pa.scalar('"', s.type)
    return pc.binary_join_element_wise(q, s, q, pa.scalar("", s.type))


# json.dumps escapes exactly these (with ensure_ascii=False): the backslash (first: the other escapes add
# backslashes), the quote and the C0 controls, five of them in short form.
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_ESCAPES = [("\\", "\\\\"), ('"', '\\"')] + [
    (chr(c), _SHORT_ESCAPES.get(chr(c), f"\\u{c:04x}")) for c in range(0x20)]


def _escapes_present(s: pa.Array) -> list[tuple[str, str]]:
    """The escapes ``s`` (a large_string array) needs: counted on the bytes of its characters, which is exact
    since the bytes of multi-byte UTF-8 sequences are all >= 0x80."""
    _, offsets, data = s.buffers()
    if data is None or not len(s):
        return []
    # Only this slice's characters: a batch of a table is a view into the whole column's buffers.
    ends = np.frombuffer(offsets, dtype=np.int64)[[s.offset, s.offset + len(s)]]
    chars = np.frombuffer(data, dtype=np.uint8)[ends[0]:ends[1]]
    counts = np.bincount(chars, minlength=256)
    return [(ch, esc) for ch, esc in _ESCAPES if counts[ord(ch)]]


def _json_strings(s: pa.Array) -> pa.Array:
    for ch, esc in _escapes_present(s):
        s = pc.replace_substring(s, ch, esc)
    return _quote(s)


# Python's repr(float) switches to exponent form outside [1e-4, 1e16); orjson writes some of those
# differently (1e-05 vs 1e-5), so only values inside the range (and zero) take orjson's digits. Inside it
# both print the shortest round-tripping digits in plain positional form.
_REPR_LOW, _REPR_HIGH = 1e-4, 1e16


def _float_fragments(arr: pa.Array) -> pa.Array:
    a64 = pc.cast(arr, pa.float64())  # float16/32 widen exactly, as their Python floats do
    if len(a64) == 0:
        return pa.array([], pa.large_string())
    vals = a64.to_numpy(zero_copy_only=False)
    text = orjson.dumps(vals, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
    s = pc.list_flatten(pc.split_pattern(pa.array([text], pa.large_binary()), b",")).cast(pa.large_string())
    with np.errstate(invalid="ignore"):
        mag = np.abs(vals)
        plain = (mag == 0) | ((mag >= _REPR_LOW) & (mag < _REPR_HIGH))
    if a64.null_count:
        plain &= a64.is_valid().to_numpy(zero_copy_only=False)
    if not plain.all():
        odd = ~plain
        repl = [_float_text(v) for v in a64.filter(pa.array(odd)).to_pylist()]
        s = pc.replace_with_mask(s, pa.array(odd), pa.array(repl, pa.large_string()))
    return s


def _float_text(v: float | None) -> str:
    if v is None:
        return "null"
    if math.isfinite(v):
        return repr(v)  # what json writes for a float
    return '"NaN"' if math.isnan(v) else ('"Infinity"' if v > 0 else '"-Infinity"')


def _ints(arr: pa.Array, width: int) -> np.ndarray:
    """The integer storage of a temporal array (nulls as 0)."""
    return arr.view(pa.int32() if width == 32 else pa.int64()).fill_null(0).to_numpy().astype(np.int64)


_US = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": 1}
_DATE_MIN, _DATE_MAX = -719_162, 2_932_896  # date(1, 1, 1) and date(9999, 12, 31) in days since 1970
_US_MIN = _DATE_MIN * 86_400_000_000
_US_MAX = (_DATE_MAX + 1) * 86_400_000_000 - 1


def _to_us(arr: pa.Array, unit: str) -> np.ndarray | None:
    """Microseconds of a timestamp/duration array, or None when the exact value is not a whole number of
    microseconds (Python would see nanoseconds) or does not fit."""
    v = _ints(arr, 64)
    if unit == "ns":
        if (v % 1000).any():
            return None
        return v // 1000
    limit = np.iinfo(np.int64).max // _US[unit]
    if (np.abs(v) > limit).any():
        return None
    return v * _US[unit]


def _valid(arr: pa.Array, values: pa.Array) -> pa.Array:
    """``values`` where ``arr`` is valid, null elsewhere."""
    if not arr.null_count:
        return values
    return pc.if_else(arr.is_valid(), values, pa.scalar(None, values.type))


def _date_fragments(arr: pa.Array) -> pa.Array | None:
    if arr.type == pa.date64():
        ms = _ints(arr, 64)
        if (ms % 86_400_000).any():  # a time of day: Python floors it, Arrow's cast rejects it
            return None
        days = ms // 86_400_000
    else:
        days = _ints(arr, 32)
    if len(days) and (days.min() < _DATE_MIN or days.max() > _DATE_MAX):
        return None  # outside Python's dates: the exact path raises the error today's encoder raises
    return _quote(_valid(arr, pc.cast(pa.array(days.astype(np.int32), pa.date32()), pa.string())))


def _time_fragments(arr: pa.Array) -> pa.Array | None:
    unit = arr.type.unit
    v = _ints(arr, arr.type.bit_width)
    us = v // 1000 if unit == "ns" else v * _US[unit]  # Python's time drops nanoseconds
    if len(us) and (us.min() < 0 or us.max() >= 86_400_000_000):
        return None
    s = pc.cast(pa.array(us, pa.time64("us")), pa.string())  # HH:MM:SS.ffffff
    return _quote(_valid(arr, _drop_zero_micros(s, 8)))


def _drop_zero_micros(s: pa.Array, width: int) -> pa.Array:
    # isoformat() writes the fraction only when it is not zero
    return pc.if_else(pc.ends_with(s, ".000000"), pc.utf8_slice_codeunits(s, 0, width), s)


def _timestamp_fragments(arr: pa.Array) -> pa.Array | None:
    us = _to_us(arr, arr.type.unit)
    if us is None:
        return None
    tz = arr.type.tz
    lo, hi = (_US_MIN, _US_MAX) if not tz else (_US_MIN + 86_400_000_000, _US_MAX - 86_400_000_000)
    if len(us) and (us.min() < lo or us.max() > hi):
        return None  # beyond datetime's range (a day's margin for the zone the exact path converts to)
    s = pc.cast(pa.array(us, pa.timestamp("us")), pa.string())  # YYYY-MM-DD HH:MM:SS.ffffff (UTC if tz)
    s = pc.utf8_replace_slice(_drop_zero_micros(s, 19), 10, 11, "T")
    if tz:
        s = pc.binary_join_element_wise(s, "+00:00", "")
    return _quote(_valid(arr, s))


def _duration_fragments(arr: pa.Array) -> pa.Array | None:
    us = _to_us(arr, arr.type.unit)
    if us is None:
        return None
    total = us // 1_000_000  # floor, as timedelta's days/seconds
    micros = us - total * 1_000_000
    neg = total < 0
    total = np.abs(total)

    def pad(x: np.ndarray, width: int) -> pa.Array:
        return pc.utf8_lpad(pc.cast(pa.array(x), pa.string()), width, "0")

    hms = pc.binary_join_element_wise(pad(total // 3600, 2), pad(total % 3600 // 60, 2), pad(total % 60, 2), ":")
    frac = pc.if_else(pa.array(micros != 0), pc.binary_join_element_wise(".", pad(micros, 6), ""), "")
    sign = pc.if_else(pa.array(neg), "-", "")
    return _quote(_valid(arr, pc.binary_join_element_wise(sign, hms, frac, "")))
