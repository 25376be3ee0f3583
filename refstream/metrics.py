"""Prometheus metrics over HTTP for the long-running processes (the refresher daemon, the job).

``metrics: {port: 9108, host: 127.0.0.1}`` at the top of ``refresh.yaml`` or ``enrich.yaml`` turns it
on (absent: off). Each process keeps its metrics in its own :class:`CollectorRegistry` (never the
library's global one, so that tests can run several) and serves it with :class:`MetricsServer`:
``/metrics`` in the Prometheus text format, plus any pages the process adds (the refresher's status
page at ``/``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from refstream.config import Section

if TYPE_CHECKING:  # the config side is loaded by every command; the client only by the daemons
    from prometheus_client import CollectorRegistry

__all__ = ["MetricsConfig", "MetricsServer", "Page", "parse_metrics"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where the metrics are served: ``port`` (0: any free port, for tests) on ``host``."""

    port: int
    host: str = "127.0.0.1"


def parse_metrics(root: Section) -> MetricsConfig | None:
    """The top-level ``metrics:`` section of a config, or None when it is absent."""
    if not root.has("metrics"):
        return None
    sec = root.section("metrics")
    raw = sec.get("port", (int, str))  # a string from ${ENV} substitution
    if isinstance(raw, str) and not raw.strip().isdigit():
        raise sec.error(f"must be a TCP port (0-65535), got {raw!r}", "port")
    port = int(raw)
    if not 0 <= port <= 65535:
        raise sec.error(f"must be a TCP port (0-65535), got {port}", "port")
    cfg = MetricsConfig(port=port, host=sec.get("host", str, "127.0.0.1"))
    sec.done()
    return cfg


#: A page besides /metrics: returns (content type, body).
Page = Callable[[], tuple[str, bytes]]


class MetricsServer:
    """``/metrics`` of ``registry`` and ``pages`` over HTTP, in a daemon thread; use as a context
    manager (or :meth:`start` / :meth:`stop`)."""

    def __init__(self, cfg: MetricsConfig, registry: CollectorRegistry,
                 pages: Mapping[str, Page] | None = None) -> None:
        self.cfg, self.registry, self.pages = cfg, registry, dict(pages or {})
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self) -> MetricsServer:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        ctype, body = CONTENT_TYPE_LATEST, generate_latest(server.registry)
                    elif path in server.pages:
                        ctype, body = server.pages[path]()
                    else:
                        self.send_error(404)
                        return
                except Exception:  # a broken page must not take the server down
                    log.exception("metrics server: %s failed", path)
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server API
                log.debug("metrics server: %s", format % args)

        self._server = ThreadingHTTPServer((self.cfg.host, self.cfg.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics on %s/metrics", self.url)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
