"""The ``calls:`` section of enrich.yaml as frozen dataclasses, ordered by ``needs``."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from enrich.calls.fields import ResponseType, column
from enrich.calls.template import STATE, Template
from refstream.config import Section, allowed_values

__all__ = ["BreakerConfig", "CallConfig", "HttpMethod", "OnError", "RetryConfig", "parse_calls", "redact"]

#: POST sends the body as JSON; GET sends its fields as query parameters.
HttpMethod = Literal["POST", "GET"]
#: A failed call (after its retries): fields null (counted, logged), the event to the dead-letter
#: topic, or the batch fails.
OnError = Literal["null", "dead_letter", "fail"]
EVERY_EVENT = "every event"
#: A header name (RFC 9110 token); the client sets Idempotency-Key itself.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
OWN_HEADERS = frozenset({"idempotency-key", "content-type", "content-length", "host"})


def redact(url: str) -> str:
    """``url`` safe to print: the userinfo and every query-string value become ``***`` (tokens are
    often put there); scheme, host, port and path are kept."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a URL that does not parse>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(f"{k}=***" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, "***" if parts.fragment else ""))


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """``attempts`` counts every try (3: at most 3 requests); ``backoff`` doubles after each."""

    attempts: int = 3
    backoff: timedelta = timedelta(milliseconds=100)


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    """After ``failures`` calls in a row failed (after their retries: refused, timed out, 429, 5xx)
    the call is skipped, as an error, for ``cooldown``; then tried again (one more failure opens it
    again). Kept per Python worker."""

    failures: int = 20
    cooldown: timedelta = timedelta(seconds=30)


@dataclass(frozen=True, kw_only=True)
class CallConfig:
    """One external call. ``refresh``: None calls once per device state, ``timedelta(0)`` for every
    event, else again when the stored result is older than that in event time."""

    name: str
    url: str = dataclasses.field(repr=False)  # may hold a token: printed as shown_url
    method: HttpMethod = "POST"
    body: Template = Template({})
    response: tuple[tuple[str, ResponseType], ...] = ()
    refresh: timedelta | None = None
    timeout: timedelta = timedelta(seconds=2)
    retries: RetryConfig = RetryConfig()
    concurrency: int = 64
    on_error: OnError = "null"
    needs: tuple[str, ...] = ()
    #: How long a batch may spend on this call, from its start: a call not ended by then is skipped.
    budget: timedelta = timedelta(seconds=60)
    circuit_breaker: BreakerConfig = BreakerConfig()
    #: Sent with every try (``${VAR}`` substituted at load); never printed, so not in the repr.
    headers: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)

    @property
    def shown_url(self) -> str:
        return redact(self.url)

    @property
    def every_event(self) -> bool:
        return self.refresh == timedelta(0)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(column(self.name, f) for f, _ in self.response)


def parse_calls(top: Section, has_state: bool) -> tuple[CallConfig, ...]:
    """The ``calls:`` list of ``top``, in an order where every call comes after the calls it
    ``needs``; a :class:`ConfigError` naming the call and key at fault (a cycle, an unknown name, a
    placeholder of a call not needed or of a field not declared)."""
    raw = top.raw("calls", [])
    if not isinstance(raw, list):
        raise top.error(f"expected a list of calls, got {raw!r}", "calls")
    if raw and not has_state:
        raise top.error("calls need a state: section (their results are kept in the device state)", "calls")
    calls = [_call(Section(c, f"calls[{i}]", top.source)) for i, c in enumerate(raw)]
    where = {c.name: i for i, c in enumerate(calls)}
    if len(where) != len(calls):
        dup = [c.name for c in calls if sum(d.name == c.name for d in calls) > 1][0]
        raise top.error(f"call name {dup!r} is used twice", "calls")
    for i, c in enumerate(calls):
        for n in c.needs:
            if n not in where:
                raise top.error(f"call {c.name!r} needs {n!r}, which is not a call", f"calls[{i}].needs")
        declared = {d.name: {f for f, _ in d.response} for d in calls}
        for ref in c.body.refs():
            if ref.scope in (None, STATE):
                continue
            if ref.scope not in c.needs:
                raise top.error(f"call {c.name!r}: {ref} names call {ref.scope!r}, which is not in its needs",
                                f"calls[{i}].body")
            if ref.name not in declared[ref.scope]:
                raise top.error(f"call {c.name!r}: {ref}: call {ref.scope!r} declares no response field "
                                f"{ref.name!r}", f"calls[{i}].body")
    return tuple(calls[where[n]] for n in _topological([c.name for c in calls], {c.name: c.needs for c in calls},
                                                       top, where))


def _topological(names: list[str], needs: dict[str, tuple[str, ...]], top: Section,
                 where: dict[str, int]) -> list[str]:
    """``names`` ordered so that each comes after its needs (configured order otherwise kept)."""
    done: list[str] = []
    visiting: list[str] = []

    def visit(n: str) -> None:
        if n in done:
            return
        if n in visiting:
            cycle = visiting[visiting.index(n):] + [n]
            raise top.error(f"call {n!r} needs itself through {' -> '.join(cycle)}", f"calls[{where[n]}].needs")
        visiting.append(n)
        for m in needs[n]:
            visit(m)
        visiting.pop()
        done.append(n)

    for n in names:
        visit(n)
    return done


