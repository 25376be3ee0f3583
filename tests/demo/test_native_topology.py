"""The docker-compose topology run natively: MariaDB loaded with the stack's init SQL, the broker, and
the refresher, the enrichment job and the simulator as separate processes started with the commands
and the conf/docker files of docker-compose.yml, with the environment compose would give them
(addresses pointing at the local services). Enriched events must come out, and a database UPDATE
must reach them."""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from demo.broker import free_port
from demo.processes import Child
from demo.seed import MODELS, SITES, device
from demo.simulate import make_event, now_iso
from demo.tail import EnrichedTail
from refstream.kafka import read_to_end
from tests.demo.conftest import ROOT
from tests.demo.test_compose import dashboard_metrics, load_compose, run_healthcheck, service_env
from tests.timing import bound

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # starts the services as processes

STARTUP = 480.0  # Spark's first start on a busy 2-core machine (over 4 min when others take half of it)
CHANGE = 60.0


def native_argv(argv: list[str], bootstrap: str, topic_prefix: str) -> list[str]:
    """A compose command as a native process: console scripts through this interpreter, the broker
    address and topic namespace of the test, two local cores, a lighter event rate."""
    if argv[0] in ("refresh", "enrich"):
        argv = [sys.executable, "-m", argv[0], *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    out = []
    replace = {"kafka:9092": bootstrap, "local[*]": "local[2]", "device-events": f"{topic_prefix}device-events"}
    for i, a in enumerate(argv):
        if i > 0 and argv[i - 1] == "--rate":
            a = "200"
        out.append(replace.get(a, a))
    return out


@pytest.fixture
def stack(init_db: str, kafka: dict[str, str], tmp_path: Path,
          unique: Callable[[str], str]) -> Iterator[dict[str, Any]]:
    compose = load_compose()
    prefix = unique("topo") + "."
    risk_port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "conf" / "docker" / "data" / "sites.csv", data / "sites.csv")
    env_overrides = {
        # What compose's service environment says, with the native addresses.
        "KAFKA_BOOTSTRAP": kafka["bootstrap.servers"], "REF_DB_URL": init_db, "REF_DATA_DIR": str(data),
        "REFSTREAM_STATE_DIR": str(tmp_path / "state"), "REFRESH_EVERY": "2s", "TOPIC_PREFIX": prefix,
        "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
        "REFRESH_METRICS_PORT": str(free_port()), "ENRICH_METRICS_PORT": str(free_port()),
        "METRICS_HOST": "127.0.0.1", "RISK_URL": f"http://127.0.0.1:{risk_port}",
    }
    children: dict[str, Child] = {}
    try:
        for name in ("refresher", "simulator", "risk", "enrich"):
            svc = compose["services"][name]
            env = {**os.environ, **service_env(svc), **env_overrides}
            argv = native_argv(svc["command"], kafka["bootstrap.servers"], prefix)
            if name == "risk":
                argv = [{"0.0.0.0": "127.0.0.1", "8085": str(risk_port)}.get(a, a) for a in argv]
            children[name] = Child(name, argv, tmp_path / f"{name}.log", env=env, cwd=ROOT).start()
        yield {"children": children, "prefix": prefix, "db": init_db, "logs": tmp_path, "env": env_overrides}
    finally:
        codes = {name: c.stop() for name, c in reversed(children.items())}
        assert not any(c.running() for c in children.values())
        # SIGTERM is a clean stop for every service (exit 0), as `docker compose stop` expects.
        assert codes == {n: 0 for n in codes}, f"exit codes after SIGTERM: {codes}"


def _check(children: dict[str, Child]) -> None:
    for c in children.values():
        c.check()


@pytest.mark.timeout(900)  # the stack's start plus STARTUP on a busy machine, the suite's default; both stretched on a slower machine
def test_compose_topology_natively_enriches_and_follows_a_database_update(
        stack: dict[str, Any], kafka: dict[str, str]) -> None:
    children, prefix = stack["children"], stack["prefix"]
    tail = EnrichedTail(kafka, f"{prefix}device-events-enriched").start()
    producer = Producer(dict(kafka))
    try:
        first = tail.expect("enriched", lambda e: e.get("model_name") is not None
                            and e.get("site_name") is not None)
        first.mark_started()
        deadline = time.monotonic() + STARTUP
        while first.wait(1.0) is None:
            _check(children)
            assert time.monotonic() < deadline, f"no enriched event in {STARTUP:.0f} s; logs in {stack['logs']}"
        event = first.event or {}
        # Chained enrichment from all three changelogs: devices (table, diff), models (table,
        # incremental, joined through the devices' model_id), sites (CSV, joined through site_id).
        d = device(int(event["device_id"].split("-")[1]))
        assert (event["model_id"], event["site_id"], event["owner"]) == (d.model_id, d.site_id, d.owner)
        assert event["model_name"] == dict((m[0], m[1]) for m in MODELS)[d.model_id]
        assert event["site_name"] == dict((s[0], s[1]) for s in SITES)[d.site_id]
        assert isinstance(event["temperature"], float | int)
        # The job's call of the risk service: its result in the event and in the device's state.
        assert event["risk_level"] in ("low", "high") and event["state"]["risk_score"] == event["risk_score"]
        # Every changelog is published: the refresher's healthcheck (what the job's start waits for
        # under compose) now passes.
        health = run_healthcheck(load_compose()["services"]["refresher"], stack["env"])
        assert health.returncode == 0, health.stdout + health.stderr
        # Both processes serve every metric the Grafana dashboard queries.
        exported: set[str] = set()
        for port in (stack["env"]["REFRESH_METRICS_PORT"], stack["env"]["ENRICH_METRICS_PORT"]):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=bound(10)) as r:
                exported |= {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert dashboard_metrics() <= exported, f"not exported: {sorted(dashboard_metrics() - exported)}"

        # An operator's UPDATE reaches the enriched events through the daemon's schedule.
        engine = sa.create_engine(stack["db"])
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE devices SET site_id = 's-7', owner = 'night-shift' "
                                     "WHERE device_id = 'd-17'"))
        finally:
            engine.dispose()
        changed = tail.expect("d-17 moved", lambda e: e.get("device_id") == "d-17" and e.get("site_id") == "s-7"
                              and e.get("site_name") == SITES[6][1] and e.get("owner") == "night-shift")
        changed.mark_started()
        deadline = time.monotonic() + CHANGE
        latency = None
        seq, rng = 2 * 10**9, random.Random(0)
        while latency is None:
            _check(children)
            assert time.monotonic() < deadline, f"the UPDATE did not reach the enriched output in {CHANGE:.0f} s"
            seq += 1
            producer.produce(f"{prefix}device-events", make_event("d-17", now_iso(), seq, rng),
                             b"d-17")
            producer.poll(0)
            latency = changed.wait(0.5)
        assert latency < CHANGE

        # The simulator's malformed share went to the dead-letter topic, not into the output.
        dlq = list(read_to_end(kafka, f"{prefix}device-events-dlq", timeout=bound(10)))
        assert dlq, "no malformed event reached the dead-letter topic"
    finally:
        producer.flush(5)
        tail.stop()
