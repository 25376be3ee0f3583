"""enrich.ipc: tables as Arrow IPC bytes, compressed or not, read back alike (pure logic)."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
import pytest

from enrich.ipc import from_ipc, to_ipc


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_a_table_comes_back_as_written_compressed_or_not(compression: Literal["lz4", "zstd"] | None) -> None:
    rows = 2_000
    table = pa.table({"device_id": [f"d-{i % 50}" for i in range(rows)],
                      "_topic": ["events"] * rows,
                      "n": pa.array(range(rows), pa.int64()),
                      "v": pa.array([None if i % 7 == 0 else i / 3 for i in range(rows)], pa.float64()),
                      "s": pa.array([{"a": i, "b": "x"} for i in range(rows)])})
    data = to_ipc(table, compression)
    assert from_ipc(data).equals(table)
    assert from_ipc(to_ipc(table.slice(10, 5), compression)).equals(table.slice(10, 5))
    if compression is not None:  # the kept chunks' case: repetitive columns take less room
        assert len(data) < 0.75 * len(to_ipc(table))
