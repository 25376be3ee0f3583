"""File sources: formats, globs, and errors that name the file and line."""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refresh.config import FileSourceConfig
from refresh.errors import EmptySnapshot, FileNotStable
from refresh.sources.files import FileSource, stat_files
from refstream.errors import DataError
from tests.timing import bound


def src(path: Path | str, fmt: str, **kw) -> FileSource:
    # Files written a moment ago would be waited for (stable_for, 1s by default): the format tests
    # read at once; the stability tests below set it.
    kw.setdefault("stable_for", dt.timedelta(0))
    return FileSource("sites", FileSourceConfig(path=str(path), format=fmt, **kw))


def test_csv_with_types_unicode_and_quoted_newlines(tmp_path: Path) -> None:
    p = tmp_path / "sites.csv"
    p.write_text('site_id,name,lat,opened\n007,"Zürich ""HQ""",47.37,2024-05-01\n'
                 '008,"multi\nline",1.5,\n', encoding="utf-8")
    table = src(p, "csv", types=(("site_id", "string"),)).read()
    assert table.column("site_id").to_pylist() == ["007", "008"]
    assert table.column("name").to_pylist() == ['Zürich "HQ"', "multi\nline"]
    assert table.column("lat").type == pa.float64()
    assert table.column("opened").to_pylist() == [dt.date(2024, 5, 1), None]


def test_jsonl_and_parquet(tmp_path: Path) -> None:
    j = tmp_path / "a.jsonl"
    j.write_text('{"id": 1, "name": "a"}\n\n{"id": 2, "name": null}\n')
    assert src(j, "jsonl").read().to_pylist() == [{"id": 1, "name": "a"}, {"id": 2, "name": None}]
    pth = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1, 2], "b": [b"\x00", None]}), pth)
    assert src(pth, "parquet").read().column("b").to_pylist() == [b"\x00", None]


def test_glob_reads_many_files_as_one_dataset(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"part-{i}.csv").write_text(f"id,v\n{i},{i * 1.5}\n{i + 10},{i}\n")
    table = src(tmp_path / "part-*.csv", "csv", chunk_rows=2).read()
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2, 10, 11, 12]
    assert table.column("v").type == pa.float64()  # int in one file, float in others: promoted


def test_glob_with_one_empty_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id\n1\n")
    (tmp_path / "b.csv").write_text("")
    with pytest.raises(EmptySnapshot, match=r"b\.csv is empty \(one of 2 files"):
        src(tmp_path / "*.csv", "csv").read()


def test_glob_files_must_agree_on_columns(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,v\n1,2\n")
    (tmp_path / "b.csv").write_text("id,w\n1,2\n")
    with pytest.raises(DataError, match=r"b\.csv has columns \['id', 'w'\], but .*a\.csv has \['id', 'v'\]"):
        src(tmp_path / "*.csv", "csv").read()


def test_missing_file_and_no_match(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file .*nope.csv not found"):
        src(tmp_path / "nope.csv", "csv").read()
    with pytest.raises(DataError, match="no file matches .*x-\\*.csv"):
        src(tmp_path / "x-*.csv", "csv").read()


def test_empty_files_read_as_empty(tmp_path: Path) -> None:
    (tmp_path / "e.csv").write_text("")
    (tmp_path / "h.csv").write_text("id,name\n")
    (tmp_path / "e.jsonl").write_text("")
    assert src(tmp_path / "e.csv", "csv").read().num_rows == 0
    assert src(tmp_path / "h.csv", "csv").read().column_names == ["id", "name"]
    assert src(tmp_path / "e.jsonl", "jsonl").read().num_rows == 0


@pytest.mark.parametrize(("fmt", "text", "line", "what"), [
    ("csv", "id,name\n1,a\n2,b\n3\n4,d\n", 4, "expected 2 fields, got 1"),
    ("csv", "id,name\n1,a\n2,\"b\n", 3, "expected 2 fields|Unterminated|quote|CSV parse error"),
    ("jsonl", '{"id": 1}\n{"id": 2\n{"id": 3}\n', 2, "invalid JSON"),
    ("jsonl", '{"id": 1}\n[1, 2]\n', 2, "expected a JSON object"),
    ("jsonl", '{"id": 1, "v": 1}\n{"id": 2, "v": "x"}\n', 2, "field v is a string, but a int on line 1"),
])
def test_malformed_files_name_file_and_line(tmp_path: Path, fmt: str, text: str, line: int, what: str) -> None:
    p = tmp_path / f"bad.{fmt}"
    p.write_text(text)
    with pytest.raises(DataError, match=rf"dataset sites: {p}:{line}: ({what})"):
        src(p, fmt).read()


def test_truncated_parquet_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(1000))}), p)
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(DataError, match=rf"dataset sites: {p}: "):
        src(p, "parquet").read()


