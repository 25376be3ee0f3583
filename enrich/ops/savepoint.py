"""``enrich savepoint --config F --to DIR`` and ``enrich run --from-savepoint DIR``: the device state
of a committed batch as files, and a new checkpoint started from them (docs/state.md, "Savepoints").

A savepoint is taken from the last batch in Spark's commit log at the time of reading, whether the
job runs or not: never from a batch that has not committed. It is a directory of

* ``state.parquet``: a Parquet dataset directory (part files), one row per device, the
  ``state.key`` column and the ``state`` struct's fields as plain columns (``events``,
  ``first_seen``, ``last_seen``, ``<column>_<agg>``), plus each ``mean``'s accumulators
  (``<column>_mean_sum``, ``<column>_mean_count``) so a fork continues it exactly;
* ``dimensions/<dataset>.parquet``: each partitioned dimension's rows as the state step held them;
* ``rollups.parquet``: each rollup's windows as the rollup step held them (``rollup``: its name,
  ``windows``: one rollup bucket's windows as Arrow IPC, with their accumulators, sketches and
  revisions), re-routed to the fork's rollup buckets when it starts;
* ``gaps.parquet`` (with ``gaps:``): each state bucket's gap tables as the state step held them
  (``kind``: ``gaps`` or ``gaps_closed``, ``table``: Arrow IPC), re-routed to the fork's buckets
  when it starts; ``savepoint.json`` holds the partitions' times and silences the driver had;
* ``written.parquet`` (with ``joins[].corrections``): the events each state bucket wrote within the
  horizon, with their times and revisions (``table``: one chunk as Arrow IPC), re-routed to the
  fork's buckets by device when it starts (:func:`enrich.state.corrections.initial_written`);
* ``savepoint.json``: the batch id, the source offsets the batch read to (events and changelogs),
  the broadcast dimensions' changelog topics and positions, the watermark for the next batch, and the
  settings the checkpoint fixes (``state.key`` and its type, aggregates and their types, TTL,
  watermark, buckets, state partitions). Written last: a directory without it is no savepoint.

Nothing per device passes through the driver, either way: the buckets are read, unpacked
(:func:`enrich.ops.stateread.device_frame`) and written as Parquet by Spark's tasks, and
``savepoint.json`` is then written atomically by the driver (:mod:`refstream.atomic`). A fork
(:meth:`Savepoint.fork`) starts a new checkpoint: the devices and dimension rows, read by Spark and
packed per bucket on the executors, are the state step's initial state, the events and changelogs
are read from the recorded offsets (a corrected broadcast dataset bootstrapped to its recorded
positions: :meth:`Savepoint.broadcast_start`), and the step's watermark starts at the recorded one
(:class:`enrich.state.stream.Fork`). A config that cannot continue the state is refused in one line
naming the setting (:meth:`Savepoint.check`); an aggregate the savepoint does not hold starts empty
(null until the device's next event).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from enrich.checkpoint import CheckpointLayout
from enrich.columns import BUCKET
from enrich.config import EnrichConfig
from enrich.dimension.versions import FileVersionLog
from enrich.ipc import from_ipc
from enrich.joins.partitioned import PartitionedDim
from enrich.ops import stateread
from enrich.pipeline import Pipeline
from enrich.rollups.spec import RollupSpec
from enrich.sinks.gaps import recorded_start
from enrich.source.offsets import from_json_offsets, to_json_offsets
from enrich.state import corrections, engine, rollups
from enrich.state.engine import StateSpec
from enrich.state.record import (
    BUCKET_IDS,
    PARTITIONS,
    ROLLUPS,
    by_name,
    check_checkpoint,
    read_record,
    record,
    rollup_changes,
    rollup_record,
)
from enrich.state.stored import GAPS, GAPS_CLOSED, WRITTEN, stored_spec
from enrich.state.stream import Fork
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError, DataError

__all__ = ["FORMAT", "Savepoint", "SavepointRefused", "SavepointResult", "load", "refuse_started", "take"]

log = logging.getLogger(__name__)

FORMAT = 1
META, STATE, ROLLUPS_FILE, GAPS_FILE = "savepoint.json", "state.parquet", "rollups.parquet", "gaps.parquet"
WRITTEN_FILE = "written.parquet"
_DIMS = "dimensions"
_TS = pa.timestamp("us", tz="UTC")
_TS_TYPE_CONF = "spark.sql.parquet.outputTimestampType"


class SavepointRefused(ConfigError):
    """A savepoint cannot be taken or forked from as asked; nothing was written. One line saying why."""


@dataclass(frozen=True, kw_only=True)
class SavepointResult:
    directory: str
    checkpoint: str
    batch_id: int
    devices: int
    dimension_rows: dict[str, int]
    seconds: float

    def lines(self) -> list[str]:
        dims = "".join(f", {n:,} row(s) of {ds}" for ds, n in self.dimension_rows.items())
        return [f"{self.directory}: savepoint of batch {self.batch_id} of {self.checkpoint}: {self.devices:,} "
                f"device(s){dims}, in {self.seconds:.1f}s"]

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "checkpoint": self.checkpoint, "batch_id": self.batch_id,
                "devices": self.devices, "dimension_rows": self.dimension_rows, "seconds": self.seconds}


def take(cfg: EnrichConfig, to: str | Path, *, spark: SparkSession | None = None,
         master: str | None = "local[*]") -> SavepointResult:
    """Write a savepoint of ``cfg``'s checkpoint to the directory ``to`` (new or empty): the state as
    the last committed batch left it (see the module doc). ``spark``: the session to read with
    (default: the active one, else a new one on ``master``)."""
    directory = Path(to)
    if cfg.state is None:
        raise ConfigError(f"{cfg.source}: no state: section; a savepoint holds a job's device state")
    if cfg.waits:  # the events a waiting join holds are read (their offsets passed) but not in the state
        raise SavepointRefused(f"{cfg.source}: joins wait for completeness ({', '.join(sorted(cfg.waits))}); "
                               "a savepoint does not hold the events they hold")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise SavepointRefused(f"{directory}: not an empty directory; a savepoint is written to a new or empty one")
    ck = CheckpointLayout(cfg.checkpoint)
    if not ck.state_record.exists():
        raise SavepointRefused(f"{ck.root}: the job has not run with state: on this checkpoint")
    committed = ck.committed()
    if not committed:
        raise SavepointRefused(f"{ck.root}: no batch has been committed yet; a savepoint is taken of a committed one")
    batch_id = committed[-1]  # the commit log's last at the time of reading: a running job may commit more
    t0 = time.monotonic()
    spark = spark or SparkSession.getActiveSession() or stateread.session(cfg, master, "refstream-savepoint")
    timezone = cfg.timezone
    pipeline = Pipeline.build(cfg, ck.read_schemas(), timezone=timezone)
    st = pipeline.state
    assert st is not None
    check_checkpoint(ck, cfg.state, st.spec, cfg.source, st.dims)  # the record exists: compares only
    kept = read_record(ck.state_record)
    saved_rollups = rollup_record(st.rollups)
    if by_name(kept.get(ROLLUPS, [])) != by_name(saved_rollups):
        raise SavepointRefused(f"{cfg.source}: rollups {json.dumps(sorted(r.name for r in st.rollups))} differ from "
                               f"those the checkpoint {ck.root} runs with "
                               f"{json.dumps(sorted(by_name(kept.get(ROLLUPS, []))))}; take the savepoint with the "
                               "config the job runs with")
    key = cfg.state.key
    devices = stateread.device_frame(spark, ck, batch_id, stored_spec(st.spec),
                                     functools.partial(to_rows, spec=st.spec, key=key), rows_schema(st.spec, key))
    sources = _sources(ck, batch_id)
    meta: dict[str, Any] = {
        "format": FORMAT, "batch_id": batch_id, "checkpoint": str(ck.root),
        "taken_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "watermark_ms": _next_watermark(ck, batch_id),
        "events": {"topic": cfg.events.topic, "offsets": _offsets(sources, cfg.events.topic)},
        "broadcast": {ds: {"topic": pipeline.broadcast_datasets[ds],
                           "positions": {str(p): o for p, o in pos.items()}}
                      for ds, pos in (FileVersionLog(ck.dimensions, create=False).get(batch_id) or {}).items()
                      if ds in pipeline.broadcast_datasets},
        "partitioned": [],
        "rollups": {"rows": ROLLUPS_FILE, "rollups": saved_rollups},
        "state": {**record(cfg.state, st.spec, st.dims), "key_type": str(st.spec.key_type),
                  "aggregate_types": {c: str(t) for c, _, t in st.spec.aggregates},
                  "ttl_s": cfg.state.ttl.total_seconds(), "watermark_s": cfg.state.watermark.total_seconds(),
                  PARTITIONS: ck.recorded_partitions(batch_id) or kept.get(PARTITIONS)},
    }
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        meta["devices"] = _write_parquet(spark, devices, directory / STATE)
        dimension_rows: dict[str, int] = {}
        for dim in st.dims:
            rows, schema = stateread.dimension_frame(spark, ck, batch_id, dim)
            name = f"{_DIMS}/{dim.dataset}.parquet"
            dimension_rows[dim.dataset] = _write_parquet(spark, rows, directory / name)
            meta["partitioned"].append({"dataset": dim.dataset, "topic": dim.topic, "rows": name,
                                        "offsets": _offsets(sources, dim.topic),
                                        "schema": None if schema is None else json.loads(schema.to_json())})
        if st.gaps is not None:
            tables = functools.reduce(DataFrame.unionByName, [
                stateread.scan(spark, ck, batch_id, name).select(F.lit(name).alias("kind"), F.col("value.table"))
                for name in (GAPS, GAPS_CLOSED)])
            # what the gaps' driver had after the batch: what the next one starts from
            meta["gaps"] = {"rows": GAPS_FILE, "driver": recorded_start(ck, batch_id + 1)}
            _write_parquet(spark, tables, directory / GAPS_FILE)
        if st.rollups:  # each rollup's open windows and its final ones (enrich.state.rollups)
            parts = []
            for r in st.rollups:
                name = rollups.state_name(r)
                finals = stateread.scan(spark, ck, batch_id, name + rollups.FINALS)
                element = stateread.list_column(finals)
                parts += [stateread.scan(spark, ck, batch_id, name).select(
                              F.lit(r.name).alias("rollup"), F.col("value.table").alias("windows")),
                          finals.select(F.lit(r.name).alias("rollup"), F.col(f"{element}.table").alias("windows"))]
                if r.moves:  # each window's part per state bucket (enrich.rollups.engine.move)
                    parts.append(stateread.scan(spark, ck, batch_id, name + rollups.PARTS).select(
                        F.lit(r.name + rollups.PARTS).alias("rollup"), F.col("value.table").alias("windows")))
            # The state buckets the parts name, for a fork to find them in its own layout.
            meta["rollups"]["bucket_ids"] = kept.get(BUCKET_IDS)
            windows = functools.reduce(DataFrame.unionByName, parts).where(F.length("windows") > 0)
            _write_parquet(spark, windows, directory / ROLLUPS_FILE)
        if pipeline.corrected:  # the events written within the horizon, which the fork goes on correcting
            meta["written"] = {"rows": WRITTEN_FILE,
                               "chunks": _write_parquet(spark, _written_chunks(spark, ck, batch_id),
                                                        directory / WRITTEN_FILE)}
        write_json_atomic(directory / META, meta)
    except BaseException:
        # Leave the directory as it was (empty, or absent), so that the command can simply run again.
        for path in [directory] if created else list(directory.iterdir()):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise
    seconds = time.monotonic() - t0
    log.info("%s: savepoint of batch %d written (%d devices) in %.1fs", directory, batch_id, meta["devices"], seconds)
    return SavepointResult(directory=str(directory), checkpoint=str(ck.root), batch_id=batch_id,
                           devices=meta["devices"], dimension_rows=dimension_rows, seconds=seconds)


def to_rows(stored: pa.Table, spec: StateSpec, key: str) -> pa.Table:
    """The stored device table as the savepoint's rows: ``key``, the ``state`` fields, each mean's accumulators."""
    state = engine.finalize(stored_spec(spec), stored)
    cols: dict[str, pa.Array] = {key: stored.column(engine.KEY).combine_chunks()}
    for field, child in zip(state.type, state.flatten(), strict=True):
        cols[field.name] = child.cast(_TS) if field.name in ("first_seen", "last_seen") else child
    for column, aggs, _ in spec.aggregates:
        if "mean" in aggs:
            cols[f"{column}_mean_sum"] = stored.column(f"{column}_sum").combine_chunks()
            cols[f"{column}_mean_count"] = stored.column(f"{column}_count").combine_chunks()
    return pa.table(cols)


def rows_schema(spec: StateSpec, key: str) -> pa.Schema:
    """The schema of :func:`to_rows`' tables."""
    return to_rows(stored_spec(spec).empty(), spec, key).schema


