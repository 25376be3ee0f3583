"""``enrich rescale --config F --partitions N``: move a stopped job's device state to ``N`` state partitions.

Spark fixes a stateful query's number of state partitions (``spark.sql.shuffle.partitions``) at its
first batch and keeps it in the offset log. Spark 4.2 added an offline state repartition
(``spark._streamingCheckpointManager.repartition``; private, evolving and experimental, Spark Classic
only): with the last batch ``n`` committed, it writes batch ``n + 1`` to the checkpoint with the
same source offsets and watermark as batch ``n`` and the new number, rewrites the state of every
stateful operator as of batch ``n`` into the new partitions (every state variable of the step: the
device tables, the partitioned dimensions' rows, the timers; and the rollup step's windows and
timers: each grouping key goes to ``pmod(hash(key), N)``, as the query's shuffle will put it), and
commits it. The rollup buckets are the state buckets' grouping keys (:mod:`enrich.state.rollups`),
which a rescale keeps, so every window stays in the bucket its keys route to. Batch ``n + 1`` reads
no input and runs no ``foreachBatch``; the next start of the job goes on from batch ``n + 2`` with
``N`` partitions.

What holds the output exactly once: the batch ids go on, so every Kafka writer's ledger
(:mod:`enrich.sinks.kafka.ledger`) still knows the batches it committed, and a writer of a new slot
(state partition) starts with an empty one. So this module refuses, in one line and before anything
is changed, a checkpoint whose last batch was planned and not committed (Spark would refuse it too;
skipping it would write its output twice), and one a job runs on (the checkpoint's lock,
:meth:`enrich.checkpoint.CheckpointLayout.held`; Spark does not check this). A rescale that failed
half way is finished by running it again with the same number (Spark retries its batch; another
number is refused, and so is the job's start, :func:`enrich.state.stream.prepare`).

The job's own records: the device counts (``devices.json``) are per bucket, and the buckets' grouping
keys never change (:mod:`enrich.state.layout`), so they stay; the new batch gets the dimension
positions of the batch it copies (``dimensions/<n + 1>.json``: ``enrich status`` and ``enrich
lookup`` read the last committed batch's), and the state record its new number of state partitions.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import SparkSession

from enrich.checkpoint import CheckpointBusy, CheckpointLayout
from enrich.config import EnrichConfig
from enrich.dimension.versions import FileVersionLog
from enrich.ops import stateread
from enrich.state.layout import BucketLayout
from enrich.state.record import bucket_layout, read_record, record_partitions
from refstream.errors import ConfigError, DataError, TerminalError

log = logging.getLogger(__name__)


class RescaleRefused(TerminalError):
    """The checkpoint cannot be rescaled as it is; nothing was changed. The message says what to do."""


@dataclass(frozen=True, kw_only=True)
class RescaleResult:
    checkpoint: str
    before: int                         # state partitions before
    after: int                          # and after
    batch_id: int | None                # the rescale's batch (None: the checkpoint had ``after`` already)
    seconds: float | None               # Spark's repartition, session start left out
    spread: list[int]                   # buckets per state partition, after
    devices: list[int] | None = None    # devices per state partition, after (None: no device count recorded)
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The result as lines for a person."""
        buckets = sum(self.spread)
        spread = (f"{self.spread[0]} bucket(s) in each" if min(self.spread) == max(self.spread)
                  else f"{min(self.spread)} to {max(self.spread)} buckets in each")
        devices = ("" if self.devices is None else
                   f"; {sum(self.devices):,} device(s), {min(self.devices):,} to {max(self.devices):,} in each")
        if self.batch_id is None:
            return [f"{self.checkpoint}: the state is in {self.after} state partitions already ({buckets} buckets, "
                    f"{spread}{devices}): nothing to do"]
        return [f"{self.checkpoint}: rescaled from {self.before} to {self.after} state partitions in "
                f"{self.seconds:.1f}s (batch {self.batch_id}, which reads no input; {buckets} buckets, "
                f"{spread}{devices})"]

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "before": self.before, "after": self.after, "batch_id": self.batch_id,
                "seconds": self.seconds, "spread": self.spread, "devices": self.devices, "warnings": self.warnings}


