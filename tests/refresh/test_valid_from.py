"""Time in the changelog (real MariaDB, files, real broker): every change carries the time it is valid
from, every run its completeness - in a heartbeat written last on every partition of its transaction,
in the committed state and in ``refresh status``.

- ``mode: diff`` and files: changes and tombstones are valid from the time the run's read began (for
  files: the read of the settled file set), the run is complete as of that time;
- ``mode: incremental``: a row is valid from its cursor value (the database clock at the read's start
  when the cursor is NULL; a tombstone, found by a reconcile, from that reconcile's read), the run is
  complete as of the database clock at the read's start minus ``lag``;
- a run without changes publishes its completeness all the same; a failed run publishes none;
- ``--full`` and a re-key send an unchanged row with the time it was first published with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from refresh.cli import main
from refresh.runner import Refresher
from refresh.stores.abc import VALID_FROM_COLUMN
from refresh.stores.files import FileStateStore, write_snapshot
from refstream import contract
from refstream.errors import DataError
from tests.refresh.conftest import Record, execute, read_topic


def now() -> datetime:
    return datetime.now(UTC)


def db_clock(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT UTC_TIMESTAMP(6)")).scalar().replace(tzinfo=UTC)


def times(records: list[Record], op: str, version: int) -> dict[str, datetime]:
    """key (text) -> valid_from of the ``op`` records of ``version``."""
    return {r.key.decode(): contract.parse_time(r.headers["valid_from"]) for r in records
            if r.op == op and r.version == version}


def completeness(records: list[Record], after: datetime) -> datetime:
    """The ``complete_as_of`` of the one run whose heartbeats (one per partition) say more than ``after``."""
    found = {contract.parse_time(r.headers["complete_as_of"]) for r in records
             if r.op == contract.OP_HEARTBEAT and contract.parse_time(r.headers["complete_as_of"]) > after}
    assert len(found) == 1, found
    return found.pop()


def timed(run: Callable[[], Any], clock: Callable[[], datetime] = now) -> tuple[Any, datetime, datetime]:
    before = clock()
    result = run()
    return result, before, clock()


def status(cfg: Any, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "status", "--json"]) == 0
    return json.loads(capsys.readouterr().out)[0]


def each_run_ends_with_its_heartbeat(records: list[Record]) -> None:
    """On every partition, every run's records end with its heartbeat: the one partition records of a
    version are followed by a heartbeat before the next version's."""
    for part in {r.partition for r in records}:
        ordered = [r for r in sorted(records, key=lambda r: r.offset) if r.partition == part]
        for prev, nxt in zip(ordered, ordered[1:], strict=False):
            if nxt.version != prev.version:
                assert prev.op == contract.OP_HEARTBEAT, (part, prev, nxt)
        assert ordered[-1].op == contract.OP_HEARTBEAT


def test_diff_mode_changes_are_valid_from_the_read_and_a_full_republish_keeps_their_times(
        make_config, mysql_engine, mysql_url, unique, kafka, capsys):
    t, topic = unique("vf_diff"), unique("ref.vf_diff")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10))",
            f"INSERT INTO {t} VALUES (1, 'a'), (2, 'b'), (3, 'c'), (4, 'd')")
    cfg = make_config({"d": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic,
                             "partitions": 2, "max_delete_fraction": 1}})
    run = Refresher(cfg).run

    _, b1, a1 = timed(lambda: run("d"))
    records = read_topic(kafka, topic, heartbeats=True)
    first = times(records, "upsert", 1)
    v1 = first['{"id":1}']
    assert b1 <= v1 <= a1 and set(first.values()) == {v1} and len(first) == 4  # when the read began
    assert completeness(records, b1 - timedelta(days=1)) == v1
    assert sorted(r.partition for r in records if r.op == contract.OP_HEARTBEAT) == [0, 1]
    assert status(cfg, capsys)["complete_as_of"] == contract.format_time(v1)

    execute(mysql_engine, f"UPDATE {t} SET v = 'B' WHERE id = 2", f"DELETE FROM {t} WHERE id = 3",
            f"INSERT INTO {t} VALUES (5, 'e')")
    _, b2, a2 = timed(lambda: run("d"))
    records = read_topic(kafka, topic, heartbeats=True)
    second = times(records, "upsert", 2)
    v2 = second['{"id":2}']
    assert b2 <= v2 <= a2 and second == {'{"id":2}': v2, '{"id":5}': v2}
    assert times(records, "delete", 2) == {'{"id":3}': v2}  # gone as of the read that found it gone
    assert completeness(records, a1) == v2
    assert status(cfg, capsys)["complete_as_of"] == contract.format_time(v2)

    # No change: the run's completeness goes out all the same, alone.
    quiet, b3, a3 = timed(lambda: run("d"))
    assert (quiet.published, quiet.inserts, quiet.updates, quiet.deletes) == (0, 0, 0, 0)
    records = read_topic(kafka, topic, heartbeats=True)
    v3 = completeness(records, a2)
    assert b3 <= v3 <= a3 and quiet.complete_as_of == contract.format_time(v3)
    st = status(cfg, capsys)
    assert st["complete_as_of"] == contract.format_time(v3)
    assert FileStateStore(cfg.state_dir).load("d").complete_as_of == contract.format_time(v3)

    # --full sends every row again, each with the time it was first published with.
    full, b4, _ = timed(lambda: run("d", full=True))
    assert full.kind == "full"
    records = read_topic(kafka, topic, heartbeats=True)
    assert times(records, "upsert", full.version) == {
        '{"id":1}': v1, '{"id":2}': v2, '{"id":4}': v1, '{"id":5}': v2}
    assert completeness(records, b4 - timedelta(microseconds=1)) >= b4
    each_run_ends_with_its_heartbeat(records)
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "status"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "COMPLETE AS OF" in table[0] and st["complete_as_of"][:10] in table[1]


