"""The status page as a person sees it: rendered by headless Chromium from a real state directory."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

from refresh.page import render, sparkline
from refresh.stores.abc import RUN_HISTORY, RunRecord, RunResult
from refresh.stores.files import FileStateStore

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def _run(ds: str, minutes_ago: float, *, ok: bool = True, inserts: int = 0, deletes: int = 0, seconds: float = 1.0,
         version: int = 1, error: str | None = None) -> RunRecord:
    t = NOW - timedelta(minutes=minutes_ago)
    return RunRecord(started=(t - timedelta(seconds=seconds)).isoformat(), finished=t.isoformat(),
                     result=RunResult(dataset=ds, ok=ok, version=version, rows=100 + inserts - deletes,
                                      inserts=inserts, updates=0, deletes=deletes, published=inserts + deletes,
                                      seconds=seconds, error=error))


def _store(tmp_path: Path) -> FileStateStore:
    store = FileStateStore(tmp_path / "state")
    history = {"devices": [_run("devices", 30 - i, inserts=i, seconds=0.5 + i / 10, version=i + 1) for i in range(8)],
               "sites": [_run("sites", 20, inserts=3), _run("sites", 5, ok=False, version=1,
                                                            error="dataset sites: cannot read sites.csv line 4")]}
    for ds, runs in history.items():
        for run in runs:
            store.write_status(ds, store.read_status(ds).after(run))
            store.append_run(ds, run)
    return store


class _Text(HTMLParser):
    """The text of each table row, by row id, and what else a person would notice."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, str] = {}
        self.row: str | None = None
        self.svgs = 0
        self.scripts = 0
        self.external: list[str] = []
        self.in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("id", "").startswith("ds-"):
            self.row = a["id"][3:]
            self.rows[self.row] = ""
        self.svgs += tag == "svg"
        self.scripts += tag == "script"
        self.in_title = tag == "title" and self.row is not None
        for k in ("src", "href"):
            if a.get(k):
                self.external.append(str(a[k]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self.row = None
        if tag == "title":
            self.in_title = False

    def handle_data(self, data: str) -> None:
        if self.row is not None and not self.in_title:  # an SVG's title is a tooltip, not row text
            self.rows[self.row] += " " + data.strip()


def test_the_page_shows_each_dataset_and_a_failed_run_as_failed(tmp_path: Path,
                                                              chromium: Callable[[str], str]) -> None:
    store = _store(tmp_path)
    page = render([(store.read_status(ds), store.read_runs(ds)) for ds in ("devices", "sites", "models")], now=NOW)
    path = tmp_path / "index.html"
    path.write_text(page, encoding="utf-8")
    dom = _Text()
    dom.feed(chromium(path.as_uri()))
    assert set(dom.rows) == {"devices", "sites", "models"}
    devices, sites, models = (re.sub(r"\s+", " ", dom.rows[k]) for k in ("devices", "sites", "models"))
    assert devices.startswith(" devices") and " ok " in devices and " 8 " in devices and "+7 ~0 -0" in devices
    assert " failed " in sites and "cannot read sites.csv line 4" in sites and " ok " not in sites
    assert " 5m ago " in sites and sites.endswith(" 20m")  # last run 5 minutes ago; age: the last success, 20 minutes ago
    assert "never run" in models
    assert dom.svgs == 4 and dom.scripts == 0 and dom.external == []  # 2 sparklines per dataset that ran


def test_history_is_bounded_and_survives_a_bad_line(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path / "state")
    for i in range(RUN_HISTORY + 5):
        store.append_run("d", _run("d", 100 - i, inserts=i))
    runs = store.read_runs("d")
    assert len(runs) == RUN_HISTORY and runs[-1].result.inserts == RUN_HISTORY + 4 and runs[0].result.inserts == 5
    path = tmp_path / "state" / "d" / "runs.jsonl"
    path.write_text(path.read_text() + "{broken\n")
    assert len(store.read_runs("d")) == RUN_HISTORY
    assert store.read_runs("never") == []


def test_sparkline_scales_to_its_maximum_and_names_the_values() -> None:
    svg = sparkline([0, 5, 10], "changes", "#000", bars=True, width=30, height=12)
    assert "<title>changes: 0, 5, 10</title>" in svg and svg.count("<rect") == 3
    heights = [float(h) for h in re.findall(r'height="([\d.]+)"', svg)[1:]]
    assert heights[-1] == 10.0 and heights[1] == 5.0  # height - 2 pixels for the maximum
    assert "none yet" in sparkline([], "d", "#000")
