"""``enrich lookup --state DEVICE``: one device's state as a committed micro-batch left it.

Read from the checkpoint by :mod:`enrich.ops.stateread`, so it works while the job runs and after it
stopped. The job's pipeline is planned again from the config
and the published schemas the job recorded (:mod:`enrich.pipeline`), so the state is read with the
spec, partitioned dimensions and bucket layout the job wrote it with. The state step keeps a table
per hash bucket of devices (docs/state.md): only the device's bucket is taken from the scans, and
its table rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from enrich.calls.step import KEY, CallStep
from enrich.checkpoint import CheckpointLayout
from enrich.config import EnrichConfig
from enrich.ops import stateread
from enrich.ops.batches import Checkpoint
from enrich.ops.stateread import device_tables
from enrich.pipeline import Pipeline
from enrich.state import engine
from enrich.state.record import check_checkpoint
from enrich.state.stored import stored_spec
from refstream.errors import ConfigError, DataError

#: ``present``: the batch left state for the device; ``absent``: it never sent an event that was
#: applied, or its state had expired (TTL) by then.
Found = Literal["present", "absent"]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, kw_only=True)
class DeviceStateResult:
    key: str                       # the state.key column
    device: Any                    # the device's key, as the events' type
    batch_id: int
    bucket: int
    found: Found
    state: dict[str, Any] | None   # the fields of the events' ``state`` struct (times as ISO text)
    expires_at: str | None         # last_seen + ttl: the watermark that drops the state

    def to_json(self) -> dict[str, Any]:
        return {"key": {self.key: self.device}, "batch_id": self.batch_id, "bucket": self.bucket,
                "found": self.found, "state": self.state, "expires_at": self.expires_at}


def device_state(cfg: EnrichConfig, device: str, batch_id: int | None = None, *,
                 spark: SparkSession | None = None) -> DeviceStateResult:
    """The state of ``device`` (its ``state.key`` value as text) after ``batch_id`` (default: the last
    committed batch). ``spark``: a session to read with (default: the active one, else a local one)."""
    if cfg.state is None:
        raise ConfigError(f"{cfg.source}: no state: section, so the job keeps no device state to look up")
    ck = CheckpointLayout(cfg.checkpoint)
    batch_id = Checkpoint(cfg.checkpoint).committed_batch(batch_id)
    if not ck.state_record.exists():
        raise DataError(f"{cfg.checkpoint}: the job ran without state: on this checkpoint; it keeps no device state")
    spark = spark or SparkSession.getActiveSession() or session(cfg)  # Spark parses events.schema
    timezone = cfg.timezone
    pipeline = Pipeline.build(cfg, ck.read_schemas(), timezone=timezone)
    st = pipeline.state
    assert st is not None
    layout = check_checkpoint(ck, cfg.state, st.spec, cfg.source, st.dims)  # the record exists: compares only
    assert layout is not None
    stored = stored_spec(st.spec)

    key_type = st.joined[cfg.state.key].dataType
    typed = F.lit(device).try_cast(key_type)
    key, bucket = spark.range(1).select(typed, layout.column(typed)).first()  # type: ignore[misc]
    if key is None:
        raise ConfigError(f"device {device!r} is not a {key_type.simpleString()} (the type of state.key "
                          f"{cfg.state.key})")

    table = device_tables(spark, ck, batch_id, stored, bucket)
    hit = table.filter(pc.equal(table.column(engine.KEY), pa.scalar(key, st.spec.key_type)))
    found: dict[str, Any] | None = engine.finalize(stored, hit).to_pylist()[0] if hit.num_rows else None
    if found is None:
        return DeviceStateResult(key=cfg.state.key, device=key, batch_id=batch_id, bucket=bucket, found="absent",
                                 state=None, expires_at=None)
    if st.calls is not None:  # the results sit flat at the end of the state struct, as in the output
        found.update(_results(stateread.call_table(spark, ck, batch_id, bucket), st.calls, key))
    zone = ZoneInfo(timezone)
    expires = found["last_seen"] + st.spec.ttl_us
    for name in ("first_seen", "last_seen"):
        found[name] = _iso(found[name], zone)
    return DeviceStateResult(key=cfg.state.key, device=key, batch_id=batch_id, bucket=bucket, found="present",
                             state=found, expires_at=_iso(expires, zone))


def _results(table: pa.Table | None, calls: CallStep, key: Any) -> dict[str, Any]:
    """The device's ``<name>_<field>`` results in ``table`` (its bucket's call table); null when it
    has none (no call made yet, or its calls were added after its last event)."""
    row = (table.filter(pc.equal(table.column(KEY), pa.scalar(key, calls.key_type))).to_pylist()
           if table is not None else [])
    return {col: row[0].get(col) if row else None for col, _ in calls.result_columns()}


def _iso(micros: int, zone: ZoneInfo) -> str:
    """Event time as the Kafka sink's JSON writes it (``...T00:02:00.000000Z``)."""
    text = (_EPOCH + timedelta(microseconds=micros)).astimezone(zone).isoformat(timespec="microseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def session(cfg: EnrichConfig) -> SparkSession:
    """A small local Spark session for reading the checkpoint's state."""
    return stateread.session(cfg, "local[1]", "refstream-lookup",
                             {"spark.sql.session.timeZone": cfg.timezone})
