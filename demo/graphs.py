"""The demo's graphs page: its rollups (``rollups:`` in ``conf/enrich.yaml``, docs/rollups.md) drawn
while the demo runs, one device's temperature mean per minute and each site's, and the events the
job corrected per minute (:class:`CorrectionsGraph`, fed from the enriched topic).

A small HTTP server in the demo's process (:class:`GraphsServer`, loopback only) serves:

- ``/``: the page; it draws with Chart.js (``demo/static/chart.umd.min.js``, MIT, shipped in the
  package so the page works offline) and polls ``/data.json`` every few seconds;
- ``/data.json``: each graph's series, the latest revision of each window (greatest ``_revision`` per
  keys and ``window_start``) read from the rollup's Parquet directory, and the corrections' counts;
- ``/chart.umd.min.js``: the library.

A provisional point is drawn hollow, a final one filled, a correction as a filled triangle. The
page writes what it drew (points and kinds per graph, read back from the chart objects) into its
``#drawn`` element, which tests read from the DOM headless Chromium renders.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from enrich.rollups.config import RollupConfig
from enrich.rollups.spec import KIND, REVISION, WINDOW_START

log = logging.getLogger(__name__)

LIBRARY = "chart.umd.min.js"
#: How often the page asks for new points, in milliseconds.
POLL_MS = 3000


@dataclass(frozen=True)
class Graph:
    """One chart: ``value`` (a ``<column>_<metric>`` column) of the rollup whose Parquet directory is
    ``path``, a line per distinct ``by`` values (labelled by ``label``), only the rows whose columns
    equal ``only``'s values."""

    id: str
    title: str
    path: Path
    by: tuple[str, ...]
    value: str
    label: str
    only: Mapping[str, Any] = field(default_factory=dict)


