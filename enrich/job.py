"""The enrichment job: Kafka events -> parse -> lookup joins against pinned dimensions -> sink.

One ``foreachBatch`` per micro-batch; the driver only plans it:
1. pin: fix (or, on a replay, reuse) the changelog positions of every dimension for this batch id,
   bring the dimensions there and ship what changed (docs/dimension.md);
2. parse the events (bad ones get ``_error``) and join them in one ``mapInArrow`` pass: with the
   Kafka sink pyarrow parses what it parses exactly (``enrich.events.fastparse``), else ``from_json``;
3. the sink writes the good rows at most once per batch id: the Kafka sink in the tasks, each in its
   own transaction with its dead letters (a task that met an event pyarrow left to ``from_json``
   writes nothing, and its slot is written by a second, ``from_json``, plan of the same input); the
   other sinks through Spark, their dead letters through a transactional writer on the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.accumulators import Accumulator
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from enrich import events, joins
from enrich.accumulators import KeyedCounts, KeyedTallies
from enrich.calls.step import STARTED_PROPERTY, read_tallies
from enrich.checkpoint import CheckpointLayout
from enrich.columns import ERROR, KIND, KIND_CORRECTION, LATE
from enrich.config import EnrichConfig
from enrich.dimension.abc import Positions
from enrich.dimension.changelog import ChangelogFollower
from enrich.dimension.corrections import BatchChanges, Corrected, warn_beyond
from enrich.dimension.history import Journal
from enrich.dimension.manager import Dimensions
from enrich.dimension.ship import Shipper
from enrich.dimension.versions import FileVersionLog
from enrich.events.fastparse import FastParser
from enrich.failures import root_cause, transient_worker_failure
from enrich.gaps.engine import TIMES_PROPERTY
from enrich.metrics import RESULTS, EnrichMetrics
from enrich.origin import Origin
from enrich.pipeline import JoinPass, Pipeline
from enrich.query import RangeReader, StateStream, Stream, build, enriched, read_ranges, rollup_rows, writer
from enrich.rollups.packs import IDLE_PROPERTY
from enrich.sinks import Counted, EnrichedBatch, Sink, make_sink
from enrich.sinks.deadletter import DeadLetters
from enrich.sinks.gaps import GapWriter
from enrich.sinks.identity import SinkIdentity
from enrich.sinks.rollups import RollupWriter
from enrich.state.corrections import read_tallies as correction_tallies
from enrich.state.devices import DeviceCount
from enrich.state.rollups import idle_facts
from enrich.state.stream import Fork
from enrich.state.wait import BatchFacts
from refstream import kafka as rkafka
from refstream.compat import spark_local_checkpoint_files
from refstream.errors import TerminalError
from refstream.retry import FailureStreak, RetryPolicy, call_with_retry

if TYPE_CHECKING:
    from enrich.ops.savepoint import Savepoint

log = logging.getLogger(__name__)

DEFAULT_RETRY = RetryPolicy(attempts=5, initial=1.0, maximum=15.0)


def _plus(a: Counted, b: Counted) -> Counted:
    """Two writes' counts of one batch; a count either write did not make stays unknown."""
    def add(x: int | None, y: int | None) -> int | None:
        return None if x is None or y is None else x + y

    return Counted(add(a.enriched, b.enriched), add(a.unmatched, b.unmatched), add(a.late, b.late),
                   add(a.dead_letters, b.dead_letters))


def _with(dead: pa.Table, more: pa.Table) -> pa.Table:
    """The batch's dead letters ``dead`` (the sink's schema) with the driver's ``more`` added."""
    if not dead.num_rows:
        return more
    return pa.concat_tables([dead, more.cast(dead.schema)]) if more.num_rows else dead


@dataclass(frozen=True)
class Started:
    """What :meth:`EnrichJob.start` opened for the query: the plan and the parts its batches use."""

    spark: SparkSession
    pipeline: Pipeline
    dims: Dimensions
    sink: Sink
    dead: DeadLetters | None          # the dead-letter writer, unless the sink writes them itself
    metrics: EnrichMetrics | None
    fast: FastParser | None           # the join pass parses the events itself (the Kafka sink, no state)
    state: StateStream | None
    devices: DeviceCount | None
    rollups: RollupWriter | None = None  # the rollups' outputs (the batches are the rollup step's output)
    gaps: GapWriter | None = None        # the gaps' records (enrich.sinks.gaps)
    ranges: RangeReader | None = None    # the batches hold offset ranges: this reads their records
    changes: BatchChanges | None = None  # with corrections: each batch's late versions (enrich.dimension.corrections)


