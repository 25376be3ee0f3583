"""The HTTP client of the calls: aiohttp, one session (and event loop) per Python worker, so
connections are reused across buckets and batches and calls wait on sockets, not threads.

A try that fails to connect, times out, or gets 429 or a 5xx is transient and tried again (after
``retries.backoff``, doubling) until ``retries.attempts`` tries were made; any other failure (a 4xx,
a response that is not JSON or lacks a declared field) is terminal at once. Every try of a call
sends the same ``Idempotency-Key``.

Two bounds keep a service that does not answer from holding a batch: a call not ended by its
batch's deadline (``budget`` from the batch's start) is ``skipped``, a try in flight then cut short;
and after ``circuit_breaker.failures`` calls in a row failed, the call is ``skipped`` without a
request for ``circuit_breaker.cooldown`` (:class:`Breaker`, one per call and Python worker)."""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from enrich.calls.config import CallConfig
from enrich.calls.fields import ResponseError, read_response
from enrich.calls.template import query_params
from refstream.errors import DataError, TerminalError, TransientError

if TYPE_CHECKING:
    # Imported where a call is made: the state step's processes import this module with or without
    # calls configured, and aiohttp takes a third of a second to import.
    import aiohttp

__all__ = ["Breaker", "CallDataError", "CallFailed", "CallTransient", "Outcome", "Result", "client", "run"]

log = logging.getLogger(__name__)

#: How a call ended: ``ok``, failed (``error``), its last try timed out (``timeout``), or not made
#: (or cut short) because its circuit breaker was open or its batch's budget was spent (``skipped``,
#: a failure like the others for ``on_error``).
Result = Literal["ok", "error", "timeout", "skipped"]
T = TypeVar("T")


class CallTransient(TransientError):
    """A try that may succeed if made again: refused or broken connection, timeout, 429, 5xx."""


class CallFailed(TerminalError):
    """A call that failed for good (after its retries, or at once for a terminal failure)."""


class CallDataError(CallFailed, DataError):
    """A call that failed for one value's sake: a request that cannot be made from the event's values
    (a header a device id would break), or a response that does not fit (not JSON, nested too deep,
    a field outside its type). Made again it fails again, so it never fails the batch, whatever
    ``on_error`` says: under ``fail`` the event goes to the dead-letter topic (a replay would fail
    on it for good)."""


@dataclass(frozen=True)
class Outcome:
    """A call's end: its result, the response's declared fields (``ok``) or the error, the tries."""

    result: Result
    values: dict[str, Any] | None = None
    error: str | None = None
    tries: int = 1
    #: The failure is a :class:`CallDataError` (one value's, not the service's).
    data: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {"result": self.result, "values": self.values, "error": self.error}
        return {**out, "data": True} if self.data else out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Outcome:
        return cls(d["result"], d.get("values"), d.get("error"), 0, bool(d.get("data", False)))


class _BudgetSpent(Exception):
    """A try cut short by its batch's deadline."""


class Breaker:
    """One call's circuit breaker in this process: open for ``cooldown`` once ``failures`` calls in
    a row failed for the service's sake (refused, timed out, 429, 5xx after the retries; a 4xx or a
    response that does not fit says nothing about the service's health and neither counts nor resets)."""

    def __init__(self, failures: int, cooldown_s: float, clock: Any = time.monotonic) -> None:
        self.failures, self.cooldown_s, self.clock = failures, cooldown_s, clock
        self.in_a_row = 0
        self.opened_at: float | None = None

    def why_open(self) -> str | None:
        """Why calls are skipped now (None: closed, or cooled down: calls go through again)."""
        if self.opened_at is None or self.clock() - self.opened_at >= self.cooldown_s:
            return None
        return f"skipped: circuit breaker open after {self.in_a_row} failures in a row (for {self.cooldown_s:g}s)"

    def succeeded(self) -> None:
        self.in_a_row, self.opened_at = 0, None

    def failed(self) -> None:
        self.in_a_row += 1
        if self.in_a_row >= self.failures:
            # Once cooled down, the first failure opens it again at once.
            self.opened_at = self.clock()