def test_incremental_rows_are_valid_from_their_cursor_and_the_run_complete_as_of_the_lag(
        make_config, mysql_engine, mysql_url, unique, kafka, capsys):
    t, topic = unique("vf_inc"), unique("ref.vf_inc")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10), last_update DATETIME(6))")
    base = db_clock(mysql_engine).replace(tzinfo=None) - timedelta(minutes=10)
    execute(mysql_engine, f"INSERT INTO {t} VALUES (:id, :v, :ts)", params=[
        {"id": 1, "v": "a", "ts": base}, {"id": 2, "v": "b", "ts": base + timedelta(minutes=5)},
        {"id": 3, "v": "c", "ts": None}])  # a NULL cursor: only a full read sees it
    lag = timedelta(seconds=30)
    cfg = make_config({"m": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic,
                             "mode": "incremental", "incremental": {"column": "last_update", "lag": "30s"},
                             "max_delete_fraction": 1}})
    run = Refresher(cfg).run
    clock = lambda: db_clock(mysql_engine)  # noqa: E731 - the database's, like the refresher's

    first, b1, a1 = timed(lambda: run("m"), clock)  # no snapshot yet: a full read
    assert first.kind == "reconcile"
    records = read_topic(kafka, topic, heartbeats=True)
    got = times(records, "upsert", 1)
    utc = base.replace(tzinfo=UTC)
    assert got['{"id":1}'] == utc and got['{"id":2}'] == utc + timedelta(minutes=5)
    null_row = got['{"id":3}']
    assert b1 <= null_row <= a1  # the database clock when the read began
    c1 = completeness(records, b1 - timedelta(days=1))
    assert c1 == null_row - lag
    assert status(cfg, capsys)["complete_as_of"] == contract.format_time(c1)

    t4 = (a1 - timedelta(seconds=1)).replace(tzinfo=None)
    execute(mysql_engine, f"INSERT INTO {t} VALUES (4, 'd', :ts)", params=[{"ts": t4}])
    execute(mysql_engine, f"UPDATE {t} SET v = 'B', last_update = :ts WHERE id = 2", params=[{"ts": t4}])
    second, b2, a2 = timed(lambda: run("m"), clock)
    assert (second.kind, second.inserts, second.updates) == ("incremental", 1, 1)
    records = read_topic(kafka, topic, heartbeats=True)
    cursor = t4.replace(tzinfo=UTC)
    assert times(records, "upsert", 2) == {'{"id":2}': cursor, '{"id":4}': cursor}
    c2 = completeness(records, c1)
    assert b2 - lag <= c2 <= a2 - lag

    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 1")
    third, b3, a3 = timed(lambda: run("m", reconcile=True), clock)
    assert (third.kind, third.deletes) == ("reconcile", 1)
    records = read_topic(kafka, topic, heartbeats=True)
    gone = times(records, "delete", 3)['{"id":1}']
    assert b3 <= gone <= a3 and completeness(records, c2) == gone - lag

    quiet, b4, a4 = timed(lambda: run("m"), clock)  # nothing in the window: complete as of this read
    assert (quiet.kind, quiet.published) == ("incremental", 0)
    c4 = completeness(read_topic(kafka, topic, heartbeats=True), gone - lag)
    assert b4 - lag <= c4 <= a4 - lag
    assert status(cfg, capsys)["complete_as_of"] == contract.format_time(c4)

    # --full: the row without a cursor keeps the time its first read gave it, the others their cursor.
    full = run("m", full=True)
    records = read_topic(kafka, topic, heartbeats=True)
    assert times(records, "upsert", full.version) == {'{"id":2}': cursor, '{"id":3}': null_row, '{"id":4}': cursor}
    each_run_ends_with_its_heartbeat(records)