def _call(sec: Section) -> CallConfig:
    name = sec.get("name", str)
    if not name.isidentifier() or name == STATE:
        raise sec.error(f"{name!r} is not a name (letters, digits, _; not {STATE!r})", "name")
    url = sec.get("url", str)
    if not url.startswith(("http://", "https://")):
        raise sec.error(f"call {name!r}: {redact(url)!r} is not an http(s) URL", "url")
    method = sec.get("method", str, "POST").upper()
    if method not in allowed_values(HttpMethod):
        raise sec.error(f"call {name!r}: {method!r} is not one of {', '.join(allowed_values(HttpMethod))}", "method")
    body = sec.raw("body", {})
    if not isinstance(body, dict):
        raise sec.error(f"call {name!r}: expected a mapping of fields, got {body!r}", "body")
    resp = sec.section("response")
    response: list[tuple[str, Any]] = []
    for field in list(resp.data):
        typ = str(resp.get(field, str)).upper()
        if not isinstance(field, str) or not field.isidentifier():
            raise resp.error(f"call {name!r}: {field!r} is not a field name")
        if typ not in allowed_values(ResponseType):
            raise resp.error(f"call {name!r}: {typ!r} is not one of {', '.join(allowed_values(ResponseType))}",
                             field)
        response.append((field, typ))
    resp.done()
    if not response:
        raise sec.error(f"call {name!r}: declare at least one response field", "response")
    retries = sec.section("retries", {})
    retry = RetryConfig(attempts=retries.get("attempts", int, 3), backoff=retries.duration("backoff",
                                                                                       timedelta(milliseconds=100)))
    retries.done()
    if retry.attempts < 1:
        raise sec.error(f"call {name!r}: must be at least 1 (every try counts)", "retries.attempts")
    timeout = sec.duration("timeout", timedelta(seconds=2))
    if timeout <= timedelta(0):
        raise sec.error(f"call {name!r}: must be positive", "timeout")
    concurrency = sec.get("concurrency", int, 64)
    if concurrency < 1:
        raise sec.error(f"call {name!r}: must be positive", "concurrency")
    budget = sec.duration("budget", timedelta(seconds=60))
    if budget <= timedelta(0):
        raise sec.error(f"call {name!r}: must be positive", "budget")
    cb = sec.section("circuit_breaker", {})
    breaker = BreakerConfig(failures=cb.get("failures", int, 20), cooldown=cb.duration("cooldown",
                                                                                     timedelta(seconds=30)))
    cb.done()
    if breaker.failures < 1:
        raise sec.error(f"call {name!r}: must be at least 1", "circuit_breaker.failures")
    if breaker.cooldown <= timedelta(0):
        raise sec.error(f"call {name!r}: must be positive", "circuit_breaker.cooldown")
    cfg = CallConfig(name=name, url=url, method=method, body=Template(body), response=tuple(response),
                     headers=_headers(sec, name),
                     refresh=_refresh(sec, name), timeout=timeout, retries=retry, concurrency=concurrency,
                     on_error=sec.choice("on_error", OnError, "null"), needs=tuple(sec.str_list("needs", [])),
                     budget=budget, circuit_breaker=breaker)
    sec.done()
    return cfg


def _headers(sec: Section, name: str) -> tuple[tuple[str, str], ...]:
    """``headers:`` as (name, value) pairs; errors name the header, never its value."""
    raw = sec.raw("headers", {})
    if not isinstance(raw, dict):
        raise sec.error(f"call {name!r}: expected a mapping of header names to values", "headers")
    out: list[tuple[str, str]] = []
    for k, v in raw.items():
        if not isinstance(k, str) or not _TOKEN.match(k):
            raise sec.error(f"call {name!r}: {k!r} is not a header name", "headers")
        if k.lower() in OWN_HEADERS:
            raise sec.error(f"call {name!r}: the calls set {k} themselves", f"headers.{k}")
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise sec.error(f"call {name!r}: expected a text value (not shown)", f"headers.{k}")
        if any(c in str(v) for c in "\r\n\0"):
            raise sec.error(f"call {name!r}: the value (not shown) holds a line break", f"headers.{k}")
        out.append((k, str(v)))
    return tuple(out)


def _refresh(sec: Section, name: str) -> timedelta | None:
    raw = sec.raw("refresh", "once")
    if raw == "once":
        return None
    if raw == EVERY_EVENT:
        return timedelta(0)
    try:
        d = sec.duration("refresh")
    except Exception:
        raise sec.error(f"call {name!r}: {raw!r} is not once, {EVERY_EVENT} or a duration (e.g. 10m)",
                        "refresh") from None
    if d <= timedelta(0):
        raise sec.error(f"call {name!r}: a duration must be positive (or say {EVERY_EVENT})", "refresh")
    return d
