"""The demo's graphs page (demo/graphs.py) over rollup Parquet directories written here in the job's
layout: the JSON holds the latest revision of each window, and headless Chromium draws the series
with Chart.js, provisional points hollow and final ones filled."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from demo.graphs import CorrectionsGraph, GraphsServer, demo_graphs
from enrich.rollups.config import RollupConfig, RollupOutput
from enrich.rollups.spec import RollupSpec

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
MINUTE_US = 60_000_000

DEVICE = RollupSpec(name="device_1m", by=("device_id",), by_types=(pa.string(),), window_us=MINUTE_US,
                    metrics=(("temperature", ("count", "mean", "max", "p95"), pa.float64()),
                             ("battery", ("last",), pa.int32())),
                    correct_for_us=3600 * 1_000_000)
SITE = RollupSpec(name="site_1m", by=("site_id", "site_name"), by_types=(pa.string(), pa.string()),
                  window_us=MINUTE_US,
                  metrics=(("temperature", ("mean", "max"), pa.float64()), ("device_id", ("count_distinct",), pa.string())),
                  correct_for_us=3600 * 1_000_000)


def _row(spec: RollupSpec, keys: dict[str, Any], minute: int, mean: float | None, kind: str, revision: int) -> dict[str, Any]:
    start = T0 + timedelta(minutes=minute)
    row: dict[str, Any] = {f.name: None for f in spec.output_schema()}
    row.update(keys, window_start=start, window_end=start + timedelta(minutes=1), temperature_mean=mean,
               temperature_max=mean, _kind=kind, _revision=revision, _events=3,
               _finalized_by="watermark" if kind == "final" else None,
               _cause="late event" if kind == "correction" else None)
    if "temperature_count" in row:
        row["temperature_count"] = 3
    if "device_id_count_distinct" in row:
        row["device_id_count_distinct"] = 2
    return row


def _write_batch(path: Path, spec: RollupSpec, batch_id: int, rows: list[dict[str, Any]], *, spark: bool = False) -> None:
    """A micro-batch's rows as the job leaves them: ``<path>/batch_id=<N>/part-*.parquet`` (and
    Spark's ``_SUCCESS``). ``spark``: the times as Spark's files give them to pyarrow, naive
    nanoseconds (UTC), not the spec's ``timestamp[us, UTC]``."""
    d = path / f"batch_id={batch_id}"
    d.mkdir(parents=True)
    table = pa.Table.from_pylist(rows, schema=spec.output_schema())
    if spark:
        naive = pa.schema([f.with_type(pa.timestamp("ns")) if pa.types.is_timestamp(f.type) else f for f in table.schema])
        table = table.cast(naive)
    pq.write_table(table, d / "part-00000-x.snappy.parquet")
    (d / "_SUCCESS").touch()


def _rollups(tmp_path: Path) -> tuple[Path, Path]:
    dev, site = tmp_path / "rollups" / "device_1m", tmp_path / "rollups" / "site_1m"
    d17, d18 = {"device_id": "d-17"}, {"device_id": "d-18"}
    # Minute 0 provisional, then final; minute 1 provisional (twice), then a late event's correction
    # of minute 0; minute 2 provisional only. d-18 is another device: not drawn.
    _write_batch(dev, DEVICE, 0, [_row(DEVICE, d17, 0, 20.0, "provisional", 1), _row(DEVICE, d18, 0, 5.0, "provisional", 1)])
    _write_batch(dev, DEVICE, 1, [_row(DEVICE, d17, 0, 21.0, "final", 2), _row(DEVICE, d17, 1, 22.0, "provisional", 1)])
    _write_batch(dev, DEVICE, 2, [_row(DEVICE, d17, 1, 23.0, "provisional", 2), _row(DEVICE, d17, 2, 24.0, "provisional", 1)])
    _write_batch(dev, DEVICE, 3, [_row(DEVICE, d17, 0, 21.5, "correction", 3)])
    # A batch still being written by the job (its staging directory): not read.
    (dev / "_staging" / "batch_id=4-abcd").mkdir(parents=True)
    a, b = {"site_id": "s-1", "site_name": "Alpha"}, {"site_id": "s-2", "site_name": "Beta"}
    _write_batch(site, SITE, 0, [_row(SITE, a, 0, 19.0, "provisional", 1), _row(SITE, b, 0, 30.0, "provisional", 1)])
    _write_batch(site, SITE, 2, [_row(SITE, a, 0, 19.5, "final", 2), _row(SITE, b, 0, 31.0, "final", 2),
                                 _row(SITE, a, 1, 18.0, "provisional", 1), _row(SITE, b, 1, None, "provisional", 1)],
                 spark=True)
    return dev, site


