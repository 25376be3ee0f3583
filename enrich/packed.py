"""Events packed into Arrow IPC bytes for the trip through ``transformWithStateInPandas``.

PySpark converts a stateful processor's input to pandas row by row and its output back column by
column from pandas; both cost per event and lose exact types (docs/benchmarks.md, the state step's
profile). So the step's rows are packed: before it, :func:`pack` (a ``mapInArrow`` pass) turns each
Arrow batch of events into one row per bucket holding that bucket's events as IPC bytes; the
processor reads them with :func:`unpack_rows` and answers with :func:`pack_output`; after the
step, :func:`unpack` turns the packed rows back into events (in the job's join pass:
``enrich.state.stream.Unpack``).

The step's input may mix kinds of rows (events, and the changelog records of partitioned
dimensions): each packed value says its kind in its Arrow schema's metadata, and
:func:`unpack_kinds` hands the processor one table per kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import BUCKET, MAX_TS, ROWS
from enrich.ipc import from_ipc, to_ipc

# The packed rows' columns: the grouping bucket (BUCKET), the greatest event time of the chunk (MAX_TS:
# what Spark's watermark is taken on), and the chunk's events as an Arrow IPC stream (ROWS).

#: Rows per packed chunk at most: bounds one packed value's size (and the processor's memory per read).
CHUNK_ROWS = 65536
#: The kind of packed events (the default); a partitioned dimension's records are ``dim<index>``.
EVENTS = "events"
_KIND = b"refstream.kind"


def pack(batches: Iterable[pa.RecordBatch], *, bucket: str, timestamp: str | None,
         packed_schema: pa.Schema, kind: str = EVENTS) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` before the step: per input batch, one row per bucket (and ``CHUNK_ROWS``
    rows) with the rows, every column but ``bucket``, as IPC bytes tagged with ``kind``; the
    greatest ``timestamp`` of each chunk (null without one) goes beside them."""
    for batch in batches:
        if batch.num_rows == 0:
            continue
        order = pc.sort_indices(batch.column(bucket))   # stable: a bucket's events keep their order
        ordered = batch.take(order)
        ids = ordered.column(bucket).to_numpy(zero_copy_only=False)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1])
        ends = np.append(starts[1:], len(ids))
        events = ordered.drop_columns([bucket])
        events = events.replace_schema_metadata({**(events.schema.metadata or {}), _KIND: kind.encode()})
        out_bucket, out_ts, out_rows = [], [], []
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            for s in range(start, end, CHUNK_ROWS):
                chunk = events.slice(s, min(CHUNK_ROWS, end - s))
                out_bucket.append(int(ids[start]))
                out_ts.append(pc.max(chunk.column(timestamp)).as_py() if timestamp is not None else None)
                out_rows.append(to_ipc(chunk))
        yield pa.RecordBatch.from_arrays(
            [pa.array(out_bucket, packed_schema.field(BUCKET).type),
             pa.array(out_ts, packed_schema.field(MAX_TS).type),
             pa.array(out_rows, pa.binary())], schema=packed_schema)


def marker(kind: str) -> bytes:
    """A packed value holding no rows, of ``kind``: it makes the processor call its bucket (the tick
    source's rows, ``enrich.source.tick``); :func:`unpack_kinds` gives an empty table of it."""
    return to_ipc(pa.table({}).replace_schema_metadata({_KIND: kind.encode()}))


def unpack_rows(rows: Iterable[pd.DataFrame]) -> pa.Table:
    """The processor's input: the packed values (the last column; PySpark renames columns whose
    name starts with an underscore) as one table of events."""
    tables = [from_ipc(value) for pdf in rows for value in pdf.iloc[:, -1]]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def unpack_kinds(rows: Iterable[pd.DataFrame]) -> dict[str, pa.Table]:
    """The processor's input by kind (:data:`EVENTS`, ``dim<index>``): one table each, in the order
    the packed values came."""
    parts: dict[str, list[pa.Table]] = {}
    for pdf in rows:
        for value in pdf.iloc[:, -1]:
            table = from_ipc(value)
            meta = dict(table.schema.metadata or {})
            kind = meta.pop(_KIND, EVENTS.encode()).decode()
            parts.setdefault(kind, []).append(table.replace_schema_metadata(meta or None))
    return {k: pa.concat_tables(v) if len(v) > 1 else v[0] for k, v in parts.items()}


def pack_output(table: pa.Table) -> pd.DataFrame:
    """The processor's output: ``table`` in packed rows of at most ``CHUNK_ROWS`` events."""
    values = [to_ipc(table.slice(s, CHUNK_ROWS)) for s in range(0, max(table.num_rows, 1), CHUNK_ROWS)]
    return pd.DataFrame({ROWS: values})


def unpack(batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """After the step: the events of every packed row, as ``schema``."""
    for batch in batches:
        for value in batch.column(ROWS).to_pylist():
            table = from_ipc(value)
            if table.num_rows == 0:
                continue
            if table.schema != schema:
                table = table.cast(schema)
            yield from table.to_batches()
