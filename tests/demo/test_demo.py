"""`python -m demo` end to end: a bounded run whose every scripted change must be seen in
the enriched output; Ctrl-C (SIGINT) then stops it cleanly, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import spark_defaults_less
from tests.demo.conftest import ROOT
from tests.timing import bound

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # starts the whole demo

LIMIT = 720.0  # the whole run, Spark start included, on a busy 2-core machine (typically 3-4 min)
#: The pipeline's first enriched event: Spark's start and its first stateful batch took over 5 min on
#: a 2-core machine whose other services took half of it (the demo's default is 300 s).
STARTUP = 600
SEEN = re.compile(r"^\[(?P<t0>\d\d:\d\d:\d\d)\] (?P<what>(UPDATE|EDIT|DELETE|INSERT|refresh run) .*?) \.\.\. .*"
                  r"seen in enriched output at (?P<t1>\d\d:\d\d:\d\d), after (?P<s>\d+\.\d) s", re.M)


def _leftovers(workdir: Path) -> list[psutil.Process]:
    """Processes started for this demo run (they all inherit DEMO_DIR=<workdir>)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("DEMO_DIR") == str(workdir):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


@pytest.mark.timeout(LIMIT + 240)  # its own waits, not the suite's 900 s, bound it
def test_demo_shows_every_change_in_the_enriched_output_and_stops_cleanly(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    # The tests' Spark defaults turn every job's UI off: the demo's job gets them without that line,
    # so the Spark UI it prints answers as it does under `make demo`.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spark_defaults_less("spark.ui.", tmp_path / "spark-defaults.conf")}
    env.pop("REF_DB_URL", None)  # the SQLite default
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo", "--duration", str(LIMIT), "--workdir", str(workdir),
         "--devices", "2000", "--rate", "200", "--timeout", "60", "--startup-timeout", str(STARTUP)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    done, flowing = threading.Event(), threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if " -> model " in line:  # the first enriched event: every process runs
                flowing.set()
            if "changes reached the enriched output" in line:
                done.set()
        flowing.set()
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    flowing.wait(LIMIT + 60)
    # The addresses the demo printed at start answer while it runs (the operator's changes take tens
    # of seconds from here): the refresher's status page and metrics, the job's metrics and Spark UI.
    printed = "".join(lines)
    pages = {}
    for url in re.findall(r"(?:status page|metrics|Spark UI) (http://127\.0\.0\.1:\d+/[^\s,]*)", printed):
        try:
            with urllib.request.urlopen(url, timeout=bound(10)) as r:
                pages[url] = r.read().decode("utf-8", "replace")
        except OSError as exc:
            pages[url] = f"unreachable: {exc}"
    finished = done.wait(LIMIT + 60)
    # The rollups' graphs page (demo/graphs.py, the rollups of demo/conf/enrich.yaml), while the demo
    # still runs: its JSON has the subject device's and the sites' points by now.
    graphs = re.search(r"^ +graphs: (http://127\.0\.0\.1:\d+/)$", "".join(lines), re.M)
    graph_points: dict[str, int] | str = "no graphs address printed"
    if graphs:
        try:
            with urllib.request.urlopen(graphs.group(1) + "data.json", timeout=bound(30)) as r:
                graph_points = {g["id"]: sum(len(s["points"]) for s in g["series"]) for g in json.load(r)["graphs"]}
        except OSError as exc:
            graph_points = f"unreachable: {exc}"
    # The demo's progress lines (every 10 s once the changes are through), which the README's
    # transcript shows too, before Ctrl-C.
    deadline = time.monotonic() + bound(60)
    while proc.poll() is None and time.monotonic() < deadline and \
            sum("enriched events so far" in line for line in lines) < 2:
        time.sleep(0.5)
    # Ctrl-C as a user would press it, once the scenario is through.
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=bound(90))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(10)  # stdout belongs to the reader thread: never read it here too
    assert proc.stderr is not None
    err = proc.stderr.read()
    out = "".join(lines)
    assert finished, out + err
    metrics = [text for url, text in pages.items() if url.endswith("/metrics")]
    assert len(metrics) == 2 and any("refstream_refresh_runs_total" in t for t in metrics) \
        and any("refstream_enrich_events_total" in t for t in metrics), pages
    html = [text for url, text in pages.items() if not url.endswith("/metrics")]
    assert len(html) == 2 and all("<html" in t.lower() for t in html), pages   # the status page, the Spark UI
    assert any("devices" in t for t in html), pages
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    # The corrections graph has the backdated change's corrections (the last step, done by now).
    assert isinstance(graph_points, dict) and set(graph_points) == {"device", "sites", "corrections"} \
        and all(graph_points.values()), graph_points

    # The README's transcript (make readme-demo) is what this code prints: each of its lines has the
    # shape of a line of this run (numbers, times, names and ports aside).
    from demo.transcript import readme_lines, shape

    shapes = {shape(line, str(workdir)) for line in out.splitlines()}
    stale = [line for line in readme_lines(ROOT / "README.md") if shape(line) not in shapes]
    assert not stale, "README's demo transcript has lines this demo does not print (make readme-demo):\n" + \
        "\n".join(stale)

    seen = {" ".join(m.group("what").split()[:1 if m.group("what").startswith(("UPDATE", "EDIT", "DELETE", "INSERT"))
                                            else 4]): float(m.group("s")) for m in SEEN.finditer(out)}
    for m in SEEN.finditer(out):
        # The arrival time printed is the change's time plus its latency (whole seconds, midnight wraps).
        t0, t1 = (sum(int(x) * f for x, f in zip(m.group(g).split(":"), (3600, 60, 1), strict=True))
                  for g in ("t0", "t1"))
        assert abs((t1 - t0) % 86400 - float(m.group("s"))) <= 1.5, m.group(0)
    # The operator's changes: an UPDATE of the devices table (daemon schedule), an UPDATE of the
    # models table followed by a forced `refresh run`, an edit of the watched CSV file, a DELETE, an
    # INSERT, and a backdated UPDATE of the models table followed by `refresh run --reconcile`, which
    # the job corrects; each reached the enriched output in well under the timeout.
    assert set(seen) == {"UPDATE", "refresh run models", "EDIT", "DELETE", "INSERT",
                         "refresh run models --reconcile"}, out
    assert len(SEEN.findall(out)) == 6, out
    assert re.search(r"^\[.{8}\] UPDATE models m-\d+ model_name .*\n\[.{8}\] refresh run models \.\.\. exit 0 after",
                     out, re.M), out
    backdated = re.search(r"^\[.{8}\] UPDATE models (m-\d+) model_name '(.+)' -> '(.+)' as of (\d\d:\d\d:\d\d) UTC "
                          r"\(a backdated last_update: .*\)\n\[.{8}\] refresh run models --reconcile \.\.\. exit 0 after "
                          r".* \(a correction of d-\d+'s event of (\d\d:\d\d:\d\d) UTC, revision 1, cause models "
                          r"(m-\d+) valid from (\d\d:\d\d:\d\d) UTC; events \d+", out, re.M)
    assert backdated, out
    model, _, _, since, event_at, cause, valid_from = backdated.groups()
    # The correction is of an event after the backdated time, caused by that model's late version.
    secs = [sum(int(x) * f for x, f in zip(t.split(":"), (3600, 60, 1), strict=True)) for t in (since, event_at)]
    assert cause == model and valid_from == since and (secs[1] - secs[0]) % 86400 < 600, backdated.group(0)
    assert all(s < 60 for s in seen.values()), seen
    assert "all 6 changes reached the enriched output" in out
    # Device state (the state: section of demo/conf/enrich.yaml): the first event's line and every
    # change's line give the device's event count and running temperature mean. The first three
    # changes are shown by later and later events of d-17: its count grows.
    # and the risk score its call (calls: in demo/conf/enrich.yaml, demo/risk.py) returned, kept in the state.
    assert re.search(r"^ +d-\d+ -> model .+, owner '.+', events \d+, temperature mean -?\d+\.\d, "
                     r"risk \d+\.\d \((?:low|high)\)$", out, re.M), out
    states = re.findall(r"^\[.{8}\] (\w+) .* seen in enriched output at .*, after \d+\.\d s "
                        r"\((?:now unmatched; |a correction of [^;]+; )?events (\d+), temperature mean -?\d+\.\d, "
                        r"risk (?:-|\d+\.\d \((?:low|high)\))\)$", out, re.M)
    assert [w for w, _ in states] == ["UPDATE", "refresh", "EDIT", "DELETE", "INSERT", "refresh"], out
    subject = [int(n) for _, n in states[:3]]
    assert subject == sorted(set(subject)), subject
    for name in ("refresher", "risk service", "enrichment job", "simulator", "broker"):
        assert f"stopped {name}\n" in out, out  # each stopped, and with exit code 0

    time.sleep(1)
    left = _leftovers(workdir)
    # The broker starts before DEMO_DIR is set: find it by the port the demo printed.
    port = re.search(r"broker up on 127\.0\.0\.1:(\d+)", out)
    assert port, out
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and f"127.0.0.1:{port.group(1)}" in " ".join(p.cmdline()):
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert not left, f"left behind: {[p.cmdline() for p in left]}"