def from_rows(rows: pa.Table, spec: StateSpec, key: str) -> pa.Table:
    """The savepoint's rows as the stored device table of ``spec``; an aggregate the rows do not hold
    starts empty (null; a mean of no values)."""
    stored = stored_spec(spec)
    schema = stored.state_schema()
    n = rows.num_rows
    have = set(rows.column_names)
    out: dict[str, pa.Array | pa.ChunkedArray] = {
        engine.KEY: rows.column(key), engine.FIRST_SEEN: rows.column("first_seen").cast(_TS).cast(pa.int64()),
        engine.LAST_SEEN: rows.column("last_seen").cast(_TS).cast(pa.int64()), engine.EVENTS: rows.column("events")}
    for column, aggs, typ in spec.aggregates:
        for agg in aggs:
            if agg == "mean":
                saved = f"{column}_mean_sum" in have
                out[f"{column}_sum"] = rows.column(f"{column}_mean_sum") if saved else pa.array([0.0] * n)
                out[f"{column}_count"] = rows.column(f"{column}_mean_count") if saved else pa.array([0] * n, pa.int64())
            else:
                name = f"{column}_{agg}"
                out[name] = rows.column(name) if name in have else pa.nulls(n, typ)
    return pa.Table.from_arrays([pc.cast(out[f.name], f.type) for f in schema], schema=schema)


