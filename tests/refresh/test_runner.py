"""End-to-end refreshes: real MariaDB (and SQLite, PostgreSQL, files) -> real broker, read back."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from demo.broker import EmbeddedBroker, free_port
from refresh.errors import (
    DatasetBusy,
    DuplicateKey,
    EmptySnapshot,
    PublishError,
    TooManyDeletes,
    TopicChanged,
)
from refresh.publish import Publisher
from refresh.runner import Refresher
from refresh.status import format_status, read_status
from refresh.stores.abc import VALID_FROM_COLUMN
from refresh.stores.files import FileStateStore
from refstream import contract
from refstream.errors import DataError, TerminalError, TransientError
from tests.refresh.conftest import changes, execute, read_topic, schemas, table_view
from tests.timing import bound

pytestmark = pytest.mark.integration  # starts embedded brokers of its own besides the fixtures


def db_rows(engine: sa.Engine, sql: str) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.text(sql))]


def mysql_dataset(url: str, table: str, topic: str, **extra) -> dict:
    return {"source": {"url": url, "table": table}, "key": ["id"], "topic": topic, **extra}


def test_every_type_reaches_the_topic_encoded_by_the_contract(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("types"), unique("ref.types")
    execute(mysql_engine,
            f"CREATE TABLE {t} (id INT NOT NULL, k2 VARCHAR(10) NOT NULL, price DECIMAL(30,10), day DATE, "
            "at DATETIME(6), stamp TIMESTAMP NULL, bin VARBINARY(8), name VARCHAR(50), n INT, f DOUBLE, "
            "PRIMARY KEY (id, k2))",
            f"INSERT INTO {t} VALUES (1, 'ä', 12345678901234567890.0123456789, '2024-05-01', "
            "'2024-05-01 12:00:00.123456', '2024-05-01 12:00:00', x'00ff10', '日本語 ✓ \"q\"', 7, 0.1), "
            "(2, 'b', -0.5, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
    cfg = make_config({"types": {"source": {"url": mysql_url, "table": t}, "key": ["id", "k2"], "topic": topic}})
    result = Refresher(cfg).run("types")
    assert (result.ok, result.version, result.rows, result.inserts, result.published) == (True, 1, 2, 2, 3)

    records = read_topic(kafka, topic)
    assert records[0].key == contract.SCHEMA_KEY and records[0].op == "schema"
    schema = schemas(records)[0]
    assert schema.key == ("id", "k2")
    assert {c.name: c.type for c in schema.columns} == {
        "id": "int64", "k2": "string", "price": "decimal(30,10)", "day": "date", "at": "timestamp",
        "stamp": "timestamp", "bin": "binary", "name": "string", "n": "int64", "f": "float64"}
    rows = {r.key: r for r in records[1:]}
    first = rows['{"id":1,"k2":"ä"}'.encode()]
    assert {k: v for k, v in first.headers.items() if k != "valid_from"} == {
        "op": "upsert", "dataset": "types", "version": "1", "contract": "1"}
    assert contract.parse_time(first.headers["valid_from"]) <= datetime.now(UTC)
    assert json.loads(first.value) == {
        "id": 1, "k2": "ä", "price": "12345678901234567890.0123456789", "day": "2024-05-01",
        "at": "2024-05-01T12:00:00.123456", "stamp": "2024-05-01T12:00:00",
        "bin": base64.b64encode(b"\x00\xff\x10").decode(), "name": '日本語 ✓ "q"', "n": 7, "f": 0.1}
    assert json.loads(rows[b'{"id":2,"k2":"b"}'].value) == {
        "id": 2, "k2": "b", "price": "-0.5000000000", "day": None, "at": None, "stamp": None, "bin": None,
        "name": None, "n": None, "f": None}
    # The consumer's side of the contract decodes what was published back to the same values.
    decoded = contract.decode_values(schema, [first.value]).to_pylist()[0]
    assert str(decoded["price"]) == "12345678901234567890.0123456789" and decoded["bin"] == b"\x00\xff\x10"


def test_diff_mode_publishes_only_changes(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("devices"), unique("ref.devices")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, name VARCHAR(20), w DECIMAL(6,2))",
            f"INSERT INTO {t} VALUES (1,'a',1.00),(2,'b',2.00),(3,'c',3.00),(4,'d',4.00),(5,'e',5.00),(6,'f',6)")
    cfg = make_config({"devices": mysql_dataset(mysql_url, t, topic, max_delete_fraction=1)})
    refresher = Refresher(cfg)
    refresher.run("devices")
    execute(mysql_engine,
            f"UPDATE {t} SET name='B' WHERE id=2",                 # update
            f"DELETE FROM {t} WHERE id=3",                          # delete
            f"DELETE FROM {t} WHERE id=4", f"INSERT INTO {t} VALUES (4,'D',4.5)",   # delete + re-insert, new value
            f"DELETE FROM {t} WHERE id=5", f"INSERT INTO {t} VALUES (5,'e',5.00)",  # delete + re-insert, same value
            f"UPDATE {t} SET id=60 WHERE id=6",                     # primary-key change
            f"INSERT INTO {t} VALUES (7,'g',NULL)")                 # insert
    r = refresher.run("devices")
    assert (r.version, r.inserts, r.updates, r.deletes, r.published) == (2, 2, 2, 2, 6)
    records = read_topic(kafka, topic)
    v2 = [x for x in records if x.version == 2]
    assert all(x.headers["dataset"] == "devices" for x in v2)
    assert changes(records, 2) == {
        '{"id":2}': {"id": 2, "name": "B", "w": "2.00"},
        '{"id":3}': None,
        '{"id":4}': {"id": 4, "name": "D", "w": "4.50"},
        '{"id":6}': None,
        '{"id":60}': {"id": 60, "name": "f", "w": "6.00"},
        '{"id":7}': {"id": 7, "name": "g", "w": None},
    }
    assert {x.op for x in v2 if x.value is None} == {"delete"}
    # A consumer applying the whole topic holds exactly the table.
    view = table_view(records)
    assert sorted(v["id"] for v in view.values()) == sorted(r["id"] for r in db_rows(mysql_engine, f"SELECT id FROM {t}"))
    # Nothing changed: nothing published, the version still grows.
    again = refresher.run("devices")
    assert (again.version, again.published) == (3, 0)
    assert len(read_topic(kafka, topic)) == len(records)


def test_full_republishes_every_current_row(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("full"), unique("ref.full")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))", f"INSERT INTO {t} VALUES (1,'a'),(2,'b')")
    cfg = make_config({"full": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("full")
    r = Refresher(cfg).run("full", full=True)
    assert (r.kind, r.inserts, r.updates, r.published) == ("full", 0, 0, 3)
    v2 = [x for x in read_topic(kafka, topic) if x.version == 2]
    assert [x.op for x in v2] == ["schema", "upsert", "upsert"]
    assert changes(v2) == {'{"id":1}': {"id": 1, "v": "a"}, '{"id":2}': {"id": 2, "v": "b"}}


def test_duplicate_keys_are_refused_and_nothing_is_committed(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("dups"), unique("ref.dups")
    execute(mysql_engine, f"CREATE TABLE {t} (code VARCHAR(5), region VARCHAR(5), v INT)",
            f"INSERT INTO {t} VALUES ('a','eu',1),('b','eu',2)")
    cfg = make_config({"dups": {"source": {"url": mysql_url, "table": t}, "key": ["code", "region"], "topic": topic}})
    Refresher(cfg).run("dups")
    execute(mysql_engine, f"INSERT INTO {t} VALUES ('b','eu',3)", f"UPDATE {t} SET v=9 WHERE code='a'")
    with pytest.raises(DuplicateKey, match=r'dataset dups: duplicate key \{"code":"b","region":"eu"\}'):
        Refresher(cfg).run("dups")
    assert FileStateStore(cfg.state_dir).load("dups").version == 1
    assert len(read_topic(kafka, topic)) == 3  # the schema record and two rows of version 1 only
    st = read_status(cfg)[0]
    assert st["last_result"] == "failed" and "duplicate key" in st["last_error"] and st["version"] == 1


def test_schema_change_is_logged_and_published_before_the_rows(make_config, mysql_engine, mysql_url, unique,
                                                                kafka, caplog):
    t, topic = unique("schema"), unique("ref.schema")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5), old INT)",
            f"INSERT INTO {t} VALUES (1,'a',1),(2,'b',2)")
    cfg = make_config({"s": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("s")
    execute(mysql_engine, f"ALTER TABLE {t} ADD COLUMN price DECIMAL(8,3) DEFAULT 1.5, DROP COLUMN old, "
                          f"MODIFY v VARCHAR(5) NOT NULL")
    caplog.set_level(logging.WARNING, logger="refresh.runner")
    r = Refresher(cfg).run("s")
    assert r.schema_changed and (r.updates, r.published) == (2, 3)
    assert "schema change: added price decimal(8,3), dropped old" in caplog.text
    v2 = [x for x in read_topic(kafka, topic) if x.version == 2]
    assert v2[0].op == "schema"
    assert [c.name for c in contract.DatasetSchema.from_json(v2[0].value).columns] == ["id", "v", "price"]
    assert changes(v2) == {'{"id":1}': {"id": 1, "v": "a", "price": "1.500"},
                           '{"id":2}': {"id": 2, "v": "b", "price": "1.500"}}


def test_empty_source_is_refused_unless_allowed(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("empty"), unique("ref.empty")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} VALUES (1),(2)")
    cfg = make_config({"e": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("e")
    execute(mysql_engine, f"DELETE FROM {t}")
    with pytest.raises(EmptySnapshot, match="dataset e: .* read as empty; refusing to delete 2 published row"):
        Refresher(cfg).run("e")
    assert len(read_topic(kafka, topic)) == 3
    allowed = make_config({"e": mysql_dataset(mysql_url, t, topic, allow_empty=True)}, name="allowed.yaml")
    r = Refresher(allowed).run("e")
    assert (r.deletes, r.version) == (2, 2)
    assert changes(read_topic(kafka, topic), 2) == {'{"id":1}': None, '{"id":2}': None}


def test_query_failing_half_way_commits_nothing(make_config, mysql_engine, mysql_url, unique, kafka):
    t, side, topic = unique("half"), unique("side"), unique("ref.half")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"CREATE TABLE {side} (id INT, v INT)",
            f"INSERT INTO {t} VALUES (1),(2),(3),(4),(5),(6)", f"INSERT INTO {side} VALUES (1,1),(2,2),(3,3),(4,4),(5,5),(6,6)")
    query = f"SELECT id, (SELECT v FROM {side} s WHERE s.id = t.id) AS v FROM {t} t ORDER BY id"
    cfg = make_config({"h": {"source": {"url": mysql_url, "query": query, "chunk_rows": 2}, "key": ["id"], "topic": topic}})
    Refresher(cfg).run("h")
    # Row 5 now makes the subquery fail: the first chunks were read, then the query breaks.
    execute(mysql_engine, f"INSERT INTO {side} VALUES (5, 50)", f"UPDATE {side} SET v = v + 10 WHERE id < 3")
    with pytest.raises(TerminalError, match="dataset h: read on .* failed: .*Subquery returns more than 1 row"):
        Refresher(cfg).run("h")
    assert FileStateStore(cfg.state_dir).load("h").version == 1
    assert all(x.version == 1 for x in read_topic(kafka, topic))


def test_broker_down_during_publish_commits_nothing_and_the_next_run_publishes(
        make_config, mysql_engine, mysql_url, unique, tmp_path):
    t, topic = unique("down"), unique("ref.down")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)", f"INSERT INTO {t} VALUES (1,1),(2,2)")
    port = free_port()
    broker = EmbeddedBroker(port).start()
    try:
        settings = {"bootstrap_servers": broker.bootstrap, "message.timeout.ms": "3000"}
        cfg = make_config({"d": mysql_dataset(mysql_url, t, topic)}, kafka_settings=settings,
                          retry={"attempts": 1})
        Refresher(cfg).run("d")
        execute(mysql_engine, f"UPDATE {t} SET v = 20 WHERE id = 2", f"INSERT INTO {t} VALUES (3,3)")

        class BrokerDiesAfterPrepare(Publisher):
            def prepare(self, topic: str, partitions: int = 1, config: dict[str, str] | None = None) -> list[int]:
                parts = super().prepare(topic, partitions, config)
                broker.stop()
                return parts

        # Where the dead broker is noticed depends on the machine's speed: the sends, the transaction's
        # start or its commit; each fails the run with nothing committed.
        with pytest.raises(PublishError, match=r"topic .*: (0/2 messages acknowledged|cannot start a transaction|"
                                               r"transaction of \d+ messages not committed)"):
            Refresher(cfg, publisher_factory=BrokerDiesAfterPrepare).run("d")
        store = FileStateStore(cfg.state_dir)
        assert store.load("d").version == 1
        assert store.reserved("d") == 2   # the failed run's number is not reused
        assert store.load_snapshot("d", store.load("d")).num_rows == 2
        # The new snapshot, written while the run published, was removed with the failed run.
        assert sorted(p.name for p in (cfg.state_dir / "d").glob("*snapshot*")) == ["snapshot-0000000001.arrow"]
        st = read_status(cfg)[0]
        assert st["last_result"] == "failed" and st["consecutive_failures"] == 1

        # A new (empty, in-memory) broker on the same address: the run finds the topic gone and
        # republishes the whole table, the changes included.
        broker = EmbeddedBroker(port).start()
        r = Refresher(cfg).run("d")
        assert (r.version, r.inserts, r.updates, r.kind) == (3, 1, 1, "republish")
        assert changes(read_topic({"bootstrap.servers": broker.bootstrap}, topic)) == {
            '{"id":1}': {"id": 1, "v": 1}, '{"id":2}': {"id": 2, "v": 20}, '{"id":3}': {"id": 3, "v": 3}}
        assert read_status(cfg)[0]["last_result"] == "ok"
    finally:
        broker.stop()


def test_unreachable_broker_is_retried_with_a_log_line_per_attempt(make_config, mysql_engine, mysql_url, unique,
                                                                   caplog):
    t = unique("nobroker")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} VALUES (1)")
    cfg = make_config({"n": mysql_dataset(mysql_url, t, unique("ref.n"))},
                      kafka_settings={"bootstrap_servers": f"127.0.0.1:{free_port()}"},
                      retry={"attempts": 2, "initial": "100ms"})
    caplog.set_level(logging.WARNING)
    with pytest.raises(TransientError):
        Refresher(cfg, publisher_factory=lambda s: Publisher(s, topic_timeout=1.5)).run("n")
    assert "dataset n: publish to" in caplog.text and "attempt 1/2" in caplog.text
    assert FileStateStore(cfg.state_dir).load("n").version == 0


def test_same_dataset_is_never_refreshed_twice_at_once(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("busy"), unique("ref.busy")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)", f"INSERT INTO {t} VALUES (1,1)")
    cfg = make_config({"b": mysql_dataset(mysql_url, t, topic)})
    refresher = Refresher(cfg)
    store = FileStateStore(cfg.state_dir)
    with store.lock("b"):  # as a run in another thread or process would
        with pytest.raises(DatasetBusy, match="dataset b: a refresh is already running"):
            refresher.run("b", wait=False)
        done: list = []
        waiter = threading.Thread(target=lambda: done.append(refresher.run("b")))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not done  # wait=True waits for the holder
    waiter.join(60)
    assert done and done[0].version == 1
    # Many threads at once: every run completes, versions are consecutive, no state is lost.
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(refresher.run("b"))) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert sorted(r.version for r in results) == [2, 3, 4, 5]
    assert store.load("b").version == 5


def test_schema_record_goes_to_every_partition(make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("parts"), unique("ref.parts")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)",
            f"INSERT INTO {t} VALUES " + ",".join(f"({i})" for i in range(40)))
    cfg = make_config({"p": mysql_dataset(mysql_url, t, topic, partitions=3)})
    Refresher(cfg).run("p")
    records = read_topic(kafka, topic)
    by_part: dict[int, list] = {}
    for r in records:
        by_part.setdefault(r.partition, []).append(r)
    assert sorted(by_part) == [0, 1, 2]
    for recs in by_part.values():
        assert sorted(recs, key=lambda r: r.offset)[0].op == "schema"
    assert len(table_view(records)) == 40


def test_file_dataset_end_to_end(make_config, tmp_path: Path, unique, kafka):
    topic = unique("ref.sites")
    p = tmp_path / "sites.csv"
    p.write_text("site_id,name\n007,Zürich\n008,Basel\n")
    cfg = make_config({"sites": {"source": {"path": str(p), "types": {"site_id": "string"}}, "key": ["site_id"],
                                 "topic": topic, "watch": True, "max_delete_fraction": 1}})
    Refresher(cfg).run("sites")
    p.write_text("site_id,name\n007,Zürich HB\n009,Bern\n")
    r = Refresher(cfg).run("sites")
    assert (r.inserts, r.updates, r.deletes) == (1, 1, 1)
    assert changes(read_topic(kafka, topic), 2) == {
        '{"site_id":"007"}': {"site_id": "007", "name": "Zürich HB"}, '{"site_id":"008"}': None,
        '{"site_id":"009"}': {"site_id": "009", "name": "Bern"}}
    p.write_text("site_id,name\n007,Zürich HB\n009\n")
    with pytest.raises(DataError, match=rf"dataset sites: {p}:3: expected 2 fields, got 1"):
        Refresher(cfg).run("sites")
    p.write_text("")
    with pytest.raises(EmptySnapshot, match=rf"dataset sites: {p} read as empty"):
        Refresher(cfg).run("sites")
    assert FileStateStore(cfg.state_dir).load("sites").version == 2


def test_sqlite_end_to_end(make_config, tmp_path: Path, unique, kafka):
    url, topic = f"sqlite:///{tmp_path / 'ref.db'}", unique("ref.lite")
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE m (id INTEGER PRIMARY KEY, name TEXT, note TEXT)",
            "INSERT INTO m VALUES (1, 'a', NULL), (2, 'b', 'x')")
    cfg = make_config({"m": {"source": {"url": url, "table": "m"}, "key": ["id"], "topic": topic}})
    Refresher(cfg).run("m")
    execute(engine, "UPDATE m SET note = NULL WHERE id = 2")  # the column is all NULL now: keeps its type
    r = Refresher(cfg).run("m")
    assert (r.updates, r.schema_changed) == (1, False)
    assert changes(read_topic(kafka, topic), 2) == {'{"id":2}': {"id": 2, "name": "b", "note": None}}


def test_postgresql_end_to_end(make_config, unique, kafka):
    url, t, topic = "postgresql+psycopg2://postgres@127.0.0.1:5432/test", unique("pgm"), unique("ref.pg")
    engine = sa.create_engine(url)
    execute(engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, price NUMERIC(10,2), at TIMESTAMPTZ)",
            f"INSERT INTO {t} VALUES (1, 9.99, '2024-05-01 12:00+02'), (2, NULL, NULL)")
    try:
        cfg = make_config({"pg": {"source": {"url": url, "table": t}, "key": ["id"], "topic": topic,
                                  "max_delete_fraction": 1}})
        Refresher(cfg).run("pg")
        assert changes(read_topic(kafka, topic)) == {
            '{"id":1}': {"id": 1, "price": "9.99", "at": "2024-05-01T10:00:00+00:00"},
            '{"id":2}': {"id": 2, "price": None, "at": None}}
        execute(engine, f"UPDATE {t} SET price = 10.5 WHERE id = 1", f"DELETE FROM {t} WHERE id = 2")
        r = Refresher(cfg).run("pg")
        assert (r.version, r.updates, r.deletes, r.published) == (2, 1, 1, 2)
        assert changes(read_topic(kafka, topic), 2) == {
            '{"id":1}': {"id": 1, "price": "10.50", "at": "2024-05-01T10:00:00+00:00"}, '{"id":2}': None}
    finally:
        execute(engine, f"DROP TABLE {t}")
        engine.dispose()


def test_stop_during_a_read_commits_nothing(make_config, mysql_engine, mysql_url, unique, kafka):
    from refresh.errors import Stopped

    t, topic = unique("stop"), unique("ref.stop")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)",
            f"INSERT INTO {t} VALUES " + ",".join(f"({i})" for i in range(50)))
    cfg = make_config({"s": {"source": {"url": mysql_url, "table": t, "chunk_rows": 10}, "key": ["id"],
                             "topic": topic}})
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped, match="dataset s: stopped while reading"):
        Refresher(cfg).run("s", stop=stop)
    assert FileStateStore(cfg.state_dir).load("s").version == 0
    status = read_status(cfg)[0]
    assert (status["last_result"], status["consecutive_failures"]) == ("interrupted", 0)
    assert Refresher(cfg).run("s").published == 51


def topic_config(kafka: dict[str, str], topic: str) -> dict[str, str]:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    client = AdminClient(dict(kafka))  # kept referenced until the answer arrives
    futures = client.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
    return {k: v.value for k, v in next(iter(futures.values())).result(10).items()}


def test_topic_is_created_compacted_and_keys_follow_the_declared_order(make_config, mysql_engine, mysql_url,
                                                                        unique, kafka, caplog):
    t, topic = unique("order"), unique("ref.order")
    execute(mysql_engine, f"CREATE TABLE {t} (code VARCHAR(5), region VARCHAR(5), v INT, PRIMARY KEY (code, region))",
            f"INSERT INTO {t} VALUES ('a','eu',1),('a','us',2)")
    # Declared key order differs from the table's column order: the key bytes follow the declaration.
    cfg = make_config({"o": {"source": {"url": mysql_url, "table": t}, "key": ["region", "code"], "topic": topic,
                             "max_delete_fraction": 1}})
    caplog.set_level(logging.INFO, logger="refresh.runner")
    r = Refresher(cfg).run("o")
    assert topic_config(kafka, topic)["cleanup.policy"] == "compact"
    # Records stay a day before compaction may remove them: a restarted job finds its recorded positions.
    assert topic_config(kafka, topic)["min.compaction.lag.ms"] == str(24 * 3600 * 1000)
    assert set(changes(read_topic(kafka, topic))) == {'{"region":"eu","code":"a"}', '{"region":"us","code":"a"}'}
    assert schemas(read_topic(kafka, topic))[0].key == ("region", "code")
    # The per-run log line: dataset, version, rows read, inserts/updates/deletes, messages, time.
    line = next(m for m in caplog.messages if m.startswith("dataset o: version 1"))
    assert f"dataset o: version 1 (diff): read 2 rows, 2 inserts, 0 updates, 0 deletes, 3 messages published " \
           f"in {r.seconds:.2f}s" in line
    # A composite key change: tombstone for the old key, upsert for the new one.
    execute(mysql_engine, f"UPDATE {t} SET region = 'ap' WHERE region = 'us'")
    r2 = Refresher(cfg).run("o")
    assert (r2.inserts, r2.updates, r2.deletes) == (1, 0, 1)
    assert changes(read_topic(kafka, topic), 2) == {'{"region":"us","code":"a"}': None,
                                                    '{"region":"ap","code":"a"}': {"code": "a", "region": "ap", "v": 2}}


def test_retyped_column_is_published_and_logged(make_config, mysql_engine, mysql_url, unique, kafka, caplog):
    t, topic = unique("retype"), unique("ref.retype")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, w INT, n INT)",
            f"INSERT INTO {t} VALUES (1, 10, 1), (2, 20, 2)")
    cfg = make_config({"r": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("r")
    execute(mysql_engine, f"ALTER TABLE {t} MODIFY w DECIMAL(6,1), MODIFY n VARCHAR(8)")
    caplog.set_level(logging.WARNING, logger="refresh.runner")
    r = Refresher(cfg).run("r")
    assert r.ok and r.schema_changed and (r.updates, r.published) == (2, 3)
    assert "schema change: retyped w int64 -> decimal(6,1), retyped n int64 -> string" in caplog.text
    v2 = [x for x in read_topic(kafka, topic) if x.version == 2]
    assert {c.name: c.type for c in schemas(v2)[0].columns} == {"id": "int64", "w": "decimal(6,1)", "n": "string"}
    assert changes(v2) == {'{"id":1}': {"id": 1, "w": "10.0", "n": "1"}, '{"id":2}': {"id": 2, "w": "20.0", "n": "2"}}
    assert Refresher(cfg).run("r").published == 0  # the new shape is the baseline now


def test_unreachable_database_is_retried_logged_and_shown_in_status(make_config, unique, caplog):
    url = f"mysql+pymysql://root@127.0.0.1:{free_port()}/nowhere"
    cfg = make_config({"db": mysql_dataset(url, "t", unique("ref.db"))}, retry={"attempts": 3, "initial": "50ms"})
    caplog.set_level(logging.WARNING)
    with pytest.raises(TransientError, match="dataset db: query on .* failed"):
        Refresher(cfg).run("db")
    attempts = [m for m in caplog.messages if m.startswith("dataset db: read snapshot failed (attempt")]
    assert [m.split("(attempt ")[1][:3] for m in attempts] == ["1/3", "2/3"]
    assert any("dataset db: read snapshot failed after 3 attempts" in m for m in caplog.messages)
    st = read_status(cfg)[0]
    assert (st["last_result"], st["version"], st["consecutive_failures"]) == ("failed", 0, 1)
    assert "query on mysql+pymysql://root@127.0.0.1" in st["last_error"]
    assert not (cfg.state_dir / "db" / "state.json").exists()


def test_crash_between_publish_and_commit_republishes_harmlessly(make_config, mysql_engine, mysql_url, unique,
                                                                  kafka):
    t, topic = unique("crash"), unique("ref.crash")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v INT)", f"INSERT INTO {t} VALUES (1,1),(2,2)")
    cfg = make_config({"c": mysql_dataset(mysql_url, t, topic, max_delete_fraction=1)})
    Refresher(cfg).run("c")
    execute(mysql_engine, f"UPDATE {t} SET v = 20 WHERE id = 2", f"DELETE FROM {t} WHERE id = 1")

    class CrashingStore(FileStateStore):
        def commit(self, dataset, state, snapshot):
            raise OSError("power cut before the commit")

    with pytest.raises(OSError, match="power cut"):
        Refresher(cfg, store=CrashingStore(cfg.state_dir)).run("c")
    first_try = changes(read_topic(kafka, topic), 2)
    assert first_try == {'{"id":1}': None, '{"id":2}': {"id": 2, "v": 20}}  # acknowledged, not committed
    assert FileStateStore(cfg.state_dir).load("c").version == 1
    assert sorted(p.name for p in (cfg.state_dir / "c").glob("*snapshot*")) == ["snapshot-0000000001.arrow"]
    r = Refresher(cfg).run("c")  # the next run sends the same changes again, under a new version
    assert (r.version, r.updates, r.deletes) == (3, 1, 1)
    records = read_topic(kafka, topic)
    for part in {x.partition for x in records}:  # versions never go back in a partition
        seen = [x.version for x in records if x.partition == part]
        assert seen == sorted(seen)
    assert len([x for x in records if x.version == 2]) == 2 and len([x for x in records if x.version == 3]) == 2
    assert table_view(records) == {'{"id":2}': {"id": 2, "v": 20}}
    assert Refresher(cfg).run("c").published == 0
    # The run without changes writes no new snapshot (and leaves none behind).
    assert sorted(p.name for p in (cfg.state_dir / "c").glob("*snapshot*")) == ["snapshot-0000000003.arrow"]


def test_jsonl_glob_and_parquet_files_end_to_end(make_config, tmp_path: Path, unique, kafka):
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "a.jsonl").write_text('{"id": "x1", "n": 1, "tag": "ü"}\n{"id": "x2", "n": 2, "tag": null}\n')
    (parts / "b.jsonl").write_text('{"id": "x3", "n": 3, "tag": "c"}\n')
    pth = tmp_path / "m.parquet"
    at = dt.datetime(2024, 5, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32()),
                             "at": pa.array([at, None], pa.timestamp("us", tz="Europe/Paris")),
                             "b": [b"\x01\x02", None], "p": pa.array([None, None], pa.decimal128(5, 2))}), pth)
    jt, pt = unique("ref.jl"), unique("ref.pq")
    cfg = make_config({"jl": {"source": {"path": str(parts / "*.jsonl")}, "key": ["id"], "topic": jt,
                              "max_delete_fraction": 1},
                       "pq": {"source": {"path": str(pth)}, "key": ["id"], "topic": pt}})
    assert (Refresher(cfg).run("jl").rows, Refresher(cfg).run("pq").rows) == (3, 2)
    assert changes(read_topic(kafka, jt)) == {
        '{"id":"x1"}': {"id": "x1", "n": 1, "tag": "ü"}, '{"id":"x2"}': {"id": "x2", "n": 2, "tag": None},
        '{"id":"x3"}': {"id": "x3", "n": 3, "tag": "c"}}
    assert changes(read_topic(kafka, pt)) == {
        '{"id":1}': {"id": 1, "at": "2024-05-01T10:00:00+00:00", "b": "AQI=", "p": None},
        '{"id":2}': {"id": 2, "at": None, "b": None, "p": None}}
    assert {c.name: c.type for c in schemas(read_topic(kafka, pt))[0].columns}["at"] == "timestamp_tz"
    # One file of the glob changes, another is removed: one dataset, one change set.
    (parts / "b.jsonl").unlink()
    (parts / "a.jsonl").write_text('{"id": "x1", "n": 10, "tag": "ü"}\n{"id": "x2", "n": 2, "tag": null}\n')
    r = Refresher(cfg).run("jl")
    assert (r.inserts, r.updates, r.deletes) == (0, 1, 1)
    assert changes(read_topic(kafka, jt), 2) == {'{"id":"x1"}': {"id": "x1", "n": 10, "tag": "ü"}, '{"id":"x3"}': None}


def test_allowed_empty_file_deletes_every_row(make_config, tmp_path: Path, unique, kafka):
    p, topic = tmp_path / "s.csv", unique("ref.allowed")
    p.write_text("id,v\n1,a\n2,b\n")
    cfg = make_config({"s": {"source": {"path": str(p)}, "key": ["id"], "topic": topic, "allow_empty": True}})
    Refresher(cfg).run("s")
    p.write_text("")  # zero bytes, not even a header
    r = Refresher(cfg).run("s")
    assert (r.ok, r.deletes, r.schema_changed) == (True, 2, False)
    assert changes(read_topic(kafka, topic), 2) == {'{"id":1}': None, '{"id":2}': None}
    p.write_text("id,v\n3,c\n")
    assert Refresher(cfg).run("s").inserts == 1


# ------------------------------------------------------------------ partial sources (max_delete_fraction)

def test_a_table_losing_half_its_rows_is_refused_until_deletes_are_allowed(
        make_config, mysql_engine, mysql_url, unique, kafka):
    t, topic = unique("half_gone"), unique("ref.half_gone")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))",
            f"INSERT INTO {t} SELECT seq, 'a' FROM seq_1_to_10")
    cfg = make_config({"h": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("h")
    store = FileStateStore(cfg.state_dir)
    before, published = store.load("h"), len(read_topic(kafka, topic))
    # A table being reloaded (or a query cut short) reads half of it, and one row changed meanwhile.
    execute(mysql_engine, f"DELETE FROM {t} WHERE id > 5", f"UPDATE {t} SET v = 'b' WHERE id = 1")
    with pytest.raises(TooManyDeletes) as err:
        Refresher(cfg).run("h")
    assert str(err.value) == (
        "dataset h: would delete 5 of 10 rows (limit 0.1, max_delete_fraction); refused, nothing published: "
        "a partial source? If the deletes are meant, run `refresh run h --allow-deletes`")
    assert len(read_topic(kafka, topic)) == published  # not even the update
    assert store.load("h") == before
    st = read_status(cfg)[0]
    assert (st["last_result"], st["consecutive_failures"], st["version"]) == ("refused", 0, 1)
    assert st["last_error"] == str(err.value)

    r = Refresher(cfg).run("h", allow_deletes=True)
    assert (r.ok, r.deletes, r.updates, r.version) == (True, 5, 1, 2)
    assert changes(read_topic(kafka, topic), 2) == {
        **{f'{{"id":{i}}}': None for i in range(6, 11)}, '{"id":1}': {"id": 1, "v": "b"}}
    # Allowed for that run only: the next loss is refused again; a loss within the limit is not.
    execute(mysql_engine, f"DELETE FROM {t} WHERE id > 3")
    with pytest.raises(TooManyDeletes, match="would delete 2 of 5 rows"):
        Refresher(cfg).run("h")
    execute(mysql_engine, f"INSERT INTO {t} SELECT seq, 'c' FROM seq_4_to_10", f"DELETE FROM {t} WHERE id = 10")
    assert Refresher(cfg).run("h").deletes == 0
    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 9")  # 1 of 9 is more than 0.1 of them
    with pytest.raises(TooManyDeletes, match="would delete 1 of 9 rows"):
        Refresher(cfg).run("h")
    execute(mysql_engine, f"INSERT INTO {t} VALUES (9, 'c'), (10, 'c')")
    assert Refresher(cfg).run("h").inserts == 1
    execute(mysql_engine, f"DELETE FROM {t} WHERE id = 10")  # 1 of 10: at the limit, published
    assert Refresher(cfg).run("h").deletes == 1


def test_a_csv_cut_mid_write_is_refused(make_config, tmp_path: Path, unique, kafka):
    p, topic = tmp_path / "sites.csv", unique("ref.cut")
    full = "site_id,name\n" + "".join(f"s{i:02d},Site number {i}\n" for i in range(20))
    p.write_text(full)
    cfg = make_config({"sites": {"source": {"path": str(p), "stable_for": "100ms"}, "key": ["site_id"],
                                 "topic": topic}})
    Refresher(cfg).run("sites")
    published = read_topic(kafka, topic)
    p.write_text(full[: len(full) * 2 // 5])  # the writer died mid-line: 7 rows and a cut one
    with pytest.raises(TooManyDeletes, match=r"dataset sites: would delete 12 of 20 rows \(limit 0.1"):
        Refresher(cfg).run("sites")
    assert read_topic(kafka, topic) == published
    assert FileStateStore(cfg.state_dir).load("sites").version == 1


def test_a_glob_missing_one_file_is_refused(make_config, tmp_path: Path, unique, kafka):
    parts, topic = tmp_path / "parts", unique("ref.parts")
    parts.mkdir()
    for n in range(3):
        (parts / f"part-{n}.csv").write_text("id,v\n" + "".join(f"{n * 10 + i},x\n" for i in range(5)))
    cfg = make_config({"p": {"source": {"path": str(parts / "part-*.csv"), "stable_for": "100ms"}, "key": ["id"],
                             "topic": topic}})
    assert Refresher(cfg).run("p").inserts == 15
    published = read_topic(kafka, topic)
    (parts / "part-1.csv").unlink()  # an export replacing its files one by one
    with pytest.raises(TooManyDeletes, match="dataset p: would delete 5 of 15 rows"):
        Refresher(cfg).run("p")
    assert read_topic(kafka, topic) == published
    assert read_status(cfg)[0]["last_result"] == "refused"


# ------------------------------------------------------------------ the topic is part of the state

def delete_topic(kafka: dict[str, str], topic: str) -> None:
    from refstream.kafka import admin, partitions_of

    admin(kafka).delete_topics([topic], operation_timeout=10)[topic].result(10)
    deadline = time.monotonic() + bound(20)
    while partitions_of(kafka, topic):
        assert time.monotonic() < deadline, f"topic {topic} still listed after its deletion"
        time.sleep(0.1)


def test_a_deleted_or_recreated_topic_gets_the_whole_dataset_again(make_config, mysql_engine, mysql_url,
                                                                  unique, kafka, caplog):
    from refstream.kafka import ensure_topic

    t, topic = unique("lost"), unique("ref.lost")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))",
            f"INSERT INTO {t} VALUES (1,'a'),(2,'b'),(3,'c')")
    cfg = make_config({"l": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("l")
    execute(mysql_engine, f"UPDATE {t} SET v = 'B' WHERE id = 2")
    delete_topic(kafka, topic)
    caplog.set_level(logging.WARNING, logger="refresh.runner")
    r = Refresher(cfg).run("l")
    assert (r.kind, r.version, r.published) == ("republish", 2, 4)
    assert r.reason == "topic does not exist (deleted?)"
    assert f"dataset l: topic {topic}: topic does not exist (deleted?); republishing the whole dataset" in caplog.text
    records = read_topic(kafka, topic)
    assert [x.op for x in records] == ["schema", "upsert", "upsert", "upsert"] and {x.version for x in records} == {2}
    assert table_view(records) == {'{"id":1}': {"id": 1, "v": "a"}, '{"id":2}': {"id": 2, "v": "B"},
                                   '{"id":3}': {"id": 3, "v": "c"}}
    st = read_status(cfg)[0]
    assert (st["last_kind"], st["last_reason"]) == ("republish", "topic does not exist (deleted?)")
    assert "l: last run republished everything: topic does not exist (deleted?)" in format_status(read_status(cfg))

    # The topic unchanged: a normal run, nothing republished.
    again = Refresher(cfg).run("l")
    assert (again.kind, again.published, again.reason) == ("diff", 0, None)
    assert len(read_topic(kafka, topic)) == 4

    # Deleted and recreated empty by someone else (a new topic starts again at offset 0).
    delete_topic(kafka, topic)
    ensure_topic(kafka, topic, partitions=1)
    r = Refresher(cfg).run("l")
    assert r.kind == "republish" and r.published == 4
    assert r.reason.startswith("partition 0 ends at offset 0, below the ") and "recreated" in r.reason
    assert len(read_topic(kafka, topic)) == 4
    assert Refresher(cfg).run("l").kind == "diff"


def test_a_renamed_topic_gets_the_whole_dataset(make_config, mysql_engine, mysql_url, unique, kafka):
    t, old, new = unique("moved"), unique("ref.old"), unique("ref.new")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))", f"INSERT INTO {t} VALUES (1,'a'),(2,'b')")
    Refresher(make_config({"m": mysql_dataset(mysql_url, t, old)})).run("m")
    cfg = make_config({"m": mysql_dataset(mysql_url, t, new)}, name="renamed.yaml")  # same state_dir
    r = Refresher(cfg).run("m")
    assert (r.kind, r.published, r.reason) == ("republish", 3, f"topic changed from {old} to {new} in the config")
    records = read_topic(kafka, new)
    assert records[0].op == "schema" and schemas(records)[0].key == ("id",)
    assert table_view(records) == {'{"id":1}': {"id": 1, "v": "a"}, '{"id":2}': {"id": 2, "v": "b"}}
    assert len(read_topic(kafka, old)) == 3  # the old topic is left as it was
    assert FileStateStore(cfg.state_dir).load("m").topic == new
    assert Refresher(cfg).run("m").kind == "diff"


def processlist(engine: sa.Engine, table: str) -> list[str]:
    """States of the server's sessions running a statement on ``table`` (other than this one)."""
    return [r["state"] for r in db_rows(engine, "SELECT state, info FROM information_schema.processlist "
                                                "WHERE id <> CONNECTION_ID()")
            if r["info"] and table in r["info"]]