class Client:
    """One per process (:func:`client`): the event loop the calls run on and its session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._breakers: dict[tuple[str, str], Breaker] = {}

    def breaker(self, cfg: CallConfig) -> Breaker:
        key = (cfg.name, cfg.url)
        got = self._breakers.get(key)
        if got is None or (got.failures, got.cooldown_s) != (cfg.circuit_breaker.failures,
                                                             cfg.circuit_breaker.cooldown.total_seconds()):
            got = self._breakers[key] = Breaker(cfg.circuit_breaker.failures,
                                                cfg.circuit_breaker.cooldown.total_seconds())
        return got

    def session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            # limit=0: the calls' own semaphores bound what is in flight; connections are kept alive.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                                  json_serialize=json.dumps)
        return self._session

    def run(self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    def close(self) -> None:
        if self._session is not None and not self._session.closed:
            self.loop.run_until_complete(self._session.close())
        self.loop.close()

    async def call(self, cfg: CallConfig, body: Any, key: str, deadline: float | None = None) -> Outcome:
        """Make ``cfg``'s call with the rendered ``body``, retrying transient failures; ``deadline``
        (``time.monotonic()``): when the batch's budget for it is spent."""
        breaker = self.breaker(cfg)
        why = breaker.why_open()
        if why is not None:
            return Outcome("skipped", None, why, 0)
        tries, last = 0, "no try made"
        timed_out = False
        spent = f"skipped: the batch's budget of {cfg.budget.total_seconds():g}s for this call was spent"
        for attempt in range(cfg.retries.attempts):
            if attempt:
                pause = cfg.retries.backoff.total_seconds() * 2 ** (attempt - 1)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    break  # no time left for another try: the call failed as its last try did
                await asyncio.sleep(pause)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return Outcome("skipped", None, spent, tries)
            tries += 1
            try:
                values = await self._try(cfg, body, key, left)
                breaker.succeeded()
                return Outcome("ok", values, None, tries)
            except _BudgetSpent:
                return Outcome("skipped", None, spent, tries)
            except CallTransient as exc:
                last, timed_out = str(exc), isinstance(exc.__cause__, TimeoutError)
            except CallDataError as exc:
                return Outcome("error", None, str(exc), tries, data=True)
            except CallFailed as exc:
                return Outcome("error", None, str(exc), tries)
        breaker.failed()
        return Outcome("timeout" if timed_out else "error", None, last, tries)

    async def _try(self, cfg: CallConfig, body: Any, key: str, left: float | None = None) -> dict[str, Any]:
        import aiohttp

        headers = {**dict(cfg.headers), "Idempotency-Key": key}
        # Cut short by the budget's deadline (``left`` seconds from now) when that comes first.
        cut = left is not None and left < cfg.timeout.total_seconds()
        timeout = aiohttp.ClientTimeout(total=left if cut else cfg.timeout.total_seconds())
        try:
            kwargs: dict[str, Any] = ({"params": query_params(body)} if cfg.method == "GET"
                                      else {"data": json.dumps(body, allow_nan=False).encode(),
                                            "headers": {**headers, "Content-Type": "application/json"}})
        except (TypeError, ValueError, RecursionError) as exc:
            raise CallDataError(f"call {cfg.name}: the request body cannot be sent: {_short(exc)}") from None
        headers = kwargs.pop("headers", headers)
        try:
            async with self.session().request(cfg.method, cfg.url, headers=headers, timeout=timeout,
                                              **kwargs) as resp:
                text = await resp.read()
                status = resp.status
        except TimeoutError as exc:
            if cut:
                raise _BudgetSpent from exc
            raise CallTransient(f"timed out after {cfg.timeout.total_seconds():g}s") from exc
        except aiohttp.ClientError as exc:
            raise CallTransient(_scrub(f"{type(exc).__name__}: {exc}", cfg)) from exc
        except (ValueError, TypeError, UnicodeError) as exc:
            # aiohttp refuses the request itself (a header or parameter with a newline, say):
            # this value's fault, not the service's.
            raise CallDataError(_scrub(f"call {cfg.name}: the request cannot be made: {_short(exc)}", cfg)) from None
        if status == 429 or status >= 500:
            raise CallTransient(f"HTTP {status}")
        if status >= 400:
            raise CallFailed(f"HTTP {status}")
        try:
            data = json.loads(text)
        except ValueError:
            raise CallDataError(f"call {cfg.name}: the response is not JSON") from None
        except RecursionError:
            raise CallDataError(f"call {cfg.name}: the response is nested too deep to read") from None
        try:
            return read_response(cfg.name, cfg.response, data)
        except ResponseError as exc:
            raise CallDataError(str(exc)) from None


def _scrub(text: str, cfg: CallConfig) -> str:
    """An error's text without the call's secrets: its URL redacted, its header values cut out."""
    text = text.replace(cfg.url, cfg.shown_url)
    for _, value in cfg.headers:
        if value:
            text = text.replace(value, "***")
    return text


def _short(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


_client: Client | None = None


def client() -> Client:
    """This process's client (made at first use)."""
    global _client
    if _client is None or _client.loop.is_closed():
        _client = Client()
        atexit.register(_client.close)
    return _client


def run(work: Awaitable[T]) -> T:
    """Run ``work`` on this process's event loop."""
    return client().run(work)
