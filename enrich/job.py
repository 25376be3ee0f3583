"""The enrichment job: Kafka events -> parse -> lookup joins against pinned dimensions -> sink.

One ``foreachBatch`` per micro-batch; the driver only plans it:
1. pin: fix (or, on a replay, reuse) the changelog positions of every dimension for this batch id,
   bring the dimensions there and ship what changed (docs/dimension.md);
2. parse the events (bad ones get ``_error``) and join them in one ``mapInArrow`` pass: with the
   Kafka sink pyarrow parses what it parses exactly (``enrich.fastparse``), else ``from_json``;
3. the sink writes the good rows at most once per batch id: the Kafka sink in the tasks, each in its
   own transaction with its dead letters (a task that met an event pyarrow left to ``from_json``
   writes nothing, and its slot is written by a second, ``from_json``, plan of the same input); the
   other sinks through Spark, their dead letters through a transactional writer on the driver.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructType

from enrich import events, join
from enrich.config import EnrichConfig, JoinConfig
from enrich.deadletter import DeadLetters
from enrich.dimension.changelog import ChangelogFollower
from enrich.dimension.manager import Dimensions
from enrich.dimension.ship import Shipper
from enrich.dimension.versions import FileVersionLog
from enrich.fastparse import FastParser
from enrich.metrics import RESULTS, EnrichMetrics
from enrich.sinks import Counted, EnrichedBatch, Sink, make_sink
from enrich.state.checkpoint import check_checkpoint
from enrich.state.plan import LATE
from refstream import kafka as rkafka
from refstream.atomic import write_bytes_atomic, write_json_atomic
from refstream.contract import DatasetSchema
from refstream.errors import TerminalError, one_line
from refstream.retry import RetryPolicy, call_with_retry

log = logging.getLogger(__name__)

DEFAULT_RETRY = RetryPolicy(attempts=5, initial=1.0, maximum=15.0)
#: The Kafka writers' transactional ids, relative to the checkpoint (see ``EnrichJob._transactional_id``).
SINK_IDENTITY = Path("refstream") / "sink.json"
#: Where the dimension versions of joins in the plan are written for their tasks, relative to the checkpoint.
SHIPPED = Path("refstream") / "shipped"


_OUR_ERROR = re.compile(r"refstream\.errors\.\w+: (.+)")


def _plus(a: Counted, b: Counted) -> Counted:
    """Two writes' counts of one batch; a count either write did not make stays unknown."""
    def add(x: int | None, y: int | None) -> int | None:
        return None if x is None or y is None else x + y

    return Counted(add(a.enriched, b.enriched), add(a.unmatched, b.unmatched), add(a.late, b.late),
                   add(a.dead_letters, b.dead_letters))


def root_cause(exc: BaseException) -> str:
    """One line for a failed query: the message of the refstream error that failed it, when Spark's
    exception carries one (a Python traceback inside a JVM error), else the exception's first line."""
    found = _OUR_ERROR.findall(str(exc))
    return found[-1].strip() if found else one_line(exc)


#: Spark's words for a Python worker process that did not start or did not connect back to the JVM
#: (seen once at a query's start, in the Python data source's planning worker, under load).
_WORKER_START = ("Python worker failed to connect back",)


def worker_start_failed(exc: BaseException) -> bool:
    """Whether a failed query failed because a Python worker did not start: transient, and safe to
    retry by starting the query again from its checkpoint (what a restart of the job would do)."""
    text = str(exc)
    return any(w in text for w in _WORKER_START)