def rescale(cfg: EnrichConfig, partitions: int, *, spark: SparkSession | None = None,
            master: str | None = "local[*]") -> RescaleResult:
    """Move the device state of ``cfg``'s checkpoint to ``partitions`` state partitions (see the
    module doc). Checks first, without Spark: a :class:`RescaleRefused` saying what to do when the
    job runs, the last batch is not committed, or nothing was committed yet. ``spark``: the session
    to run in (default: the active one, else a new one on ``master``, with the config's ``spark:``
    settings)."""
    if partitions < 1:
        raise ConfigError(f"--partitions {partitions}: the number of state partitions must be positive")
    if cfg.state is None:
        raise ConfigError(f"{cfg.source}: no state: section; only a job's device state is rescaled")
    ck = CheckpointLayout(cfg.checkpoint)
    if not ck.state_record.exists():
        raise RescaleRefused(f"{ck.root}: the job has not run with state: on this checkpoint; its first run "
                             "takes the number of state partitions from spark.sql.shuffle.partitions")
    layout = bucket_layout(read_record(ck.state_record), ck.state_record)
    try:
        with ck.held(exclusive=True):
            before = _check(ck, partitions)
            if before == partitions:
                _record(ck, partitions)
                return _result(ck, layout, before, partitions, None, None)
            spark = spark or SparkSession.getActiveSession() or session(cfg, master)
            location = str(ck.spark.resolve())
            log.info("%s: rescaling the state from %d to %d state partitions", ck.root, before, partitions)
            t0 = time.monotonic()
            spark._streamingCheckpointManager.repartition(location, partitions, enforce_exactly_once_sink=True)
            seconds = time.monotonic() - t0
            committed = ck.committed()
            if not committed or ck.recorded_partitions(committed[-1]) != partitions:
                raise DataError(f"{ck.root}: Spark's repartition returned, but its last committed batch does not "
                                f"record {partitions} state partitions")
            _record(ck, partitions)
            return _result(ck, layout, before, partitions, committed[-1], seconds)
    except CheckpointBusy as exc:
        raise RescaleRefused(str(exc)) from None


def _check(ck: CheckpointLayout, partitions: int) -> int:
    """The checkpoint's number of state partitions now, once it is fit to rescale to ``partitions``."""
    planned, committed = ck.planned(), ck.committed()
    root = ck.root
    pending = ck.unfinished_rescale()
    if pending is not None:
        if pending != partitions:
            raise RescaleRefused(f"{root}: a rescale to {pending} state partitions did not finish (batch "
                                 f"{planned[-1]}); run enrich rescale --partitions {pending} first, then rescale "
                                 "again")
        before = ck.recorded_partitions(planned[-1] - 1)
        assert before is not None  # unfinished_rescale read it
        return before
    if planned and (not committed or committed[-1] < planned[-1]):
        raise RescaleRefused(f"{root}: batch {planned[-1]} was planned and not committed ({ck.offsets / str(planned[-1])} "
                             f"without {ck.commits / str(planned[-1])}): start the job to finish it (enrich run "
                             "--available-now), then rescale")
    if not committed:
        raise RescaleRefused(f"{root}: no batch has been committed yet; the first batch takes the number of state "
                             "partitions from spark.sql.shuffle.partitions in the config's spark: section")
    now = ck.recorded_partitions(committed[-1])
    if now is None:
        raise RescaleRefused(f"{ck.offsets / str(committed[-1])}: records no spark.sql.shuffle.partitions; this "
                             "checkpoint cannot be rescaled")
    return now


def _record(ck: CheckpointLayout, partitions: int) -> None:
    """The job's records after Spark committed the rescale's batch (again, when a rescale stopped
    between the two): its dimension positions, those of the batch before it, and the number."""
    committed = ck.committed()
    versions = FileVersionLog(ck.dimensions, create=False)
    last = committed[-1]
    if versions.get(last) is None and last > 0:
        previous = versions.get(last - 1)
        if previous is not None:
            versions.put(last, previous, versions.info(last - 1))
    record_partitions(ck, partitions)


def _result(ck: CheckpointLayout, layout: BucketLayout, before: int, after: int, batch_id: int | None,
            seconds: float | None) -> RescaleResult:
    where = layout.partitions(after).tolist()
    spread = layout.spread(after)
    devices = _devices(ck, layout, where, after)
    warnings = []
    if after > layout.buckets:
        warnings.append(f"{after} state partitions for {layout.buckets} buckets: {after - layout.buckets} of them hold "
                        "no bucket and idle")
    elif max(spread) - min(spread) > 1:
        divisors = ", ".join(str(n) for n in range(1, layout.buckets + 1) if layout.buckets % n == 0)
        warnings.append(f"{layout.buckets} buckets fall {min(spread)} to {max(spread)} per state partition over "
                        f"{after}: the partition with the most holds up every batch; a number that divides "
                        f"{layout.buckets} ({divisors}) spreads them evenly")
    return RescaleResult(checkpoint=str(ck.root), before=before, after=after, batch_id=batch_id, seconds=seconds,
                         spread=spread, devices=devices, warnings=warnings)


def _devices(ck: CheckpointLayout, layout: BucketLayout, where: list[int], partitions: int) -> list[int] | None:
    """Devices per state partition, from the job's count per bucket (None when it has none)."""
    try:
        kept = json.loads(ck.devices.read_text(encoding="utf-8"))["buckets"]
        per_bucket = {int(g): int(n) for g, n in kept.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    out = [0] * partitions
    for g, p in zip(layout.ids, where, strict=True):
        out[p] += per_bucket.get(g, 0)
    return out


def session(cfg: EnrichConfig, master: str | None) -> SparkSession:
    """A Spark session for the rescale: the config's ``spark:`` settings (storage, memory), the job's
    state store."""
    return stateread.session(cfg, master, "refstream-rescale")
