"""The daemon's /metrics and status page: a real daemon (MariaDB, the broker) with ``metrics: {port: 0}``,
scraped over HTTP after real runs, and its page rendered by headless Chromium."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from refresh.config import load_config
from refstream.errors import ConfigError
from tests.refresh.test_daemon import daemon_thread, items, sql, wait_for, write_config  # noqa: F401 - items is a fixture
from tests.timing import bound


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=bound(10)) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_and_status_page_of_a_running_daemon(mysql_url: str, kafka: dict[str, str], items: str,  # noqa: F811
                                                    tmp_path: Path, chromium: Callable[[str], str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("id,name\n1,a\n2\n")  # line 3 has a missing field: every run fails
    path = write_config(tmp_path, kafka, f"""
        items:
          source: {{url: "{mysql_url}", table: {items}}}
          key: [id]
          schedule: {{every: 1s}}
          topic: ref.{items}
          max_delete_fraction: 1
        broken:
          source: {{path: "{bad}"}}
          key: [id]
          schedule: {{every: 1s}}
          topic: ref.{items}-broken
        """, extra="metrics: {port: 0}\n")
    cfg = load_config(path)
    with daemon_thread(cfg) as d:
        wait_for(lambda: d.metrics_server is not None, what="the metrics server")
        assert d.metrics_server is not None
        url = d.metrics_server.url
        t0 = time.time()
        m = wait_for(lambda: (s := scrape(url)) and value(s, "refstream_refresh_version", dataset="items") == 1
                     and (value(s, "refstream_refresh_runs_total", dataset="items", result="ok") or 0) >= 1 and s,
                     what="an ok run", timeout=90)
        assert value(m, "refstream_refresh_changes_total", dataset="items", op="upsert") == 3
        assert value(m, "refstream_refresh_changes_total", dataset="items", op="delete") == 0
        assert value(m, "refstream_refresh_rows", dataset="items") == 3
        assert value(m, "refstream_refresh_version", dataset="items") == 1
        assert t0 - 60 < (value(m, "refstream_refresh_last_success_timestamp_seconds", dataset="items") or 0) <= time.time()
        assert (value(m, "refstream_refresh_run_duration_seconds_count", dataset="items") or 0) >= 1
        sql(mysql_url, f"DELETE FROM `{items}` WHERE id = 3", f"UPDATE `{items}` SET name = 'uno' WHERE id = 1")
        # One scrape reads the metrics one after the other, while a run may be recording: wait for all.
        # Every run commits a new version (a heartbeat's too), so the run that reads the changes is the
        # second or a later one, as the schedule falls against the UPDATE's commit.
        wait_for(lambda: (s := scrape(url)) and (value(s, "refstream_refresh_version", dataset="items") or 0) >= 2
                 and value(s, "refstream_refresh_changes_total", dataset="items", op="upsert") == 4
                 and value(s, "refstream_refresh_changes_total", dataset="items", op="delete") == 1
                 and value(s, "refstream_refresh_rows", dataset="items") == 2, what="the second version's figures", timeout=90)
        m = wait_for(lambda: (s := scrape(url)) and (value(s, "refstream_refresh_runs_total", dataset="broken",
                                                          result="failed") or 0) >= 1 and s, what="a failed run", timeout=90)
        assert value(m, "refstream_refresh_runs_total", dataset="broken", result="ok") == 0
        assert value(m, "refstream_refresh_last_success_timestamp_seconds", dataset="broken") is None

        dom = chromium(url + "/")
        rows = {k: re.sub(r"<[^>]+>", " ", v) for k, v in re.findall(r'<tr id="ds-(\w+)">(.*?)</tr>', dom, re.S)}
        assert set(rows) == {"items", "broken"}
        assert re.search(r"\bok\b", rows["items"]) and not re.search(r"\bfailed\b", rows["items"])
        assert re.search(r"\bfailed\b", rows["broken"]) and "bad.csv" in rows["broken"]
        assert "never succeeded" in rows["broken"]


def test_the_metrics_section_is_checked_at_load(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id\n1\n")
    for extra, error in [("metrics: {port: 70000}\n", r"metrics\.port: must be a TCP port"),
                         ("metrics: {port: 9108, hots: x}\n", r"metrics.*hots"),
                         ("metrics: {host: x}\n", r"metrics\.port")]:
        path = write_config(tmp_path, {"bootstrap.servers": "127.0.0.1:9"},
                            f"a: {{source: {{path: \"{tmp_path / 'a.csv'}\"}}, key: [id]}}", extra=extra)
        with pytest.raises(ConfigError, match=error):
            load_config(path)
    path = write_config(tmp_path, {"bootstrap.servers": "127.0.0.1:9"},
                        f"a: {{source: {{path: \"{tmp_path / 'a.csv'}\"}}, key: [id]}}", extra="metrics: {port: 9108}\n")
    m = load_config(path).metrics
    assert m is not None and (m.port, m.host) == (9108, "127.0.0.1")
