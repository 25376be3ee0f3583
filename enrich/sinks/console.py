"""Console output for trying the job out: shows the first rows of every micro-batch."""

from __future__ import annotations

import pyarrow as pa

from enrich.sinks.abc import Counted, EnrichedBatch


class ConsoleSink:
    writes_dead_letters = False
    counts: tuple[str, ...] = ()
    reparses = False  # writes through Spark: events are parsed by from_json
    pending: tuple[int, ...] = ()
    counted = Counted()  # it shows rows, it counts none

    def __init__(self, rows: int = 20) -> None:
        self.rows = rows

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        df = batch.df.persist()
        try:
            print(f"-------- batch {batch_id} --------", flush=True)
            batch.good().show(self.rows, truncate=False)
            return batch.dead_letters()
        finally:
            df.unpersist()

    def close(self) -> None:
        pass
