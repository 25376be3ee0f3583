"""Console output for trying the job out: shows the first rows of every micro-batch."""

from __future__ import annotations

import pyarrow as pa

from enrich.sinks.abc import EnrichedBatch


class ConsoleSink:
    writes_dead_letters = False
    reparses = False  # writes through Spark: events are parsed by from_json
    pending: tuple[int, ...] = ()

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
