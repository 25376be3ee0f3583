"""File watching: debounce, temp-file-then-rename, slow writers, globs, reads that must not trigger."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from refresh.watch import FileWatcher, quiet_for, split_pattern
from tests.timing import bound

DEBOUNCE = 0.4


class Recorder:
    """Collects callbacks with the target's size at callback time (to prove the write had settled)."""

    def __init__(self, target: Path | None = None) -> None:
        self.calls: list[tuple[str, float, int]] = []
        self.target = target
        self._event = threading.Condition()

    def __call__(self, name: str) -> None:
        size = self.target.stat().st_size if self.target and self.target.exists() else -1
        with self._event:
            self.calls.append((name, time.monotonic(), size))
            self._event.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[tuple[str, float, int]]:
        with self._event:
            self._event.wait_for(lambda: len(self.calls) >= n, bound(timeout))
            return list(self.calls)


@pytest.fixture
def watched(tmp_path: Path):
    started: list[FileWatcher] = []

    def make(pattern: str | Path, target: Path | None = None, name: str = "ds") -> Recorder:
        rec = Recorder(target)
        w = FileWatcher(rec, debounce=DEBOUNCE)
        w.add(name, pattern)
        started.append(w.start())
        return rec

    yield make
    for w in started:
        w.stop()


def settle() -> None:
    """Longer than a debounce window: anything that was going to fire has fired."""
    time.sleep(DEBOUNCE * 4)


def test_split_pattern() -> None:
    assert split_pattern("/d/sites.csv") == (Path("/d"), False)
    assert split_pattern("/d/sites-*.csv") == (Path("/d"), False)
    assert split_pattern("/d/*/part.parquet") == (Path("/d"), True)
    assert split_pattern("/d/x/**/p-*.parquet") == (Path("/d/x"), True)


def test_edit_triggers_once_after_debounce(tmp_path: Path, watched) -> None:
    f = tmp_path / "sites.csv"
    f.write_text("site_id,name\n1,a\n")
    rec = watched(f)
    settle()
    assert rec.calls == []  # starting to watch is not a change
    t0 = time.monotonic()
    for i in range(5):  # a burst of writes: one refresh
        with f.open("a") as fh:
            fh.write(f"{i + 2},b\n")
        time.sleep(0.05)
    calls = rec.wait(1)
    settle()
    assert len(rec.calls) == 1, rec.calls
    assert calls[0][0] == "ds"
    assert calls[0][1] - t0 >= DEBOUNCE


def test_write_temp_then_rename(tmp_path: Path, watched) -> None:
    f = tmp_path / "sites.csv"
    f.write_text("site_id\n1\n")
    rec = watched(f, target=f)
    settle()
    tmp = tmp_path / ".sites.csv.swp"
    tmp.write_text("site_id\n1\n2\n3\n")
    time.sleep(DEBOUNCE * 2)
    assert rec.calls == []  # the editor's temp file is not the dataset
    os.replace(tmp, f)
    calls = rec.wait(1)
    assert len(calls) == 1 and calls[0][2] == len("site_id\n1\n2\n3\n")


def test_slowly_written_file_fires_after_the_writer_stops(tmp_path: Path, watched) -> None:
    """Written in place over ~2 s with pauses shorter than the debounce: one call, after the last
    write, with the whole file. A loaded machine can stretch a pause past the debounce; the watcher
    then rightly fires in it, so an earlier call is checked for that instead: a whole debounce after
    the last write before it, with the size written by then."""
    f = tmp_path / "big.csv"
    rec = watched(f, target=f)
    chunks = 8
    writes: list[tuple[float, int]] = []   # (when, size after) of each write
    with f.open("w") as fh:  # created in place
        for i in range(chunks):
            fh.write(f"{i},{'x' * 100}\n")
            fh.flush()
            writes.append((time.monotonic(), fh.tell()))
            time.sleep(DEBOUNCE * 0.5)
        final = fh.tell()
        done = time.monotonic()
    rec.wait(1)
    settle()
    *early, (_, at, size) = rec.calls
    assert size == final  # never fired on a half-written file
    assert at >= done
    for _, when, got in early:
        last_at, last_size = max((w for w in writes if w[0] <= when), default=(float("-inf"), -1))
        assert when - last_at >= DEBOUNCE * 0.9 and got == last_size, (rec.calls, writes)
    long_pauses = sum(b[0] - a[0] >= DEBOUNCE for a, b in zip(writes, writes[1:], strict=False))
    assert len(early) <= long_pauses, (rec.calls, writes)


