"""The changelog contract between the refresher (producer) and the enrichment job (consumer).

One Kafka topic per dataset (``ref.<dataset>`` unless configured), ``cleanup.policy=compact``.

Records
    *change*  key   = canonical JSON object of the key columns in declared order, e.g.
                      ``{"device_id":"d-17"}`` (UTF-8, no spaces: same key, same bytes, always)
              value = the whole row as a JSON object (upsert) or null (delete: a tombstone)
    *schema*  key   = ``__schema__`` (never a JSON object, so it cannot collide with a row key)
              value = :class:`DatasetSchema` as JSON; published to every partition before the changes
                      of any refresh whose columns differ from the last published schema, so a reader
                      that applies records in offset order always knows the types of what follows.
    *heartbeat* key = ``__heartbeat__`` (never a JSON object either)
              value = ``{"dataset": ..., "version": n, "at": "<ISO time of the run>",
                      "complete_as_of": "<time>"}``; the run's *completeness record*: every
                      successful run writes one to every partition as the last records of its
                      transaction, after its changes, or alone when it found none. It changes no row:
                      readers skip it (a reader that predates it logs it as an unknown op and skips
                      it), and compaction keeps only the latest one per partition, since every
                      heartbeat has the same key.

Headers (UTF-8 strings): ``op`` = ``upsert`` | ``delete`` | ``schema`` | ``heartbeat``; ``dataset``; ``version`` = a
decimal integer that grows with every refresh of the dataset; ``contract`` = :data:`CONTRACT_VERSION`.
Times are ISO 8601 in UTC with microseconds and a ``Z``, ``2024-05-01T12:00:00.000000Z``
(:func:`format_time`, :func:`parse_time`):

``valid_from`` (upserts and tombstones)
    The time from which the record holds: an upsert's row is the key's row from then on, a
    tombstone says the key is gone from then on. ``mode: diff`` and files: the time the run's read
    began (for files, the read of the settled file set), the first moment the refresher knew the row;
    ``mode: incremental``: the row's cursor value when the cursor is a time (a naive one read as
    UTC, a date as its midnight), else - an integer or text cursor, a row whose cursor is NULL, a
    tombstone (found by a reconcile) - the database clock when the run's read began. A row
    republished unchanged (``--full``, a republish of a lost topic, a re-key) keeps the time it was
    first published with. Records written before valid-from times existed have no such header.
``complete_as_of`` (heartbeats)
    The run's completeness: every change of the source valid at or before this time is in the
    changelog, in this transaction or an earlier one. ``mode: diff`` and files: the time the run's
    read began; ``mode: incremental``: the database clock when the read began minus ``lag`` (the
    bound the window read up to, for a time cursor; a date cursor: the end of the day before that
    bound's day; an integer or text cursor: the read's start, its rows carrying that time), never
    below what an earlier run published. A reader has applied a dataset completely as of the
    smallest ``complete_as_of`` of the latest heartbeats it read on each of the topic's partitions
    (:func:`complete_as_of`): a partition's heartbeat follows every record of its run on that
    partition, and the transaction makes the run visible on every partition or none.
    Only a run that read the source publishes one (a run that fails publishes nothing), so a
    dataset's completeness moves only when its source was checked.

JSON encoding of values: DECIMAL as a string with its exact digits; DATE ``YYYY-MM-DD``;
DATETIME ``2024-05-01T12:00:00[.ffffff]``; TIMESTAMP WITH TIME ZONE the same with an offset
(normalised to UTC, ``+00:00``); TIME ``HH:MM:SS[.ffffff]``; binary as base64; NULL as null; text as
UTF-8 (any unicode); non-finite floats as the strings ``NaN``, ``Infinity``, ``-Infinity``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from itertools import repeat
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from refstream.encode import dumps, encode_batches, fix_floats
from refstream.errors import ContractError

__all__ = [
    "CONTRACT_VERSION",
    "DECIMAL128_DIGITS",
    "DECIMAL256_DIGITS",
    "HEARTBEAT_KEY",
    "H_COMPLETE_AS_OF",
    "H_CONTRACT",
    "H_DATASET",
    "H_OP",
    "H_VALID_FROM",
    "H_VERSION",
    "OP_DELETE",
    "OP_HEARTBEAT",
    "OP_SCHEMA",
    "OP_UPSERT",
    "SCHEMA_KEY",
    "SIMPLE_TYPES",
    "TIME_TYPE",
    "TOPIC_CONFIG",
    "Change",
    "Column",
    "DatasetSchema",
    "Message",
    "MessageBatch",
    "ValidFrom",
    "check_type",
    "complete_as_of",
    "decimal_type",
    "decode",
    "decode_values",
    "default_topic",
    "delete_batches",
    "delete_messages",
    "encode_key",
    "encode_row",
    "format_time",
    "format_times",
    "header_map",
    "headers",
    "heartbeat_message",
    "parse_time",
    "schema_message",
    "type_from_arrow",
    "type_to_arrow",
    "type_to_spark",
    "upsert_batches",
    "upsert_messages",
]

CONTRACT_VERSION = 1

H_OP, H_DATASET, H_VERSION, H_CONTRACT = "op", "dataset", "version", "contract"
H_VALID_FROM, H_COMPLETE_AS_OF = "valid_from", "complete_as_of"
OP_UPSERT, OP_DELETE, OP_SCHEMA, OP_HEARTBEAT = "upsert", "delete", "schema", "heartbeat"
SCHEMA_KEY = b"__schema__"
HEARTBEAT_KEY = b"__heartbeat__"
TOPIC_CONFIG = {"cleanup.policy": "compact"}

#: Contract column types. ``decimal(p,s)`` is parametric; everything else is a plain name.
SIMPLE_TYPES = ("bool", "int64", "float64", "string", "binary", "date", "time", "timestamp", "timestamp_tz")
_DECIMAL = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")
#: Digits of Arrow's decimal128, which is also the widest decimal Spark holds (wider: decimal256, STRING).
DECIMAL128_DIGITS = 38
#: Digits of Arrow's decimal256, the widest decimal a column can have; wider sources are capped.
DECIMAL256_DIGITS = 76


def default_topic(dataset: str) -> str:
    return f"ref.{dataset}"


# --------------------------------------------------------------------------------------------- types

def check_type(t: str) -> str:
    if t in SIMPLE_TYPES or _DECIMAL.match(t):
        return t
    raise ContractError(f"unknown column type {t!r}")


def decimal_type(precision: int, scale: int) -> pa.DataType:
    """The Arrow type of a DECIMAL(precision, scale), for sources and the contract alike: decimal128 up
    to 38 digits, decimal256 beyond, capped at its 76 digits (PostgreSQL's numeric allows 1000)."""
    precision = min(precision, DECIMAL256_DIGITS)
    if precision <= DECIMAL128_DIGITS:
        return pa.decimal128(precision, scale)
    return pa.decimal256(precision, scale)


def type_from_arrow(t: pa.DataType) -> str:
    """Map an Arrow type (as read from a database or a file) to a contract type."""
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int64"
    if pa.types.is_floating(t):
        return "float64"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_time(t) or pa.types.is_duration(t):
        return "time"
    if pa.types.is_timestamp(t):
        return "timestamp_tz" if t.tz else "timestamp"
    if pa.types.is_null(t):
        return "string"
    if pa.types.is_dictionary(t):
        return type_from_arrow(t.value_type)
    raise ContractError(f"Arrow type {t} has no changelog encoding")


def type_to_arrow(t: str) -> pa.DataType:
    m = _DECIMAL.match(t)
    if m:
        return decimal_type(int(m.group(1)), int(m.group(2)))
    try:
        return {
            "bool": pa.bool_(), "int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
            "binary": pa.binary(), "date": pa.date32(), "time": pa.string(),
            "timestamp": pa.timestamp("us"), "timestamp_tz": pa.timestamp("us", tz="UTC"),
        }[t]
    except KeyError:
        raise ContractError(f"unknown column type {t!r}") from None


def type_to_spark(t: str) -> str:
    """Spark SQL DDL type of a contract type."""
    m = _DECIMAL.match(t)
    if m:
        return f"DECIMAL({m.group(1)},{m.group(2)})" if int(m.group(1)) <= DECIMAL128_DIGITS else "STRING"
    try:
        return {
            "bool": "BOOLEAN", "int64": "BIGINT", "float64": "DOUBLE", "string": "STRING",
            "binary": "BINARY", "date": "DATE", "time": "STRING", "timestamp": "TIMESTAMP_NTZ",
            "timestamp_tz": "TIMESTAMP",
        }[t]
    except KeyError:
        raise ContractError(f"unknown column type {t!r}") from None


# -------------------------------------------------------------------------------------------- schema

@dataclass(frozen=True)
class Column:
    name: str
    type: str

    def __post_init__(self) -> None:
        check_type(self.type)


@dataclass(frozen=True)
class DatasetSchema:
    """Column names and types of a dataset, published on its changelog topic."""

    dataset: str
    key: tuple[str, ...]
    columns: tuple[Column, ...]
    version: int = 0
    contract: int = field(default=CONTRACT_VERSION)

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        missing = [k for k in self.key if k not in names]
        if missing:
            raise ContractError(f"dataset {self.dataset}: key column(s) {missing} not among columns {names}")
        if len(set(names)) != len(names):
            raise ContractError(f"dataset {self.dataset}: duplicate column names in {names}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def type_of(self, name: str) -> str:
        for c in self.columns:
            if c.name == name:
                return c.type
        raise KeyError(name)

    def same_columns(self, other: DatasetSchema | None) -> bool:
        return other is not None and self.key == other.key and self.columns == other.columns

    @classmethod
    def from_arrow(cls, dataset: str, key: Sequence[str], schema: pa.Schema, version: int = 0) -> DatasetSchema:
        return cls(dataset, tuple(key), tuple(Column(f.name, type_from_arrow(f.type)) for f in schema), version)

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, type_to_arrow(c.type)) for c in self.columns])

    def spark_ddl(self, columns: Iterable[str] | None = None) -> str:
        wanted = list(columns) if columns is not None else self.names
        return ", ".join(f"`{n}` {type_to_spark(self.type_of(n))}" for n in wanted)

    def to_json(self) -> bytes:
        return dumps({
            "contract": self.contract, "dataset": self.dataset, "version": self.version,
            "key": list(self.key), "columns": [{"name": c.name, "type": c.type} for c in self.columns],
        })

    @classmethod
    def from_json(cls, data: bytes | str) -> DatasetSchema:
        try:
            obj = json.loads(data)
            return cls(obj["dataset"], tuple(obj["key"]),
                       tuple(Column(c["name"], c["type"]) for c in obj["columns"]),
                       int(obj.get("version", 0)), int(obj.get("contract", CONTRACT_VERSION)))
        except ContractError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ContractError(f"malformed schema record: {exc}") from None


