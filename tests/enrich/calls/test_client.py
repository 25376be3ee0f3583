"""The calls' HTTP client (enrich.calls.client) against a real HTTP service on 127.0.0.1: retries of
transient failures only, with one Idempotency-Key; timeouts; malformed and partial responses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from enrich.calls.client import Outcome, client, run
from enrich.calls.config import CallConfig, RetryConfig
from tests.enrich.calls.server import Service, free_port, serve

RESPONSE: Any = (("score", "DOUBLE"), ("level", "STRING"))


@pytest.fixture
def service() -> Iterator[Service]:
    with serve() as svc:
        yield svc


def call(url: str, **kw: Any) -> CallConfig:
    return CallConfig(name="risk", url=url, response=RESPONSE,
                      retries=RetryConfig(attempts=3, backoff=timedelta(milliseconds=10)), **kw)


def make(c: CallConfig, key: str = "q-0-d1-risk-0", body: Any = None) -> Outcome:
    return run(client().call(c, {"events": 2} if body is None else body, key))


def test_an_answer_is_read_into_the_declared_fields(service: Service) -> None:
    got = make(call(service.url("/score")))
    assert got == Outcome("ok", {"score": 20.0, "level": "low"}, None, 1)
    assert service.keys["q-0-d1-risk-0"] == 1


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_statuses_are_retried_with_the_same_key(service: Service, status: int) -> None:
    service.fail_first = 2
    got = make(call(service.url(f"/status/{status}")))
    assert got.result == "ok" and got.tries == 3 and service.keys["q-0-d1-risk-0"] == 3


def test_attempts_count_every_try(service: Service) -> None:
    service.fail_first = 5
    got = make(call(service.url("/status/500")))
    assert (got.result, got.error, got.tries) == ("error", "HTTP 500", 3)
    assert service.keys["q-0-d1-risk-0"] == 3


def test_a_4xx_is_terminal_at_once(service: Service) -> None:
    service.fail_first = 5
    got = make(call(service.url("/status/400")))
    assert (got.result, got.error, got.tries) == ("error", "HTTP 400", 1)


def test_malformed_and_partial_responses_are_errors_naming_the_call_and_field(service: Service) -> None:
    assert make(call(service.url("/bad"))).error == "call risk: the response is not JSON"
    assert make(call(service.url("/partial"))).error == "call risk: the response lacks field 'level'"
    wrong = CallConfig(name="risk", url=service.url("/action"), response=(("action", "BIGINT"),))
    assert make(wrong, body={"score": 1}).error == "call risk: field 'action' is 'act-1', not BIGINT"
    assert service.paths["/bad"] == 1 and service.paths["/partial"] == 1  # not retried


def test_a_slow_service_times_out_on_each_try(service: Service) -> None:
    service.delay = 1.0
    t0 = time.monotonic()
    got = make(call(service.url("/slow"), timeout=timedelta(milliseconds=100)))
    assert (got.result, got.tries) == ("timeout", 3) and "timed out after 0.1s" in str(got.error)
    assert time.monotonic() - t0 < 0.9


def test_a_refused_connection_is_retried_then_an_error() -> None:
    got = make(call(f"http://127.0.0.1:{free_port()}/score"))
    assert got.result == "error" and got.tries == 3 and "ClientConnectorError" in str(got.error)


def test_calls_run_concurrently_over_reused_connections(service: Service) -> None:
    service.delay = 0.2
    c = call(service.url("/score"))

    async def many() -> list[Outcome]:
        return await asyncio.gather(*(client().call(c, {"events": i}, f"k{i}") for i in range(50)))

    t0 = time.monotonic()
    got = run(many())
    assert all(o.result == "ok" for o in got) and time.monotonic() - t0 < 2
    assert sorted(o.values["score"] for o in got if o.values) == [i * 10.0 for i in range(50)]


def test_the_breaker_opens_after_failures_in_a_row_and_closes_after_its_cooldown(service: Service) -> None:
    from enrich.calls.config import BreakerConfig

    service.down = True
    c = call(service.url("/score"), circuit_breaker=BreakerConfig(failures=2, cooldown=timedelta(seconds=60)))
    breaker = client().breaker(c)
    now = [0.0]
    breaker.clock = lambda: now[0]
    assert [make(c).result for _ in range(2)] == ["error", "error"]
    made = service.paths["/score"]
    skipped = make(c)
    assert skipped.result == "skipped" and skipped.tries == 0 and "circuit breaker open" in str(skipped.error)
    assert service.paths["/score"] == made   # no request while open
    now[0] = 61.0                             # cooled down: tried again, one failure opens it again
    assert make(c).result == "error" and make(c).result == "skipped"
    now[0] = 122.0
    service.down = False
    assert make(c).result == "ok" and breaker.in_a_row == 0


def test_a_try_past_the_budgets_deadline_is_cut_short_and_skipped(service: Service) -> None:
    from tests.enrich.calls.server import blackhole

    with blackhole() as hole:
        c = call(hole.url("/x"), timeout=timedelta(hours=1))
        got = run(client().call(c, {}, "k", time.monotonic() + 0.5))
        assert got.result == "skipped" and "budget" in str(got.error) and got.tries == 1
        late = run(client().call(c, {}, "k", time.monotonic() - 1))
        assert late == Outcome("skipped", None, late.error, 0) and hole.accepted == 1