class EnrichJob:
    """The streaming query of one config: :meth:`start` plans and starts it on a SparkSession and
    returns it (:meth:`close`, or leaving a ``with`` block, stops it and releases what it opened);
    :meth:`run` starts it and blocks until it ends (available-now) or :meth:`stop`.

    ``available_now``: process what the topics hold now, then stop. ``retry``: the policy of every
    transient failure the driver retries (a dimension bootstrap, a batch's write, a worker start).
    ``from_savepoint``: a savepoint directory to start the (new) checkpoint from (:mod:`enrich.ops.savepoint`)."""

    def __init__(self, cfg: EnrichConfig, *, available_now: bool = False, retry: RetryPolicy = DEFAULT_RETRY,
                 from_savepoint: str | Path | None = None) -> None:
        self.cfg, self.available_now, self.retry = cfg, available_now, retry
        self.from_savepoint = from_savepoint
        self._fork: tuple[str, Fork] | None = None
        self._origin: Origin | None = None
        self.layout = CheckpointLayout(cfg.checkpoint)
        self._stack = ExitStack()
        self._stop = threading.Event()
        self.query: StreamingQuery | None = None
        self._writer: DataStreamWriter | None = None
        self._started: Started | None = None
        self._pass: JoinPass | None = None
        self._call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None  # with calls: only
        # With corrections on a partitioned join: its buckets' counts (enrich.state.corrections.tally).
        self._correction_counts: Accumulator[dict[int, dict[str, Any]]] | None = None
        self._beyond_warned: set[str] = set()
        self._gap_records: Accumulator[dict[int, dict[str, Any]]] | None = None  # with gaps: only
        self._ident: SinkIdentity | None = None
        self.batches = 0
        self._trigger_logged: int | None = None

    @property
    def checkpoint(self) -> Path:
        return self.cfg.checkpoint

    @property
    def origin(self) -> Origin:
        """What the checkpoint recorded at its first start (read or written by :meth:`start`)."""
        if self._origin is None:
            raise RuntimeError("the job has not started")
        return self._origin

    @property
    def started(self) -> Started:
        """The parts :meth:`start` opened (an error before it ran)."""
        if self._started is None:
            raise RuntimeError("the job has not started")
        return self._started

    # ------------------------------------------------------------------------------- lifecycle

    def start(self, spark: SparkSession) -> StreamingQuery:
        """Plan the query on ``spark`` and start it: the output topics, the dimensions' bootstrap,
        the pipeline (:mod:`enrich.pipeline`), the sink, the metrics, the stream, the query. The
        checkpoint's lock is held until :meth:`close`: another job or ``enrich rescale`` on it is
        refused meanwhile, and a start while either runs is (:class:`enrich.checkpoint.CheckpointBusy`).
        A start that fails releases what it opened, the lock first of all."""
        try:
            return self._start(spark)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, spark: SparkSession) -> StreamingQuery:
        self._stack.enter_context(self.layout.held())
        saved = self._begin()
        # events.schema is checked before the broker is touched (the pipeline parses it again).
        events.event_schema(self.cfg.events.schema, self.cfg.events.required, self.cfg.source)
        if self._origin is None:  # the checkpoint's first start
            self._origin = Origin(self._resolve_start())
            self._origin.write(self.layout)
        self._ensure_topics()
        dims = self._dimensions(spark, saved.broadcast_start(self.cfg) if saved is not None else None)
        pipeline = self._plan(spark, dims)
        if saved is not None:
            st = pipeline.state
            saved.check(self.cfg, st.spec if st is not None else None, st.dims if st is not None else (),
                        st.rollups if st is not None else ())
            self._fork = saved.fork(spark, pipeline)
            log.info("starting from the savepoint %s (batch %d of %s)", saved.directory, saved.batch_id,
                     saved.meta.get("checkpoint"))
        sink, dead, rollups = self._sinks(pipeline)
        metrics = self._metrics(sink)
        stream, devices = self._stream(spark, pipeline, dims, sink, metrics)
        self._started = Started(spark, pipeline, dims, sink, dead, metrics, stream.fast, stream.state, devices,
                                rollups, self._gaps(pipeline, saved.gaps_driver if saved is not None else None),
                                stream.ranges, self._changes(pipeline))
        self._pass = pipeline.join_pass
        self.query = self._start_query(stream.frame)
        log.info("enrichment query started: %s -> %s (checkpoint %s)", self.cfg.events.topic,
                 self.cfg.output.topic or self.cfg.output.path or
                 (self.cfg.output.database.table if self.cfg.output.database else "console"), self.cfg.checkpoint)
        return self.query

    def _begin(self) -> Savepoint | None:
        """The checkpoint's origin (:mod:`enrich.origin`) as recorded (a fork's recorded at its first
        start; None until :meth:`start` resolves a new checkpoint's, before the dimensions'
        bootstrap), and the savepoint to fork from, while a fork's batch 0 has not committed (run
        again with its initial state after a crash, with ``--from-savepoint`` or without it)."""
        from enrich.ops import savepoint

        kept, wanted = Origin.read(self.layout), self.from_savepoint
        if kept is not None and kept.savepoint is not None and (wanted is None or kept.forked_from(wanted)):
            self._origin = kept
            if self.layout.committed_any():
                return None
            try:
                return savepoint.load(kept.savepoint)
            except savepoint.SavepointRefused as exc:
                raise savepoint.SavepointRefused(
                    f"{self.layout.root}: a fork whose first batch has not committed starts again from its savepoint "
                    f"{kept.savepoint}, which is not there ({exc}); put it back, or point checkpoint: at a new "
                    "directory") from None
        if wanted is not None:
            savepoint.refuse_started(self.layout, wanted)
            saved = savepoint.load(wanted)
            self._origin = Origin(saved.events_start, str(Path(wanted).resolve()), saved.floor_us)
            self._origin.write(self.layout)
            return saved
        self._origin = kept
        return None

    def _resolve_start(self) -> str:
        """``events.starting_offsets`` as the offsets each partition of the events topic starts at now
        (Spark's JSON; a partition created later starts at its earliest)."""
        from enrich.source.offsets import EndOffsetProbe, parse_starting_offsets, resolve_start

        ev = self.cfg.events
        start = parse_starting_offsets(ev.starting_offsets, [ev.topic], "events.starting_offsets")
        probe = EndOffsetProbe(self.cfg.kafka)
        try:
            offsets = call_with_retry(lambda: resolve_start(probe, [ev.topic], start),
                                      what=f"resolving events.starting_offsets of {ev.topic}", policy=self.retry,
                                      stop=self._stop)
        finally:
            probe.close()
        return json.dumps({ev.topic: {str(p): o for (_, p), o in sorted(offsets.items())}})

    def _ensure_topics(self) -> None:
        cfg = self.cfg
        for topic in [cfg.dead_letter_topic] + ([cfg.output.topic] if cfg.output.topic else []):
            call_with_retry(functools.partial(rkafka.ensure_topic, cfg.kafka, topic),
                            what=f"creating topic {topic}", policy=self.retry)

    def _changes(self, pipeline: Pipeline) -> BatchChanges | None:
        """With corrections: where each batch's late versions are written for the state step."""
        shipped = [c for c in pipeline.corrected if c.dim is None]  # a partitioned join's: its buckets find them
        if not shipped:
            return None
        assert self.cfg.state is not None
        by_dataset: dict[str, Corrected] = {}
        for c in shipped:  # a dataset joined twice: one file, the columns of both joins compared
            was = by_dataset.get(c.dataset)
            columns = tuple(dict.fromkeys((*(was.columns if was is not None else ()), *c.columns)))
            by_dataset[c.dataset] = Corrected(c.dataset, c.key, columns, c.horizon_us)
        return BatchChanges(list(by_dataset.values()), self.layout.corrections,
                            self.cfg.state.watermark // timedelta(microseconds=1))

    def _dimensions(self, spark: SparkSession, start: Mapping[str, Positions] | None = None) -> Dimensions:
        """The broadcast dimensions, bootstrapped: each ships only the columns some join uses;
        ``start``: a fork's savepoint's changelog positions, where a new checkpoint's bootstrap stops."""
        cfg = self.cfg
        columns: dict[str, list[str] | None] = {}
        for j in cfg.broadcast_joins:
            if j.columns is None or columns.get(j.dataset, []) is None:
                columns[j.dataset] = None
            else:
                columns[j.dataset] = sorted(set(columns.get(j.dataset) or []) | set(j.columns))
        dims = Dimensions(cfg.broadcast_datasets, columns, lambda topic: ChangelogFollower(cfg.kafka, topic),
                          FileVersionLog(self.layout.dimensions), Shipper(spark.sparkContext),
                          timeout=cfg.bootstrap_timeout.total_seconds(),
                          history={j.dataset: j.history for j in cfg.broadcast_joins if j.as_of},
                          journal={j.dataset for j in cfg.broadcast_joins if j.corrections is not None},
                          start=start)
        self._stack.callback(dims.close)
        call_with_retry(dims.bootstrap, what="bootstrapping dimensions", policy=self.retry, stop=self._stop)
        return dims

    def _plan(self, spark: SparkSession, dims: Dimensions) -> Pipeline:
        """The pipeline against the published schemas: the broadcast dimensions' as bootstrapped, the
        partitioned ones' read from their changelogs. A join naming a missing column fails here, as a
        config error, instead of failing the first micro-batch."""
        cfg = self.cfg
        schemas = {ds: dims.schema(ds) for ds in cfg.broadcast_datasets}
        if cfg.partitioned_joins:
            from enrich.joins.partitioned import published_schema

            for j in cfg.partitioned_joins:
                if j.dataset not in schemas:
                    schemas[j.dataset] = published_schema(spark, cfg.kafka, j.dataset, j.topic,
                                                          cfg.bootstrap_timeout.total_seconds())
        pipeline = Pipeline.build(cfg, schemas, timezone=spark.conf.get("spark.sql.session.timeZone") or "UTC")
        self.layout.write_schemas(schemas)
        for line in pipeline.explain()[1:]:
            log.info("plan: %s", line.strip())
        return pipeline

    def _sinks(self, pipeline: Pipeline) -> tuple[Sink, DeadLetters | None, RollupWriter | None]:
        """The sink, the dead-letter writer unless the sink writes them itself (and there are no
        rollups or gaps), and the rollups' writer, with the checkpoint's writer identity
        (:mod:`enrich.sinks.identity`: a start that would change it is refused)."""
        cfg = self.cfg
        ident = self._ident = SinkIdentity.load(self.layout, cfg)
        # The Kafka output's writers' base id, else the dead letters' (the database output's tasks write them).
        # Opening it reaches the database output (its tables checked): a database still starting is waited for.
        sink = call_with_retry(lambda: make_sink(cfg, ident.scope, ident.id_of(cfg.output.topic or cfg.dead_letter_topic),
                                                 pipeline.events.fieldNames()),
                               what="opening the output", policy=self.retry, stop=self._stop)
        self._stack.callback(sink.close)
        dead = None
        if not sink.writes_dead_letters or cfg.driver_dead_letters:
            dead = DeadLetters(cfg.kafka, cfg.dead_letter_topic, ident.id_of(cfg.dead_letter_topic), ident.scope)
            self._stack.callback(dead.close)
        rollups = None
        if pipeline.state is not None and pipeline.state.rollups:
            specs = pipeline.state.rollups
            rollups = call_with_retry(lambda: RollupWriter(specs, cfg.rollups, cfg.kafka, ident.ids, ident.scope),
                                      what="opening the rollups' outputs", policy=self.retry, stop=self._stop)
            self._stack.callback(rollups.close)
        return sink, dead, rollups

    def _gaps(self, pipeline: Pipeline, initial: dict[str, Any] | None) -> GapWriter | None:
        """The gaps' writer (with ``gaps:``), with the checkpoint's writer identity; ``initial``: a
        fork's savepoint's partition times and silences."""
        cfg, st = self.cfg, pipeline.state
        if st is None or st.gaps is None or cfg.gaps is None:
            return None
        ident = self._ident
        assert ident is not None
        spec, gaps = st.gaps, cfg.gaps
        out = call_with_retry(lambda: GapWriter(spec, gaps, self.layout, cfg.kafka, ident.ids, ident.scope, initial),
                              what="opening the gaps' outputs", policy=self.retry, stop=self._stop)
        self._stack.callback(out.close)
        return out

    def _metrics(self, sink: Sink) -> EnrichMetrics | None:
        if self.cfg.metrics is None:
            return None
        from refstream.metrics import MetricsServer

        # The results counted: the sink's, and the unmatched and late events and dead letters the job counts.
        metrics = EnrichMetrics(results=[r for r in RESULTS if r in ("unmatched", "late", "dead_letter")
                                         or r in sink.counts], rollups=[r.name for r in self.cfg.rollups])
        self._stack.enter_context(MetricsServer(self.cfg.metrics, metrics.registry))
        return metrics

    def _stream(self, spark: SparkSession, pipeline: Pipeline, dims: Dimensions, sink: Sink,
                metrics: EnrichMetrics | None) -> tuple[Stream, DeviceCount | None]:
        """The query up to what ``foreachBatch`` receives (:func:`enrich.query.build`), and the state
        step's device counts; what the step's tasks use from the job set up first."""
        devices = None
        if pipeline.state is not None:
            devices = DeviceCount(spark.sparkContext, self.layout)
            if metrics is not None:
                metrics.devices_in_state(devices.total)
            if pipeline.state.before:  # their tasks read the pinned versions from files (enrich.joins.PlanEnricher)
                dims.shipper.write_to(self.layout.shipped)
            if pipeline.state.calls is not None:
                self._call_counts = spark.sparkContext.accumulator({}, KeyedTallies())
            if pipeline.state.gaps is not None:
                self._gap_records = spark.sparkContext.accumulator({}, KeyedTallies())
            if any(c.dim is not None for c in pipeline.corrected):  # the buckets count their own late versions
                self._correction_counts = spark.sparkContext.accumulator({}, KeyedTallies())
        stream = build(spark, pipeline, starting=self.origin.events, reparses=sink.reparses,
                       devices=devices.accumulator if devices is not None else None,
                       fork=self._fork[1] if self._fork is not None else None, call_counts=self._call_counts,
                       floor_us=self.origin.floor_us, gap_records=self._gap_records,
                       correction_counts=self._correction_counts)
        if stream.state is not None and stream.state.cache is not None:
            self._stack.callback(stream.state.cache.remove)  # after the query has stopped (the stack unwinds in reverse)
        return stream, devices

    def _start_query(self, stream: DataFrame) -> StreamingQuery:
        cfg = self.cfg
        # The checkpoint is a local path (enrich.checkpoint): its files need no FileContext.
        spark_local_checkpoint_files(stream.sparkSession)
        self._writer = writer(stream, self._process, checkpoint=self.layout.spark.resolve(),
                              name=f"enrich-{cfg.events.topic}", available_now=self.available_now, trigger=cfg.trigger)
        query = self._writer.start()
        self._stack.callback(self._stop_query)
        return query

    def run(self, spark: SparkSession | None = None, *, master: str | None = None) -> None:
        """Start on ``spark``, then wait until the query ends (available-now) or :meth:`stop` is
        called, and release what the job opened. A query that fails because a Python worker did not
        start or lost its state server (:func:`enrich.failures.transient_worker_failure`) is started
        again from its checkpoint, with backoff, up to the retry policy's attempts in a row: a
        failure after a batch was written since the previous one counts as the first again.

        Without ``spark`` the job builds its session as ``enrich run`` does
        (:func:`enrich.session.build_session`: the session defaults, then the config's ``spark:``
        section, the UI on) on ``master`` (default ``local[*]``, or what ``spark-submit`` set), and
        stops it at the end."""
        if spark is None:
            import os

            from enrich.session import build_session

            if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
                master = "local[*]"
            spark = build_session(master, "refstream-enrich", self.cfg.spark_conf, ui=True)
            self._stack.callback(spark.stop)  # last: after the query has stopped
        with self._stack:
            query = self.start(spark)
            streak = FailureStreak(self.retry)  # in a row: a batch written between two failures ends a streak
            while True:
                try:
                    while not self._stop.is_set() and query.isActive:
                        query.awaitTermination(0.5)  # type: ignore[arg-type]  # takes float seconds; typed int
                    exc = query.exception()
                except StreamingQueryException as failed:
                    exc = failed
                if exc is None or self._stop.is_set():
                    break
                failures = streak.failed(self.batches)
                why = transient_worker_failure(exc)
                if why is None or streak.exhausted:
                    raise TerminalError(f"enrichment query failed: {root_cause(exc)}") from exc
                wait = self.retry.backoff(failures)
                log.warning("enrichment query failed: %s; %s, which is transient: "
                            "starting the query again from its checkpoint in %.1fs (attempt %d of %d)",
                            root_cause(exc), why, wait, failures + 1, self.retry.attempts)
                if self._stop.wait(wait):
                    break
                assert self._writer is not None
                query = self.query = self._writer.start()
            if self._stop.is_set():
                log.info("stopping the enrichment query")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop the query if it runs and release what :meth:`start` opened."""
        self._stack.close()

    def __enter__(self) -> EnrichJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop_query(self) -> None:
        if self.query is not None and self.query.isActive:
            self.query.stop()

    # ----------------------------------------------------------------------------- one batch

    def _process(self, batch_df: DataFrame, batch_id: int) -> None:
        t0 = time.monotonic()
        # The last finished trigger's progress (this batch's comes after foreachBatch returns): read once.
        progress = self.query.lastProgress if self.query is not None else None
        self._log_trigger(progress)
        st = self.started
        if st.state is None or st.devices is None:
            dead, counted = self._process_batch(batch_df, batch_id)
            return self._observe(t0, dead, counted, progress, late=0)
        # With the state step the batch is parsed already. A sink that counts the late events it
        # writes (Kafka, the database, in their tasks) gives the count; with the others the job
        # counts them in a job of its own. The batch is cached when it is read twice: by that
        # count, or by the rollups' writer after the sink.
        st.devices.before_batch()
        if self._call_counts is not None:
            self._call_counts.value = {}
        if self._gap_records is not None:
            self._gap_records.value = {}
        if self._correction_counts is not None:
            self._correction_counts.value = {}
        counts_late = "late" in st.sink.counts
        cached = st.rollups is not None or not counts_late
        if cached:
            batch_df.persist()
        try:
            dead, counted = self._process_batch(batch_df, batch_id)
            if counts_late:
                late = counted.late
            else:
                frame = st.state.frame(batch_df)
                late_events = F.col(LATE)
                if KIND in frame.columns:  # a correction repeats its event's flag: not counted again
                    late_events = late_events & (F.col(KIND) != F.lit(KIND_CORRECTION))
                late = frame.filter(late_events).count()
        finally:
            if cached:
                batch_df.unpersist()
        devices = st.devices.after_batch(batch_id)
        if self._call_counts is not None:
            self._after_calls(batch_id, st.metrics)
        if self._correction_counts is not None:
            counts, beyond = correction_tallies(self._correction_counts.value)
            if st.metrics is not None:
                st.metrics.corrections(counts)
            for dataset, (key, valid_from, start) in sorted(beyond.items()):
                warn_beyond(dataset, key, valid_from, start, st.changes.warned if st.changes is not None
                            else self._beyond_warned)
        log.info("batch %d: %d late event(s) written with a null state; %s device(s) in state", batch_id, late,
                 "unknown" if devices is None else devices)
        if st.metrics is not None:
            st.metrics.devices_in_state(devices)
        return self._observe(t0, dead, counted, progress, late=late)

    def _log_trigger(self, progress: dict[str, Any] | None) -> None:
        """The last finished trigger's own durations (Spark's ``progress``: ``triggerExecution``, the
        figure behind "falling behind", and its parts), once per trigger: the batch's time besides
        this job's own work (offsets, the commit log, the state store's commit)."""
        if not progress or progress.get("batchId") == self._trigger_logged:
            return
        self._trigger_logged = progress.get("batchId")
        took = dict(progress.get("durationMs") or {})
        total = took.pop("triggerExecution", None)
        if total is not None:
            log.info("batch %s: trigger %.3fs (%s)", self._trigger_logged, total / 1000,
                     ", ".join(f"{k} {v / 1000:.3f}" for k, v in sorted(took.items())))

    def _after_calls(self, batch_id: int, metrics: EnrichMetrics | None) -> None:
        """The batch's call counts to the log and the metrics; the responses recorded for batches
        before it dropped (each is committed: no replay reads them again)."""
        assert self._call_counts is not None
        counts, failures = read_tallies(self._call_counts.value)
        if counts:
            log.info("batch %d: calls %s", batch_id, ", ".join(f"{c} {r} {n}" for (c, r), n in sorted(counts.items())))
        for call, (n, first) in sorted(failures.items()):  # the executors' own lines stay in their logs
            log.warning("batch %d: call %s failed %d time(s), e.g. %s", batch_id, call, n, first)
        if metrics is not None:
            metrics.calls_made(counts)
        root = self.layout.calls
        if root.is_dir():
            for d in root.iterdir():
                if d.name.isdigit() and int(d.name) < batch_id:
                    shutil.rmtree(d, ignore_errors=True)

    def _join_pass(self) -> JoinPass:
        """The join pass against the broadcast datasets' current published schemas (planned again
        when one changed)."""
        st = self.started
        schemas = {ds: st.dims.schema(ds) for ds in st.pipeline.broadcast_datasets}
        if self._pass is None or dict(self._pass.schemas) != schemas:
            self._pass = st.pipeline.replan(schemas)
            log.info("output columns: %s", ", ".join(self._pass.columns))
        return self._pass

    def _watermark_ms(self, batch_id: int) -> int | None:
        """The watermark batch ``batch_id`` runs with, as the state step sees it: never below a
        fork's floor (Spark's own starts from nothing in a fork)."""
        wm = self.layout.batch_watermark_ms(batch_id)
        floor = self._origin.floor_us if self._origin is not None else None
        if floor is None:
            return wm
        return floor // 1000 if wm is None else max(wm, floor // 1000)

    def _process_batch(self, batch_df: DataFrame, batch_id: int) -> tuple[int, Counted]:
        """Pin, enrich, write one batch; returns the dead letters collected on the driver and what
        the sink counted (summed over both writes when slots are written again from from_json)."""
        t0 = time.monotonic()
        st = self.started
        changes = st.changes
        journaled = None
        if changes is not None:  # the batch's late versions, written before it runs (a replay finds them)
            def journaled(journals: Mapping[str, Journal], replay: bool) -> None:
                changes.record(batch_id, journals, replay, self._watermark_ms(batch_id))
        shipped = call_with_retry(lambda: st.dims.pin(batch_id, journaled), what=f"batch {batch_id}: pinning dimensions",
                                  policy=self.retry, stop=self._stop)
        if changes is not None and st.metrics is not None:
            st.metrics.corrections(changes.counts)
        files = st.dims.shipper.files
        facts = None
        if self.cfg.waits:  # the state step decides what it holds against the batch's recorded facts
            at, complete = st.dims.batch_facts(batch_id, list(self.cfg.waits))
            facts = BatchFacts.of(at, complete).to_json()
        corrections = {"dir": str(changes.dir.resolve()), "batch": batch_id} if changes is not None else None
        if files is not None or facts is not None or corrections is not None:  # the tasks learn it here
            st.spark.sparkContext.setLocalProperty(joins.PINNED_PROPERTY, joins.pinned_property(
                shipped, str(files.resolve()) if files is not None else None, facts, corrections))
        if any(r.idle_finalize for r in self.cfg.rollups):  # the rollup step's idleness, from the offset log
            st.spark.sparkContext.setLocalProperty(IDLE_PROPERTY, json.dumps(
                idle_facts(self.layout, batch_id, self.cfg.events.topic)))
        if st.gaps is not None:  # the partitions' times the state step judges silent devices against
            st.spark.sparkContext.setLocalProperty(TIMES_PROPERTY, st.gaps.pin(batch_id))
        if self._call_counts is not None:  # the calls' budgets run from here
            st.spark.sparkContext.setLocalProperty(STARTED_PROPERTY, repr(time.time()))
        jp = self._join_pass()
        matched = tuple(s.matched for s in jp.specs)
        # A sink that does not count the unmatched events it writes (Parquet, console): the join pass
        # counts them, per task, in the same pass.
        unmatched = (None if "unmatched" in st.sink.counts
                     else st.spark.sparkContext.accumulator({}, KeyedCounts()))

        def exact(df: DataFrame) -> EnrichedBatch:  # parsed by from_json, or the state step's packed rows
            if st.state is not None:
                return enriched(st.state.events(df), jp.specs, jp.schema, shipped, jp.columns, matched, ERROR,
                                first=st.state.unpack, unmatched=unmatched)
            parsed = events.parse(df, st.pipeline.events, self.cfg.events.required)
            return enriched(parsed, jp.specs, jp.schema, shipped, jp.columns, matched, ERROR, unmatched=unmatched)

        if st.fast is not None and st.ranges is not None:  # the pass reads the records of the batch's ranges
            batch = enriched(batch_df, jp.specs, jp.fast_schema, shipped, jp.columns, matched, ERROR, parser=st.fast,
                             parsed_schema=events.fast_schema(st.pipeline.parsed), read=st.ranges)
        elif st.fast is not None:
            batch = enriched(events.source_columns(batch_df), jp.specs, jp.fast_schema, shipped, jp.columns,
                             matched, ERROR, parser=st.fast, parsed_schema=events.fast_schema(st.pipeline.parsed))
        else:
            batch = exact(batch_df)
        dead = call_with_retry(lambda: st.sink.write(batch_id, batch), what=f"batch {batch_id}: writing output",
                               policy=self.retry, stop=self._stop)
        counted = st.sink.counted
        if counted.corrections:
            log.info("batch %d: %d corrections written", batch_id, counted.corrections)
        if st.rollups is not None:
            dead = self._rollups(batch_id, batch_df, dead)
        if st.gaps is not None and self._gap_records is not None:
            dead = self._write_gaps(batch_id, dead)
        if unmatched is not None:
            counted = dataclasses.replace(counted, unmatched=sum(unmatched.value.values()))
        redone = st.sink.pending
        if redone:
            # Tasks that met events the fast parser left to from_json wrote nothing: their input
            # ranges (same partition indexes, so same slots) are written again from from_json's parse.
            redo = batch_df.where(F.spark_partition_id().isin(list(redone)))  # a range's partition is its slot
            again = exact(redo if st.ranges is None else read_ranges(redo, st.ranges))
            call_with_retry(lambda: st.sink.write(batch_id, again), what=f"batch {batch_id}: writing output",
                            policy=self.retry, stop=self._stop)
            counted = _plus(counted, st.sink.counted)
        if st.dead is not None:
            dlq = st.dead
            call_with_retry(lambda: dlq.write(batch_id, dead), what=f"batch {batch_id}: writing dead letters",
                            policy=self.retry, stop=self._stop)
        self.batches += 1
        log.info("batch %d done in %.2fs (dimensions pinned in %.3fs, %d slot(s) parsed again by from_json, "
                 "%d dead letter(s) collected)", batch_id, time.monotonic() - t0, st.dims.last_pin_seconds,
                 len(redone), dead.num_rows)
        # Events only: a rollup row or gap record an output could not take has no source position.
        return dead.num_rows - dead.column("_offset").null_count, counted

    def _rollups(self, batch_id: int, batch_df: DataFrame, dead: pa.Table) -> pa.Table:
        """The batch's rollup rows written; ``dead`` with the rollups' dead letters added; counts logged."""
        st = self.started
        assert st.rollups is not None
        writer = st.rollups
        assert st.pipeline.state is not None
        frames = rollup_rows(batch_df, st.pipeline.state.rollups)
        got = call_with_retry(lambda: writer.write(batch_id, batch_df, frames),
                              what=f"batch {batch_id}: writing rollups", policy=self.retry, stop=self._stop)
        if got.counts:
            log.info("batch %d: rollup events %s", batch_id,
                     ", ".join(f"{r} {k} {n}" for (r, k), n in sorted(got.counts.items())))
        if st.metrics is not None:
            st.metrics.rollup_events(got.counts)
        return _with(dead, got.dead)

    def _write_gaps(self, batch_id: int, dead: pa.Table) -> pa.Table:
        """The batch's gap records written (the state step has reported them: the sink's write ran
        it); ``dead`` with the records an output could not take added, before the dead letters'
        write."""
        st = self.started
        assert st.gaps is not None and self._gap_records is not None
        gaps, reported = st.gaps, self._gap_records.value
        got = call_with_retry(lambda: gaps.write(batch_id, reported), what=f"batch {batch_id}: writing gaps",
                              policy=self.retry, stop=self._stop)
        if st.metrics is not None:
            st.metrics.gap_records(got.kinds, got.no_interval)
        return _with(dead, got.dead)

    def _observe(self, t0: float, collected_dead: int, counted: Counted, progress: dict[str, Any] | None, *,
                 late: int | None) -> None:
        """The batch's metrics: what the sink counted, else what the job counted (dead letters it
        collected, late events, the join pass's unmatched events); the input lag and event time from
        the last finished trigger's ``progress``."""
        st = self.started
        if st.metrics is None:
            return
        dims = {}
        for ds in self.cfg.broadcast_datasets:
            d = st.dims.state(ds)
            dims[ds] = (d.version, d.live_rows(), d.changed_ms)
        dead = counted.dead_letters if counted.dead_letters is not None else collected_dead
        st.metrics.after_batch(time.monotonic() - t0, enriched=counted.enriched, unmatched=counted.unmatched,
                               late=late, dead=dead, dimensions=dims)
        if progress:
            st.metrics.progress(progress.get("sources") or [])
            st.metrics.event_time(progress.get("eventTime"))
