"""Arrow tables as bytes (the Arrow IPC stream format): how the job moves tables through Spark
(dimension broadcasts, device state in the state store, events packed for the state step)."""

from __future__ import annotations

import pyarrow as pa


def to_ipc(table: pa.Table | pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        if isinstance(table, pa.RecordBatch):
            writer.write_batch(table)
        else:
            writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