def _configs(dev: Path, site: Path) -> list[RollupConfig]:
    return [RollupConfig(name="device_1m", by=("device_id",), window=timedelta(minutes=1),
                         metrics=(("temperature", ("mean",)),), output=RollupOutput(parquet=dev)),
            RollupConfig(name="site_1m", by=("site_id", "site_name"), window=timedelta(minutes=1),
                         metrics=(("temperature", ("mean",)),), output=RollupOutput(parquet=site)),
            RollupConfig(name="other", by=("device_id",), window=timedelta(minutes=1),
                         metrics=(("temperature", ("mean",)),), output=RollupOutput(kafka="t"))]


def _correction(offset: int, minute: int, second: int, key: str, revision: int = 1, *, text: bool = False) -> dict[str, Any]:
    """A correction as the demo's tail reads it from the enriched topic (``_cause`` an object, or its
    JSON text as a database row has it)."""
    cause = {"dataset": "models", "key": json.dumps({"model_id": key}), "valid_from": "2026-11-23T11:58:00.000Z",
             "partition": 0, "offset": 7}
    ts = (T0 + timedelta(minutes=minute, seconds=second)).isoformat().replace("+00:00", "Z")
    return {"device_id": "d-3", "ts": ts, "_topic": "device-events", "_partition": 1, "_offset": offset,
            "_kind": "correction", "_revision": revision, "_cause": json.dumps(cause) if text else cause}


def _corrections() -> CorrectionsGraph:
    """Four events of minute 0 and one of minute 1 corrected by m-2's late version; one of them
    corrected again by m-5's (its latest revision counts, under m-5)."""
    g = CorrectionsGraph()
    for i, (minute, second) in enumerate([(0, 5), (0, 10), (0, 20), (0, 40), (1, 0)]):
        g.add(_correction(100 + i, minute, second, "m-2"))
    g.add(_correction(100, 0, 5, "m-5", revision=2, text=True))
    g.add(_correction(101, 0, 10, "m-9", revision=1))  # a lower revision than the one held: ignored
    return g


def test_the_corrections_graph_counts_each_event_once_per_minute_under_its_latest_cause() -> None:
    ms = [int((T0 + timedelta(minutes=m)).timestamp() * 1000) for m in range(2)]
    assert _corrections().series() == [
        {"label": "models m-2 valid from 11:58:00 UTC",
         "points": [{"x": ms[0], "y": 3, "kind": "correction", "revision": 1},
                    {"x": ms[1], "y": 1, "kind": "correction", "revision": 1}]},
        {"label": "models m-5 valid from 11:58:00 UTC",
         "points": [{"x": ms[0], "y": 1, "kind": "correction", "revision": 2}]}]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[GraphsServer]:
    dev, site = _rollups(tmp_path)
    srv = GraphsServer(demo_graphs(_configs(dev, site), "d-17"), more=[_corrections()]).start()
    try:
        yield srv
    finally:
        srv.stop()


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read()


def _points(data: dict[str, Any], graph: str) -> dict[str, list[tuple[int, float, str, int]]]:
    (g,) = [g for g in data["graphs"] if g["id"] == graph]
    return {s["label"]: [(p["x"], p["y"], p["kind"], p["revision"]) for p in s["points"]] for s in g["series"]}