class Drawn(Protocol):
    """What the page draws a chart from: its ``id``, ``title``, the y axis' ``value`` and the series."""

    @property
    def id(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def value(self) -> str: ...

    def refresh(self) -> None:
        """Take in what arrived since the last call."""

    def series(self) -> list[dict[str, Any]]:
        """A series per line: ``label`` and ``points`` (``x`` ms since the epoch, ``y``, ``kind``,
        ``revision``)."""
        ...


class RollupReader:
    """The latest revision of each window of one graph, read incrementally: a ``batch_id=<N>``
    directory is renamed into place complete and never written again (enrich/sinks/rollups.py), so
    each is read once. Thread-safe."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._read: set[str] = set()
        # (by values, window_start µs) -> the row's latest revision
        self._latest: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.graph.id

    @property
    def title(self) -> str:
        return self.graph.title

    @property
    def value(self) -> str:
        return self.graph.value

    def refresh(self) -> None:
        """Read the batch directories that appeared since the last call."""
        with self._lock:
            for batch in self._new_batches():
                try:
                    rows = self._rows(batch)
                except (OSError, pa.ArrowException) as exc:
                    log.warning("graph %s: cannot read %s yet: %s", self.graph.id, batch, exc)
                    continue  # read again at the next refresh
                self._read.add(batch.name)
                for row in rows:
                    key = (*(row[b] for b in self.graph.by), row[WINDOW_START])
                    old = self._latest.get(key)
                    if old is None or row[REVISION] > old[REVISION]:
                        self._latest[key] = row

    def series(self) -> list[dict[str, Any]]:
        """A series per distinct ``by`` values, its points ordered by window: ``x`` the window's
        start (ms since the epoch), ``y`` the value, ``kind`` (provisional|final|correction) and the
        row's ``revision``; windows whose value is null are left out."""
        lines: dict[tuple[Any, ...], dict[str, Any]] = {}
        with self._lock:
            rows = sorted(self._latest.values(), key=lambda r: r[WINDOW_START])
        g = self.graph
        for row in rows:
            if row[g.value] is None:
                continue
            label = "(none)" if row[g.label] is None else str(row[g.label])  # e.g. a device no site matched
            line = lines.setdefault(tuple(row[b] for b in g.by), {"label": label, "points": []})
            line["points"].append({"x": row[WINDOW_START] // 1000, "y": row[g.value], "kind": row[KIND],
                                   "revision": row[REVISION]})
        return sorted(lines.values(), key=lambda s: s["label"])

    def _new_batches(self) -> list[Path]:
        try:
            found = [p for p in self.graph.path.iterdir()
                     if p.name.startswith("batch_id=") and p.is_dir() and p.name not in self._read]
        except FileNotFoundError:
            return []  # the job has written no row of this rollup yet
        return sorted(found, key=lambda p: int(p.name.split("=", 1)[1]))

    def _rows(self, batch: Path) -> list[dict[str, Any]]:
        g = self.graph
        columns = list(dict.fromkeys([*g.by, g.label, WINDOW_START, g.value, KIND, REVISION]))
        tables = [pq.read_table(f, columns=columns) for f in sorted(batch.glob("*.parquet"))]
        if not tables:
            return []
        t = pa.concat_tables(tables)
        for col, want in g.only.items():
            t = t.filter(pc.equal(t[col], pa.scalar(want, t.schema.field(col).type)))
        # Microseconds since the epoch: cheap to compare and to hand to the page as milliseconds. Spark's
        # files hold the times as naive nanoseconds (UTC), not as the spec's schema says: cast through it.
        start = t[WINDOW_START].cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        t = t.set_column(t.schema.get_field_index(WINDOW_START), WINDOW_START, start)
        rows: list[dict[str, Any]] = t.to_pylist()
        return rows


class CorrectionsGraph:
    """The corrections the demo read from the enriched topic (:meth:`add`, from the tail's thread):
    how many events were corrected, per minute of their event time, a line per cause (the late
    version: dataset, key and ``valid_from``). An event corrected twice counts once, under the cause
    of its latest revision. Thread-safe."""

    id = "corrections"
    title = "Corrections: events written again when reference truth came late, per minute of their time"
    value = "events corrected"

    def __init__(self) -> None:
        # event identity (topic, partition, offset) -> (its minute, ms; cause label; revision)
        self._latest: dict[tuple[Any, ...], tuple[int, str, int]] = {}
        self._lock = threading.Lock()

    def add(self, correction: Mapping[str, Any]) -> None:
        ident = (correction.get("_topic"), correction.get("_partition"), correction.get("_offset"))
        t = _utc(correction.get("ts"))
        if t is None:
            log.warning("graphs: a correction without an event time: %s", ident)
            return
        minute = int(t.timestamp()) // 60 * 60_000
        revision = int(correction.get("_revision") or 0)
        with self._lock:
            old = self._latest.get(ident)
            if old is None or revision > old[2]:
                self._latest[ident] = (minute, cause_label(correction.get("_cause")), revision)

    def refresh(self) -> None:
        """Nothing to read: :meth:`add` is called as corrections arrive."""

    def series(self) -> list[dict[str, Any]]:
        with self._lock:
            latest = list(self._latest.values())
        per: dict[str, dict[int, list[int]]] = {}
        for minute, cause, revision in latest:
            slot = per.setdefault(cause, {}).setdefault(minute, [0, 0])
            slot[0] += 1
            slot[1] = max(slot[1], revision)
        return [{"label": cause, "points": [{"x": m, "y": n, "kind": "correction", "revision": r}
                                            for m, (n, r) in sorted(minutes.items())]}
                for cause, minutes in sorted(per.items())]


def cause_label(cause: Any) -> str:
    """A correction's ``_cause`` (``{dataset, key, valid_from, ...}``, or its JSON text) in a few words:
    ``models m-2 valid from 12:00:00 UTC``."""
    if isinstance(cause, str):
        try:
            cause = json.loads(cause)
        except ValueError:
            return cause
    if not isinstance(cause, Mapping):
        return str(cause)
    try:
        key = " ".join(str(v) for v in json.loads(cause.get("key") or "{}").values())
    except (ValueError, AttributeError):
        key = str(cause.get("key"))
    return f"{cause.get('dataset')} {key} valid from {utc_hms(cause.get('valid_from'))}"


def utc_hms(ts: Any) -> str:
    """``HH:MM:SS UTC`` of an ISO time (naive: UTC), or the value as it came when it is not one."""
    t = _utc(ts)
    return str(ts) if t is None else t.strftime("%H:%M:%S UTC")


def _utc(ts: Any) -> datetime | None:
    """An ISO time (text or a datetime; naive: UTC) in UTC; None when it is not one."""
    try:
        t = datetime.fromisoformat(str(ts))
    except ValueError:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def demo_graphs(rollups: Iterable[RollupConfig], device_id: str) -> list[Graph]:
    """The demo's graphs over its rollups' Parquet directories: ``device_id``'s temperature mean per
    minute (``device_1m``) and every site's (``site_1m``); a rollup missing from ``rollups`` or
    without a Parquet output has no graph."""
    paths = {r.name: r.output.parquet for r in rollups if r.output.parquet is not None}
    graphs = []
    if "device_1m" in paths:
        graphs.append(Graph("device", f"Device {device_id}: temperature mean per minute (°C)",
                            paths["device_1m"], ("device_id",), "temperature_mean", "device_id",
                            {"device_id": device_id}))
    if "site_1m" in paths:
        graphs.append(Graph("sites", "Sites: temperature mean per minute (°C)", paths["site_1m"],
                            ("site_id", "site_name"), "temperature_mean", "site_name"))
    return graphs


class GraphsServer:
    """Serves the graphs page of ``graphs`` on ``host``:``port`` (0: a free port) from a daemon thread."""

    def __init__(self, graphs: Sequence[Graph], host: str = "127.0.0.1", port: int = 0,
                 more: Sequence[Drawn] = ()) -> None:
        self.readers: list[Drawn] = [*(RollupReader(g) for g in graphs), *more]
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="demo-graphs", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> GraphsServer:
        self._thread.start()
        log.info("graphs page on %s", self.url)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)

    def data(self) -> dict[str, Any]:
        """What ``/data.json`` returns: every graph's series, read from the rollups' directories now."""
        out = []
        for r in self.readers:
            r.refresh()
            out.append({"id": r.id, "title": r.title, "value": r.value, "series": r.series()})
        return {"graphs": out, "read_at": int(time.time() * 1000)}