class EnrichJob:
    """Builds and runs the streaming query; ``run()`` blocks until done or ``stop`` is set."""

    def __init__(self, cfg: EnrichConfig, spark: SparkSession, *, available_now: bool = False,
                 retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.cfg, self.spark, self.available_now, self.retry = cfg, spark, available_now, retry
        self.event_schema = events.event_schema(cfg.events.schema, cfg.events.required, cfg.source)
        self._stack = ExitStack()
        self._stop = threading.Event()
        self.query: StreamingQuery | None = None
        self._plan: tuple[dict[str, DatasetSchema], list[join.JoinSpec], tuple[str, ...], StructType,
                          StructType] | None = None
        self.fast: FastParser | None = None
        self.batches = 0
        #: The broadcast joins run in ``foreachBatch`` (all of them, unless the state step needs some).
        self._post_joins = cfg.broadcast_joins

    @property
    def checkpoint(self) -> Path:
        return self.cfg.checkpoint

    # ------------------------------------------------------------------------------- lifecycle

    def start(self) -> StreamingQuery:
        cfg = self.cfg
        for topic in [cfg.dead_letter_topic] + ([cfg.output.topic] if cfg.output.topic else []):
            call_with_retry(functools.partial(rkafka.ensure_topic, cfg.kafka, topic),
                            what=f"creating topic {topic}", policy=self.retry)
        self.cfg.checkpoint.mkdir(parents=True, exist_ok=True)
        columns: dict[str, list[str] | None] = {}
        for j in cfg.broadcast_joins:  # ship only the columns some join uses (plus the key)
            if j.columns is None or columns.get(j.dataset, []) is None:
                columns[j.dataset] = None
            else:
                columns[j.dataset] = sorted(set(columns.get(j.dataset) or []) | set(j.columns))
        self.dims = Dimensions(cfg.broadcast_datasets, columns, lambda topic: ChangelogFollower(cfg.kafka, topic),
                               FileVersionLog(cfg.checkpoint / "dimensions"), Shipper(self.spark.sparkContext),
                               timeout=cfg.bootstrap_timeout.total_seconds())
        self._stack.callback(self.dims.close)
        call_with_retry(self.dims.bootstrap, what="bootstrapping dimensions", policy=self.retry, stop=self._stop)
        scope = self._scope()
        self.sink: Sink = make_sink(cfg, scope, self._transactional_id(cfg.output.topic) if cfg.output.topic else None)
        self._stack.callback(self.sink.close)
        self.metrics: EnrichMetrics | None = None
        if cfg.metrics is not None:
            from refstream.metrics import MetricsServer

            # The results counted: the sink's, and the late events and dead letters the job counts.
            self.metrics = EnrichMetrics(results=[r for r in RESULTS if r in ("late", "dead_letter")
                                                  or r in self.sink.counts])
            self.metrics_server = self._stack.enter_context(MetricsServer(cfg.metrics, self.metrics.registry))
        self.dead: DeadLetters | None = None
        if not self.sink.writes_dead_letters:
            self.dead = DeadLetters(cfg.kafka, cfg.dead_letter_topic, self._dlq_transactional_id(), scope)
            self._stack.callback(self.dead.close)
        parser = (FastParser.for_schema(self.event_schema, cfg.events.required, self._timezone())
                  if cfg.events.parser == "auto" else None)
        # Without state, the fast parser's leftovers are parsed again by a sink that can write a task's
        # slot twice; with state, by from_json in the plan before the step (enrich.state.ingest).
        if cfg.state is None and self.sink.reparses:
            self.fast = parser
        elif cfg.state is None:
            parser = None
        log.info("events parsed by %s", "pyarrow, with from_json for what it leaves" if parser else "from_json")

        from enrich.kafka import read_stream

        raw = read_stream(self.spark, cfg.kafka, [cfg.events.topic], starting_offsets=cfg.events.starting_offsets,
                          max_offsets_per_trigger=cfg.max_events_per_batch,
                          fail_on_data_loss=cfg.events.fail_on_data_loss, on_offset_reset=cfg.events.on_offset_reset,
                          builtin=cfg.events.source == "builtin")
        # The published schemas are known now: a join naming a missing column fails here, as a config
        # error, instead of failing the first micro-batch.
        parsed = events.parse(raw, self.event_schema, cfg.events.required)
        self._parsed_schema = parsed.schema
        before = self._parsed_schema  # what the broadcast joins see: events, then partitioned joins' columns
        schemas: dict[str, DatasetSchema] = {}
        if cfg.partitioned_joins:
            from enrich.state.dimension import published_schema

            for j in cfg.partitioned_joins:
                if j.dataset not in schemas:
                    schemas[j.dataset] = published_schema(self.spark, cfg.kafka, j.dataset, j.topic,
                                                          cfg.bootstrap_timeout.total_seconds())
            _, before = join.plan(cfg.partitioned_joins, schemas, before, timezone=self._timezone(),
                                  source=cfg.source)
        _, _, enriched_schema, _ = self._planned(before)
        self._plan = None
        stream = raw
        if cfg.state is not None:  # the keyed state step: events parsed in the plan (enrich/state/)
            from enrich.state.devices import DeviceCount
            from enrich.state.stream import state_step

            self.devices = DeviceCount(self.spark.sparkContext, cfg.checkpoint)
            if self.metrics is not None:
                self.metrics.devices_in_state(self.devices.total)
            pre = self._state_joins(before)
            self._post_joins = tuple(j for j in cfg.broadcast_joins if j not in pre)
            if pre:
                # Their tasks read the pinned versions from files (enrich.join.PlanEnricher).
                self.dims.shipper.write_to(cfg.checkpoint / SHIPPED)
                log.info("joined in the plan, before the state step (the state aggregates their columns): %s",
                         ", ".join(j.dataset for j in pre))
            self.state = state_step(self.spark, cfg, raw, self.event_schema, enriched_schema, self._timezone(),
                                    self.devices.accumulator, {**schemas, **{j.dataset: self.dims.schema(j.dataset)
                                                                             for j in pre}}, pre, parser)
            if self.state.cache is not None:  # after the query has stopped (the stack unwinds in reverse)
                self._stack.callback(self.state.cache.remove)
            # The stream is the step's packed rows; the join pass unpacks them (_process_batch).
            stream = self.state.packed
            self._parsed_schema, self._plan = self.state.schema, None
            self._planned(self._parsed_schema)
        else:
            check_checkpoint(cfg.checkpoint, None, None, cfg.source)
        writer = (stream.writeStream.foreachBatch(self._process)
                  .option("checkpointLocation", str((cfg.checkpoint / "spark").resolve()))
                  .queryName(f"enrich-{cfg.events.topic}"))
        if self.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{int(cfg.trigger.total_seconds() * 1000)} milliseconds")
        self._writer = writer
        self.query = writer.start()
        self._stack.callback(self._stop_query)
        log.info("enrichment query started: %s -> %s (checkpoint %s)", cfg.events.topic,
                 cfg.output.topic or cfg.output.path or "console", cfg.checkpoint)
        return self.query

    def _dlq_transactional_id(self) -> str:
        if self.cfg.output.transactional_id:
            return self.cfg.output.transactional_id + "-dlq"
        return self._transactional_id(self.cfg.dead_letter_topic)

    def _transactional_id(self, topic: str) -> str:
        """The transactional id of this checkpoint's writer to ``topic``, created at first use and kept
        in ``<checkpoint>/refstream/sink.json``: a checkpoint moved to another path keeps its identity,
        so the restarted writer still fences its predecessor and finds its batch markers."""
        from enrich.kafka import transactional_id_for

        path = self.cfg.checkpoint / SINK_IDENTITY
        ids: dict[str, str] = {}
        if path.exists():
            try:
                ids = dict(json.loads(path.read_text(encoding="utf-8"))["transactional_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TerminalError(f"{path}: not a sink identity file ({exc}); restore it from a backup of the "
                                    "checkpoint, or reset the checkpoint") from None
        if topic not in ids:
            # Derived from the path once (what checkpoints written before this file used), then kept.
            ids[topic] = transactional_id_for(self.cfg.checkpoint, topic)
            write_json_atomic(path, {"transactional_ids": ids})
        return ids[topic]

    def _scope(self) -> str:
        """Identity of this checkpoint's query: output markers of an earlier query that used the same
        checkpoint path (since deleted) must not make the new query's batch ids look committed."""
        path = self.cfg.checkpoint / "scope"
        if path.exists():
            return path.read_text(encoding="utf-8").strip()
        scope = uuid.uuid4().hex
        write_bytes_atomic(path, scope.encode("utf-8"))
        return scope

    def run(self) -> None:
        """Start, then wait until the query ends (available-now) or :meth:`stop` is called. A query
        that fails because a Python worker did not start (:func:`worker_start_failed`) is started
        again from its checkpoint, with backoff, up to the retry policy's attempts."""
        with self._stack:
            query = self.start()
            failures = 0
            while True:
                try:
                    while not self._stop.is_set() and query.isActive:
                        query.awaitTermination(0.5)  # type: ignore[arg-type]  # takes float seconds; typed int
                    exc = query.exception()
                except StreamingQueryException as failed:
                    exc = failed
                if exc is None or self._stop.is_set():
                    break
                failures += 1
                if not worker_start_failed(exc) or failures >= self.retry.attempts:
                    raise TerminalError(f"enrichment query failed: {root_cause(exc)}") from exc
                wait = self.retry.backoff(failures)
                log.warning("enrichment query failed: %s; a Python worker did not start, which is transient: "
                            "starting the query again from its checkpoint in %.1fs (attempt %d of %d)",
                            root_cause(exc), wait, failures + 1, self.retry.attempts)
                if self._stop.wait(wait):
                    break
                query = self.query = self._writer.start()
            if self._stop.is_set():
                log.info("stopping the enrichment query")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stack.close()

    def _stop_query(self) -> None:
        if self.query is not None and self.query.isActive:
            self.query.stop()

    # ----------------------------------------------------------------------------- one batch

    def _process(self, batch_df: DataFrame, batch_id: int) -> None:
        t0 = time.monotonic()
        if self.cfg.state is None:
            dead, counted = self._process_batch(batch_df, batch_id)
            return self._observe(t0, dead, counted, late=0)
        # With the state step the batch is parsed already. A sink that counts the late events it
        # writes (Kafka, in its tasks) reads the batch once; with the others the job counts the
        # batch's late events, so the batch is cached (they read it twice, too).
        self.devices.before_batch()
        if "late" in self.sink.counts:
            dead, counted = self._process_batch(batch_df, batch_id)
            late = counted.late
        else:
            batch_df.persist()
            try:
                dead, counted = self._process_batch(batch_df, batch_id)
                late = self.state.frame(batch_df).filter(F.col(LATE)).count()
            finally:
                batch_df.unpersist()
        devices = self.devices.after_batch(batch_id)
        log.info("batch %d: %d late event(s) written with a null state; %s device(s) in state", batch_id, late,
                 "unknown" if devices is None else devices)
        if self.metrics is not None:
            self.metrics.devices_in_state(devices)
        return self._observe(t0, dead, counted, late=late)

    def _process_batch(self, batch_df: DataFrame, batch_id: int) -> tuple[int, Counted]:
        """Pin, enrich, write one batch; returns the dead letters collected on the driver and what
        the sink counted (summed over both writes when slots are written again from from_json)."""
        t0 = time.monotonic()
        shipped = call_with_retry(lambda: self.dims.pin(batch_id), what=f"batch {batch_id}: pinning dimensions",
                                  policy=self.retry, stop=self._stop)
        files = self.dims.shipper.files
        if files is not None:  # joins in the plan: this batch's tasks learn its pinned versions here
            self.spark.sparkContext.setLocalProperty(join.PINNED_PROPERTY,
                                                     join.pinned_property(shipped, str(files.resolve())))
        specs, out_cols, out_schema, fast_schema = self._planned(self._parsed_schema)
        matched = tuple(s.matched for s in specs)

        def exact(df: DataFrame) -> EnrichedBatch:  # parsed by from_json, or the state step's packed rows
            if self.cfg.state is not None:
                return EnrichedBatch(join.enrich(df, specs, out_schema, shipped, events.ERROR, first=self.state.unpack),
                                     out_cols, matched)
            parsed = events.parse(df, self.event_schema, self.cfg.events.required)
            return EnrichedBatch(join.enrich(parsed, specs, out_schema, shipped, events.ERROR), out_cols, matched)

        if self.fast is not None:
            batch = EnrichedBatch(join.enrich(events.source_columns(batch_df), specs, fast_schema, shipped,
                                              events.ERROR, parser=self.fast,
                                              parsed_schema=events.fast_schema(self._parsed_schema)), out_cols,
                                  matched)
        else:
            batch = exact(batch_df)
        dead = call_with_retry(lambda: self.sink.write(batch_id, batch), what=f"batch {batch_id}: writing output",
                               policy=self.retry, stop=self._stop)
        counted = self.sink.counted
        redone = self.sink.pending
        if redone:
            # Tasks that met events the fast parser left to from_json wrote nothing: their input
            # ranges (same partition indexes, so same slots) are written again from from_json's parse.
            again = exact(batch_df.where(F.spark_partition_id().isin(list(redone))))
            call_with_retry(lambda: self.sink.write(batch_id, again), what=f"batch {batch_id}: writing output",
                            policy=self.retry, stop=self._stop)
            counted = _plus(counted, self.sink.counted)
        if self.dead is not None:
            dlq = self.dead
            call_with_retry(lambda: dlq.write(batch_id, dead), what=f"batch {batch_id}: writing dead letters",
                            policy=self.retry, stop=self._stop)
        self.batches += 1
        log.info("batch %d done in %.2fs (dimensions pinned in %.3fs, %d slot(s) parsed again by from_json, "
                 "%d dead letter(s) collected)", batch_id, time.monotonic() - t0, self.dims.last_pin_seconds,
                 len(redone), dead.num_rows)
        return dead.num_rows, counted

    def _observe(self, t0: float, collected_dead: int, counted: Counted, *, late: int | None) -> None:
        """The batch's metrics: what the sink counted, else what the driver has (dead letters it
        collected, the late events the job counted); Parquet and console count no unmatched events."""
        if self.metrics is None:
            return
        dims = {}
        for ds in self.cfg.broadcast_datasets:
            st = self.dims.state(ds)
            dims[ds] = (st.version, st.live_rows(), st.changed_ms)
        dead = counted.dead_letters if counted.dead_letters is not None else collected_dead
        self.metrics.after_batch(time.monotonic() - t0, enriched=counted.enriched, unmatched=counted.unmatched,
                                 late=late, dead=dead, dimensions=dims)
        progress = self.query.lastProgress if self.query is not None else None
        if progress:
            self.metrics.progress(progress.get("sources") or [])

    def _state_joins(self, enriched: StructType) -> list[JoinConfig]:
        """The broadcast joins the state step needs, in configured order: those adding a column
        ``state:`` names, and those their ``on`` columns come from. They run in the plan, before
        the step (``enrich.join.PlanEnricher``); the others stay in ``foreachBatch``."""
        assert self.cfg.state is not None
        joins = self.cfg.broadcast_joins
        schemas = {ds: self.dims.schema(ds) for ds in self.cfg.broadcast_datasets}
        specs, _ = join.plan(joins, schemas, enriched, timezone=self._timezone(), source=self.cfg.source)
        needed, chosen = set(self.cfg.state.columns), set()
        for _ in range(len(specs)):
            for i, s in enumerate(specs):
                if i not in chosen and ({out for _, out in s.columns} | {s.matched}) & needed:
                    chosen.add(i)
                    needed |= {e for e, _ in s.pairs}
        return [j for i, j in enumerate(joins) if i in chosen]

    def _timezone(self) -> str:
        return self.spark.conf.get("spark.sql.session.timeZone") or "UTC"

    def _planned(self, parsed: StructType) -> tuple[list[join.JoinSpec], tuple[str, ...], StructType, StructType]:
        """The joins resolved against the current published schemas: specs, output columns, and the
        output schemas of the join pass after ``from_json`` and after the fast parser."""
        schemas = {ds: self.dims.schema(ds) for ds in self.cfg.broadcast_datasets}
        if self._plan is None or self._plan[0] != schemas:
            tz = self._timezone()
            joins = self._post_joins
            specs, out_schema = join.plan(joins, schemas, parsed, timezone=tz, source=self.cfg.source)
            _, fast_schema = join.plan(joins, schemas, events.fast_schema(parsed), timezone=tz,
                                       source=self.cfg.source)
            out_cols = tuple(f.name for f in out_schema.fields if f.name not in events.INTERNAL)
            self._plan = (schemas, specs, out_cols, out_schema, fast_schema)
            log.info("output columns: %s", ", ".join(out_cols))
        _, specs, out_cols, out_schema, fast_schema = self._plan
        return specs, out_cols, out_schema, fast_schema

