"""A ConnectorX read in key ranges (``read_partitions`` > 1) against a transaction that commits between
two ranges' statements: what is published is a state each key really had, never a tombstone for a row
that always existed nor a duplicate refused for a row that moved."""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from refresh.config import SqlSourceConfig
from refresh.runner import Refresher
from refresh.sources import mysql_cx, sql
from refresh.sources.sql import SqlSource
from tests.refresh.conftest import changes, execute, read_topic, table_view

pytestmark = pytest.mark.integration


def interleave(monkeypatch: pytest.MonkeyPatch, engine: sa.Engine, script: dict[int, list[str]]) -> list[list[str]]:
    """From now on, ConnectorX reads run their statements one after the other (a read in key ranges
    runs them in parallel, in an order nobody controls), and ``script[n]`` (a transaction) commits just
    before the statement ``n`` (0, 1...: counted over every read) runs. Returns the statements of
    every read, one list per read."""
    real = mysql_cx.read
    reads: list[list[str]] = []
    count = itertools.count()

    def one(url: str, query: str, settings: list[str]) -> pa.Table:
        statements = script.get(next(count))
        if statements:
            execute(engine, *statements)
        return real(url, [query], settings)

    def read(url: str, queries: list[str], settings: list[str]) -> pa.Table:
        reads.append(list(queries))
        return pa.concat_tables([one(url, q, settings) for q in queries])

    monkeypatch.setattr(mysql_cx, "read", read)
    return reads


def db_rows(engine: sa.Engine, table: str) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT id, code, v FROM {table}")).mappings()
        return {f'{{"code":"{r["code"]}"}}': dict(r) for r in rows}


@pytest.mark.parametrize("move", [
    # Out of the range read after the transaction into the range read before it: in neither.
    "DELETE FROM {t} WHERE code = 'c900'; INSERT INTO {t} VALUES (0, 'c900', -900)",
    # Out of the range read before the transaction into the range read after it: in both.
    "DELETE FROM {t} WHERE code = 'c10'; INSERT INTO {t} VALUES (5000, 'c10', -10)",
    # The same by an update of the primary key, with an unrelated insert in the first range.
    "UPDATE {t} SET id = 0, v = -900 WHERE code = 'c900'; INSERT INTO {t} VALUES (-1, 'new', 1)",
], ids=["missing", "twice", "update"])
def test_a_row_moved_between_two_ranges_reads_publishes_a_real_state(
        make_config, mysql_engine: sa.Engine, mysql_url: str, unique, kafka, monkeypatch, move: str) -> None:
    t, topic = unique("moves"), unique("ref.moves")
    execute(mysql_engine, f"CREATE TABLE {t} (id BIGINT PRIMARY KEY, code VARCHAR(20) NOT NULL UNIQUE, v INT)",
            f"INSERT INTO {t} SELECT seq, CONCAT('c', seq), seq FROM seq_1_to_1000")
    # The dataset's key is not the primary key the ranges split: a row can change range under its key.
    cfg = make_config({"m": {"source": {"url": mysql_url, "table": t, "read_partitions": 2},
                             "key": ["code"], "topic": topic}})
    refresher = Refresher(cfg)
    assert refresher.run("m").rows == 1000
    before = db_rows(mysql_engine, t)

    reads = interleave(monkeypatch, mysql_engine, {1: move.format(t=t).split("; ")})  # between the ranges
    result = refresher.run("m")
    after = db_rows(mysql_engine, t)
    assert after != before and len(reads[0]) == 2  # the transaction landed between the two ranges

    records = read_topic(kafka, topic)
    published = changes(records, 2)
    assert result.ok and result.deletes == 0 and None not in published.values()  # no tombstone
    # Each change published is the row its key has now; the topic holds the table as it is now.
    assert published and all(after[k] == row for k, row in published.items())
    assert table_view(records) == after


def moves_table(engine: sa.Engine, unique) -> str:
    t = unique("moves")
    execute(engine, f"CREATE TABLE {t} (id BIGINT PRIMARY KEY, code VARCHAR(20) NOT NULL UNIQUE, v INT)",
            f"INSERT INTO {t} SELECT seq, CONCAT('c', seq), seq FROM seq_1_to_1000")
    return t


def read_now(url: str, table: str) -> pa.Table:
    return SqlSource("ds", SqlSourceConfig(url=url, table=table, reader="pymysql")).read().sort_by("code")


@pytest.mark.parametrize(("script", "reads_done"), [
    # c10 in both ranges, then deleted before the keys are read again: gone.
    ({1: ["UPDATE {t} SET id = 5000 WHERE code = 'c10'"], 2: ["DELETE FROM {t} WHERE code = 'c10'"]},
     [2, 1]),
    # c900 in no range; found at id 0 by the keys read again, then moved once more before it is
    # re-read there: the whole table is read again in one statement.
    ({1: ["UPDATE {t} SET id = 0 WHERE code = 'c900'"], 3: ["UPDATE {t} SET id = 7000 WHERE code = 'c900'"]},
     [2, 1, 1, 1]),
], ids=["twice-then-gone", "moved-again"])
def test_keys_that_keep_moving_after_the_ranges_were_read(mysql_engine: sa.Engine, mysql_url: str, unique,
                                                          monkeypatch, script, reads_done) -> None:
    t = moves_table(mysql_engine, unique)
    src = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=t, read_partitions=2), ("code",))
    reads = interleave(monkeypatch, mysql_engine, {n: [s.format(t=t) for s in ss] for n, ss in script.items()})
    got = src.read()
    assert [len(r) for r in reads] == reads_done
    assert got.sort_by("code").equals(read_now(mysql_url, t))  # the table as it is now


def test_a_mass_change_during_a_read_in_ranges_reads_again_in_one_statement(
        mysql_engine: sa.Engine, mysql_url: str, unique, monkeypatch) -> None:
    t = moves_table(mysql_engine, unique)
    monkeypatch.setattr(sql, "REREAD_KEYS", 2)
    src = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=t, read_partitions=2), ("code",))
    reads = interleave(monkeypatch, mysql_engine, {1: [f"UPDATE {t} SET id = id + 2000 WHERE id <= 3"]})
    got = src.read()
    assert [len(r) for r in reads] == [2, 1, 1] and "IN (" not in reads[2][0]
    assert got.sort_by("code").equals(read_now(mysql_url, t))