def _handler(server: GraphsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, "text/html; charset=utf-8", page(server.readers).encode())
            elif path == "/data.json":
                try:
                    body = json.dumps(server.data(), allow_nan=False).encode()
                except Exception:  # the page shows the error; the server keeps serving
                    log.exception("graphs: reading the rollups failed")
                    self._send(500, "text/plain; charset=utf-8", b"reading the rollups failed (see the demo's log)")
                    return
                self._send(200, "application/json", body)
            elif path == "/" + LIBRARY:
                self._send(200, "text/javascript; charset=utf-8", library(), cache=True)
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found")

        def _send(self, status: int, ctype: str, body: bytes, cache: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            log.debug("graphs: %s", format % args)

    return Handler


def library() -> bytes:
    """Chart.js as shipped in the package (its licence header kept)."""
    return (resources.files("demo") / "static" / LIBRARY).read_bytes()


def page(readers: Sequence[Drawn]) -> str:
    """The graphs page: a canvas per graph, drawn and updated by the script from ``/data.json``."""
    canvases = "\n".join(
        f'<section><h2>{_esc(r.title)}</h2><div class="box"><canvas id="chart-{_esc(r.id)}">'
        f"</canvas></div></section>" for r in readers)
    return _PAGE.replace("@CANVASES@", canvases).replace("@POLL_MS@", str(POLL_MS))


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>refstream demo: rollups</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 1.2em 0 .3em; }
 .box { position: relative; height: 320px; max-width: 1100px; }
 #status { color: #666; } #drawn { display: none; }
