"""The diff's shortcuts for tables in key order: the binary-search match of ascending integer keys and
the duplicate check by order give the same results as the hash join and the group-by."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from refresh import diff as D
from refresh.errors import DuplicateKey
from refresh.stores.files import _IPC_WRITE, open_snapshot_file


def _sorted(cs: D.ChangeSet) -> tuple[list[str], list[str], int, int]:
    # repr: NaN equals NaN there
    return ([repr(r) for r in cs.upserts.sort_by("id").to_pylist()],
            [repr(r) for r in cs.deletes.sort_by("id").to_pylist()], cs.inserts, cs.updates)


def test_merge_match_equals_hash_join(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    calls: list[int] = []
    real = D._merge_match

    def counted(old_keys: np.ndarray, new_keys: np.ndarray) -> tuple[pa.Array, ...]:
        calls.append(1)
        return real(old_keys, new_keys)

    for _ in range(300):
        old_ids = np.unique(rng.integers(-20, 60, int(rng.integers(1, 50))))
        new_ids = np.unique(rng.integers(-20, 60, int(rng.integers(1, 50))))
        if rng.random() < 0.2:
            new_ids = new_ids[::-1].copy()  # not in key order: the hash join decides
        old = pa.table({"id": pa.array(old_ids, pa.int32()), "v": rng.integers(0, 3, len(old_ids))})
        new = pa.table({"id": pa.array(new_ids, pa.int32()), "v": rng.integers(0, 3, len(new_ids))})
        with monkeypatch.context() as m:
            m.setattr(D, "_merge_match", counted)
            fast = _sorted(D.diff("ds", old, new, ["id"]))
        with monkeypatch.context() as m:
            m.setattr(D, "_int_keys", lambda col: None)
            slow = _sorted(D.diff("ds", old, new, ["id"]))
        assert fast == slow
        ins = set(new_ids) - set(old_ids)
        assert fast[2] == len(ins) and len(fast[1]) == len(set(old_ids) - set(new_ids))
    assert 200 < len(calls) < 300  # both paths were taken


def test_duplicate_keys_found_whatever_the_order() -> None:
    D.check_keys("ds", pa.table({"id": [1, 2, 5, 9]}), ["id"])
    D.check_keys("ds", pa.table({"id": ["a", "b", "c"]}), ["id"])
    for ids in ([1, 2, 2, 3], [3, 1, 3], ["b", "a", "b"]):
        with pytest.raises(DuplicateKey, match="dataset ds: duplicate key"):
            D.check_keys("ds", pa.table({"id": ids}), ["id"])
    chunked = pa.Table.from_batches([pa.record_batch({"id": [1, 2]}), pa.record_batch({"id": [2, 3]})])
    with pytest.raises(DuplicateKey, match='duplicate key {"id":2}'):
        D.check_keys("ds", chunked, ["id"])


def test_snapshot_compared_one_part_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    old_ids = np.unique(rng.integers(0, 400, 300))
    old = pa.table({"id": old_ids, "v": rng.integers(0, 4, len(old_ids)),
                    "s": pa.array([None if i % 5 == 0 else f"s{i % 7}" for i in old_ids]),
                    "f": pa.array([float("nan") if i % 9 == 0 else i % 3 * 0.5 for i in old_ids])})
    new_ids = np.unique(rng.integers(0, 400, 300))
    new = pa.table({"id": new_ids, "v": rng.integers(0, 4, len(new_ids)),
                    "s": pa.array([None if i % 6 == 0 else f"s{i % 7}" for i in new_ids]),
                    "f": pa.array([float("nan") if i % 9 == 0 else i % 4 * 0.5 for i in new_ids])})
    new = pa.Table.from_batches(new.to_batches(max_chunksize=13))  # as read: many chunks
    with pa.ipc.new_file(str(tmp_path / "s.arrow"), old.schema, options=_IPC_WRITE) as w:
        w.write_table(old, max_chunksize=37)
    snap = open_snapshot_file(tmp_path / "s.arrow")
    read: list[int] = []
    real = snap.column_parts

    def parts(name: str) -> Iterator[tuple[int, pa.ChunkedArray]]:
        for start, part in real(name):
            read.append(len(part))
            yield start, part

    monkeypatch.setattr(snap, "column_parts", parts)
    lazy = _sorted(D.diff("ds", snap, new, ["id"]))
    assert max(read) == 37 and sum(read) == 3 * len(old_ids)  # every value column, part by part
    assert lazy == _sorted(D.diff("ds", old, new, ["id"]))  # the whole snapshot in memory
    assert lazy[3] > 0 and lazy[2] > 0 and lazy[1]


def test_take_rows_from_many_chunks_keeps_the_order() -> None:
    batches = [pa.record_batch({"id": list(range(i, i + 10)), "s": [f"v{j}" for j in range(i, i + 10)]})
               for i in range(0, 100, 10)]
    table = pa.Table.from_batches(batches)
    rows = pa.array([57, 3, 99, 3, 10, 0, 42])
    assert D.take_rows(table, rows).to_pylist() == table.combine_chunks().take(rows).to_pylist()
    assert D.take_rows(table, pa.array([], pa.int64())).num_rows == 0
    with pytest.raises(IndexError):
        D.take_rows(table, pa.array([100]))
