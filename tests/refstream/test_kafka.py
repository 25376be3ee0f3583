"""Client presets and the client cache (no broker needed)."""

from __future__ import annotations

from refstream import kafka


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
