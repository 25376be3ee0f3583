"""Client presets and the client cache (no broker needed)."""

from __future__ import annotations

import logging

from refstream import kafka
from refstream.logs import RepeatSuppressor


def test_role_defaults_give_way_to_settings_and_forced_settings_do_not():
    conf = kafka.PRODUCERS["publisher"].conf({"linger.ms": "5", "enable.idempotence": "false"}, {})
    assert conf["linger.ms"] == "5"
    assert conf["enable.idempotence"] == "true"
    assert conf["acks"] == "all"


def test_overrides_win_over_settings():
    conf = kafka.PRODUCERS["bulk"].conf({"linger.ms": 1}, {"linger.ms": 50})
    assert conf["linger.ms"] == 50 and conf["compression.type"] == "lz4"


def test_every_consumer_role_reads_committed_records_without_a_group():
    for role, preset in kafka.CONSUMERS.items():
        conf = preset.conf({"bootstrap.servers": "x:1"}, {})
        assert conf["isolation.level"] == "read_committed", role
        assert conf["enable.auto.commit"] is False and conf["enable.partition.eof"] is True, role
    probe = kafka.CONSUMERS["probe"].conf({"fetch.wait.max.ms": 500}, {})
    assert probe["fetch.wait.max.ms"] == 20  # the probe's own tuning is not overridable


def test_client_cache_keys_by_settings_and_lets_the_least_recently_used_go():
    made: list[dict] = []
    closed: list[dict] = []

    def make(settings):
        made.append(dict(settings))
        return dict(settings)

    cache = kafka.ClientCache(make, size=2, close=closed.append)
    a = cache.get({"bootstrap.servers": "a", "x": 1})
    assert cache.get({"x": "1", "bootstrap.servers": "a"}) is a  # order and value type do not matter
    cache.get({"bootstrap.servers": "b"})
    cache.get({"bootstrap.servers": "a", "x": 1})  # a is now the most recently used
    cache.get({"bootstrap.servers": "c"})
    assert closed == [{"bootstrap.servers": "b"}]
    assert len(made) == 3
    cache.clear()
    assert len(closed) == 3


def test_client_cache_lets_go_of_the_clients_of_a_stopped_broker_only():
    closed: list[dict] = []
    cache = kafka.ClientCache(dict, close=closed.append)
    cache.get({"bootstrap.servers": "a:1", "x": 1})
    cache.get({"bootstrap.servers": "a:1"})
    kept = cache.get({"bootstrap.servers": "b:1"})
    cache.discard("a:1")
    assert closed == [{"bootstrap.servers": "a:1", "x": 1}, {"bootstrap.servers": "a:1"}]
    assert cache.get({"bootstrap.servers": "b:1"}) is kept


def test_every_client_logs_through_one_repeat_suppressor_per_logger(monkeypatch):
    built: list[tuple[str, dict]] = []

    class Fake:
        def __init__(self, conf: dict) -> None:
            built.append((type(self).__name__, conf))

        def close(self) -> None:
            pass

    for name in ("Producer", "Consumer", "AdminClient"):
        monkeypatch.setattr(kafka, name, type(name, (Fake,), {}))
    monkeypatch.setattr(kafka, "_Producer", type("Producer", (Fake,), {}))  # what producer() builds
    monkeypatch.setattr(kafka, "_ADMINS", kafka.ClientCache(kafka._new_admin))
    monkeypatch.setattr(kafka, "_SHARED", {})
    settings = {"bootstrap.servers": "127.0.0.1:1"}
    kafka.producer(settings, role="publisher")
    kafka.consumer(settings, role="probe")
    kafka.shared_consumer({**settings, "x": 1}, role="fetch")
    admin = kafka.admin(settings)
    kafka.admin(settings, cached=False)
    tail = logging.getLogger("demo.tail")
    kafka.consumer(settings, logger=tail)  # a caller's logger: its repeats are counted too

    assert [kind for kind, _ in built] == ["Producer", "Consumer", "Consumer", "AdminClient", "AdminClient",
                                           "Consumer"]
    loggers = [conf["logger"] for _, conf in built]
    assert all(isinstance(lg, RepeatSuppressor) for lg in loggers)
    # One suppressor per logger, shared by its clients: a line repeated by several clients counts once.
    assert all(lg is loggers[0] for lg in loggers[:5]) and loggers[0].logger is kafka.LIBRDKAFKA_LOG
    assert loggers[5].logger is tail and loggers[0].window == kafka.REPEAT_WINDOW == 60.0
    assert admin in set(kafka._polled)  # admin clients are polled by the log pump: nobody else polls them
