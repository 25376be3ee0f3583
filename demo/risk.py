"""The demo's risk-score service: the external call of demo/conf/enrich.yaml's ``calls:`` section.

``POST /score`` with ``{"device": ..., "mean": <temperature mean>, "events": <events in state>}``
answers ``{"score": ..., "level": "low" | "high"}``: a made-up score from the device's running
temperature mean (the state the job accumulated), which the job keeps in the device state and
writes next to it on every event. ``python -m demo.risk --port 8085`` (``--host 0.0.0.0`` in a
container)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: A score above this is ``high``.
HIGH = 60.0


def score(body: dict[str, Any]) -> dict[str, Any]:
    mean = body.get("mean")
    value = round(min(100.0, max(0.0, (float(mean) - 10.0) * 3.0)), 1) if isinstance(mean, int | float) else 0.0
    return {"score": value, "level": "high" if value > HIGH else "low"}


async def handle(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "expected a JSON body"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "expected a JSON object"}, status=400)
    return web.json_response(score(body))


async def health(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def app() -> web.Application:
    application = web.Application()
    application.router.add_post("/score", handle)
    application.router.add_get("/health", health)
    return application


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.risk", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8085)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("risk-score service on http://%s:%d/score", args.host, args.port)
    web.run_app(app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