@dataclass(frozen=True)
class Savepoint:
    """A savepoint directory as :func:`load` read it."""

    directory: Path
    meta: dict[str, Any]

    @property
    def batch_id(self) -> int:
        return int(self.meta["batch_id"])

    def check(self, cfg: EnrichConfig, spec: StateSpec | None, dims: Sequence[PartitionedDim] = (),
              rollup_specs: Sequence[RollupSpec] = ()) -> None:
        """Refuse (:class:`SavepointRefused`, one line naming the setting) a config whose state cannot
        continue the savepoint's: another ``state.key`` or key type, another events topic, an
        aggregate removed or an aggregated column of another type, a partitioned join (``dims``)
        whose stored rows differ from the savepoint's (its ``columns:`` or ``as_of`` changed: the
        rows would not fit the step's state), a rollup (``rollup_specs``) the savepoint holds under its
        name with other keys, window, horizon or metrics. Added aggregates, another TTL, watermark,
        bucket count or number of state partitions, a partitioned join or a rollup added or removed are
        fine (an added rollup starts empty). A fork with ``corrections`` goes on correcting the events
        the savepoint holds (:data:`WRITTEN_FILE`); from a savepoint of a job without them, it corrects
        only what it writes itself, and says so in a warning."""
        if cfg.state is None:
            raise SavepointRefused(f"{cfg.source}: no state: section; a savepoint starts a job's device state")
        assert spec is not None
        saved, where = self.meta["state"], f"the savepoint {self.directory}"
        corrected = [i for i, j in enumerate(cfg.joins) if j.corrections is not None]
        if corrected and "written" not in self.meta:
            log.warning("%s: joins[%d].corrections: %s was taken of a job without corrections and holds no events "
                        "it wrote; the fork corrects only the events it writes itself", cfg.source, corrected[0],
                        where)
        if saved["key"] != cfg.state.key:
            raise SavepointRefused(f"{cfg.source}: state.key is {cfg.state.key!r}; {where} keeps device state by "
                                   f"{saved['key']!r}")
        if saved["key_type"] != str(spec.key_type):
            raise SavepointRefused(f"{cfg.source}: state.key {cfg.state.key!r} is of type {spec.key_type}; in {where} "
                                   f"it is {saved['key_type']}")
        if self.meta["events"]["topic"] != cfg.events.topic:
            raise SavepointRefused(f"{cfg.source}: events.topic is {cfg.events.topic!r}; {where} holds the offsets "
                                   f"of {self.meta['events']['topic']!r}")
        now = dict(cfg.state.aggregates)
        for column, aggs in saved["aggregates"].items():
            gone = [a for a in aggs if a not in now.get(column, ())]
            if gone:
                raise SavepointRefused(f"{cfg.source}: state.aggregates.{column}: {', '.join(gone)} removed; {where} "
                                       f"keeps {column}: {aggs} (put it back: the state would lose it)")
        kept = {(d["dataset"], d["topic"]): d["columns"] for d in saved.get("partitioned", [])}
        for dim in dims:
            was = kept.get((dim.dataset, dim.topic))
            if was is not None and was != dim.stored.names:
                i = next(i for i, j in enumerate(cfg.joins) if (j.dataset, j.topic) == (dim.dataset, dim.topic))
                raise SavepointRefused(
                    f"{cfg.source}: joins[{i}] ({dim.dataset}, partitioned): its rows are kept as "
                    f"{', '.join(dim.stored.names)}; in {where} as {', '.join(was)} (columns: or as_of changed); "
                    "put them back: a fork continues the dimension's rows as the savepoint holds them")
        types = saved.get("aggregate_types", {})
        for column, _, typ in spec.aggregates:
            if column in types and types[column] != str(typ):
                raise SavepointRefused(f"{cfg.source}: state.aggregates.{column}: the column is {typ}; in {where} "
                                       f"it is {types[column]}")
        held = by_name(self.meta.get("rollups", {}).get("rollups", []))
        for name, now in by_name(rollup_record(rollup_specs)).items():
            changed = rollup_changes(held[name], now) if name in held else []
            if changed:
                raise SavepointRefused(f"{cfg.source}: rollup {name}: {', '.join(changed)} changed; {where} holds its "
                                       "windows laid out by the old settings (put them back, or give the rollup a "
                                       "new name: it starts empty)")
        ids = self.meta.get("rollups", {}).get("bucket_ids")
        moving = [r.name for r in rollup_specs if r.moves and r.name in held]
        if moving and (not isinstance(ids, list) or len(ids) != cfg.state.buckets):
            raise SavepointRefused(f"{cfg.source}: rollup {moving[0]}: its windows' parts are kept per state bucket "
                                   f"and {where} has {len(ids) if isinstance(ids, list) else 'other'} buckets, "
                                   f"not {cfg.state.buckets}; fork with state.buckets as it was (or rename the "
                                   "rollup: it starts empty)")

    def fork(self, spark: SparkSession, pipeline: Pipeline) -> tuple[str, Fork]:
        """The events' starting offsets (Spark's JSON) and the state step's start, for ``pipeline``
        (checked with :meth:`check`): the savepoint's files read by Spark, each device made a row of
        the stored layout on the executors (:func:`from_rows`)."""
        st = pipeline.state
        assert st is not None and pipeline.cfg.state is not None
        stored = stored_spec(st.spec).state_schema()
        out = stateread.spark_schema(stored)
        if _has_rows(self.directory / STATE):
            devices = spark.read.parquet(str(self.directory / STATE)).mapInArrow(
                functools.partial(_stored_rows, spec=st.spec, key=pipeline.cfg.state.key,
                                  schema=to_arrow_schema(out, timezone="UTC")), out)
        else:  # a savepoint of no device: Spark may have written no part file to read a schema from
            devices = spark.createDataFrame([], out)
        dims: dict[str, tuple[DataFrame, bytes]] = {}
        changelogs: dict[str, str] = {}
        saved = {(d["dataset"], d["topic"]): d for d in self.meta.get("partitioned", [])}
        for dim in st.dims:
            entry = saved.get((dim.dataset, dim.topic))
            if entry is None:  # a partitioned join the savepoint's job had not: read from the earliest
                continue
            changelogs[dim.topic] = json.dumps({dim.topic: entry["offsets"]})
            if entry.get("schema") is not None and _has_rows(self.directory / entry["rows"]):
                dims[dim.state_name] = (spark.read.parquet(str(self.directory / entry["rows"])),
                                        json.dumps(entry["schema"]).encode("utf-8"))
        windows = None
        rows = self.directory / str(self.meta.get("rollups", {}).get("rows", ROLLUPS_FILE))
        if st.rollups and _has_rows(rows):
            windows = spark.read.schema(rollups.SAVED).parquet(str(rows))
        saved_ids = self.meta.get("rollups", {}).get("bucket_ids")
        written = None
        rows = self.directory / str(self.meta.get("written", {}).get("rows", WRITTEN_FILE))
        if pipeline.corrected and _has_rows(rows):
            written = spark.read.parquet(str(rows))
        gaps: dict[str, DataFrame] = {}
        rows = self.directory / str(self.meta.get("gaps", {}).get("rows", GAPS_FILE))
        if st.gaps is not None and _has_rows(rows):
            saved_gaps = spark.read.parquet(str(rows))
            for name, schema in ((GAPS, st.gaps.table_schema()), (GAPS_CLOSED, st.gaps.closed_schema())):
                gaps[name] = saved_gaps.where(F.col("kind") == F.lit(name)).select("table").mapInArrow(
                    functools.partial(_gap_rows, schema=schema), from_arrow_schema(schema))
        return self.events_start, Fork(devices=devices, dims=dims, changelogs=changelogs, floor_us=self.floor_us,
                                       rollups=windows, gaps=gaps, written=written,
                                       rollup_ids=tuple(saved_ids) if isinstance(saved_ids, list) else None)

    @property
    def gaps_driver(self) -> dict[str, Any] | None:
        """The partitions' times and silences the savepoint's job had (None: it had no gaps)."""
        got = self.meta.get("gaps", {}).get("driver")
        return dict(got) if isinstance(got, dict) else None

    def broadcast_start(self, cfg: EnrichConfig) -> dict[str, dict[int, int]]:
        """Where a fork of ``cfg`` bootstraps each broadcast dataset it corrects: the changelog
        positions the savepoint's batch read to (the same topic only), so that its first batch
        applies what came after as changes, which correct the events the savepoint holds. The
        other datasets bootstrap to their changelogs' ends: their first batch reads to there anyway."""
        corrected = {j.dataset: j.topic for j in cfg.broadcast_joins if j.corrections is not None}
        return {ds: {int(p): int(o) for p, o in got["positions"].items()}
                for ds, got in self.meta.get("broadcast", {}).items() if corrected.get(ds) == got["topic"]}

    @property
    def events_start(self) -> str:
        """The events' starting offsets of a fork (Spark's JSON): where the savepoint's batch read to."""
        events = self.meta["events"]
        return json.dumps({events["topic"]: events["offsets"]})

    @property
    def floor_us(self) -> int | None:
        """A fork's watermark floor (event time, microseconds): the savepoint's next watermark; None: none."""
        watermark = self.meta.get("watermark_ms")
        return int(watermark) * 1000 if watermark else None


