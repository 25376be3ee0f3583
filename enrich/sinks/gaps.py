"""The gaps' records: written by the driver once per batch, and the partitions' times and silences
the next batch judges against (docs/gaps.md).

The state step's buckets report their records, their devices without an interval and the greatest
event time they read per source partition (small: a record per gap, not per event). The driver
writes a batch's records in one Kafka transaction with the batch id in the topic's ledger (keyed by
``gap_id``) and/or in one database transaction with its fence row (primary key ``gap_id``, ``kind``),
so a replayed batch writes nothing twice.

The source partitions' silences are the driver's, from Spark's offset log: a partition whose end
offset has not moved for ``idle_after`` of batch time (wall clock, downtime included) gets one
``source_idle`` record, and a ``source_resumed`` when it moves again.

``gaps.json`` in the checkpoint holds, for the last batch written, what it started from and what it
left (each partition's time, when it last moved, which are idle): a batch is pinned to what the
batch before left, and a replay of the last batch to what it started from, so it judges alike.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema

from enrich.checkpoint import CheckpointLayout
from enrich.gaps.config import GapsConfig
from enrich.gaps.engine import GapSpec, gap_id, records
from enrich.ipc import from_ipc
from enrich.sinks.database.sink import check_existing, ensure, prune_fence
from enrich.sinks.database.slots import write_rows
from enrich.sinks.database.tables import TableSpec, table_spec
from enrich.sinks.deadletter import empty, refused, too_large
from enrich.sinks.jsonrow import dumps, json_value
from enrich.sinks.kafka.writer import TransactionalBatchWriter
from refstream.atomic import write_json_atomic
from refstream.contract import TOPIC_CONFIG
from refstream.kafka import ensure_topic

log = logging.getLogger(__name__)

__all__ = ["GapBatch", "GapWriter", "recorded_start"]

#: The records' key in the database table.
KEY = ("gap_id", "kind")


@dataclass(frozen=True)
class GapBatch:
    """What a batch wrote: records by kind, devices with events and no interval, records written
    (None: the batch was written before, a replay)."""

    kinds: dict[str, int]
    no_interval: int
    written: int | None
    #: Records an output could not take (too large for the topic, refused by the table), as dead
    #: letters (:data:`enrich.sinks.deadletter.COLUMNS`) for the batch's dead-letter write.
    dead: pa.Table


class GapWriter:
    """Pins each batch's partition times (:meth:`pin`) and writes its records (:meth:`write`)."""

    def __init__(self, spec: GapSpec, cfg: GapsConfig, layout: CheckpointLayout,
                 kafka: Mapping[str, str] | None = None, ids: Mapping[str, str] | None = None,
                 scope: str | None = None, initial: Mapping[str, Any] | None = None) -> None:
        """``kafka``: the librdkafka settings, ``ids``: topic -> transactional id and ``scope``: the
        query's (``enrich.sinks.identity``); ``initial``: what a fork's first batch starts from (the
        savepoint's partition times and silences)."""
        self.spec, self.cfg, self.layout, self.scope = spec, cfg, layout, scope or ""
        self.initial = dict(initial) if initial is not None else None
        self.idle_ms = int(cfg.idle_after.total_seconds() * 1000)
        self.table: TableSpec | None = None
        self.topic: TransactionalBatchWriter | None = None
        if cfg.database is not None:
            self.table = table_spec(cfg.database, from_arrow_schema(spec.record_schema()).fields, KEY)
            ensure(self.table)
            check_existing(cfg.database, self.table.key)
        if cfg.kafka is not None:
            assert kafka is not None and ids is not None
            ensure_topic(kafka, cfg.kafka, config=TOPIC_CONFIG)
            self.topic = TransactionalBatchWriter(kafka, cfg.kafka, ids[cfg.kafka], scope=scope)

    def close(self) -> None:
        if self.topic is not None:
            self.topic.close()

    def _start(self, batch_id: int) -> dict[str, Any]:
        return recorded_start(self.layout, batch_id, self.initial)

    def pin(self, batch_id: int) -> str:
        """Batch ``batch_id``'s partition times and time, as :data:`enrich.gaps.engine.TIMES_PROPERTY`'s JSON."""
        entry = self.layout.offset_entry(batch_id)
        now = int(entry.meta["batchTimestampMs"]) * 1000 if entry is not None and "batchTimestampMs" in entry.meta \
            else None
        return json.dumps({"times": self._start(batch_id)["times"], "now_us": now})

    def write(self, batch_id: int, reported: Mapping[int, Mapping[str, Any]]) -> GapBatch:
        """The batch's records written: the buckets' (``reported``: bucket -> ``records`` (Arrow IPC,
        empty: none), ``no_interval``, ``times``), in bucket order, then the source partitions'; what
        the next batch starts from recorded."""
        before = self._start(batch_id)
        times: dict[str, int] = dict(before["times"])
        after: dict[str, Any] = {"times": times, "read_ms": dict(before["read_ms"]), "idle": dict(before["idle"]),
                                 "ends": before.get("ends")}
        parts, no_interval = [], 0
        for bucket in sorted(reported):
            got = reported[bucket]
            no_interval += int(got.get("no_interval", 0))
            for p, t in dict(got.get("times", {})).items():
                cur = times.get(str(p))
                times[str(p)] = int(t) if cur is None else max(int(cur), int(t))
            if got.get("records"):
                parts.append(from_ipc(got["records"]).cast(self.spec.record_schema()))
        parts.append(self._sources(batch_id, after))
        out = pa.concat_tables(parts)
        written, dead = self._write(batch_id, out) if out.num_rows else (0, empty())
        # Counted once: a replay of a batch written before counts nothing again.
        kinds = Counter(out.column("kind").to_pylist()) if written is not None else Counter()
        write_json_atomic(self.layout.gaps, {"batch": batch_id, "before": before, "after": after})
        if out.num_rows:
            log.info("batch %d: gap records %s", batch_id, ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        return GapBatch(dict(kinds), no_interval, written, dead)

    def _sources(self, batch_id: int, state: dict[str, Any]) -> pa.Table:
        """The source partitions that went quiet or came back in batch ``batch_id`` (offset log), and
        ``state`` moved on."""
        entry = self.layout.offset_entry(batch_id, missing_ok=False)
        assert entry is not None
        time_ms = int(entry.meta.get("batchTimestampMs", 0))
        topic = self.spec.topic
        now = {str(p): int(o) for p, o in next((src[topic] for src in entry.sources if topic in src), {}).items()}
        # Against the ends the batch before left (a fork's first batch: the savepoint's), not the
        # offset log's entry before, which a fork has not.
        was = state.get("ends")
        state["ends"] = now
        rows = []
        for p in sorted(now, key=int):
            moved = was is None or now[p] != was.get(p)
            idle = state["idle"].get(p)
            if moved:
                state["read_ms"][p] = time_ms
                if idle is not None:
                    rows.append(self._source("source_resumed", idle["id"], int(p), idle["since"], time_ms))
                    del state["idle"][p]
                continue
            read = state["read_ms"].get(p)
            if idle is None and read is not None and time_ms - read >= self.idle_ms:
                gid = gap_id(("source", topic, int(p)), read * 1000)
                state["idle"][p] = {"id": gid, "since": read}
                rows.append(self._source("source_idle", gid, int(p), read, time_ms))
        return records(self.spec, rows)

    def _source(self, kind: str, gid: str, partition: int, since_ms: int, at_ms: int) -> dict[str, Any]:
        return {"gap_id": gid, "kind": kind, "topic": self.spec.topic, "partition": partition,
                "since": since_ms * 1000, "at": at_ms * 1000}

    def _write(self, batch_id: int, rows: pa.Table) -> tuple[int | None, pa.Table]:
        """The records written (None: a replay) and, as dead letters, those an output could not take."""
        written: int | None = rows.num_rows
        dead = []
        if self.table is not None:
            assert self.cfg.database is not None
            last = _last_per_key(rows)
            written, left, reasons = write_rows(self.table, self.scope, batch_id, last, "gaps")
            dead.append(refused(_records(left), reasons, "gap record", self.table.table))
            prune_fence(self.cfg.database, self.scope, batch_id)
        if self.topic is not None:
            written, left = self.topic.write_fitting(batch_id, _records(rows), "gaps")
            if written == 0 and left.num_rows < rows.num_rows:
                written = None  # records that fit, none written: the batch was committed before
            dead.append(too_large(left, "gap record", self.topic.record_limit, self.topic.topic))
        return written, pa.concat_tables(dead) if dead else empty()


def _records(rows: pa.Table) -> pa.Table:
    """Gap records as Kafka records (``key`` the gap id, ``value`` the record as JSON)."""
    return pa.table({"key": pa.array([r.encode() for r in rows.column("gap_id").to_pylist()], pa.binary()),
                     "value": pa.array([dumps({k: json_value(v) for k, v in r.items()}) for r in rows.to_pylist()],
                                       pa.binary())})


def recorded_start(layout: CheckpointLayout, batch_id: int, initial: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What batch ``batch_id`` starts from, as ``gaps.json`` records it: what the batch before left
    (a replay of the last batch written: what it started from); with none recorded, ``initial`` (a
    fork's first batch) or nothing."""
    path = layout.gaps
    kept = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if kept.get("batch") == batch_id:
        return dict(kept["before"])
    if isinstance(kept.get("batch"), int) and kept["batch"] < batch_id:
        return dict(kept["after"])
    return {"times": {}, "read_ms": {}, "idle": {}, "ends": None, **(initial or {})}


def _last_per_key(rows: pa.Table) -> pa.Table:
    """One row per (``gap_id``, ``kind``): the last (a database upsert takes one)."""
    seen: dict[tuple[str, str], int] = {}
    for i, k in enumerate(zip(rows.column("gap_id").to_pylist(), rows.column("kind").to_pylist(), strict=True)):
        seen[k] = i
    return rows.take(pa.array(sorted(seen.values()), pa.int64())) if len(seen) < rows.num_rows else rows
