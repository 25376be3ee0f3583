"""``enrich lookup --rollup NAME --key V [--key V2 ...]``: the latest revision of one key's windows,
newest first, from the rollup's database table (one indexed query, no Spark session) or else its
Parquet directory (every revision; the greatest ``_revision`` per window kept)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from enrich.config import EnrichConfig
from enrich.rollups.config import RollupConfig
from enrich.rollups.spec import REVISION, WINDOW_START
from enrich.sinks.database.connect import connect, quote
from refstream.errors import ConfigError

__all__ = ["rollup_rows"]


def rollup_rows(cfg: EnrichConfig, name: str, keys: Sequence[str], limit: int) -> list[dict[str, Any]]:
    """The latest revision of the windows of rollup ``name`` whose ``by`` values are ``keys`` (as
    text, in ``by:`` order), newest window first, at most ``limit``; JSON-ready (times in ISO 8601)."""
    rollup = next((r for r in cfg.rollups if r.name == name), None)
    if rollup is None:
        have = ", ".join(r.name for r in cfg.rollups) or "none"
        raise ConfigError(f"{cfg.source}: no rollup named {name!r} (rollups: {have})")
    if len(keys) != len(rollup.by):
        raise ConfigError(f"rollup {name} is by {', '.join(rollup.by)}: give --key {len(rollup.by)} time(s), "
                          f"in that order (got {len(keys)})")
    if rollup.output.database is not None:
        rows = _from_database(rollup, keys, limit)
    elif rollup.output.parquet is not None:
        rows = _from_parquet(rollup, keys, limit)
    else:
        raise ConfigError(f"{cfg.source}: rollup {name} writes to Kafka only; lookup reads its database table "
                          "or Parquet directory")
    return [{k: _json(v) for k, v in r.items()} for r in rows]


def _from_database(rollup: RollupConfig, keys: Sequence[str], limit: int) -> list[dict[str, Any]]:
    db = rollup.output.database

    def q(n: str) -> str:
        return quote(db.dialect, n)

    conn = connect(db.url, db.dialect, db.statement_timeout.total_seconds())
    try:
        with conn.cursor() as cur:
            # Text compared with each key column as its own type, so its index serves the query.
            casts = ["%s"] * len(keys)
            if db.dialect == "postgresql":
                cur.execute("SELECT column_name, data_type FROM information_schema.columns "
                            "WHERE table_schema = current_schema() AND table_name = %s", (db.table,))
                types = dict(cur.fetchall())
                casts = [f"CAST(%s AS {types.get(b, 'text')})" for b in rollup.by]
            where = " AND ".join(f"{q(b)} = {c}" for b, c in zip(rollup.by, casts, strict=True))
            cur.execute(f"SELECT * FROM {q(db.table)} WHERE {where} ORDER BY {q(WINDOW_START)} DESC "
                        f"LIMIT {int(limit)}", tuple(keys))
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
        conn.commit()
    finally:
        conn.close()
    return rows


def _from_parquet(rollup: RollupConfig, keys: Sequence[str], limit: int) -> list[dict[str, Any]]:
    path = rollup.output.parquet
    assert path is not None
    if not path.is_dir() or not any(path.glob("batch_id=*")):
        return []
    data = ds.dataset(path, format="parquet", partitioning="hive", exclude_invalid_files=True)
    match = None
    for b, k in zip(rollup.by, keys, strict=True):  # read only the key's rows
        one = pc.field(b).cast(pa.string()) == k
        match = one if match is None else match & one
    table = data.to_table(filter=match).drop_columns(["batch_id"])
    ordered = table.sort_by([(WINDOW_START, "descending"), (REVISION, "descending")]).to_pylist()
    latest, seen = [], set()
    for row in ordered:
        if row[WINDOW_START] not in seen:
            seen.add(row[WINDOW_START])
            latest.append(row)
    return latest[:limit]


def _json(v: object) -> object:
    if isinstance(v, datetime):
        return (v if v.tzinfo is not None else v.replace(tzinfo=UTC)).astimezone(UTC).isoformat()
    return v
