"""Arrow tables as bytes (the Arrow IPC stream format): how the job moves tables through Spark
(dimension broadcasts, device state in the state store, events packed for the state step)."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa


def to_ipc(table: pa.Table | pa.RecordBatch, compression: Literal["lz4", "zstd"] | None = None) -> bytes:
    """``table`` as an IPC stream; ``compression``: its buffers compressed (what :func:`from_ipc`
    reads back either way)."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression) if compression else None
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        if isinstance(table, pa.RecordBatch):
            writer.write_batch(table)
        else:
            writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
