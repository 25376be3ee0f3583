"""Incremental mode against the real MariaDB (and PostgreSQL): watermark, lag, boundary timestamps, reconcile,
NULL cursors, integer cursors, UTC sessions."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging

import pytest
import sqlalchemy as sa

from refresh.runner import Refresher
from refresh.stores.files import FileStateStore
from tests.refresh.conftest import changes, execute, read_topic


def db_now(engine: sa.Engine) -> dt.datetime:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT NOW(6)")).scalar()


def db_value(engine: sa.Engine, query: str) -> object:
    with engine.connect() as conn:
        return conn.execute(sa.text(query)).scalar()


def inc_dataset(url: str, table: str, topic: str, **inc) -> dict:
    # Tiny tables whose reconciles find hard deletes on purpose: no partial-source guard.
    return {"source": {"url": url, "table": table}, "key": ["id"], "topic": topic, "mode": "incremental",
            "incremental": {"column": "last_update", "lag": "30s", **inc}, "max_delete_fraction": 1}


def insert(engine: sa.Engine, table: str, *rows: tuple[int, str, dt.datetime]) -> None:
    execute(engine, f"INSERT INTO {table} VALUES (:id, :v, :ts)",
            params=[{"id": i, "v": v, "ts": ts} for i, v, ts in rows])


def test_watermark_lag_boundary_and_reconcile(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("models"), unique("ref.models")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    base = db_now(mysql_engine) - dt.timedelta(minutes=10)
    t1 = base + dt.timedelta(minutes=5)
    insert(mysql_engine, t, (1, "a", base), (2, "b", t1))
    cfg = make_config({"m": inc_dataset(mysql_url, t, topic)})
    refresher = Refresher(cfg)

    first = refresher.run("m")  # no snapshot yet: a full read
    assert (first.kind, first.inserts, first.watermark) == ("reconcile", 2, t1.isoformat())

    insert(mysql_engine, t,
           (3, "c", t1),                                  # same timestamp as the watermark
           (4, "d", t1 - dt.timedelta(seconds=20)),       # committed late, stamped inside the lag
           (5, "e", t1 - dt.timedelta(seconds=120)))      # stamped before the lag: only a reconcile sees it
    second = refresher.run("m")
    assert second.kind == "incremental"
    assert second.rows == 3  # rows 2, 3, 4 were read; row 2 is unchanged and not sent again
    assert (second.inserts, second.updates, second.published) == (2, 0, 2)
    assert changes(read_topic(kafka, topic), 2) == {
        '{"id":3}': {"id": 3, "v": "c", "last_update": t1.isoformat()},
        '{"id":4}': {"id": 4, "v": "d", "last_update": (t1 - dt.timedelta(seconds=20)).isoformat()}}

    # Delete and re-insert with a new stamp: an upsert. A hard delete: invisible to the cursor.
    t2 = t1 + dt.timedelta(minutes=1)
    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 3", f"DELETE FROM {t} WHERE id = 1")
    insert(mysql_engine, t, (3, "C", t2))
    third = refresher.run("m")
    assert (third.kind, third.updates, third.deletes) == ("incremental", 1, 0)
    assert changes(read_topic(kafka, topic), 3) == {'{"id":3}': {"id": 3, "v": "C", "last_update": t2.isoformat()}}

    fourth = refresher.run("m", reconcile=True)
    assert (fourth.kind, fourth.inserts, fourth.updates, fourth.deletes) == ("reconcile", 1, 0, 1)
    assert changes(read_topic(kafka, topic), 4) == {
        '{"id":1}': None, '{"id":5}': {"id": 5, "v": "e", "last_update": (t1 - dt.timedelta(seconds=120)).isoformat()}}
    state = FileStateStore(cfg.state_dir).load("m")
    assert state.watermark == t2.isoformat() and state.rows == 4 and state.last_reconcile


def test_watermark_never_passes_the_database_clock(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("future"), unique("ref.future")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    now = db_now(mysql_engine)
    insert(mysql_engine, t, (1, "skewed", now + dt.timedelta(days=1)), (2, "b", now - dt.timedelta(minutes=1)))
    cfg = make_config({"f": inc_dataset(mysql_url, t, topic)})
    r = Refresher(cfg).run("f")
    wm = dt.datetime.fromisoformat(r.watermark)
    assert now <= wm < now + dt.timedelta(minutes=5)
    insert(mysql_engine, t, (3, "late", db_now(mysql_engine) - dt.timedelta(seconds=1)))
    r2 = Refresher(cfg).run("f")
    assert r2.kind == "incremental" and r2.inserts == 1
    assert set(changes(read_topic(kafka, topic), 2)) == {'{"id":3}'}


def test_reconcile_runs_by_itself_when_due(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("due"), unique("ref.due")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    insert(mysql_engine, t, (1, "a", db_now(mysql_engine)), (2, "b", db_now(mysql_engine)))
    often = make_config({"d": inc_dataset(mysql_url, t, topic, reconcile={"every": "1ms"})})
    Refresher(often).run("d")
    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 1")
    r = Refresher(often).run("d")
    assert (r.kind, r.deletes) == ("reconcile", 1)
    rarely = make_config({"d": inc_dataset(mysql_url, t, topic, reconcile={"every": "24h"})}, name="rare.yaml")
    assert Refresher(rarely).run("d").kind == "incremental"


def test_schema_change_switches_to_a_full_read(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("incschema"), unique("ref.incschema")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    old = db_now(mysql_engine) - dt.timedelta(hours=1)
    insert(mysql_engine, t, (1, "a", old), (2, "b", db_now(mysql_engine)))
    cfg = make_config({"s": inc_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("s")
    execute(mysql_engine, f"ALTER TABLE {t} ADD COLUMN extra INT DEFAULT 7")
    r = Refresher(cfg).run("s")
    assert r.schema_changed and r.kind == "reconcile" and r.updates == 2  # row 1 is outside the window
    v2 = [x for x in read_topic(kafka, topic) if x.version == 2]
    assert v2[0].op == "schema"
    assert {k: v["extra"] for k, v in changes(v2).items()} == {'{"id":1}': 7, '{"id":2}': 7}


def test_full_in_incremental_mode_republishes_and_advances_the_watermark(make_config, mysql_engine, mysql_url,
                                                                           unique, kafka):
    t, topic = unique("incfull"), unique("ref.incfull")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    ts = db_now(mysql_engine) - dt.timedelta(minutes=1)
    insert(mysql_engine, t, (1, "a", ts - dt.timedelta(hours=2)), (2, "b", ts))
    cfg = make_config({"x": inc_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("x")
    r = Refresher(cfg).run("x", full=True)
    assert (r.kind, r.published, r.watermark) == ("full", 3, ts.isoformat())
    assert [x.op for x in read_topic(kafka, topic) if x.version == 2] == ["schema", "upsert", "upsert"]


def test_row_committed_late_by_a_long_transaction_is_not_lost(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("late"), unique("ref.late")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    insert(mysql_engine, t, (1, "a", db_now(mysql_engine) - dt.timedelta(minutes=1)))
    cfg = make_config({"l": inc_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("l")
    with mysql_engine.connect() as slow:
        tx = slow.begin()  # a long transaction stamps its row now and commits after the next refresh
        slow.execute(sa.text(f"INSERT INTO {t} VALUES (2, 'late', NOW(6))"))
        execute(mysql_engine, "DO SLEEP(0.05)", f"INSERT INTO {t} VALUES (3, 'quick', NOW(6))")
        second = Refresher(cfg).run("l")
        assert (second.kind, second.inserts) == ("incremental", 1)
        assert set(changes(read_topic(kafka, topic), 2)) == {'{"id":3}'}
        tx.commit()
    state = FileStateStore(cfg.state_dir).load("l")
    late_stamp = db_value(mysql_engine, f"SELECT last_update FROM {t} WHERE id = 2")
    assert late_stamp < dt.datetime.fromisoformat(state.watermark)  # behind the watermark, inside the lag
    third = Refresher(cfg).run("l")
    assert (third.kind, third.inserts, third.updates) == ("incremental", 1, 0)
    assert changes(read_topic(kafka, topic), 3) == {
        '{"id":2}': {"id": 2, "v": "late", "last_update": late_stamp.isoformat()}}


def test_now_comes_from_the_database_clock(make_config, mysql_engine, mysql_url, unique, kafka):
    from urllib.parse import quote

    t, topic = unique("clock"), unique("ref.clock")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    real_now = db_now(mysql_engine)
    insert(mysql_engine, t, (1, "a", real_now - dt.timedelta(hours=1)), (2, "b", real_now - dt.timedelta(hours=3)))
    # The refresher's sessions see a database clock two hours behind this host's: a row stamped an hour
    # ago is in the database's future, so the watermark stops at the database's "now".
    skewed = f"{mysql_url}&init_command={quote('SET timestamp = UNIX_TIMESTAMP() - 7200')}"
    cfg = make_config({"c": inc_dataset(skewed, t, topic)})
    first = Refresher(cfg).run("c")
    wm = dt.datetime.fromisoformat(first.watermark)
    assert abs(wm - (real_now - dt.timedelta(hours=2))) < dt.timedelta(minutes=5), (wm, real_now)
    second = Refresher(cfg).run("c")  # row 1 is read again (>= watermark - lag) but not republished
    assert (second.kind, second.rows, second.published) == ("incremental", 1, 0)


def test_reconcile_is_daily_by_default(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("daily"), unique("ref.daily")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    insert(mysql_engine, t, (1, "a", db_now(mysql_engine)), (2, "b", db_now(mysql_engine)))
    cfg = make_config({"d": inc_dataset(mysql_url, t, topic)})  # no reconcile setting
    Refresher(cfg).run("d")
    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 1")
    assert Refresher(cfg).run("d").kind == "incremental"  # reconciled less than a day ago
    store = FileStateStore(cfg.state_dir)
    state = store.load("d")
    day_ago = dt.datetime.fromisoformat(state.last_reconcile) - dt.timedelta(days=1, minutes=1)
    store.commit("d", dataclasses.replace(state, last_reconcile=day_ago.isoformat()), None)
    r = Refresher(cfg).run("d")
    assert (r.kind, r.deletes) == ("reconcile", 1)
    assert changes(read_topic(kafka, topic), r.version) == {'{"id":1}': None}


def test_null_cursor_rows_are_found_by_reconcile_and_counted(make_config, mysql_engine, mysql_url, unique, kafka,
                                                             caplog):
    t, topic = unique("nulls"), unique("ref.nulls")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    insert(mysql_engine, t, (1, "a", db_now(mysql_engine)))
    cfg = make_config({"n": inc_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("n")
    insert(mysql_engine, t, (2, "null", None), (3, "null", None), (4, "d", db_now(mysql_engine)))
    inc = Refresher(cfg).run("n")
    assert (inc.kind, inc.inserts) == ("incremental", 1)  # the NULL-cursor rows are outside every window
    with caplog.at_level(logging.WARNING, logger="refresh.runner"):
        rec = Refresher(cfg).run("n", reconcile=True)
    assert (rec.kind, rec.inserts) == ("reconcile", 2)
    assert set(changes(read_topic(kafka, topic), rec.version)) == {'{"id":2}', '{"id":3}'}
    warned = [r.getMessage() for r in caplog.records if "NULL" in r.getMessage()]
    assert warned == ["dataset n: 2 row(s) with last_update NULL: incremental runs cannot see them, only "
                      "reconciles (every 1d) do"]


def test_integer_cursor_rereads_a_window_below_the_watermark(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("intcur"), unique("ref.intcur")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT AUTO_INCREMENT PRIMARY KEY, v VARCHAR(10))")
    execute(mysql_engine, f"INSERT INTO {t} (v) VALUES ('a'), ('b')")
    ds = {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic, "mode": "incremental",
          "incremental": {"column": "id"}}
    cfg = make_config({"i": ds})
    Refresher(cfg).run("i")
    with mysql_engine.connect() as slow:
        tx = slow.begin()  # takes id 3 now, commits after a refresh has read id 4
        slow.execute(sa.text(f"INSERT INTO {t} (v) VALUES ('late')"))
        execute(mysql_engine, f"INSERT INTO {t} (v) VALUES ('quick')")
        second = Refresher(cfg).run("i")
        assert (second.kind, second.inserts, second.watermark) == ("incremental", 1, 4)
        tx.commit()
    third = Refresher(cfg).run("i")
    assert (third.kind, third.inserts, third.updates) == ("incremental", 1, 0)
    assert changes(read_topic(kafka, topic), third.version) == {'{"id":3}': {"id": 3, "v": "late"}}


def test_sessions_read_in_utc_whatever_the_session_time_zone(make_config, mysql_engine, mysql_url, unique, kafka):
    from urllib.parse import quote

    t, topic = unique("utc"), unique("ref.utc")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update TIMESTAMP(6) NULL)",
            "SET time_zone = '+00:00'",
            f"INSERT INTO {t} VALUES (1, 'a', '2024-05-01 12:00:00'), "
            f"(2, 'b', UTC_TIMESTAMP(6) - INTERVAL 10 MINUTE)")

    def in_zone(zone: str, name: str) -> object:
        # A server (or a URL's init_command) whose sessions default to another time zone, as after a
        # change of the server's zone or a daylight-saving switch between two runs.
        url = f"{mysql_url}&init_command={quote(f'SET time_zone = {zone!r}')}"
        return make_config({"z": inc_dataset(url, t, topic)}, name=name)

    first = Refresher(in_zone("+05:00", "east.yaml")).run("z")
    assert changes(read_topic(kafka, topic), 1)['{"id":1}'] == {"id": 1, "v": "a",
                                                                "last_update": "2024-05-01T12:00:00"}
    execute(mysql_engine, "SET time_zone = '+00:00'",
            f"INSERT INTO {t} VALUES (3, 'c', UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)")
    second = Refresher(in_zone("-03:00", "west.yaml")).run("z")
    assert (first.kind, second.kind, second.inserts) == ("reconcile", "incremental", 1)
    stamp = db_value(mysql_engine, f"SELECT DATE_FORMAT(CONVERT_TZ(last_update, @@session.time_zone, '+00:00'), "
                                   f"'%Y-%m-%dT%H:%i:%s.%f') FROM {t} WHERE id = 3")
    assert changes(read_topic(kafka, topic), 2) == {'{"id":3}': {"id": 3, "v": "c", "last_update": stamp}}


PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


@pytest.mark.integration  # reaches the PostgreSQL at PG_URL without a fixture
def test_postgresql_timestamptz_watermark_never_passes_the_database_clock(make_config, unique, kafka):
    t, topic = unique("pgtz"), unique("ref.pgtz")
    engine = sa.create_engine(PG_URL)
    execute(engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v TEXT, last_update TIMESTAMPTZ)",
            f"INSERT INTO {t} VALUES (1, 'skewed', now() + interval '1 day'), (2, 'b', now() - interval '1 minute')")
    try:
        now = db_value(engine, "SELECT now()")
        cfg = make_config({"p": inc_dataset(PG_URL, t, topic)})
        r = Refresher(cfg).run("p")
        wm = dt.datetime.fromisoformat(r.watermark)
        assert now <= wm < now + dt.timedelta(minutes=5), (wm, now)
        execute(engine, f"INSERT INTO {t} VALUES (3, 'late', now() - interval '1 second')")
        r2 = Refresher(cfg).run("p")
        assert (r2.kind, r2.inserts) == ("incremental", 1)
        assert set(changes(read_topic(kafka, topic), 2)) == {'{"id":3}'}
    finally:
        execute(engine, f"DROP TABLE {t}")
        engine.dispose()
