"""``python -m demo`` (``make demo``): the whole pipeline on one machine, then an operator
changing reference data and the time each change takes to reach the enriched output.

Starts, each in its own process group and stopped in reverse order on Ctrl-C, SIGTERM or
``--duration``: an embedded Kafka-protocol broker, the refresher daemon (``python -m refresh``), the
enrichment job (``python -m enrich run``) and the device simulator (``python -m demo.simulate``).
The job keeps a running state per device (the ``state:`` section of ``conf/enrich.yaml``): each
enriched event the demo shows comes with its device's event count and temperature mean.
``--duration`` stops the run that many seconds after its start, but only once the scripted changes
are through (each bounded by ``--timeout``, the start by ``--startup-timeout``). The reference
database is a SQLite file under the work directory, or the database at ``REF_DB_URL``
(its ``devices`` and ``models`` tables are replaced). Logs of every process go to ``<workdir>/logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import site
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from demo.broker import EmbeddedBroker, free_port
from demo.graphs import CorrectionsGraph, GraphsServer, demo_graphs
from demo.processes import Child, ChildExited
from demo.scenario import SUBJECT, ChangeNotSeen, Operator, Stopped, device_state, matched, say, stamp
from demo.seed import MODELS, SITES, device, seed_database, write_sites
from demo.tail import EnrichedTail
from enrich import config as enrich_config
from refresh.config import RefreshConfig, load_config
from refstream import kafka, version
from refstream.contract import OP_UPSERT, decode, default_topic
from refstream.errors import RefstreamError
from refstream.kafka import read_to_end
from refstream.logs import setup_logging

log = logging.getLogger("demo")

#: The directory holding the project's packages: the children import the same code as the demo.
PACKAGES = Path(__file__).resolve().parents[1]
MARKER = ".refstream-demo"
EVENTS_TOPIC = "device-events"
ENRICHED_TOPIC = "device-events-enriched"
DATASETS = ("devices", "models", "sites")


class DemoError(RuntimeError):
    """The demo cannot go on; the message is the one line the user sees."""


def config_file(name: str) -> contextlib.AbstractContextManager[Path]:
    """The demo's config ``name`` (``refresh.yaml``, ``enrich.yaml``), shipped inside the package
    (``demo/conf/``) so that an installed wheel runs the demo as a checkout does, as a file path
    valid while the context lasts."""
    return resources.as_file(resources.files("demo") / "conf" / name)


def shown_path(path: Path) -> str:
    """``path`` as the user would type it: relative to the current directory when it lies inside."""
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def demo_environment(workdir: Path, bootstrap: str, db_url: str) -> dict[str, str]:
    """The variables the demo's configs read (``${DEMO_...}``) and its children need. The children
    start in the work directory: a source tree the demo runs from without being installed goes on
    their PYTHONPATH (an installed package is found through the interpreter's site-packages)."""
    env = {"DEMO_BOOTSTRAP": bootstrap, "DEMO_DB_URL": db_url, "DEMO_DIR": str(workdir),
           # Free ports for the refresher's and the job's /metrics (and the refresher's status page),
           # and the job's Spark UI: printed at start.
           "DEMO_REFRESH_METRICS_PORT": str(free_port()), "DEMO_ENRICH_METRICS_PORT": str(free_port()),
           "DEMO_SPARK_UI_PORT": str(free_port()), "DEMO_RISK_PORT": str(free_port()),
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    installed = {Path(p).resolve() for p in site.getsitepackages()}
    if PACKAGES not in installed:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGES), os.environ.get("PYTHONPATH", "")) if p)
    return env


def load_configs(refresh_yaml: Path, enrich_yaml: Path) -> tuple[RefreshConfig, enrich_config.EnrichConfig]:
    """Load the demo's two configs as its children will (with :func:`demo_environment` exported): a
    broken config stops the demo before anything starts, naming the file and key."""
    return load_config(refresh_yaml), enrich_config.load(enrich_yaml)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None,
                   help="stop this many seconds after the start, once the operator's changes are "
                        "through (default: run until Ctrl-C)")
    p.add_argument("--workdir", type=Path, default=Path("var/demo"),
                   help="state, data and logs of this run (wiped at start; default var/demo)")
    p.add_argument("--devices", type=int, default=5000, help="devices in the sample data")
    p.add_argument("--rate", type=float, default=500, help="simulated events per second")
    p.add_argument("--timeout", type=float, default=60,
                   help="seconds a change may take to reach the enriched output")
    p.add_argument("--startup-timeout", type=float, default=300,
                   help="seconds the pipeline may take to deliver its first enriched event")
    p.add_argument("--master", default="local[2]", help="Spark master of the enrichment job")
    p.add_argument("--debug", action="store_true", help="tracebacks and debug logs")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return p


