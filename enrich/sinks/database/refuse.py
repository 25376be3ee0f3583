"""The rows a database would refuse, found before they are written: each is a dead letter with the
reason, never a failed statement that every restart replays.

- PostgreSQL: a NUL character in a text value (``text`` cannot store it), a nested value (``JSONB``)
  holding NaN or +-Infinity, or a NUL (``\\u0000``, which ``JSONB`` refuses).
- MySQL/MariaDB: NaN or +-Infinity in a ``DOUBLE``/``FLOAT`` column, a key longer than its column
  (:data:`enrich.sinks.database.tables.KEY_LENGTH` characters, or bytes for binary keys).

What is stored losslessly is never refused: MariaDB's ``LONGTEXT`` keeps a NUL and a nested value's
``NaN`` as JSON text; PostgreSQL's ``DOUBLE PRECISION`` keeps NaN and +-Infinity. A ``%`` in a column
name is escaped in the statements (:mod:`.connect`), not refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from enrich.config import DatabaseDialect
from enrich.sinks.database.tables import KEY_LENGTH

__all__ = ["refused", "nested_json"]


def _nested(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t)


def nested_json(value: object) -> str:
    """A nested value as the JSON text the table stores; ValueError for NaN or +-Infinity."""
    return json.dumps(value, default=str, allow_nan=False)


def refused(table: pa.Table, dialect: DatabaseDialect, key: Sequence[str]) -> pa.Array:
    """Per row of ``table`` (the table's columns): why the database would refuse it, or null."""
    n = table.num_rows
    reasons: list[str | None] = [None] * n
    found = False

    def mark(mask: pa.Array | pa.ChunkedArray, reason: str) -> None:
        nonlocal found
        mask = pc.fill_null(mask, False)
        if not pc.any(mask).as_py():
            return
        found = True
        for i, hit in enumerate(mask.to_pylist()):
            if hit and reasons[i] is None:
                reasons[i] = reason

    for name in table.column_names:
        col = table.column(name)
        t = col.type
        what = f"output.database: column {name!r}"
        if dialect == "postgresql":
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                mark(pc.match_substring(col, "\x00"), f"{what} holds a NUL character, which PostgreSQL text cannot store")
            elif _nested(t):
                bad: list[str | None] = []
                for v in col.to_pylist():
                    try:
                        text = None if v is None else nested_json(v)
                        bad.append("NUL" if text is not None and "\\u0000" in text else None)
                    except ValueError:
                        bad.append("NaN")
                mark(pa.array([b == "NaN" for b in bad]),
                     f"{what} holds NaN or Infinity in a nested value, which JSONB cannot store")
                mark(pa.array([b == "NUL" for b in bad]),
                     f"{what} holds a NUL character in a nested value, which JSONB cannot store")
            continue
        if pa.types.is_floating(t):
            mark(pc.invert(pc.is_finite(col)), f"{what} holds NaN or Infinity, which a MySQL/MariaDB DOUBLE "
                                               "cannot store")
        elif name in key and (pa.types.is_string(t) or pa.types.is_large_string(t)):
            mark(pc.greater(pc.utf8_length(col), KEY_LENGTH),
                 f"{what} is the key and longer than its {KEY_LENGTH} characters")
        elif name in key and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            mark(pc.greater(pc.binary_length(col), KEY_LENGTH),
                 f"{what} is the key and longer than its {KEY_LENGTH} bytes")
    return pa.array(reasons if found else [None] * n, pa.string())
