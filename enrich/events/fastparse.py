"""Event values parsed with pyarrow's JSON reader, where its answer is provably Spark's own.

``from_json`` in the JVM was the largest single cost of a micro-batch (docs/benchmarks.md). This
parser runs inside the join's ``mapInArrow`` pass instead, and is deliberately *conservative*: a value
is taken only when pyarrow parses it strictly (standard JSON, one object, every field of exactly the
declared JSON type, no duplicate field, timestamps of one exact ISO 8601 shape). Everything else,
including every value Spark might accept through one of its lenient options (single quotes, ``NaN``,
numbers in string fields, other timestamp shapes) or reject, is marked *slow* and is parsed again by
``enrich.events.parse`` (Spark's ``from_json``), which alone decides what is a dead letter and why.
So the fast path changes the cost, never the result (``tests/enrich/events/test_fastparse.py`` compares the
two on a corpus of edge cases).

Only flat schemas of string, boolean, integer, double and timestamp fields have a fast path;
:meth:`FastParser.for_schema` returns ``None`` for any other schema, and the job parses with Spark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DoubleType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampType,
)

#: The one timestamp shape taken on the fast path: ISO 8601 with 'T', at most microseconds, and an
#: explicit zone (``Z`` or ``+hh:mm``), or none when the session time zone is UTC.
_TS_ZONED = r"^[1-9]\d{3}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$"
_TS_NAIVE = r"^[1-9]\d{3}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?$"

_JSON_TYPES = {StringType: pa.string(), BooleanType: pa.bool_(), ByteType: pa.int8(), ShortType: pa.int16(),
               IntegerType: pa.int32(), LongType: pa.int64(), DoubleType: pa.float64()}


def _framed(values: pa.Array) -> np.ndarray:
    """Values that can be parsed one per line without any chance of misframing: valid UTF-8, start with
    ``{``, end with ``}`` and hold no line break. Joined by line breaks, a boundary ``}\\n{`` is valid
    JSON only between two top-level objects (the reader refuses raw control characters in strings),
    so if the reader returns one row per value, each value was exactly one object."""
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=bool)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[values.offset:values.offset + n + 1]
    data = values.buffers()[2]
    buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    starts, ends = offsets[:-1], offsets[1:]
    ok = ends > starts
    if values.null_count:
        ok &= values.is_valid().to_numpy(zero_copy_only=False)
    first = np.zeros(n, dtype=np.uint8)
    last = np.zeros(n, dtype=np.uint8)
    first[ok] = buf[starts[ok]]
    last[ok] = buf[ends[ok] - 1]
    ok &= (first == ord("{")) & (last == ord("}"))
    try:
        values.cast(pa.string())  # validates UTF-8: the reader does not, Spark decodes it its own way
    except pa.ArrowInvalid:
        for i in np.flatnonzero(ok):
            try:
                bytes(memoryview(data)[offsets[i]:offsets[i + 1]]).decode("utf-8")
            except UnicodeDecodeError:
                ok[i] = False
    span = bytes(memoryview(data)[offsets[0]:offsets[-1]]) if data is not None else b""
    for ch in (b"\n", b"\r"):
        at = span.find(ch)
        while at >= 0:  # rare: map the byte back to its value
            ok[np.searchsorted(offsets, offsets[0] + at, side="right") - 1] = False
            at = span.find(ch, at + 1)
    return ok


@dataclass(frozen=True)
class FastParser:
    """Parses one Arrow array of event values; picklable for the executors."""

    read_schema: pa.Schema      # what pyarrow reads: timestamps as strings
    out_schema: pa.Schema       # the Arrow types Spark hands the join for the parsed event fields
    timestamps: tuple[str, ...]
    naive_is_utc: bool
    required: tuple[str, ...]

    @classmethod
    def for_schema(cls, schema: StructType, required: Sequence[str] = (), timezone: str = "UTC",
                   prefers_large_types: bool = False) -> FastParser | None:
        """A parser for ``schema``, or ``None`` when some field's type has no exact fast path."""
        read, ts = [], []
        for f in schema.fields:
            if isinstance(f.dataType, TimestampType):
                read.append(pa.field(f.name, pa.string()))
                ts.append(f.name)
            elif type(f.dataType) in _JSON_TYPES:
                read.append(pa.field(f.name, _JSON_TYPES[type(f.dataType)]))
            else:
                return None
        out = to_arrow_schema(schema, timezone=timezone, prefers_large_types=prefers_large_types)
        return cls(pa.schema(read), out, tuple(ts), timezone in ("UTC", "Etc/UTC", "Z", "+00:00"),
                   tuple(required))

    def parse(self, values: pa.Array | pa.ChunkedArray) -> tuple[pa.Table, np.ndarray]:
        """The parsed fields of every value (``out_schema``) and a mask of the *slow* values, whose
        fields are null here and must be parsed by Spark."""
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if values.type != pa.binary():
            values = values.cast(pa.binary())
        n = len(values)
        slow = ~_framed(values)
        parsed = self._read_rows(values, slow)
        columns = []
        for field in self.out_schema:
            col = parsed.column(field.name)
            if field.name in self.timestamps:
                col = self._timestamps(col, slow, field.type)
            elif col.type != field.type:
                col = col.cast(field.type)
            columns.append(col)
        for name in self.required:  # Spark's path names the field in the dead letter
            slow |= parsed.column(name).is_null().to_numpy(zero_copy_only=False)
        table = pa.table(columns, schema=self.out_schema)
        if slow.any():  # slow rows hold nothing: Spark fills them
            mask = pa.array(slow)
            table = pa.table([pc.if_else(mask, pa.nulls(n, c.type), c) for c in table.columns],
                             schema=self.out_schema)
        return table, slow

    # --------------------------------------------------------------------------------- internals

    def _read_rows(self, values: pa.Array, slow: np.ndarray) -> pa.Table:
        """Parse the values not yet ``slow``; values pyarrow refuses are added to ``slow``.
        Returns a table of ``len(values)`` rows, null where not parsed."""
        pieces: list[tuple[np.ndarray, pa.Table]] = []
        if not slow.all():
            # Every value followed by a line break, in one contiguous buffer; a span of rows is a slice.
            # Values that cannot be framed become "{}" (parsed and ignored: they are already slow).
            framed = values if not slow.any() else pc.if_else(
                pa.array(slow), pa.scalar(b"{}", pa.binary()), values)
            lines = pc.binary_join_element_wise(framed, pa.scalar(b"", pa.binary()), b"\n")
            offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[lines.offset:lines.offset + len(lines) + 1]
            self._parse_span(lines.buffers()[2], offsets, 0, len(values), slow, pieces)
        if not pieces:
            return pa.table([pa.nulls(len(values), f.type) for f in self.read_schema], schema=self.read_schema)
        if len(pieces) == 1 and len(pieces[0][0]) == len(values):
            return pieces[0][1]
        idx = np.concatenate([p for p, _ in pieces])
        tables = pa.concat_tables([t for _, t in pieces])
        # Scatter the parsed rows to their positions: take from [parsed rows..., one null row].
        pos = np.full(len(values), len(idx), dtype=np.int64)
        pos[idx] = np.arange(len(idx))
        padded = pa.concat_tables([tables, pa.table([pa.nulls(1, f.type) for f in self.read_schema],
                                                    schema=self.read_schema)])
        return padded.take(pa.array(pos))

    def _parse_span(self, data: pa.Buffer, offsets: np.ndarray, lo: int, hi: int, slow: np.ndarray,
                    out: list[tuple[np.ndarray, pa.Table]]) -> None:
        """Parse values ``[lo, hi)``: appends (their positions, their rows) to ``out`` when the reader
        takes them all, else bisects; a single value it refuses is marked slow."""
        if hi <= lo:
            return
        start, end = int(offsets[lo]), int(offsets[hi])
        table = self._try_read(data.slice(start, end - start), hi - lo)
        if table is not None:
            out.append((np.arange(lo, hi), table))
        elif hi - lo == 1:
            slow[lo] = True
        else:  # bisect down to the values pyarrow refuses: O(bad * log n) reads
            mid = (lo + hi) // 2
            self._parse_span(data, offsets, lo, mid, slow, out)
            self._parse_span(data, offsets, mid, hi, slow, out)

    def _try_read(self, data: pa.Buffer, expected: int) -> pa.Table | None:
        try:
            table = pj.read_json(
                pa.BufferReader(data),
                read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, data.size + 1)),
                parse_options=pj.ParseOptions(explicit_schema=self.read_schema, newlines_in_values=False,
                                              unexpected_field_behavior="ignore"))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError, ValueError):
            return None
        # Two objects on one line would shift every later row.
        if table.num_rows != expected:
            return None
        return table.select(self.read_schema.names).cast(self.read_schema)

    def _timestamps(self, col: pa.ChunkedArray, slow: np.ndarray, typ: pa.DataType) -> pa.Array:
        text = col.combine_chunks()
        ok = pc.fill_null(pc.match_substring_regex(text, _TS_ZONED), True)  # a null timestamp is fine
        if not pc.all(ok).as_py():
            if self.naive_is_utc:  # naive values are UTC here: a "Z" makes the cast take them so
                naive = pc.fill_null(pc.match_substring_regex(text, _TS_NAIVE), False)
                text = pc.if_else(naive, pc.binary_join_element_wise(text, pa.scalar("Z"), ""), text)
                ok = pc.or_(ok, naive)
            text = pc.if_else(ok, text, pa.scalar(None, pa.string()))
        ok_np = ok.to_numpy(zero_copy_only=False)
        slow |= ~ok_np
        try:
            out = pc.cast(text, pa.timestamp("us", tz="UTC"))
        except pa.ArrowInvalid:  # an impossible date (2024-02-30): find it, leave it to Spark
            vals = []
            for i, v in enumerate(text.to_pylist()):
                try:
                    vals.append(None if v is None else pc.cast(pa.scalar(v), pa.timestamp("us", tz="UTC")).value)
                except pa.ArrowInvalid:
                    slow[i] = True
                    vals.append(None)
            out = pa.array(vals, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
        return out.cast(typ)