</style>
<script src="/chart.umd.min.js"></script></head>
<body>
<h1>refstream demo: rollups</h1>
<p>Latest revision of each one-minute window. <b>&#9675;</b> provisional (the window may still change),
<b>&#9679;</b> final (the watermark passed its end), <b>&#9650;</b> correction (a late event changed a final
window; on the corrections graph, events a late reference version changed).
<span id="status">loading&hellip;</span></p>
@CANVASES@
<pre id="drawn"></pre>
<script>
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"];
const charts = {};
const hhmm = ms => new Date(ms).toISOString().slice(11, 16);

function dataset(series, i) {
  const color = COLORS[i % COLORS.length];
  return {
    label: series.label, data: series.points, borderColor: color, backgroundColor: color, borderWidth: 1.5,
    pointRadius: 4,
    pointBorderColor: color, pointBorderWidth: 1.5,
    // Provisional: hollow; final and correction: filled (a correction as a triangle).
    pointBackgroundColor: ctx => (ctx.raw && ctx.raw.kind === "provisional") ? "#ffffff" : color,
    pointStyle: ctx => (ctx.raw && ctx.raw.kind === "correction") ? "triangle" : "circle",
  };
}

function chartFor(graph) {
  if (charts[graph.id]) return charts[graph.id];
  const canvas = document.getElementById("chart-" + graph.id);
  if (!canvas) return null;
  charts[graph.id] = new Chart(canvas, {
    type: "line",
    data: {datasets: []},
    options: {
      animation: false, maintainAspectRatio: false, parsing: {xAxisKey: "x", yAxisKey: "y"},
      scales: {x: {type: "linear", ticks: {callback: v => hhmm(v), stepSize: 60000}, title: {display: true, text: "window start (UTC)"}},
               y: {title: {display: true, text: graph.value}}},
      plugins: {legend: {position: "right"},
                tooltip: {callbacks: {label: c => `${c.dataset.label} ${hhmm(c.raw.x)}: ${c.raw.y.toFixed(2)} (${c.raw.kind}, revision ${c.raw.revision})`}}},
    },
  });
  return charts[graph.id];
}

// What the charts hold, read back from Chart.js: points drawn and their kinds per graph, with the
// fill each kind got. Tests read it from the DOM.
function recordDrawn() {
  const out = {};
  for (const [id, chart] of Object.entries(charts)) {
    const kinds = {}, fills = {};
    let points = 0;
    chart.data.datasets.forEach((ds, i) => {
      const elements = chart.getDatasetMeta(i).data;
      points += elements.length;
      elements.forEach((el, j) => {
        const kind = ds.data[j].kind;
        kinds[kind] = (kinds[kind] || 0) + 1;
        fills[kind] = el.options.backgroundColor === "#ffffff" ? "hollow" : "filled";
      });
    });
    out[id] = {datasets: chart.data.datasets.length, points, kinds, fills};
  }
  document.getElementById("drawn").textContent = JSON.stringify(out);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/data.json", {cache: "no-store"});
    if (!r.ok) throw new Error(await r.text());
    const data = await r.json();
    let points = 0;
    for (const graph of data.graphs) {
      const chart = chartFor(graph);
      if (!chart) continue;
      chart.data.datasets = graph.series.map(dataset);
      chart.update("none");
      points += graph.series.reduce((n, s) => n + s.points.length, 0);
    }
    recordDrawn();
    status.textContent = `${points} windows, read ${new Date(data.read_at).toISOString().slice(11, 19)} UTC; ` +
                         `updated every @POLL_MS@ ms.`;
  } catch (e) {
    status.textContent = "cannot read the rollups: " + e;
  }
}

poll();
setInterval(poll, @POLL_MS@);
</script>
</body></html>
"""