# ------------------------------------------------------------------------------------------- times

#: The Arrow type of valid-from times and completeness in memory.
TIME_TYPE = pa.timestamp("us", tz="UTC")


def format_time(t: datetime) -> str:
    """The contract's text of a time: ISO 8601 in UTC with microseconds and ``Z``
    (``2024-05-01T12:00:00.000000Z``); a naive time is taken as UTC."""
    if t.tzinfo is not None:
        t = t.astimezone(UTC).replace(tzinfo=None)
    return t.isoformat(timespec="microseconds") + "Z"


def parse_time(text: str | bytes) -> datetime:
    """A time written by :func:`format_time` (any ISO 8601 form is accepted; without an offset it is
    UTC), as an aware UTC datetime."""
    try:
        t = datetime.fromisoformat(text.decode() if isinstance(text, bytes) else text)
    except (ValueError, UnicodeDecodeError):
        raise ContractError(f"{text!r} is not an ISO 8601 time") from None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def format_times(times: pa.Array | pa.ChunkedArray) -> list[bytes]:
    """:func:`format_time` of every value of a NULL-free timestamp array, with Arrow kernels (a million
    in about 0.3 s, where ``strftime`` with a zone takes seconds)."""
    if times.null_count:
        raise ContractError("a time to format is NULL")
    # As naive UTC: casting a zoned timestamp to text converts through the time zone database.
    naive = pc.cast(pc.cast(times, pa.int64()), pa.timestamp("us"))
    text = pc.replace_substring(pc.cast(naive, pa.string()), " ", "T", max_replacements=1)
    return pc.cast(pc.binary_join_element_wise(text, "Z", ""), pa.binary()).to_pylist()


