"""``enrich lookup --state DEVICE`` answered from ``output.database``'s table (``write: state``):
one indexed query, no Spark session. The answer has the fields of the checkpoint's
(:mod:`enrich.ops.device`) plus ``"source": "database"``: ``batch_id`` is the last batch the job
committed (its fence rows in the table, in the checkpoint's query, or Spark's commit log), ``bucket`` the device's grouping
key as the checkpoint records the layout."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pyarrow as pa

from enrich.checkpoint import CheckpointLayout
from enrich.config import EnrichConfig
from enrich.sinks.database.connect import connect, percent, quote
from enrich.state.hashing import buckets_of
from refstream.errors import ConfigError

__all__ = ["device_state_from_database"]

_INTS = {"int8", "int16", "int32", "int64"}


def device_state_from_database(cfg: EnrichConfig, device: str) -> dict[str, Any]:
    """The device's row as :meth:`enrich.ops.device.DeviceStateResult.to_json` gives the checkpoint's
    answer, plus ``source``."""
    db, st = cfg.output.database, cfg.state
    if db is None or db.write != "state" or st is None:
        raise ConfigError(f"{cfg.source}: output.database.write: the table holds no device state (write: state)")
    ck = CheckpointLayout(cfg.checkpoint)
    record = _json(ck.state_record)
    key_type = _key_type(record)
    try:
        key: Any = int(device) if str(key_type) in _INTS else device
    except ValueError:
        raise ConfigError(f"device {device!r} is not a {key_type} (the type of state.key {st.key})") from None
    ids = record.get("bucket_ids") if record else None
    bucket = int(ids[int(buckets_of(pa.array([key], key_type), len(ids))[0])]) if ids else None
    scope = (_json(ck.sink_identity) or {}).get("scope")

    def q(n: str) -> str:
        return quote(db.dialect, n)

    conn = connect(db.url, db.dialect, db.statement_timeout.total_seconds())
    try:
        with conn.cursor() as cur:
            cur.execute(percent(f"SELECT * FROM {q(db.table)} WHERE {q(st.key)}") + " = %s", (key,))
            names = [d[0] for d in cur.description]
            got = cur.fetchone()
            where, args = ("WHERE query_id = %s", (scope,)) if scope else ("", ())
            cur.execute(f"SELECT MAX(batch_id) FROM {q(db.fence)} {where}", args)
            batch = cur.fetchone()
        conn.commit()
    finally:
        conn.close()
    # The table holds the state as of the last batch written to it, or a later batch that wrote no
    # rows (one Spark ran to move the watermark on); the checkpoint commits a batch after its rows.
    done = [int(batch[0])] if batch and batch[0] is not None else []
    done += ck.committed()[-1:]
    batch_id = max(done) if done else None
    out: dict[str, Any] = {"key": {st.key: key}, "batch_id": batch_id, "bucket": bucket, "found": "absent",
                           "state": None, "expires_at": None, "source": "database"}
    if got is None:
        return out
    row = dict(zip(names, got, strict=True))
    zone = ZoneInfo(cfg.timezone)
    state = {f: row[f] for f in ("events", "first_seen", "last_seen", *st.fields)}
    last = _utc(state["last_seen"])
    for name in ("first_seen", "last_seen"):
        state[name] = _iso(_utc(state[name]), zone)
    out.update(found="present", state=state, expires_at=_iso(last + st.ttl, zone) if last else None)
    return out


def _json(path: Any) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _key_type(record: dict[str, Any] | None) -> pa.DataType:
    """The key's Arrow type as the checkpoint's state record has it (``_key: <type>``); text without one."""
    for line in str((record or {}).get("state_schema", "")).splitlines():
        name, _, typ = line.partition(": ")
        if name.strip() == "_key":
            try:
                return pa.type_for_alias(typ.strip().split()[0])
            except ValueError:
                break
    return pa.string()


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)  # MariaDB: UTC, naive


def _iso(value: datetime | None, zone: ZoneInfo) -> str | None:
    """Event time as the Kafka sink's JSON writes it (``...T00:02:00.000000Z``)."""
    if value is None:
        return None
    text = value.astimezone(zone).isoformat(timespec="microseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text
