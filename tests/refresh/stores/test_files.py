"""The file state store: atomic commits, snapshot files, locks across threads and processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from refresh.errors import DatasetBusy, Stopped
from refresh.stores.abc import (
    VALID_FROM_COLUMN,
    CommittedState,
    DatasetStatus,
    RunRecord,
    RunResult,
    TableSnapshot,
    with_valid_from,
)
from refresh.stores.files import FileStateStore
from refstream.contract import TIME_TYPE, DatasetSchema
from refstream.errors import TerminalError
from tests.timing import bound


def test_commit_round_trip_and_old_snapshots_removed(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    assert store.load("d") == CommittedState()
    schema = DatasetSchema.from_arrow("d", ["id"], pa.schema([("id", pa.int64())]), 1)
    s1 = store.commit("d", CommittedState(version=1, schema=schema, rows=2, watermark="2024-01-01T00:00:00",
                                          watermark_type="timestamp"), pa.table({"id": [1, 2]}))
    assert s1.snapshot == "snapshot-0000000001.arrow"
    loaded = store.load("d")
    assert loaded == s1 and store.load_snapshot("d", loaded).column("id").to_pylist() == [1, 2]
    assert loaded.offsets is None
    # The topic and its end offsets after the publish (partition numbers are JSON object keys).
    with_offsets = store.commit("d", CommittedState(version=1, schema=schema, snapshot=s1.snapshot, rows=2,
                                                    topic="ref.d", offsets={0: 7, 1: 3}), None)
    assert store.load("d") == with_offsets and store.load("d").offsets == {0: 7, 1: 3}
    # A commit without a new snapshot keeps pointing at the last one.
    s2 = store.commit("d", CommittedState(version=2, schema=schema, snapshot=s1.snapshot, rows=2), None)
    assert s2.snapshot == s1.snapshot and (tmp_path / "d" / s1.snapshot).exists()
    s3 = store.commit("d", CommittedState(version=3, schema=schema, rows=1), pa.table({"id": [3]}))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["snapshot-0000000003.arrow", "state.json"]
    assert store.load_snapshot("d", s3).column("id").to_pylist() == [3]


# status.json as earlier releases wrote it (a failed run after a successful one).
_RUN = {"dataset": "d", "ok": True, "version": 2, "rows": 5, "inserts": 1, "updates": 2, "deletes": 0,
        "published": 3, "seconds": 0.25, "error": None, "kind": "incremental", "watermark": "2024-01-01T00:00:00",
        "schema_changed": False, "phases": {"load": 0.01, "read": 0.2}, "interrupted": False,
        "started": "2024-01-01T00:00:00+00:00", "finished": "2024-01-01T00:00:01+00:00"}
_STATUS = {"dataset": "d", "consecutive_failures": 1, "last_success": _RUN,
           "last_run": {**_RUN, "ok": False, "error": "database down", "published": 0, "phases": {}}}


def test_status_reads_and_writes_the_same_json(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    assert store.read_status("d") == DatasetStatus(dataset="d")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "status.json").write_text(json.dumps(_STATUS))
    st = store.read_status("d")
    assert st.last_run is not None and st.last_run.result.outcome == "failed" and st.consecutive_failures == 1
    store.write_status("d", st)
    # Read back the same, with the fields later releases added at their defaults.
    newer = {"refused": False, "reason": None, "complete_as_of": None}
    assert json.loads((tmp_path / "d" / "status.json").read_text()) == {
        **_STATUS, "last_success": {**_RUN, **newer}, "last_run": {**_STATUS["last_run"], **newer}}
    # A success resets the failures; an interrupted or refused run keeps them and is not one more.
    ok = RunRecord(started="s", finished="f", result=RunResult(
        dataset="d", ok=True, version=3, rows=1, inserts=0, updates=0, deletes=0, published=0, seconds=0.1))
    stopped = RunRecord(started="s", finished="f", result=RunResult(
        dataset="d", ok=False, version=2, rows=0, inserts=0, updates=0, deletes=0, published=0, seconds=0.1,
        interrupted=True))
    assert (st.after(ok).consecutive_failures, st.after(ok).last_success) == (0, ok)
    assert (st.after(stopped).consecutive_failures, st.after(stopped).last_success) == (1, st.last_success)
    refused = RunRecord(started="s", finished="f", result=RunResult(
        dataset="d", ok=False, version=2, rows=0, inserts=0, updates=0, deletes=0, published=0, seconds=0.1,
        error="dataset d: would delete 5 of 10 rows", refused=True))
    assert refused.result.outcome == "refused"
    assert (st.after(refused).consecutive_failures, st.after(refused).last_run) == (1, refused)
    (tmp_path / "d" / "status.json").write_text('{"last_run": {"ok": true}}')
    assert store.read_status("d") == DatasetStatus(dataset="d")  # unreadable: as if it never ran


def test_a_failed_commit_leaves_the_previous_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStateStore(tmp_path)
    store.commit("d", CommittedState(version=1, rows=1), pa.table({"id": [1]}))
    import refresh.stores.files as files

    def broken(table, where, stop=None):
        where.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(files, "write_snapshot", broken)
    with pytest.raises(OSError, match="disk full"):
        store.commit("d", CommittedState(version=2, rows=5), pa.table({"id": [1, 2, 3, 4, 5]}))
    # The same failure in a snapshot staged ahead of its commit: the commit raises it.
    staged = store.stage_snapshot("d", 2, pa.table({"id": [1, 2, 3, 4, 5]}))
    with pytest.raises(OSError, match="disk full"):
        store.commit("d", CommittedState(version=2, rows=5), staged)
    staged.discard()
    state = store.load("d")
    assert state.version == 1 and store.load_snapshot("d", state).num_rows == 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["snapshot-0000000001.arrow", "state.json"]


def test_a_staged_snapshot_is_invisible_until_committed_and_gone_when_discarded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import refresh.stores.files as files

    monkeypatch.setattr(files, "ROW_GROUP", 1000)  # many row groups: a discard stops between them
    store = FileStateStore(tmp_path)
    store.commit("d", CommittedState(version=1, rows=1), pa.table({"id": [1]}))
    big = pa.table({"id": pa.array(range(200_000)), "v": pa.array([f"v{i}" for i in range(200_000)])})
    dropped = store.stage_snapshot("d", 2, big)
    dropped.discard()
    dropped.discard()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["snapshot-0000000001.arrow", "state.json"]
    assert store.load("d").version == 1

    staged = store.stage_snapshot("d", 2, big)
    assert store.load("d").snapshot == "snapshot-0000000001.arrow"  # written or not, not committed
    state = store.commit("d", CommittedState(version=2, rows=big.num_rows), staged)
    staged.discard()  # after the commit: a no-op
    assert state.snapshot == "snapshot-0000000002.arrow"
    assert store.load_snapshot("d", store.load("d")).equals(big)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["snapshot-0000000002.arrow", "state.json"]
    # A snapshot staged for one version is not committed as another's.
    other = store.stage_snapshot("d", 4, big)
    with pytest.raises(ValueError, match="is not version 3's"):
        store.commit("d", CommittedState(version=3, rows=1), other)
    other.discard()
    assert store.load("d").version == 2


def test_lock_excludes_threads_and_waits_or_refuses(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    order: list[str] = []
    with store.lock("d"):
        with pytest.raises(DatasetBusy):
            with store.lock("d", wait=False):
                pass
        stop = threading.Event()
        stop.set()
        with pytest.raises(Stopped):
            with store.lock("d", stop=stop):
                pass

        def second() -> None:
            with store.lock("d"):
                order.append("second")

        th = threading.Thread(target=second)
        th.start()
        time.sleep(0.3)
        order.append("first done")
    th.join(10)
    assert order == ["first done", "second"]
    with store.lock("other", wait=False):  # datasets are independent
        with store.lock("d", wait=False):
            pass


def test_lock_excludes_other_processes(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    code = ("import sys, time; from refresh.stores.files import FileStateStore\n"
            f"s = FileStateStore({str(tmp_path)!r})\n"
            "with s.lock('d'):\n    print('locked', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[3])
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(DatasetBusy):
            with store.lock("d", wait=False):
                pass
    finally:
        proc.kill()
        proc.wait()
    with store.lock("d", wait=False):  # the lock died with its process
        pass


def test_an_empty_snapshot_and_a_snapshot_in_another_format(tmp_path: Path) -> None:
    """Snapshots are Arrow IPC files, the only format: a state pointing at another file (Parquet, say)
    fails naming the dataset and the file."""
    import pyarrow.parquet as pq

    store = FileStateStore(tmp_path)
    schema = DatasetSchema.from_arrow("d", ["id"], pa.schema([("id", pa.int64())]), 1)
    s1 = store.commit("d", CommittedState(version=1, schema=schema, rows=2), pa.table({"id": [1, 2]}))
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "d" / "snapshot-0000000001.parquet")
    state = json.loads((tmp_path / "d" / "state.json").read_text())
    (tmp_path / "d" / "state.json").write_text(json.dumps({**state, "snapshot": "snapshot-0000000001.parquet"}))
    for read in (store.load_snapshot, store.open_snapshot):
        with pytest.raises(TerminalError, match="dataset d: snapshot .*snapshot-0000000001.parquet is unreadable"):
            read("d", store.load("d"))
    assert store.load_snapshot("d", s1).column("id").to_pylist() == [1, 2]
    # An empty snapshot (every row deleted) is a file with the schema and no batch.
    s3 = store.commit("d", CommittedState(version=3, schema=schema, rows=0), pa.table({"id": pa.array([], pa.int64())}))
    empty = store.open_snapshot("d", s3)
    assert empty.num_rows == 0 and empty.read().num_rows == 0 and empty.schema.names == ["id"]


def test_a_snapshot_keeps_each_rows_valid_from_beside_its_columns(tmp_path: Path) -> None:
    """The diff sees the rows' own columns; the valid-from times come apart (None for a snapshot
    written before they were kept), read lazily or from a prefetch alike."""
    store = FileStateStore(tmp_path)
    rows = pa.table({"id": [1, 2], "v": ["a", "b"]})
    times = pa.array([datetime(2024, 5, 1, tzinfo=UTC), datetime(2024, 5, 2, tzinfo=UTC)], TIME_TYPE)
    state = store.commit("d", CommittedState(version=1, rows=2), with_valid_from(rows, times))
    assert store.load_snapshot("d", state).column_names == ["id", "v", VALID_FROM_COLUMN]  # as stored
    for prefetch in (False, True):
        snap = store.open_snapshot("d", state)
        assert snap is not None
        if prefetch:
            assert snap.prefetch(1 << 30)
        assert snap.schema == rows.schema and snap.read().equals(rows) and snap.select(["v"]).equals(rows.select(["v"]))
        assert snap.valid_from().to_pylist() == times.to_pylist()
    legacy = store.commit("d", CommittedState(version=2, rows=2), rows)
    snap = store.open_snapshot("d", legacy)
    assert snap is not None and snap.valid_from() is None and snap.read().equals(rows)
    # In memory (a store without lazy reads) the same.
    held = TableSnapshot(with_valid_from(rows, times))
    assert held.schema == rows.schema and held.read().equals(rows) and held.valid_from().to_pylist() == times.to_pylist()


def test_a_staged_snapshot_waits_for_its_valid_from_times_and_a_discard_does_not(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    rows = pa.table({"id": [1, 2]})
    times = pa.array([datetime(2024, 5, 1, tzinfo=UTC)] * 2, TIME_TYPE)
    pending: Future[pa.Array] = Future()
    staged = store.stage_snapshot("d", 1, rows, pending)
    time.sleep(0.2)
    assert not (tmp_path / "d" / "snapshot-0000000001.arrow").exists()  # waiting for the times
    pending.set_result(times)
    state = store.commit("d", CommittedState(version=1, rows=2), staged)
    assert store.load_snapshot("d", state).equals(with_valid_from(rows, times))
    # A run that ends before its diff knew the times: the waiting write gives up at once.
    dropped = store.stage_snapshot("d", 2, rows, Future())
    started = time.monotonic()
    dropped.discard()
    assert time.monotonic() - started < bound(5)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["snapshot-0000000001.arrow", "state.json"]