def complete_as_of(latest: Mapping[int, datetime | None], partitions: Iterable[int]) -> datetime | None:
    """How complete a reader's copy of a dataset is: given the ``complete_as_of`` of the latest
    heartbeat it applied on each partition (``latest``, None or absent: none yet), the time up to
    which it holds every change of the source - the smallest over the topic's ``partitions``, None
    while one of them has none."""
    out: datetime | None = None
    for p in partitions:
        t = latest.get(p)
        if t is None:
            return None
        out = t if out is None or t < out else out
    return out


# ---------------------------------------------------------------------------------------- encoding

# The row-wise encoding lives in refstream.encode, next to the bulk encoder that must match it byte for byte.


def encode_key(key: Sequence[str], row: Mapping[str, Any]) -> bytes:
    """Canonical key bytes: a JSON object of the key columns in declared order."""
    try:
        return dumps({k: fix_floats(row[k]) for k in key})
    except KeyError as exc:
        raise ContractError(f"row has no key column {exc}") from None


def encode_row(row: Mapping[str, Any]) -> bytes:
    """Value bytes of an upsert: the whole row as a JSON object."""
    return dumps({k: fix_floats(v) for k, v in row.items()})


def headers(op: str, dataset: str, version: int, *, valid_from: datetime | None = None) -> list[tuple[str, bytes]]:
    out = [(H_OP, op.encode()), (H_DATASET, dataset.encode()), (H_VERSION, str(version).encode()),
           (H_CONTRACT, str(CONTRACT_VERSION).encode())]
    if valid_from is not None:
        out.append((H_VALID_FROM, format_time(valid_from).encode()))
    return out


