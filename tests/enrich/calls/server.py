"""A real HTTP service on 127.0.0.1 for the calls' tests (aiohttp's server, in a thread): it counts
the requests per path and per Idempotency-Key, keeps the bodies, and answers by path:

- ``/score``: ``{"score": <events> * 10 + <mean or 0>, "level": "high" when score > 50 else "low"}``
- ``/action``: ``{"action": "act-<score>"}``
- ``/echo``: the body (or the GET query) back, under ``got``
- ``/slow``: ``{"score": 1.0}`` after ``delay`` seconds
- ``/status/<n>``: status ``n`` (the first ``fail_first`` tries of each key, the next ``fail_next``
  requests), else ``/score``'s answer
- ``/picky``: 503 for the devices in ``refuse``, else ``/score``'s answer
- ``/unique``: a new score at every request (a count), after ``delay`` seconds
- ``/bad``: not JSON; ``/partial``: JSON without ``level``.
- ``/raw``: the text in ``answers`` for the body's ``device`` (as JSON), else ``{"score": 1.5}``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.timing import bound


@dataclass
class Service:
    port: int = 0
    delay: float = 0.0
    fail_first: int = 0                 # /status/<n>: the first tries of each key fail with n
    fail_next: int = 0                  # /status/<n>: the next requests fail with n, whatever their key
    down: bool = False                  # every path answers 503
    refuse: set[str] = field(default_factory=set)   # /picky answers 503 for these devices
    served: int = 0                     # /unique's answers so far
    keys: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    bodies: list[tuple[str, Any]] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)   # /raw: the response text per device
    headers: list[dict[str, str]] = field(default_factory=list)   # every request's headers

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        key = request.headers.get("Idempotency-Key", "")
        self.keys[key] += 1
        self.paths[path] += 1
        self.headers.append(dict(request.headers))
        body: Any = dict(request.query) if request.method == "GET" else await request.json()
        self.bodies.append((path, body))
        if self.down:
            return web.Response(status=503)
        if path == "/slow":
            await asyncio.sleep(self.delay)
            return web.json_response({"score": 1.0, "level": "slow"})
        if path.startswith("/status/"):
            if self.fail_next > 0 or self.keys[key] <= self.fail_first:
                self.fail_next -= 1
                return web.Response(status=int(path.rsplit("/", 1)[1]))
            path = "/score"
        if path == "/picky":
            if body.get("device") in self.refuse:
                return web.Response(status=503)
            path = "/score"
        if path == "/unique":
            await asyncio.sleep(self.delay)
            self.served += 1
            return web.json_response({"score": float(self.served), "level": key})
        if path == "/score":
            await asyncio.sleep(self.delay)
            score = float(body.get("events") or 0) * 10 + float(body.get("mean") or 0)
            return web.json_response({"score": score, "level": "high" if score > 50 else "low"})
        if path == "/action":
            return web.json_response({"action": f"act-{body.get('score')}"})
        if path == "/echo":
            return web.json_response({"got": json.dumps(body, sort_keys=True)})
        if path == "/bad":
            return web.Response(text="{not json", content_type="application/json")
        if path == "/raw":
            return web.Response(text=self.answers.get(body.get("device"), '{"score": 1.5}'),
                                content_type="application/json")
        if path == "/partial":
            return web.json_response({"score": 1.0})
        return web.Response(status=404)


@contextmanager
def serve(**settings: Any) -> Iterator[Service]:
    """A :class:`Service` listening on a free port of 127.0.0.1 until the block ends."""
    svc = Service(**settings)
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    svc.port = sock.getsockname()[1]
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", svc.handle)
    runner = web.AppRunner(app, access_log=None)
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(bound(10))
    try:
        yield svc
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def free_port() -> int:
    """A port nothing listens on (for refused connections)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


@dataclass
class Blackhole:
    """A service that accepts connections and never answers (nor reads): every try times out."""

    port: int = 0
    accepted: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def blackhole() -> Iterator[Blackhole]:
    """A :class:`Blackhole` on a free port of 127.0.0.1 until the block ends; it counts connections."""
    hole = Blackhole()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.settimeout(0.2)
    hole.port = sock.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def main() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)
            hole.accepted += 1

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        yield hole
    finally:
        stop.set()
        thread.join(10)
        for conn in held:
            conn.close()
        sock.close()
