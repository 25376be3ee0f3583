"""The soak's call service (bench/soak.py): ``POST /echo`` answers ``{"device", "events", "seq"}`` taken
from the request's body, so the soak can check that every enriched event carries the answer to its
own call, made with its own state (``{state.events}`` including the event). Stateless but for
``--keys``, a file it appends each request's ``Idempotency-Key`` to (a key seen twice is a try
after a failed one, or a replay's call that was not recorded): the soak SIGKILLs it and starts it
again on the same port. ``python -m bench.soak_service --port 8086 --keys keys.txt``."""

from __future__ import annotations

import argparse
from typing import IO

from aiohttp import web


def app(keys: IO[str] | None = None) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        if keys is not None:
            keys.write(request.headers.get("Idempotency-Key", "") + "\n")
            keys.flush()
        return web.json_response({"device": body.get("device"), "events": body.get("events"),
                                  "seq": body.get("seq")})

    application = web.Application()
    application.router.add_post("/echo", echo)
    return application


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak_service", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--keys", default=None, help="append each request's Idempotency-Key to this file")
    args = p.parse_args(argv)
    keys = open(args.keys, "a", encoding="utf-8") if args.keys else None  # noqa: SIM115 - open while serving
    web.run_app(app(keys), host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