@dataclass(frozen=True)
class Message:
    """One changelog record ready to produce."""

    key: bytes
    value: bytes | None
    headers: list[tuple[str, bytes]]


def schema_message(schema: DatasetSchema) -> Message:
    return Message(SCHEMA_KEY, schema.to_json(), headers(OP_SCHEMA, schema.dataset, schema.version))


def heartbeat_message(dataset: str, version: int, at: datetime,
                      complete_as_of: datetime | None = None) -> Message:
    """The completeness record of a run, made at ``at``: every change valid at or before
    ``complete_as_of`` is in the changelog (see the module's docstring)."""
    body: dict[str, Any] = {"dataset": dataset, "version": version, "at": at.isoformat()}
    h = headers(OP_HEARTBEAT, dataset, version)
    if complete_as_of is not None:
        body["complete_as_of"] = format_time(complete_as_of)
        h.append((H_COMPLETE_AS_OF, body["complete_as_of"].encode()))
    return Message(HEARTBEAT_KEY, json.dumps(body, separators=(",", ":")).encode(), h)


@dataclass(frozen=True)
class MessageBatch:
    """Changelog records sharing one set of headers, as parallel lists: what a publisher produces
    without a :class:`Message` object per record (``values[i]`` None: a tombstone). ``valid_from``,
    when set, holds each record's own ``valid_from`` header value (appended to ``headers``)."""

    keys: list[bytes]
    values: Sequence[bytes | None]
    headers: list[tuple[str, bytes]]
    valid_from: Sequence[bytes] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def record_headers(self, i: int) -> list[tuple[str, bytes]]:
        """The headers of record ``i``."""
        return self.headers if self.valid_from is None else [*self.headers, (H_VALID_FROM, self.valid_from[i])]

    def messages(self) -> Iterator[Message]:
        if self.valid_from is None:
            return map(Message, self.keys, self.values, repeat(self.headers))
        return map(Message, self.keys, self.values, map(self.record_headers, range(len(self.keys))))


#: When records are valid from: one time for all, or one per row (a timestamp array or a sequence).
ValidFrom: TypeAlias = datetime | pa.Array | pa.ChunkedArray | Sequence[datetime] | None