@pytest.mark.timeout(120)  # without a statement timeout the read waits for the lock (a day by default)
def test_a_read_stuck_on_a_locked_table_times_out_naming_the_dataset(make_config, mysql_engine, mysql_url, unique,
                                                                      kafka):
    t, topic = unique("locked"), unique("ref.locked")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(10))", f"INSERT INTO {t} VALUES (1, 'a')")
    ds = {"source": {"url": mysql_url, "table": t, "statement_timeout": "2s"}, "key": ["id"], "topic": topic}
    cfg = make_config({"L": ds})
    Refresher(cfg).run("L")
    execute(mysql_engine, f"INSERT INTO {t} VALUES (2, 'b')")
    with mysql_engine.connect() as holder:
        holder.execute(sa.text(f"LOCK TABLES {t} WRITE"))
        t0 = time.monotonic()
        with pytest.raises(TerminalError, match=f"dataset L: query on .*table {t} timed out after "
                                                f"statement_timeout 2s") as info:
            Refresher(cfg).run("L")
        assert 1.5 < time.monotonic() - t0 < bound(10)
        assert not isinstance(info.value, TransientError)  # not retried within the run
        holder.execute(sa.text("UNLOCK TABLES"))
    assert FileStateStore(cfg.state_dir).load("L").version == 1
    assert {r.version for r in read_topic(kafka, topic)} == {1}
    assert read_status(cfg)[0]["last_result"] == "failed"
    assert Refresher(cfg).run("L").inserts == 1


