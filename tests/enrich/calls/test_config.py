"""The calls: section (enrich.calls.config): defaults, durations, the needs graph, errors naming the call."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from enrich import config
from refstream.errors import ConfigError


def parse(calls: list[dict[str, Any]], state: bool = True, env: bool = False) -> config.EnrichConfig:
    data: dict[str, Any] = {"kafka": {"bootstrap_servers": "b:9092"},
                            "events": {"topic": "e", "schema": "device_id STRING, ts TIMESTAMP"},
                            "output": {"kafka": {"topic": "o"}}, "dead_letter_topic": "d", "checkpoint": "/c",
                            "calls": calls}
    if state:
        data["state"] = {"key": "device_id", "timestamp": "ts"}
    if env:  # ${VAR} substituted, as for a file
        return config.load_config(data, source="enrich.yaml")
    return config.parse(data, "enrich.yaml")


def call(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "url": f"http://127.0.0.1:8085/{name}", "response": {"x": "double"}, **kw}


def test_defaults_and_durations_are_parsed_at_load() -> None:
    (c,) = parse([call("risk", refresh="10m", timeout="250ms", retries={"attempts": 2, "backoff": "1s"},
                       on_error=None)]).calls
    assert (c.method, c.refresh, c.timeout, c.retries.attempts, c.retries.backoff, c.concurrency, c.on_error) == \
        ("POST", timedelta(minutes=10), timedelta(milliseconds=250), 2, timedelta(seconds=1), 64, "null")
    assert c.response == (("x", "DOUBLE"),) and c.columns == ("risk_x",)
    assert (c.budget, c.circuit_breaker.failures, c.circuit_breaker.cooldown) == (
        timedelta(seconds=60), 20, timedelta(seconds=30))
    (b,) = parse([call("b", budget="5m", circuit_breaker={"failures": 3, "cooldown": "1m"})]).calls
    assert (b.budget, b.circuit_breaker.failures, b.circuit_breaker.cooldown) == (
        timedelta(minutes=5), 3, timedelta(minutes=1))
    once, every = parse([call("a"), call("b", refresh="every event")]).calls
    assert once.refresh is None and not once.every_event and every.every_event


def test_calls_are_ordered_by_needs() -> None:
    cfg = parse([call("c", needs=["b"], body={"v": "{b.x}"}), call("a"), call("b", needs=["a"])])
    assert [c.name for c in cfg.calls] == ["a", "b", "c"]


@pytest.mark.parametrize(("calls", "message"), [
    ([call("a", needs=["b"]), call("b", needs=["a"])], r"calls\[0\].needs: call 'a' needs itself through a -> b -> a"),
    ([call("a", needs=["zz"])], r"calls\[0\].needs: call 'a' needs 'zz', which is not a call"),
    ([call("a"), call("b", body={"v": "{a.x}"})], r"calls\[1\].body: call 'b': \{a.x\} names call 'a', which is not"),
    ([call("a"), call("b", needs=["a"], body={"v": "{a.y}"})], r"call 'a' declares no response field 'y'"),
    ([call("a"), call("a")], r"calls: call name 'a' is used twice"),
    ([call("a", refresh="sometimes")], r"calls\[0\].refresh: call 'a': 'sometimes' is not once, every event"),
    ([call("a", on_error="retry")], r"calls\[0\].on_error: 'retry' is not one of null, dead_letter, fail"),
    ([call("a", method="PUT")], r"calls\[0\].method: call 'a': 'PUT' is not one of POST, GET"),
    ([call("a", response={"x": "DATE"})], r"calls\[0\].response.x: call 'a': 'DATE' is not one of"),
    ([call("a", retries={"attempts": 0})], r"calls\[0\].retries.attempts: call 'a': must be at least 1"),
    ([call("state")], r"calls\[0\].name: 'state' is not a name"),
    ([call("a", url="ftp://x")], r"calls\[0\].url: call 'a': 'ftp://x' is not an http"),
    ([call("a", timeout="soon")], r"calls\[0\].timeout"),
    ([call("a", colour="red")], r"calls\[0\]: unknown key\(s\): colour"),
    ([call("a", budget="0s")], r"calls\[0\].budget: call 'a': must be positive"),
    ([call("a", circuit_breaker={"failures": 0})], r"calls\[0\].circuit_breaker.failures: call 'a': must be at least 1"),
    ([call("a", circuit_breaker={"cooldown": "never"})], r"calls\[0\].circuit_breaker.cooldown"),
    ([call("a", circuit_breaker={"open": 1})], r"calls\[0\].circuit_breaker: unknown key\(s\): open"),
])
def test_errors_name_the_file_the_call_and_the_key(calls: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^enrich.yaml: " + ".*" + message):
        parse(calls)


def test_calls_need_a_state_section() -> None:
    with pytest.raises(ConfigError, match="enrich.yaml: calls: calls need a state: section"):
        parse([call("a")], state=False)


def test_validate_lists_the_calls_in_the_order_they_run() -> None:
    from enrich.validate import summary

    lines = summary(parse([call("b", needs=["a"], refresh="every event", on_error="dead_letter"),
                        call("a", refresh="10m", method="GET")]))
    assert [line for line in lines if line.startswith("  call ")] == [
        "  call a: GET http://127.0.0.1:8085/a, refresh after 10m, on_error null: a_x",
        "  call b: POST http://127.0.0.1:8085/b, refresh every event, on_error dead_letter, after a: b_x"]


def test_headers_take_their_values_from_the_environment_and_are_never_shown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from enrich.validate import summary

    monkeypatch.setenv("RISK_TOKEN", "s3cret-token")
    cfg = parse([call("a", headers={"Authorization": "Bearer ${RISK_TOKEN}", "X-Tenant": 7},
                      url="https://me:pa55@127.0.0.1:8085/a?api_key=k3y&v=2")], env=True)
    (c,) = cfg.calls
    assert c.headers == (("Authorization", "Bearer s3cret-token"), ("X-Tenant", "7"))
    shown = "\n".join(summary(cfg)) + repr(c)
    assert "https://***@127.0.0.1:8085/a?api_key=***&v=***" in shown
    assert not any(s in shown for s in ("s3cret", "pa55", "k3y"))
    monkeypatch.delenv("RISK_TOKEN")
    with pytest.raises(ConfigError, match=r"calls\[0\].headers.Authorization: environment variable RISK_TOKEN is not set"):
        parse([call("a", headers={"Authorization": "Bearer ${RISK_TOKEN}"})], env=True)


@pytest.mark.parametrize(("headers", "message"), [
    ({"Idempotency-Key": "x"}, r"calls\[0\].headers.Idempotency-Key: call 'a': the calls set Idempotency-Key"),
    ({"Bad Name": "x"}, r"calls\[0\].headers: call 'a': 'Bad Name' is not a header name"),
    ({"X-A": "a\nb"}, r"calls\[0\].headers.X-A: call 'a': the value \(not shown\) holds a line break"),
    ({"X-A": ["x"]}, r"calls\[0\].headers.X-A: call 'a': expected a text value"),
])
def test_header_errors_name_the_header_not_its_value(headers: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse([call("a", headers=headers)])


def test_an_url_error_shows_it_redacted() -> None:
    with pytest.raises(ConfigError, match=r"'ftp://\*\*\*@h/x\?token=\*\*\*' is not an http") as err:
        parse([call("a", url="ftp://u:pw@h/x?token=abc")])
    assert "abc" not in str(err.value) and "pw" not in str(err.value)