def test_a_sqlite_rows_backdated_timestamp_cursor_is_the_time_it_is_valid_from(make_config, tmp_path: Path, unique,
                                                                             kafka):
    """SQLite keeps times as text; a column declared TIMESTAMP is read as a time, so an UPDATE that
    sets ``last_update`` to an hour ago publishes a change valid from then (a backdated change), not
    from the read."""
    url, topic = f"sqlite:///{tmp_path / 'ref.db'}", unique("ref.vf_lite")
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE m (id INTEGER PRIMARY KEY, v TEXT, "
                    "last_update TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
            "INSERT INTO m (id, v) VALUES (1, 'a'), (2, 'b')")
    cfg = make_config({"m": {"source": {"url": url, "table": "m"}, "key": ["id"], "topic": topic,
                             "mode": "incremental", "incremental": {"column": "last_update", "lag": "5s"}}})
    run = Refresher(cfg).run
    run("m")
    execute(engine, "UPDATE m SET v = 'B', last_update = datetime('now', '-1 hour') WHERE id = 2",
            "UPDATE m SET v = 'A', last_update = CURRENT_TIMESTAMP WHERE id = 1")
    second, before, after = timed(lambda: run("m"))
    assert (second.kind, second.updates) == ("incremental", 1)  # id 2 is behind the window: a reconcile's
    records = read_topic(kafka, topic, heartbeats=True)
    got = times(records, "upsert", 2)
    assert list(got) == ['{"id":1}'] and before - timedelta(seconds=2) <= got['{"id":1}'] <= after
    third = run("m", reconcile=True)
    assert (third.kind, third.updates) == ("reconcile", 1)
    back = times(read_topic(kafka, topic, heartbeats=True), "upsert", 3)['{"id":2}']
    assert before - timedelta(hours=1, seconds=5) <= back <= after - timedelta(minutes=59)


def test_a_file_is_valid_from_the_read_of_the_settled_file_and_a_failed_run_claims_nothing(
        make_config, tmp_path: Path, unique, kafka, capsys):
    topic = unique("ref.vf_file")
    p = tmp_path / "sites.csv"
    cfg = make_config({"s": {"source": {"path": str(p), "stable_for": "1s"}, "key": ["site_id"], "topic": topic,
                             "max_delete_fraction": 1}})
    run = Refresher(cfg).run
    written = now()
    p.write_text("site_id,name\n1,a\n2,b\n3,c\n")
    _, _, a1 = timed(lambda: run("s"))
    records = read_topic(kafka, topic, heartbeats=True)
    first = times(records, "upsert", 1)
    v1 = first['{"site_id":1}']
    # Read once the file held still for stable_for, not when the run began waiting for it.
    assert written + timedelta(seconds=1) <= v1 <= a1 and set(first.values()) == {v1}
    assert completeness(records, written - timedelta(days=1)) == v1

    p.write_text("site_id,name\n1,a\n2,B\n4,d\n")
    time.sleep(1.1)  # settled: read at once
    _, b2, a2 = timed(lambda: run("s"))
    records = read_topic(kafka, topic, heartbeats=True)
    v2 = times(records, "upsert", 2)['{"site_id":2}']
    assert b2 <= v2 <= a2
    assert times(records, "upsert", 2) == {'{"site_id":2}': v2, '{"site_id":4}': v2}
    assert times(records, "delete", 2) == {'{"site_id":3}': v2}
    assert completeness(records, a1) == v2

    quiet, b3, a3 = timed(lambda: run("s"))
    assert quiet.published == 0
    v3 = completeness(read_topic(kafka, topic, heartbeats=True), a2)
    assert b3 <= v3 <= a3 and status(cfg, capsys)["complete_as_of"] == contract.format_time(v3)

    # A run that cannot read the source publishes no completeness and leaves the recorded one.
    p.unlink()
    with pytest.raises(DataError, match="not found"):
        run("s")
    assert len([r for r in read_topic(kafka, topic, heartbeats=True) if r.op == contract.OP_HEARTBEAT]) == 3
    st = status(cfg, capsys)
    assert (st["last_result"], st["complete_as_of"]) == ("failed", contract.format_time(v3))

    p.write_text("site_id,name\n1,a\n2,B\n4,d\n")
    time.sleep(1.1)
    full = run("s", full=True)
    records = read_topic(kafka, topic, heartbeats=True)
    assert times(records, "upsert", full.version) == {'{"site_id":1}': v1, '{"site_id":2}': v2, '{"site_id":4}': v2}
    each_run_ends_with_its_heartbeat(records)


