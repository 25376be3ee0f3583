"""File sources: formats, globs, and errors that name the file and line."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refresh.config import FileSourceConfig
from refresh.errors import EmptySnapshot
from refresh.sources.files import FileSource
from refstream.errors import DataError


def src(path: Path | str, fmt: str, **kw) -> FileSource:
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