def _batches(op: str, schema: DatasetSchema, rows: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
             version: int, valid_from: ValidFrom, *, values: bool) -> Iterator[MessageBatch]:
    """Records of ``op`` for every row of ``rows``: an Arrow table encoded in bulk, a batch at a time;
    per-row valid-from times formatted a batch at a time too, and shared by the batch's records
    when they are all one time (a diff run's changes)."""
    if isinstance(valid_from, datetime) or valid_from is None:
        h = headers(op, schema.dataset, version, valid_from=valid_from)
        per_row: pa.ChunkedArray | None = None
    else:
        h = headers(op, schema.dataset, version)
        per_row = (valid_from if isinstance(valid_from, pa.ChunkedArray) else pa.chunked_array(
            [valid_from if isinstance(valid_from, pa.Array) else pa.array(list(valid_from), TIME_TYPE)]
        )).cast(TIME_TYPE)
    encoded: Iterable[tuple[list[bytes], list[bytes] | None]]
    if isinstance(rows, pa.Table | pa.RecordBatch):
        encoded, count = encode_batches(rows, schema.key, values=values), rows.num_rows
    else:
        listed = list(rows)
        encoded = [([encode_key(schema.key, r) for r in listed],
                    [encode_row(r) for r in listed] if values else None)] if listed else []
        count = len(listed)
    if per_row is not None and len(per_row) != count:
        raise ContractError(f"dataset {schema.dataset}: {len(per_row)} valid-from times for {count} rows")
    start = 0
    for keys, vals in encoded:
        n = len(keys)
        out_vals: Sequence[bytes | None] = vals if vals is not None else [None] * n
        if per_row is None:
            yield MessageBatch(keys, out_vals, h)
        else:
            times = per_row.slice(start, n)
            lo_hi = pc.min_max(times).as_py()
            if lo_hi["min"] == lo_hi["max"]:
                yield MessageBatch(keys, out_vals, [*h, (H_VALID_FROM, format_time(lo_hi["min"]).encode())])
            else:
                yield MessageBatch(keys, out_vals, h, format_times(times))
        start += n


def upsert_batches(schema: DatasetSchema, rows: pa.Table | Iterable[Mapping[str, Any]],
                   version: int, *, valid_from: ValidFrom = None) -> Iterator[MessageBatch]:
    """Upsert records for every row of ``rows`` in batches (an Arrow table is encoded in bulk), each
    with the ``valid_from`` header when given: one time for every row, or one per row."""
    return _batches(OP_UPSERT, schema, rows, version, valid_from, values=True)


def delete_batches(schema: DatasetSchema, keys: pa.Table | Iterable[Mapping[str, Any]],
                   version: int, *, valid_from: ValidFrom = None) -> Iterator[MessageBatch]:
    """Tombstones for every key row of ``keys`` in batches (only the key columns are read), with
    ``valid_from`` as for :func:`upsert_batches`."""
    return _batches(OP_DELETE, schema, keys, version, valid_from, values=False)


def upsert_messages(schema: DatasetSchema, rows: pa.Table | Iterable[Mapping[str, Any]],
                    version: int, *, valid_from: ValidFrom = None) -> Iterator[Message]:
    """Upsert records for every row of ``rows``, one :class:`Message` each."""
    for batch in upsert_batches(schema, rows, version, valid_from=valid_from):
        yield from batch.messages()


def delete_messages(schema: DatasetSchema, keys: pa.Table | Iterable[Mapping[str, Any]],
                    version: int, *, valid_from: ValidFrom = None) -> Iterator[Message]:
    """Tombstones for every key row of ``keys``, one :class:`Message` each."""
    for batch in delete_batches(schema, keys, version, valid_from=valid_from):
        yield from batch.messages()


# ---------------------------------------------------------------------------------------- decoding

def header_map(hdrs: Iterable[tuple[str, bytes | None]] | Mapping[str, Any] | None) -> dict[str, str]:
    if not hdrs:
        return {}
    items = hdrs.items() if isinstance(hdrs, Mapping) else hdrs
    return {k: (v.decode("utf-8") if isinstance(v, bytes | bytearray) else (v or "")) for k, v in items}


@dataclass(frozen=True)
class Change:
    """A decoded changelog record."""

    op: str
    dataset: str
    version: int
    key: bytes
    value: bytes | None
    schema: DatasetSchema | None = None
    #: An upsert's or tombstone's ``valid_from`` header (None: a record written without one).
    valid_from: datetime | None = None
    #: A heartbeat's ``complete_as_of`` header (None: a heartbeat written without one).
    complete_as_of: datetime | None = None


def _time_header(h: Mapping[str, str], name: str, key: bytes) -> datetime | None:
    text = h.get(name)
    if not text:
        return None
    try:
        return parse_time(text)
    except ContractError:
        raise ContractError(f"record {key!r}: bad {name} header {text!r}") from None