def test_a_write_whose_event_is_handled_late_still_holds_the_call_back(tmp_path: Path, watched,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer's thread stalls for longer than the debounce (a loaded machine) while the writer
    goes on: at the deadline, the file's modification time shows a write the watcher has no event of
    yet, and the call waits for a debounce after it. One call, with the whole file."""
    handle, seen = FileWatcher._event, []

    def stalled(self: FileWatcher, event: object) -> None:
        seen.append(event)
        if len(seen) == 4:
            time.sleep(DEBOUNCE * 2.5)
        handle(self, event)  # type: ignore[arg-type]

    monkeypatch.setattr(FileWatcher, "_event", stalled)
    f = tmp_path / "big.csv"
    rec = watched(f, target=f)
    with f.open("w") as fh:
        for i in range(8):
            fh.write(f"{i},{'x' * 100}\n")
            fh.flush()
            time.sleep(DEBOUNCE * 0.5)
        final = fh.tell()
    rec.wait(1)
    settle()
    assert len(seen) > 4, seen
    assert [size for _, _, size in rec.calls] == [final], rec.calls


def test_quiet_for_is_the_time_since_the_newest_write_and_ignores_future_times() -> None:
    second = 1_000_000_000
    files = (("a", 1, 10, 5 * second), ("b", 2, 10, 8 * second))
    assert quiet_for(files, 10 * second) == 2.0
    assert quiet_for(files + (("c", 3, 1, 60 * second),), 10 * second) == 2.0   # a clock ahead: not recent
    assert quiet_for((), 10 * second) == float("inf")


def test_reading_or_touching_nothing_does_not_trigger(tmp_path: Path, watched) -> None:
    f = tmp_path / "sites.csv"
    f.write_text("site_id\n1\n")
    rec = watched(f)
    for _ in range(3):
        f.read_text()  # the refresher reading its source
        time.sleep(0.05)
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))  # attrib event, same stat
    settle()
    assert rec.calls == []


def test_glob_new_matching_file_triggers_others_do_not(tmp_path: Path, watched) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    (d / "p-1.csv").write_text("id\n1\n")
    rec = watched(d / "p-*.csv")
    (d / "notes.txt").write_text("x")
    (d / "q-1.csv").write_text("id\n9\n")
    settle()
    assert rec.calls == []
    (d / "p-2.csv").write_text("id\n2\n")
    assert len(rec.wait(1)) == 1
    (d / "p-1.csv").unlink()  # a part removed is a change too
    assert len(rec.wait(2)) == 2


@pytest.mark.integration  # the OS file watcher on wall-clock debounce windows: seconds
def test_recursive_glob_and_two_datasets(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    (root / "a").mkdir(parents=True)
    rec = Recorder()
    w = FileWatcher(rec, debounce=DEBOUNCE)
    w.add("lake", root / "*" / "part-*.csv")
    w.add("sites", tmp_path / "sites.csv")
    with w:
        (root / "a" / "part-0.csv").write_text("id\n1\n")
        assert [c[0] for c in rec.wait(1)] == ["lake"]
        (tmp_path / "sites.csv").write_text("site_id\n1\n")
        rec.wait(2)
        settle()
    assert sorted(c[0] for c in rec.calls) == ["lake", "sites"]


def test_file_removed_then_recreated(tmp_path: Path, watched) -> None:
    """A vanished file is not reported (the source would read as missing); its return is."""
    f = tmp_path / "sites.csv"
    f.write_text("site_id\n1\n")
    rec = watched(f, target=f)
    f.unlink()
    settle()
    assert rec.calls == []
    f.write_text("site_id\n1\n2\n")
    calls = rec.wait(1)
    assert len(calls) == 1 and calls[0][2] == len("site_id\n1\n2\n")


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    w = FileWatcher(lambda _n: None, debounce=DEBOUNCE)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        w.add("ds", tmp_path / "nope" / "x.csv")
