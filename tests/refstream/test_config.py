from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from refstream.config import Section, format_duration, kafka_settings, load_yaml, parse_duration
from refstream.errors import ConfigError


def test_env_substitution_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REF_DB_URL", "sqlite:///x.db")
    monkeypatch.delenv("UNSET_VAR", raising=False)
    p = tmp_path / "c.yaml"
    p.write_text("url: ${REF_DB_URL}\nother: ${UNSET_VAR:-fallback}\n")
    assert load_yaml(p) == {"url": "sqlite:///x.db", "other": "fallback"}
    p.write_text("a: 1\nurl: ${UNSET_VAR}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: environment variable UNSET_VAR is not set"):
        load_yaml(p)


def test_durations() -> None:
    assert parse_duration("6h") == timedelta(hours=6)
    assert parse_duration("250ms") == timedelta(milliseconds=250)
    assert parse_duration(30) == timedelta(seconds=30)
    with pytest.raises(ValueError):
        parse_duration("6x")


@pytest.mark.parametrize(("text", "shown"), [("1d", "1d"), ("24h", "1d"), ("90m", "90m"), ("30s", "30s"),
                                             ("1.5s", "1500ms"), ("250ms", "250ms"), (0, "0ms")])
def test_format_duration_writes_what_parse_duration_reads(text: str | int, shown: str) -> None:
    assert format_duration(parse_duration(text)) == shown
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)


def test_section_errors_name_the_key() -> None:
    sec = Section({"schedule": {"every": "6x"}, "typo": 1}, "datasets.devices", "conf/refresh.yaml")
    with pytest.raises(ConfigError, match=r"conf/refresh.yaml: datasets.devices.schedule.every: '6x'"):
        sec.section("schedule").duration("every")
    with pytest.raises(ConfigError, match=r"datasets.devices: unknown key\(s\): typo"):
        sec.done()
    with pytest.raises(ConfigError, match=r"datasets.devices.mode: 'x' is not one of diff, incremental"):
        Section({"mode": "x"}, "datasets.devices", "conf/refresh.yaml").choice("mode", ("diff", "incremental"))


def test_kafka_settings_pass_through() -> None:
    sec = Section({"bootstrap_servers": "h:9092", "security.protocol": "SASL_SSL", "enable.idempotence": True})
    assert kafka_settings(sec) == {"bootstrap.servers": "h:9092", "security.protocol": "SASL_SSL",
                                   "enable.idempotence": "true"}
    with pytest.raises(ConfigError, match="bootstrap_servers: is required"):
        kafka_settings(Section({}, "kafka"))


def test_read_to_end_on_real_broker(kafka: dict[str, str], unique) -> None:
    from confluent_kafka import Producer

    from refstream.kafka import ensure_topic, read_to_end

    topic = unique("t")
    assert ensure_topic(kafka, topic, partitions=2, config={"cleanup.policy": "compact"})
    assert not ensure_topic(kafka, topic)
    p = Producer({**kafka, "enable.idempotence": True})
    for i in range(1000):
        p.produce(topic, key=str(i).encode(), value=str(i).encode(), partition=i % 2)
    p.flush()
    got = sorted(int(m.value()) for m in read_to_end(kafka, topic))
    assert got == list(range(1000))


@pytest.mark.parametrize("secret", [
    "pa#ss word",          # a comment marker inside the value
    "a: b\nc: d",          # what would be a key in the YAML text
    "0123",                # a leading zero: stays a string, exactly
    "${NOT_EXPANDED_TWICE}",
    "x'\"}{[]&*!|>%@`",
])
def test_env_values_are_substituted_after_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 secret: str) -> None:
    monkeypatch.setenv("REF_SECRET", secret)
    p = tmp_path / "c.yaml"
    p.write_text("db:\n  password: ${REF_SECRET}\n  quoted: \"pre-${REF_SECRET}\"\n"
                 "  list:\n    - ${REF_SECRET}\n# ${UNSET_IN_A_COMMENT}\nafter: 1\n")
    assert load_yaml(p) == {"db": {"password": secret, "quoted": f"pre-{secret}", "list": [secret]},
                            "after": 1}


def test_env_number_feeds_a_number_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REF_PORT", "9092")
    p = tmp_path / "c.yaml"
    p.write_text("port: ${REF_PORT}\nratio: ${REF_RATIO:-0.5}\n")
    sec = Section(load_yaml(p), "", str(p))
    assert sec.get("port", int) == 9092
    assert sec.get("ratio", float) == 0.5
    with pytest.raises(ConfigError, match=r"port: expected int, got 'x'"):
        Section({"port": "x"}).get("port", int)


@pytest.mark.parametrize(("url", "shown"), [
    ("mysql+pymysql://app:s3cret@db:3306/ref", "mysql+pymysql://app:***@db:3306/ref"),
    ("mysql+pymysql://app@db/ref?password=s3cret&charset=utf8mb4",
     "mysql+pymysql://app@db/ref?charset=utf8mb4&password=***"),
    ("postgresql://db/ref?sslmode=require&sslpassword=s3cret", "postgresql://db/ref?sslmode=require&sslpassword=***"),
])
def test_redact_url_hides_user_and_query_passwords(url: str, shown: str) -> None:
    from refstream.config import redact_url

    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
