"""The HTTP client of the calls: aiohttp, one session (and event loop) per Python worker, so
connections are reused across buckets and batches and calls wait on sockets, not threads.

A try that fails to connect, times out, or gets 429 or a 5xx is transient and tried again (after
``retries.backoff``, doubling) until ``retries.attempts`` tries were made; any other failure (a 4xx,
a response that is not JSON or lacks a declared field) is terminal at once. Every try of a call
sends the same ``Idempotency-Key``."""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from enrich.calls.config import CallConfig
from enrich.calls.fields import ResponseError, read_response
from enrich.calls.template import query_params
from refstream.errors import TerminalError, TransientError

if TYPE_CHECKING:
    # Imported where a call is made: the state step's processes import this module with or without
    # calls configured, and aiohttp takes a third of a second to import.
    import aiohttp

__all__ = ["CallFailed", "CallTransient", "Outcome", "Result", "client", "run"]

log = logging.getLogger(__name__)

#: How a call ended: ``ok``, failed (``error``), or its last try timed out (``timeout``).
Result = Literal["ok", "error", "timeout"]
T = TypeVar("T")


class CallTransient(TransientError):
    """A try that may succeed if made again: refused or broken connection, timeout, 429, 5xx."""


class CallFailed(TerminalError):
    """A call that failed for good (after its retries, or at once for a terminal failure)."""


@dataclass(frozen=True)
class Outcome:
    """A call's end: its result, the response's declared fields (``ok``) or the error, the tries."""

    result: Result
    values: dict[str, Any] | None = None
    error: str | None = None
    tries: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, "values": self.values, "error": self.error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Outcome:
        return cls(d["result"], d.get("values"), d.get("error"), 0)


class Client:
    """One per process (:func:`client`): the event loop the calls run on and its session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None

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

    async def call(self, cfg: CallConfig, body: Any, key: str) -> Outcome:
        """Make ``cfg``'s call with the rendered ``body``, retrying transient failures."""
        tries, last = 0, "no try made"
        timed_out = False
        for attempt in range(cfg.retries.attempts):
            if attempt:
                await asyncio.sleep(cfg.retries.backoff.total_seconds() * 2 ** (attempt - 1))
            tries += 1
            try:
                values = await self._try(cfg, body, key)
                return Outcome("ok", values, None, tries)
            except CallTransient as exc:
                last, timed_out = str(exc), isinstance(exc.__cause__, TimeoutError)
            except CallFailed as exc:
                return Outcome("error", None, str(exc), tries)
        return Outcome("timeout" if timed_out else "error", None, last, tries)

    async def _try(self, cfg: CallConfig, body: Any, key: str) -> dict[str, Any]:
        import aiohttp

        headers = {"Idempotency-Key": key}
        timeout = aiohttp.ClientTimeout(total=cfg.timeout.total_seconds())
        kwargs: dict[str, Any] = ({"params": query_params(body)} if cfg.method == "GET" else {"json": body})
        try:
            async with self.session().request(cfg.method, cfg.url, headers=headers, timeout=timeout,
                                              **kwargs) as resp:
                text = await resp.read()
                status = resp.status
        except TimeoutError as exc:
            raise CallTransient(f"timed out after {cfg.timeout.total_seconds():g}s") from exc
        except aiohttp.ClientError as exc:
            raise CallTransient(f"{type(exc).__name__}: {exc}") from exc
        if status == 429 or status >= 500:
            raise CallTransient(f"HTTP {status}")
        if status >= 400:
            raise CallFailed(f"HTTP {status}")
        try:
            data = json.loads(text)
        except ValueError:
            raise CallFailed(f"call {cfg.name}: the response is not JSON") from None
        try:
            return read_response(cfg.name, cfg.response, data)
        except ResponseError as exc:
            raise CallFailed(str(exc)) from None


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