def test_the_json_holds_the_latest_revision_of_each_window_and_picks_up_new_batches(
        server: GraphsServer, tmp_path: Path) -> None:
    ms = [int((T0 + timedelta(minutes=m)).timestamp() * 1000) for m in range(4)]
    status, ctype, body = _get(server.url + "data.json")
    assert status == 200 and ctype == "application/json"
    data = json.loads(body)
    # The Kafka-only rollup has no graph; the corrections' comes after the rollups'.
    assert [g["id"] for g in data["graphs"]] == ["device", "sites", "corrections"]
    assert _points(data, "device") == {"d-17": [(ms[0], 21.5, "correction", 3), (ms[1], 23.0, "provisional", 2),
                                                (ms[2], 24.0, "provisional", 1)]}
    # Beta's minute 1 has no mean (no values): left out, not drawn at zero.
    assert _points(data, "sites") == {"Alpha": [(ms[0], 19.5, "final", 2), (ms[1], 18.0, "provisional", 1)],
                                      "Beta": [(ms[0], 31.0, "final", 2)]}
    # The job renames the next batch into place: the next poll has it, the older batches are not read again.
    _write_batch(tmp_path / "rollups" / "device_1m", DEVICE, 5,
                 [_row(DEVICE, {"device_id": "d-17"}, 2, 24.5, "final", 2),
                  _row(DEVICE, {"device_id": "d-17"}, 3, 25.0, "provisional", 1)])
    later = _points(json.loads(_get(server.url + "data.json")[2]), "device")["d-17"]
    assert later[2:] == [(ms[2], 24.5, "final", 2), (ms[3], 25.0, "provisional", 1)]


def test_a_rollup_not_written_yet_has_a_graph_without_series(tmp_path: Path) -> None:
    srv = GraphsServer(demo_graphs(_configs(tmp_path / "none1", tmp_path / "none2"), "d-17")).start()
    try:
        data = json.loads(_get(srv.url + "data.json")[2])
    finally:
        srv.stop()
    assert [(g["id"], g["series"]) for g in data["graphs"]] == [("device", []), ("sites", [])]


def test_the_page_and_its_library_are_served_from_the_package(server: GraphsServer) -> None:
    status, ctype, html = _get(server.url)
    assert status == 200 and ctype.startswith("text/html")
    page = html.decode()
    # Every script the page loads is the server's own: it works offline.
    assert re.findall(r'<script src="([^"]+)"', page) == ["/chart.umd.min.js"]
    assert 'id="chart-device"' in page and 'id="chart-sites"' in page and 'id="chart-corrections"' in page
    status, ctype, lib = _get(server.url + "chart.umd.min.js")
    assert status == 200 and "javascript" in ctype
    assert lib.startswith(b"/*!\n * Chart.js v4.") and b"Released under the MIT License" in lib[:300]
    with pytest.raises(urllib.error.HTTPError, match="404"):
        _get(server.url + "nothing")


def test_chromium_draws_the_series_with_provisional_points_hollow_and_final_points_filled(
        server: GraphsServer, chromium: Callable[[str], str]) -> None:
    dom = chromium(server.url)
    drawn = re.search(r'<pre id="drawn">(.*?)</pre>', dom, re.S)
    assert drawn and drawn.group(1), dom[-2000:]
    charts = json.loads(drawn.group(1).replace("&quot;", '"'))
    # The points Chart.js laid out (its dataset metadata), per graph, and how it filled each kind.
    assert charts["device"] == {"datasets": 1, "points": 3, "kinds": {"correction": 1, "provisional": 2},
                                "fills": {"correction": "filled", "provisional": "hollow"}}
    assert charts["sites"] == {"datasets": 2, "points": 3, "kinds": {"final": 2, "provisional": 1},
                               "fills": {"final": "filled", "provisional": "hollow"}}
    assert charts["corrections"] == {"datasets": 2, "points": 3, "kinds": {"correction": 3},
                                     "fills": {"correction": "filled"}}
    assert "3 windows" not in dom and re.search(r"9 windows, read \d\d:\d\d:\d\d UTC", dom), dom[-2000:]