def test_nested_json_is_refused_naming_the_column(tmp_path: Path) -> None:
    from refresh.diff import normalize

    p = tmp_path / "n.jsonl"
    p.write_text('{"id": 1, "tags": ["a", "b"]}\n')
    with pytest.raises(DataError, match="dataset sites: column tags: Arrow type list<item: string> has no changelog"):
        normalize(src(p, "jsonl").read(), "sites")


# ------------------------------------------------------------------------------ stable files

class LogWaiter(logging.Handler):
    """Lets a test wait until a log line containing ``text`` was emitted (from any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


@pytest.fixture
def settle_log():
    logger = logging.getLogger("refresh.sources.files")
    waiter = LogWaiter("waiting for it to settle")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(waiter)
    yield waiter
    logger.removeHandler(waiter)
    logger.setLevel(old)


def test_stat_files_skips_hidden_and_directories(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("1")
    (tmp_path / ".a.csv.tmp").write_text("1")
    (tmp_path / "d.csv").mkdir()
    assert [os.path.basename(s[0]) for s in stat_files(str(tmp_path / "*.csv"))] == ["a.csv"]


def test_a_file_being_appended_to_is_read_once_it_settles(tmp_path: Path, settle_log) -> None:
    p = tmp_path / "sites.csv"
    p.write_text("id,v\n1,a\n")
    result: list[pa.Table] = []
    reader = threading.Thread(target=lambda: result.append(
        src(p, "csv", stable_for=dt.timedelta(seconds=0.5)).read()))
    reader.start()
    try:
        # The file was written just now: the read waits; rows appended meanwhile are read too.
        assert settle_log.seen.wait(bound(10)), "the read did not wait for the file to settle"
        with p.open("a") as f:
            f.write("2,b\n3,c\n")
    finally:
        reader.join(10)
    assert result and result[0].column("id").to_pylist() == [1, 2, 3]


def test_a_file_that_never_settles_fails_naming_it(tmp_path: Path) -> None:
    p = tmp_path / "sites.csv"
    p.write_text("id\n0\n")
    stop = threading.Event()

    def append() -> None:
        n = 0
        while not stop.wait(0.01):
            n += 1
            with p.open("a") as f:
                f.write(f"{n}\n")

    writer = threading.Thread(target=append)
    writer.start()
    t0 = time.monotonic()
    try:
        # A writer every 10 ms against a second of stability: a loaded machine that holds the writer's
        # thread back for 0.2 s (the window this test had) made the file look settled.
        with pytest.raises(FileNotStable, match=rf"dataset sites: {p} still changing after 2.5s"):
            src(p, "csv", stable_for=dt.timedelta(seconds=1), stable_timeout=dt.timedelta(seconds=2.5)).read()
    finally:
        stop.set()
        writer.join()
    assert time.monotonic() - t0 < bound(5)  # bounded by stable_timeout (plus one interval)


def test_a_file_changed_during_the_read_is_read_again(tmp_path: Path) -> None:
    p = tmp_path / "sites.csv"
    p.write_text("id\n1\n")

    class WriterComesBack(FileSource):
        reads = 0

        def read_file(self, path: Path) -> pa.Table:
            t = super().read_file(path)
            self.reads += 1
            if self.reads == 1:  # a writer appends while the first read is under way
                with p.open("a") as f:
                    f.write("2\n")
            return t

    s = WriterComesBack("sites", FileSourceConfig(path=str(p), format="csv", stable_for=dt.timedelta(0)))
    assert s.read().column("id").to_pylist() == [1, 2] and s.reads == 2


def test_a_file_appearing_in_the_glob_is_waited_for(tmp_path: Path, settle_log) -> None:
    (tmp_path / "a.csv").write_text("id\n1\n")
    result: list[pa.Table] = []
    reader = threading.Thread(target=lambda: result.append(
        src(tmp_path / "*.csv", "csv", stable_for=dt.timedelta(seconds=0.5)).read()))
    reader.start()
    try:
        assert settle_log.seen.wait(bound(10)), "the read did not wait for the files to settle"
        (tmp_path / "b.csv").write_text("id\n2\n")  # the export's second file lands meanwhile
    finally:
        reader.join(10)
    assert result and sorted(result[0].column("id").to_pylist()) == [1, 2]
