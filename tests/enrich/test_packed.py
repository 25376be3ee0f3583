"""Packing events for the trip through the stateful operator, and back (pure Arrow, no JVM)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from enrich import packed
from enrich.ipc import from_ipc, to_ipc

SCHEMA = pa.schema([(packed.BUCKET, pa.int32()), (packed.MAX_TS, pa.timestamp("us", tz="UTC")),
                    (packed.ROWS, pa.binary())])


def events(buckets: list[int], ts: list[int | None]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"device": [f"d{i}" for i in range(len(buckets))],
                                       "_ts_us": pa.array(ts, pa.int64()),
                                       "_bucket": pa.array(buckets, pa.int32())})


def test_one_row_per_bucket_keeps_each_buckets_order_and_greatest_time() -> None:
    out = list(packed.pack([events([2, 0, 2, 1, 0], [5, 9, 7, None, 1]),
                            events([], [])], bucket="_bucket", timestamp="_ts_us", packed_schema=SCHEMA))
    assert len(out) == 1 and out[0].schema == SCHEMA
    rows = out[0].to_pylist()
    assert [r[packed.BUCKET] for r in rows] == [0, 1, 2]
    assert [r[packed.MAX_TS] and int(r[packed.MAX_TS].timestamp() * 10**6) for r in rows] == [9, None, 7]
    inner = [from_ipc(r[packed.ROWS]) for r in rows]
    assert [t.column("device").to_pylist() for t in inner] == [["d1", "d4"], ["d3"], ["d0", "d2"]]
    assert all("_bucket" not in t.column_names for t in inner)


def test_a_big_bucket_is_split_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "CHUNK_ROWS", 2)
    out = next(packed.pack([events([4] * 5, [1, 2, 3, 4, 5])], bucket="_bucket", timestamp="_ts_us",
                           packed_schema=SCHEMA))
    sizes = [from_ipc(v).num_rows for v in out.column(packed.ROWS).to_pylist()]
    assert sizes == [2, 2, 1] and out.column(packed.BUCKET).to_pylist() == [4, 4, 4]
    back = packed.pack_output(pa.table({"x": list(range(5))}))
    assert [from_ipc(v).column("x").to_pylist() for v in back[packed.ROWS]] == [[0, 1], [2, 3], [4]]


def test_unpack_gives_the_declared_schema() -> None:
    table = pa.table({"x": pa.array([1, None], pa.int64()), "t": pa.array([1, 2], pa.timestamp("us"))})
    want = pa.schema([("x", pa.int64()), ("t", pa.timestamp("us", tz="UTC"))])
    batch = pa.RecordBatch.from_pydict({packed.ROWS: [to_ipc(table), to_ipc(table.slice(0, 0))]})
    out = list(packed.unpack([batch], want))
    assert len(out) == 1 and out[0].schema == want and out[0].column("x").to_pylist() == [1, None]


def test_kinds_travel_with_their_rows() -> None:
    import pandas as pd

    ev = list(packed.pack([events([1, 1], [3, 4])], bucket="_bucket", timestamp="_ts_us", packed_schema=SCHEMA))
    changes = pa.RecordBatch.from_pydict({"key": [b"k1", b"k2", b"k3"], "_bucket": pa.array([1, 1, 1], pa.int32())})
    ch = list(packed.pack([changes], bucket="_bucket", timestamp=None, packed_schema=SCHEMA, kind="dim0"))
    assert ch[0].column(packed.MAX_TS).to_pylist() == [None]
    # As the processor gets them: pandas frames, the packed values last; kinds interleaved.
    frames = [pd.DataFrame({"v": ch[0].column(packed.ROWS).to_pylist() + ev[0].column(packed.ROWS).to_pylist()}),
              pd.DataFrame({"v": ch[0].column(packed.ROWS).to_pylist()})]
    kinds = packed.unpack_kinds(frames)
    assert sorted(kinds) == ["dim0", packed.EVENTS]
    assert kinds[packed.EVENTS].column("device").to_pylist() == ["d0", "d1"]
    assert kinds["dim0"].column("key").to_pylist() == [b"k1", b"k2", b"k3"] * 2
    assert kinds["dim0"].schema.metadata is None
