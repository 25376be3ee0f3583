"""How many devices the state store holds, for ``refstream_enrich_devices_in_state``, without a pass
over the state or per-event work on the driver.

Every call of the stateful processor reports its bucket's device count (after the call) to a Spark
accumulator of :class:`~enrich.accumulators.KeyedCounts` (by bucket); after each micro-batch the driver
merges those into its count per bucket and keeps them in ``CheckpointLayout.devices``
(written before Spark commits the batch), the base a restarted job starts from: buckets the batches
since the restart have not touched keep the count recorded there.

Exact across task retries and recomputations: a bucket's count is absolute, not a difference, and
every attempt at it within a batch computes the same one (same state version, same input); Spark
merges the updates of successful task attempts only. A batch replayed after a crash reports the same
counts again. A checkpoint that has committed batches but lost this record (restored in part) has an
unknown count: the gauge is not set.
"""

from __future__ import annotations

import json
import logging

from pyspark import SparkContext
from pyspark.accumulators import Accumulator

from enrich.accumulators import KeyedCounts
from enrich.checkpoint import CheckpointLayout
from refstream.atomic import write_json_atomic

log = logging.getLogger(__name__)


class DeviceCount:
    """The driver's side: the accumulator the step reports to, and the count per bucket."""

    def __init__(self, sc: SparkContext, checkpoint: CheckpointLayout) -> None:
        self.accumulator: Accumulator[dict[int, int]] = sc.accumulator({}, KeyedCounts())
        self.path = checkpoint.devices
        self.buckets: dict[int, int] | None = self._load(checkpoint)

    def _load(self, checkpoint: CheckpointLayout) -> dict[int, int] | None:
        if self.path.exists():
            try:
                kept = json.loads(self.path.read_text(encoding="utf-8"))
                return {int(b): int(n) for b, n in kept["buckets"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("%s: unreadable (%s); the number of devices in state is not reported", self.path, exc)
                return None
        if checkpoint.committed_any():
            log.warning("%s: the checkpoint's device state was written without a count of its devices; the "
                        "number of devices in state is not reported", checkpoint.root)
            return None
        return {}  # a new checkpoint: no state yet

    @property
    def total(self) -> int | None:
        """Devices in the state store after the last batch; None when unknown."""
        return None if self.buckets is None else sum(self.buckets.values())

    def before_batch(self) -> None:
        self.accumulator.value = {}

    def after_batch(self, batch_id: int) -> int | None:
        """Merge what the batch's calls reported, record it, and return :attr:`total`."""
        seen = dict(self.accumulator.value)
        if self.buckets is not None and seen:
            self.buckets.update(seen)
            write_json_atomic(self.path, {"batch_id": batch_id,
                                          "buckets": {str(b): n for b, n in sorted(self.buckets.items())}})
        return self.total