class Demo:
    def __init__(self, args: argparse.Namespace, stop: threading.Event) -> None:
        self.args = args
        self.stop = stop
        self.workdir: Path = args.workdir.resolve()
        self.logs = self.workdir / "logs"
        self.children: list[Child] = []
        self.started = time.monotonic()

    # ------------------------------------------------------------------------------------- the run

    def run(self) -> int:
        try:
            return self._run()
        except Stopped:
            say(f"[{stamp()}] stopped before the end of the scenario")
            return 0

    def _run(self) -> int:
        with contextlib.ExitStack() as stack:
            self._prepare_workdir()
            say(f"refstream demo: work directory {shown_path(self.workdir)}, logs in {shown_path(self.logs)}/ "
                f"(Ctrl-C stops)")
            broker = EmbeddedBroker(log_path=self.logs / "broker.log")
            broker.start()
            stack.callback(self._stopped, "broker", broker.stop)
            settings = {"bootstrap.servers": broker.bootstrap}
            say(f"[{stamp()}] broker up on {broker.bootstrap} (embedded, in memory)")

            db_url = self._seed()
            # Read by demo/conf/*.yaml in every child and in `refresh run` started by the operator.
            os.environ.update(demo_environment(self.workdir, broker.bootstrap, db_url))
            refresh_yaml = stack.enter_context(config_file("refresh.yaml"))
            enrich_yaml = stack.enter_context(config_file("enrich.yaml"))
            _, enrich_conf = load_configs(refresh_yaml, enrich_yaml)
            refresh_cmd = [sys.executable, "-m", "refresh", "--config", str(refresh_yaml)]

            refresher_started = time.monotonic()
            self._start(stack, "refresher", [*refresh_cmd, "daemon"])
            port = os.environ["DEMO_REFRESH_METRICS_PORT"]
            say(f"           status page http://127.0.0.1:{port}/, metrics http://127.0.0.1:{port}/metrics")
            # The job starts beside the refresher's first run, not after it: its Spark start takes
            # longer than that run, and its start waits for each changelog's schema record, which
            # comes in one transaction with the dataset's rows (bootstrap_timeout in enrich.yaml).
            self._start(stack, "risk service", [sys.executable, "-m", "demo.risk", "--port",
                                                os.environ["DEMO_RISK_PORT"]])
            self._start(stack, "enrichment job", [sys.executable, "-m", "enrich", "run", "--config",
                                                  str(enrich_yaml), "--master", self.args.master])
            say(f"           metrics http://127.0.0.1:{os.environ['DEMO_ENRICH_METRICS_PORT']}/metrics, Spark UI "
                f"http://127.0.0.1:{os.environ['DEMO_SPARK_UI_PORT']}/")
            # The rollups' graphs, served from this process: it reads the job's Parquet directories.
            corrections = CorrectionsGraph()  # fed by the tail below
            graphs = GraphsServer(demo_graphs(enrich_conf.rollups, device(SUBJECT).device_id),
                                  more=[corrections]).start()
            stack.callback(graphs.stop)
            say(f"           graphs: {graphs.url}")
            self._start(stack, "simulator", [sys.executable, "-m", "demo.simulate", "--bootstrap",
                                             broker.bootstrap, "--topic", EVENTS_TOPIC, "--rate",
                                             f"{self.args.rate:g}", "--devices", str(self.args.devices),
                                             "--malformed", "0.01"])
            tail = EnrichedTail(settings, ENRICHED_TOPIC, on_correction=corrections.add).start()
            stack.callback(tail.stop)
            self._wait_for_changelogs(settings, since=refresher_started)
            overrides: dict[str, Any] = {"linger.ms": "5", "logger": log}
            producer = kafka.producer(settings, **overrides)
            stack.callback(producer.flush, 5)

            self._wait_for_first_event(tail)
            operator = Operator(db_url=db_url, sites_csv=self.workdir / "data" / "sites.csv", tail=tail,
                                producer=producer, events_topic=EVENTS_TOPIC, refresh_cmd=refresh_cmd,
                                timeout=self.args.timeout, stop=self.stop, check=self._check_children,
                                devices=self.args.devices)
            stack.callback(operator.close)
            results = operator.run()
            lat = [s for _, s in results.latencies]
            say(f"[{stamp()}] all {len(lat)} changes reached the enriched output "
                f"(median {statistics.median(lat):.1f} s, max {max(lat):.1f} s)")
            self._steady(tail)
            say(f"[{stamp()}] stopping: {tail.count:,} enriched events read, {tail.corrections:,} corrections")
        return 0

    def _prepare_workdir(self) -> None:
        w = self.workdir
        if w.exists() and any(w.iterdir()):
            if not (w / MARKER).exists():
                raise DemoError(f"{w} exists and was not made by the demo; choose another --workdir")
            shutil.rmtree(w)  # the broker keeps topics in memory: old state would not match them
        (w / "data").mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        (w / MARKER).write_text("work directory of `python -m demo`, wiped at each start\n")
        setup_logging(debug=self.args.debug, file=self.logs / "demo.log", force=True)

    def _seed(self) -> str:
        db_url = os.environ.get("REF_DB_URL") or f"sqlite:///{self.workdir / 'refdata.db'}"
        seed_database(db_url, self.args.devices)
        write_sites(self.workdir / "data" / "sites.csv")
        shown = db_url.split("@")[-1] if "@" in db_url else db_url.replace(str(self.workdir),
                                                                            shown_path(self.workdir))
        say(f"[{stamp()}] seeded {shown}: {self.args.devices:,} devices, {len(MODELS)} models; "
            f"{len(SITES)} sites in data/sites.csv")
        return db_url

    def _start(self, stack: contextlib.ExitStack, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, self.logs / f"{name.split()[0]}.log", cwd=self.workdir).start()
        self.children.append(child)
        stack.callback(self._stopped, name, child.stop)
        say(f"[{stamp()}] started {name} (pid {child.pid})")
        return child

    def _stopped(self, name: str, stop: Callable[[], Any]) -> None:
        code = stop()
        say(f"[{stamp()}] stopped {name}" + (f" (exit code {code})" if code not in (None, 0) else ""))

    def _check_children(self) -> None:
        for c in self.children:
            try:
                c.check()
            except ChildExited as exc:
                raise DemoError(str(exc)) from None

    def _sleep(self, seconds: float) -> None:
        self._check_children()
        if self.stop.wait(seconds):
            raise Stopped

    # ---------------------------------------------------------------------------------- waiting

    def _wait_for_changelogs(self, settings: dict[str, str], since: float) -> None:
        deadline = since + self.args.startup_timeout
        counts: dict[str, int] = {}
        while time.monotonic() < deadline:
            counts = {d: _upserts(settings, default_topic(d)) for d in DATASETS}
            if all(counts.values()):
                say(f"[{stamp()}] refresher published "
                    + ", ".join(f"{d}: {n:,} rows" for d, n in counts.items())
                    + f" in {time.monotonic() - since:.1f} s")
                return
            self._sleep(1.0)
        missing = [d for d, n in counts.items() if not n] or list(DATASETS)
        raise DemoError(f"the refresher published nothing for {', '.join(missing)} within "
                        f"{self.args.startup_timeout:.0f} s (see {self.logs / 'refresher.log'})")

    def _wait_for_first_event(self, tail: EnrichedTail) -> None:
        t0 = time.monotonic()
        say(f"[{stamp()}] waiting for the first enriched event (Spark's first start takes a minute or two) ...", end=" ")
        exp = tail.expect("first", lambda e: matched(e, "devices", "model_id") and bool(e.get("site_name")))
        exp.mark_started()
        while time.monotonic() - t0 < self.args.startup_timeout:
            latency = exp.wait(1.0, self.stop)
            if latency is not None:
                e = exp.event or {}
                say(f"after {latency:.1f} s ({time.monotonic() - self.started:.1f} s since the demo started):\n           {e.get('device_id')} -> model "
                    f"{e.get('model_name')!r}, site {e.get('site_name')!r} ({e.get('region')}), "
                    f"owner {e.get('owner')!r}, {device_state(e)}")
                return
            self._sleep(0)
        raise DemoError(f"no enriched event within {self.args.startup_timeout:.0f} s "
                        f"(see {self.logs / 'enrichment.log'})")

    def _steady(self, tail: EnrichedTail) -> None:
        # --duration bounds the run but never cuts the scenario short: on a busy machine Spark's start
        # alone can take minutes, and a run that stops before the changes shows nothing.
        end = None if self.args.duration is None else self.started + self.args.duration
        if end is None:
            say(f"[{stamp()}] the pipeline keeps running; Ctrl-C stops it")
        last, t_last = tail.count, time.monotonic()
        while True:
            left = 10.0 if end is None else min(10.0, end - time.monotonic())
            if left <= 0:
                return
            try:
                self._sleep(left)
            except Stopped:
                return
            now = time.monotonic()
            if now - t_last < 5.0:
                continue  # the short stretch before --duration ends: no rate worth showing
            subject = device(SUBJECT).device_id
            seen = tail.latest.get(subject)
            say(f"[{stamp()}] {tail.count:,} enriched events so far "
                f"({(tail.count - last) / (now - t_last):,.0f}/s)"
                + (f"; {subject}: {device_state(seen)}" if seen is not None else ""))
            last, t_last = tail.count, now


def _upserts(settings: dict[str, str], topic: str) -> int:
    try:
        return sum(1 for m in read_to_end(settings, topic, timeout=10)
                   if decode(m.key(), m.value(), m.headers()).op == OP_UPSERT)
    except RefstreamError:
        return 0


@contextlib.contextmanager
def _signals(stop: threading.Event) -> Iterator[None]:
    """First SIGINT/SIGTERM: stop in order. A second one: unwind at once (children still stopped).

    A second signal within a second of the first is the same Ctrl-C delivered twice (wrappers such as
    ``timeout`` pass it on to their whole process group, which already got it): ignored."""
    first: float | None = None

    def handler(signum: int, _frame: object) -> None:
        nonlocal first
        now = time.monotonic()
        if first is None:
            first = now
            stop.set()
        elif now - first > 1.0:
            raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    demo = Demo(args, stop)
    try:
        with _signals(stop):
            return demo.run()
    except KeyboardInterrupt:
        return 130
    except (DemoError, ChangeNotSeen, ChildExited, RefstreamError, OSError) as exc:
        if args.debug:
            raise
        print(f"demo: {exc} (logs in {demo.logs})", file=sys.stderr)
        return 1