def test_a_snapshot_from_before_valid_from_times_gets_them_at_its_next_run(make_config, tmp_path: Path, unique,
                                                                           kafka):
    topic = unique("ref.vf_old")
    p = tmp_path / "sites.csv"
    p.write_text("site_id,name\n1,a\n2,b\n")
    cfg = make_config({"s": {"source": {"path": str(p), "stable_for": "0s"}, "key": ["site_id"], "topic": topic}})
    run = Refresher(cfg).run
    run("s")
    # The committed snapshot as an earlier release wrote it: the rows only.
    store = FileStateStore(cfg.state_dir)
    state = store.load("s")
    path = cfg.state_dir / "s" / (state.snapshot or "")
    rows = store.load_snapshot("s", state).drop_columns([VALID_FROM_COLUMN])
    with path.open("wb") as f:
        write_snapshot(rows, f)
    quiet, b, a = timed(lambda: run("s"))  # no change, yet the snapshot is stored again, with times
    assert quiet.published == 0
    stored = store.load_snapshot("s", store.load("s"))
    known = stored.column(VALID_FROM_COLUMN).to_pylist()
    assert all(b <= t <= a for t in known)
    full = run("s", full=True)
    assert set(times(read_topic(kafka, topic), "upsert", full.version).values()) == set(known)


def test_a_re_key_sends_every_row_with_the_time_it_was_first_published_with(make_config, mysql_engine, mysql_url,
                                                                            unique, kafka):
    t, topic = unique("vf_rekey"), unique("ref.vf_rekey")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, code VARCHAR(12) NOT NULL UNIQUE, v INT)",
            f"INSERT INTO {t} VALUES (1, 'c1', 1), (2, 'c2', 1), (3, 'c3', 1)")

    def config(key: str, name: str) -> Any:
        return make_config({"r": {"source": {"url": mysql_url, "table": t}, "key": [key], "topic": topic}}, name=name)

    Refresher(config("id", "by_id.yaml")).run("r")
    execute(mysql_engine, f"UPDATE {t} SET v = 2 WHERE id = 2")
    Refresher(config("id", "by_id.yaml")).run("r")
    records = read_topic(kafka, topic)
    v1, v2 = times(records, "upsert", 1)['{"id":1}'], times(records, "upsert", 2)['{"id":2}']
    rekey, b, a = timed(lambda: Refresher(config("code", "by_code.yaml")).run("r"))
    assert rekey.deletes == 3
    records = read_topic(kafka, topic)
    assert times(records, "upsert", rekey.version) == {'{"code":"c1"}': v1, '{"code":"c2"}': v2, '{"code":"c3"}': v1}
    gone = times(records, "delete", rekey.version)
    assert set(gone) == {'{"id":1}', '{"id":2}', '{"id":3}'} and all(b <= g <= a for g in gone.values())


def test_a_clock_stepped_back_never_makes_a_change_valid_before_a_published_completeness(
        make_config, tmp_path: Path, unique, kafka, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """The host's clock steps back an hour between two runs of a file dataset: the second run's
    changes are valid from the completeness the first published (a consumer holding events until
    that completeness has already judged them), with a warning; the completeness never goes back."""
    import logging

    import refresh.sources.files as files

    topic = unique("ref.vf_clock")
    p = tmp_path / "sites.csv"
    cfg = make_config({"s": {"source": {"path": str(p), "stable_for": "200ms"}, "key": ["site_id"], "topic": topic,
                             "max_delete_fraction": 1}})
    run = Refresher(cfg).run
    p.write_text("site_id,name\n1,a\n2,b\n")
    run("s")
    v1 = completeness(read_topic(kafka, topic, heartbeats=True), now() - timedelta(days=1))

    class Behind(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
            return datetime.now(tz) - timedelta(hours=1)

    monkeypatch.setattr(files, "datetime", Behind)
    p.write_text("site_id,name\n1,a\n2,B\n3,c\n")
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="refresh.runner"):
        run("s")
    records = read_topic(kafka, topic, heartbeats=True)
    assert set(times(records, "upsert", 2).values()) == {v1}
    assert "a clock stepped back" in caplog.text and "dataset s:" in caplog.text
    heartbeats = [contract.parse_time(r.headers["complete_as_of"]) for r in records if r.op == contract.OP_HEARTBEAT]
    assert heartbeats == sorted(heartbeats) and heartbeats[-1] == v1
