"""The stored format of the state step: the state variables of a bucket and how its device table
is rebuilt from them. One owner for the processor that writes them (:mod:`enrich.state.processor`)
and the lookup that reads them from a checkpoint (:mod:`enrich.ops.device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

from enrich.columns import TS_US
from enrich.ipc import from_ipc
from enrich.state import engine
from enrich.state.engine import StateSpec

__all__ = ["CALLS_NAME", "DELTAS", "GAPS", "GAPS_CLOSED", "DELTA_SCHEMA", "DIM_SCHEMA", "HELD", "SIZES_SCHEMA", "STATE_NAME",
           "TOKEN_SCHEMA", "VALUE_SCHEMA", "CHUNK_KEY_SCHEMA", "CHUNK_SCHEMA", "WRITTEN", "WRITTEN_INDEX_SCHEMA", "bucket_table", "stored_spec"]

#: The state variable holding a bucket's device table (its base: see :class:`DeviceStateProcessor`),
#: and its schema; ``devicesv`` holds the token naming the table's version in the executors' local
#: cache (:mod:`enrich.state.cache`); ``devicesd`` the changes stored since the base (a list, in
#: order: ``seq`` counts up), ``devicesn`` the rows they hold and the base's.
STATE_NAME = "devices"
VALUE_SCHEMA = StructType([StructField("table", BinaryType(), False)])
DELTAS = STATE_NAME + "d"
DELTA_SCHEMA = StructType([StructField("seq", LongType(), False), StructField("rows", BinaryType(), False),
                           StructField("removed", BinaryType(), False)])
#: The state variable of a bucket's call results (``enrich.calls.step``; a VALUE_SCHEMA table), when the job has calls.
CALLS_NAME = "calls"
SIZES_SCHEMA = StructType([StructField("appended", LongType(), False), StructField("base", LongType(), False)])
#: A partitioned dimension's state variables: ``dim<index>``, a bucket's rows and the schema last
#: applied; ``dim<index>v``, a token naming that version (new at every change), which Python workers
#: cache the decoded rows and their index under (``enrich.joins.partitioned.CACHE``).
DIM_SCHEMA = StructType([StructField("table", BinaryType(), False), StructField("schema", BinaryType(), False)])
TOKEN_SCHEMA = StructType([StructField("token", StringType(), False)])
#: With ``joins[].wait``: a bucket's events held for completeness (``enrich.state.wait``), as one
#: Arrow IPC value of :data:`VALUE_SCHEMA`; absent when none are held.
HELD = "held"
#: With ``joins[].corrections``: a bucket's events written within the horizon (``enrich.state.corrections``),
#: a map of chunks (chunk id -> Arrow IPC rows: :data:`CHUNK_KEY_SCHEMA`, :data:`CHUNK_SCHEMA`), and
#: their index (``writtenn``: JSON ``{"next": id, "chunks": [[id, rows, min_ts, max_ts], ...]}``), read
#: on every call instead of the chunks.
WRITTEN = "written"
CHUNK_KEY_SCHEMA = StructType([StructField("chunk", LongType(), False)])
CHUNK_SCHEMA = StructType([StructField("rows", BinaryType(), False)])
WRITTEN_INDEX_SCHEMA = StructType([StructField("index", StringType(), False)])


def revisions_key(chunk: int) -> int:
    """The key of chunk ``chunk``'s revisions in the :data:`WRITTEN` map (chunks' keys count up from
    0); its own inverse: the chunk of a revisions key."""
    return -chunk - 1
#: The state variables of a bucket's gaps (``enrich.gaps.engine``: its devices, its closed gaps;
#: VALUE_SCHEMA tables), when the job has ``gaps:``.
GAPS, GAPS_CLOSED = "gaps", "gaps_closed"


def stored_spec(spec: StateSpec) -> StateSpec:
    """The engine's spec as the processor runs it: event times as int64 microseconds in ``_ts_us``;
    the stored bucket tables (``first_seen``, ``last_seen``) are laid out by it."""
    return dataclasses.replace(spec, timestamp=TS_US, timestamp_type=pa.int64())


def bucket_table(spec: StateSpec, base: bytes | None, deltas: Iterable[tuple[Any, bytes, bytes]]) -> pa.Table:
    """A bucket's device table as stored: its ``base`` (the :data:`STATE_NAME` value; None: none)
    with the changes stored since (the :data:`DELTAS` list's ``(seq, rows, removed)``, in any order)
    applied in ``seq`` order. ``spec``: the stored spec (:func:`stored_spec`)."""
    table = spec.empty() if base is None else engine.state_from_ipc(base, spec)
    for _, rows, removed in sorted(deltas, key=lambda d: int(d[0])):
        table = engine.merge(spec, table, engine.state_from_ipc(rows, spec), from_ipc(removed).column(0).combine_chunks())
    return table