@pytest.mark.timeout(120)
def test_a_stop_interrupts_a_read_stuck_on_a_locked_table(make_config, mysql_engine, mysql_url, unique, kafka):
    from refresh.errors import Stopped

    t, topic = unique("stuck"), unique("ref.stuck")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} VALUES (1)")
    cfg = make_config({"s": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic}})
    stop = threading.Event()
    with mysql_engine.connect() as holder:
        holder.execute(sa.text(f"LOCK TABLES {t} WRITE"))
        try:
            threading.Timer(1.5, stop.set).start()
            t0 = time.monotonic()
            with pytest.raises(Stopped, match="dataset s: stopped while reading"):
                Refresher(cfg).run("s", stop=stop)
            assert time.monotonic() - t0 < bound(5)
            deadline = time.monotonic() + bound(5)  # the server dropped the statement too (KILL)
            while processlist(mysql_engine, t) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert processlist(mysql_engine, t) == []
        finally:
            holder.execute(sa.text("UNLOCK TABLES"))
    assert FileStateStore(cfg.state_dir).load("s").version == 0
    assert read_status(cfg)[0]["last_result"] == "interrupted"


def test_a_run_with_new_or_gone_keys_stages_its_snapshot_before_comparing_values(
        make_config, tmp_path: Path, unique, kafka, monkeypatch):
    import refresh.diff as diff_module
    topic = unique("ref.sites")
    p = tmp_path / "sites.csv"
    p.write_text("site_id,name\n1,a\n2,b\n3,c\n")
    cfg = make_config({"sites": {"source": {"path": str(p)}, "key": ["site_id"], "topic": topic,
                                 "max_delete_fraction": 1}})
    Refresher(cfg).run("sites")
    store_dir = cfg.state_dir / "sites"
    events: list[str] = []
    compare = diff_module._changed_rows

    def spy(*args, **kwargs):
        events.append("compare")
        return compare(*args, **kwargs)

    real_stage = FileStateStore.stage_snapshot

    def staging(self, dataset, version, table, valid_from=None):
        events.append("stage")
        return real_stage(self, dataset, version, table, valid_from)

    monkeypatch.setattr(diff_module, "_changed_rows", spy)
    monkeypatch.setattr(FileStateStore, "stage_snapshot", staging)
    p.write_text("site_id,name\n1,a\n2,B\n4,d\n")  # an update, a delete, an insert
    r = Refresher(cfg).run("sites")
    assert (r.inserts, r.updates, r.deletes) == (1, 1, 1)
    # Staged before the values were compared (its write waits for the rows' valid-from times, which
    # the comparison settles, and overlaps the publish).
    assert events == ["stage", "compare"]
    stored = FileStateStore(cfg.state_dir).load_snapshot("sites", FileStateStore(cfg.state_dir).load("sites"))
    assert stored.drop_columns([VALID_FROM_COLUMN]).to_pylist() == [
        {"site_id": 1, "name": "a"}, {"site_id": 2, "name": "B"}, {"site_id": 4, "name": "d"}]

    events.clear()
    p.write_text("site_id,name\n1,A\n2,B\n4,d\n")  # only a value changes: staged after the comparison
    r = Refresher(cfg).run("sites")
    assert (r.inserts, r.updates, r.deletes) == (0, 1, 0)
    assert events == ["compare", "stage"]
    assert sorted(x.name for x in store_dir.glob("*snapshot*")) == ["snapshot-0000000003.arrow"]


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_topic_recreated_during_a_run_gets_nothing_committed_and_the_next_run_republishes(
        make_config, mysql_engine, mysql_url, unique, kafka, partitions: int):
    """Every run publishes (its heartbeat at least), so a topic replaced between a run's check and its
    publish must not be taken for the one checked: with other partitions nothing is published to it,
    with the same ones its ends, found below those checked, fail the run before its commit."""
    from refstream.kafka import ensure_topic

    t, topic = unique("swap"), unique("ref.swap")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))", f"INSERT INTO {t} VALUES (1,'a')")
    cfg = make_config({"s": mysql_dataset(mysql_url, t, topic)})
    Refresher(cfg).run("s")
    committed = FileStateStore(cfg.state_dir).load("s")

    class Swapping(Publisher):
        def prepare(self, *args, **kwargs):  # the topic recreated just after the run's check
            delete_topic(kafka, topic)
            ensure_topic(kafka, topic, partitions=partitions)
            return super().prepare(*args, **kwargs)

    with pytest.raises(TopicChanged, match=f"dataset s: topic {topic} "):
        Refresher(cfg, publisher_factory=Swapping).run("s")
    assert FileStateStore(cfg.state_dir).load("s") == committed
    beats = [r for r in read_topic(kafka, topic, heartbeats=True) if r.op == contract.OP_HEARTBEAT]
    assert len(beats) == (1 if partitions == 1 else 0)  # published, or refused before publishing
    r = Refresher(cfg).run("s")
    assert r.kind == "republish" and table_view(read_topic(kafka, topic)) == {'{"id":1}': {"id": 1, "v": "a"}}