def _has_rows(path: Path) -> bool:
    """Whether the Parquet file or dataset directory ``path`` has a data file (Spark writes none
    for a DataFrame of no partitions)."""
    return path.is_file() or any(path.glob("*.parquet"))


def _written_chunks(spark: SparkSession, ck: CheckpointLayout, batch_id: int) -> DataFrame:
    """Every bucket's kept chunks of written events (the state step's ``written`` map) after
    ``batch_id``, each with its revisions applied: one row per chunk, ``table`` its Arrow IPC."""
    kept = stateread.scan(spark, ck, batch_id, WRITTEN)
    bucket, chunk = F.col(f"key.{BUCKET}"), F.col("user_map_key.chunk")
    rows = kept.where(chunk >= 0).select(bucket.alias("b"), chunk.alias("chunk"), F.col("user_map_value.rows"))
    # the chunk of a revisions key, as enrich.state.stored.revisions_key maps it (its own inverse)
    revised = kept.where(chunk < 0).select(bucket.alias("b"), (-chunk - 1).alias("chunk"),
                                           F.col("user_map_value.rows").alias("revisions"))
    return rows.join(revised, ["b", "chunk"], "left").select("rows", "revisions").mapInArrow(
        corrections.saved_chunks, "table binary")


def _stored_rows(batches: Iterator[pa.RecordBatch], *, spec: StateSpec, key: str,
                 schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        yield from from_rows(pa.Table.from_batches([batch]), spec, key).cast(schema).to_batches()


def _gap_rows(batches: Iterator[pa.RecordBatch], *, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """A savepoint's gap tables (one bucket's each) as rows of ``schema``: a column the savepoint's
    job had not (another join's reference column) is null, one it had and the fork has not, left out."""
    for batch in batches:
        for value in batch.column("table").to_pylist():
            t = from_ipc(value)
            yield from pa.Table.from_arrays(
                [t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type)
                 for f in schema], schema=schema).to_batches()


def load(directory: str | Path) -> Savepoint:
    """The savepoint in ``directory``; a :class:`SavepointRefused` naming it when it holds none."""
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SavepointRefused(f"{directory}: no savepoint ({META} missing; enrich savepoint --to writes one)") from None
    except ValueError as exc:
        raise SavepointRefused(f"{path}: not a savepoint record ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SavepointRefused(f"{path}: not a savepoint of format {FORMAT}")
    return Savepoint(Path(directory), meta)


def refuse_started(ck: CheckpointLayout, directory: str | Path) -> None:
    """A fork starts a new checkpoint: refuse one Spark has planned batches in."""
    if ck.planned_any():
        raise SavepointRefused(f"{ck.root}: the checkpoint has batches already; --from-savepoint {directory} starts "
                               "a new one (point checkpoint: at a new directory)")


def _sources(ck: CheckpointLayout, batch_id: int) -> dict[tuple[str, int], int]:
    """Every source's end offsets of ``batch_id`` (Spark's offset log)."""
    entry = ck.offset_entry(batch_id, missing_ok=False)
    assert entry is not None
    out: dict[tuple[str, int], int] = {}
    for source in entry.sources:
        if all(isinstance(v, dict) for k, v in source.items() if not k.startswith("@")):  # not the tick source's
            out.update(from_json_offsets(source))
    return out


def _offsets(sources: dict[tuple[str, int], int], topic: str) -> dict[str, int]:
    """``{partition: offset}`` of ``topic``, as Spark's offset JSON keys them."""
    return dict(to_json_offsets({tp: o for tp, o in sources.items() if tp[0] == topic}).get(topic, {}))


def _next_watermark(ck: CheckpointLayout, batch_id: int) -> int:
    """The watermark (ms) Spark recorded at ``batch_id``'s commit for the batch after it (0: none yet)."""
    value = ck.commit_entry(batch_id).get("nextBatchWatermarkMs", 0)
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{ck.commits / str(batch_id)}: unreadable commit log entry ({exc})") from None


def _write_parquet(spark: SparkSession, frame: DataFrame, path: Path) -> int:
    """Write ``frame`` with Spark's Parquet writer (its tasks write the part files, its commit the
    directory) and return its row count, read back from the part files' footers. Timestamps are
    written as Parquet's TIMESTAMP_MICROS (UTC), not Spark's default INT96, so other tools read
    them as timestamps in UTC; the session's setting is put back after (a streaming query running
    in the session has its own copy of the settings)."""
    before = spark.conf.get(_TS_TYPE_CONF, None)
    spark.conf.set(_TS_TYPE_CONF, "TIMESTAMP_MICROS")
    try:
        frame.write.option("compression", "snappy").parquet(str(path))
    finally:
        if before is None:
            spark.conf.unset(_TS_TYPE_CONF)
        else:
            spark.conf.set(_TS_TYPE_CONF, before)
    return spark.read.parquet(str(path)).count()