def decode(key: bytes | None, value: bytes | None, hdrs: Any) -> Change:
    """Classify one record; raises :class:`ContractError` naming the key when it breaks the contract."""
    h = header_map(hdrs)
    if key is None:
        raise ContractError("changelog record without a key")
    op = h.get(H_OP) or (OP_SCHEMA if key == SCHEMA_KEY else OP_HEARTBEAT if key == HEARTBEAT_KEY
                         else (OP_DELETE if value is None else OP_UPSERT))
    try:
        version = int(h.get(H_VERSION, "0") or 0)
    except ValueError:
        raise ContractError(f"record {key!r}: bad version header {h.get(H_VERSION)!r}") from None
    if op == OP_SCHEMA:
        if value is None:
            raise ContractError("schema record without a value")
        schema = DatasetSchema.from_json(value)
        return Change(op, h.get(H_DATASET, schema.dataset), version, key, value, schema)
    if op == OP_HEARTBEAT:
        return Change(op, h.get(H_DATASET, ""), version, key, value,
                      complete_as_of=_time_header(h, H_COMPLETE_AS_OF, key))
    if op == OP_DELETE or value is None:
        return Change(OP_DELETE, h.get(H_DATASET, ""), version, key, None,
                      valid_from=_time_header(h, H_VALID_FROM, key))
    if op != OP_UPSERT:
        raise ContractError(f"record {key!r}: unknown op header {op!r}")
    return Change(op, h.get(H_DATASET, ""), version, key, value, valid_from=_time_header(h, H_VALID_FROM, key))


def decode_values(schema: DatasetSchema, values: Sequence[bytes]) -> pa.Table:
    """Decode upsert values into an Arrow table typed by ``schema`` (columns absent from a value are null).

    Vectorised: the values are parsed by Arrow's JSON reader as strings and numbers, then cast.
    """
    if not values:
        return schema.arrow_schema().empty_table()
    read_types = []
    for c in schema.columns:
        if c.type in ("bool", "int64"):
            read_types.append(pa.field(c.name, type_to_arrow(c.type)))
        elif c.type == "float64":
            read_types.append(pa.field(c.name, pa.float64()))
        else:
            read_types.append(pa.field(c.name, pa.string()))
    buf = b"\n".join(values)
    try:
        table = pajson.read_json(
            io.BytesIO(buf),
            read_options=pajson.ReadOptions(block_size=max(1 << 20, min(len(buf) + 1, 64 << 20))),
            parse_options=pajson.ParseOptions(explicit_schema=pa.schema(read_types),
                                              unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # Slow path: a float column holding "NaN", an int column holding a string, ...; done per row so
        # the error can name the record at fault.
        return _decode_values_slow(schema, values)
    cols = []
    for c, f in zip(schema.columns, read_types, strict=True):
        cols.append(_cast_column(c, table.column(c.name) if c.name in table.column_names
                                 else pa.nulls(len(table), f.type)))
    return pa.Table.from_arrays(cols, schema=schema.arrow_schema())


def _cast_column(c: Column, arr: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    target = type_to_arrow(c.type)
    if c.type == "binary":
        return pa.array([None if v is None else base64.b64decode(v) for v in arr.to_pylist()], pa.binary())
    if c.type == "timestamp_tz":
        return pa.array([None if v is None else datetime.fromisoformat(v) for v in arr.to_pylist()],
                        target)
    if c.type in ("bool", "int64", "float64", "string", "time"):
        return arr
    return pc.cast(arr, target)


def _decode_values_slow(schema: DatasetSchema, values: Sequence[bytes]) -> pa.Table:
    out: dict[str, list[Any]] = {c.name: [] for c in schema.columns}
    for i, raw in enumerate(values):
        try:
            obj = json.loads(raw)
            for c in schema.columns:
                out[c.name].append(_from_json(c.type, obj.get(c.name)))
        except (ValueError, TypeError, AttributeError, ArithmeticError, KeyError) as exc:
            raise ContractError(f"dataset {schema.dataset}: value #{i} {raw[:200]!r} does not fit the "
                                f"published schema: {exc}") from None
    return pa.table({c.name: pa.array(out[c.name], type_to_arrow(c.type)) for c in schema.columns},
                    schema=schema.arrow_schema())


_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _from_json(t: str, v: Any) -> Any:
    if v is None:
        return None
    if t == "float64":
        return _NONFINITE[v] if isinstance(v, str) else float(v)
    if t == "int64":
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{v!r} is not an integer")
        return v
    if t == "bool":
        if not isinstance(v, bool):
            raise TypeError(f"{v!r} is not a boolean")
        return v
    if t.startswith("decimal"):
        return Decimal(v)
    if t == "date":
        return date.fromisoformat(v)
    if t in ("timestamp", "timestamp_tz"):
        return datetime.fromisoformat(v)
    if t == "binary":
        return base64.b64decode(v)
    return v if isinstance(v, str) else json.dumps(v)
