"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the file parses, every
project service runs a real CLI verb with a config that loads (through the real config loaders, with
the service's environment), every mounted path and init script exists, and the addresses the
services use agree with what the MySQL and Kafka services offer."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import make_url

from demo.seed import MODELS, SITE_COLUMNS, SITES, device
from enrich.config import load as load_enrich_config
from refresh.config import load_config as load_refresh_config
from tests.demo.conftest import INIT_SQL, ROOT
from tests.timing import bound

COMPOSE = ROOT / "docker-compose.yml"
HOST_KAFKA = ROOT / "docker-compose.host-kafka.yml"
SECRETS = {"MYSQL_ROOT_PASSWORD": "root-secret", "MYSQL_PASSWORD": "app-secret",
           "GRAFANA_ADMIN_PASSWORD": "grafana-secret"}
PROJECT_SERVICES = ("refresher", "enrich", "simulator")
MONITORING = ("prometheus", "grafana")
DASHBOARD = ROOT / "conf" / "grafana" / "refstream.json"
_METRIC = re.compile(r"\brefstream_[a-z_]+")


def dashboard_metrics() -> set[str]:
    """The metric families the Grafana dashboard queries (``_total``/``_bucket``/... suffixes off)."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    return {re.sub(r"_(total|bucket|count|sum)$", "", m) for e in exprs for m in _METRIC.findall(e)}

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\})")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR:?error}, $$ for a literal $."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op and op.endswith("?") and unset:
            raise KeyError(f"{name}: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return value or ""

    return _VAR.sub(repl, text)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), SECRETS if env is None else env))


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of ``-f a.yml -f b.yml``: mappings merge key by key, ``ports`` lists append,
    anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if k == "ports" and isinstance(v, list):
                out[k] = list(base.get(k, [])) + v
            else:
                out[k] = merge(base.get(k), v) if k in base else v
        return out
    return override


def load_with_host_kafka() -> dict[str, Any]:
    return merge(load_compose(), yaml.safe_load(interpolate(HOST_KAFKA.read_text(), SECRETS)))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def workdir() -> PurePosixPath:
    found = re.findall(r"^WORKDIR\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert found, "Dockerfile sets no WORKDIR"
    return PurePosixPath(found[-1])


def mounts(service: dict[str, Any]) -> list[tuple[str, PurePosixPath]]:
    out = []
    for v in service.get("volumes", []):
        src, target = v.split(":")[:2]
        out.append((src, PurePosixPath(target)))
    return out


def host_path(service: dict[str, Any], container_path: str | Path) -> Path | None:
    """Where a container path of ``service`` lives on the host (bind mounts of this repository),
    None when it is on a named volume; fails when nothing is mounted there."""
    p = PurePosixPath(workdir()) / PurePosixPath(str(container_path))
    best: tuple[str, PurePosixPath] | None = None
    for src, target in mounts(service):
        if (p == target or target in p.parents) and (best is None or len(target.parts) > len(best[1].parts)):
            best = (src, target)
    assert best is not None, f"{p} is on no volume of the service (lost at every restart)"
    src, target = best
    if not src.startswith((".", "/")):
        return None  # a named volume
    return ROOT / src / p.relative_to(target)


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def parse_cli(argv: list[str]) -> tuple[str, Any]:
    """Parse a service command with the project's real CLI parser: ('refresh'|'enrich'|'simulate', args)."""
    if argv[:3] == ["python", "-m", "demo.simulate"]:
        from demo.simulate import build_parser

        return "simulate", build_parser().parse_args(argv[3:])
    assert argv[0] in scripts(), f"{argv[0]} is not a console script of this project"
    if argv[0] == "refresh":
        from refresh.cli import build_parser as refresh_parser

        return "refresh", refresh_parser().parse_args(argv[1:])
    if argv[0] == "enrich":
        import enrich.cli

        enrich_parser = getattr(enrich.cli, "build_parser", None) or enrich.cli.parser
        return "enrich", enrich_parser().parse_args(argv[1:])
    raise AssertionError(f"unknown command {argv}")


def run_healthcheck(service: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A service's CMD-SHELL healthcheck run here, as the image would run it: the project's console
    scripts and ``python`` first on PATH, the service's environment, the image's working directory."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    bindir = os.path.dirname(sys.executable)
    full = {**os.environ, **service_env(service), **env, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", test[1]], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=bound(60))


def kafka_listeners(compose: dict[str, Any]) -> dict[str, str]:
    env = service_env(compose["services"]["kafka"])
    return dict(reversed(item.split("://")) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))


# --------------------------------------------------------------------------------------------- tests

def test_compose_parses_with_every_service_and_needs_its_secrets(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"mysql", "kafka", *PROJECT_SERVICES, "risk", *MONITORING}
    assert services["mysql"]["image"].startswith("mysql:8")
    assert services["kafka"]["image"].startswith("apache/kafka:")
    # Secrets come from the environment only: without them the file does not even interpolate.
    for name in SECRETS:
        with pytest.raises(KeyError, match=name):
            load_compose({k: v for k, v in SECRETS.items() if k != name})
    raw = COMPOSE.read_text()
    for value in SECRETS.values():
        assert value not in raw


def test_kafka_is_single_node_kraft(compose: dict[str, Any]) -> None:
    env = service_env(compose["services"]["kafka"])
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "zookeeper" not in " ".join(env).lower()
    node, voter = env["KAFKA_NODE_ID"], env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert voter.startswith(f"{node}@kafka:")
    controller_port = voter.rsplit(":", 1)[1]
    listeners = dict(reversed(x.split("://")) for x in env["KAFKA_LISTENERS"].split(","))
    assert listeners[f":{controller_port}"] == env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    protocols = dict(x.split(":") for x in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners.values()) <= set(protocols)
    # Every advertised listener is one the broker listens on, on the same port.
    for addr, name in kafka_listeners(compose).items():
        assert f":{addr.rsplit(':', 1)[1]}" in listeners and listeners[f":{addr.rsplit(':', 1)[1]}"] == name
    # No host listener by default; the opt-in override advertises localhost:29092 and publishes exactly
    # that port, on loopback (README).
    assert all(not a.startswith("localhost:") for a in kafka_listeners(compose))
    assert "ports" not in compose["services"]["kafka"]
    with_host = load_with_host_kafka()
    host_env = service_env(with_host["services"]["kafka"])
    host_listeners = dict(reversed(x.split("://")) for x in host_env["KAFKA_LISTENERS"].split(","))
    published = {p.rsplit(":", 1)[-1]: p for p in with_host["services"]["kafka"]["ports"]}
    host_addrs = [a for a in kafka_listeners(with_host) if a.startswith("localhost:")]
    assert host_addrs == ["localhost:29092"]
    for addr in host_addrs:
        port = addr.rsplit(":", 1)[1]
        assert published.get(port) == f"127.0.0.1:{port}:{port}", f"{addr} is advertised but not published"
        assert f":{port}" in host_listeners
    hc = " ".join(compose["services"]["kafka"]["healthcheck"]["test"])
    assert re.search(r"--bootstrap-server (\S+)", hc).group(1) in kafka_listeners(compose)
    assert int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == 1  # one node
    assert int(env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]) == 1  # the job's transactions
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"])  # a base64 UUID, as kafka-storage wants


def test_ports_bind_loopback_and_no_password_on_a_command_line(compose: dict[str, Any]) -> None:
    for doc in (compose, load_with_host_kafka()):
        for name, svc in doc["services"].items():
            for port in svc.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    # Command lines (commands, entrypoints, healthchecks) are visible to every process on the host:
    # no secret may reach one, neither as a value nor through a variable.
    for name, svc in compose["services"].items():
        argv = [*svc.get("command", []), *svc.get("entrypoint", []),
                *svc.get("healthcheck", {}).get("test", [])]
        text = " ".join(map(str, argv))
        for secret_name, value in SECRETS.items():
            assert value not in text and secret_name not in text, f"{name}: {secret_name} on a command line"
        assert not re.search(r"(^|\s)(-p\S|--password)", text), f"{name}: a password flag on a command line"


def test_depends_on_waits_for_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy: it has no check"
    for name in ("refresher", "enrich"):
        deps = services[name]["depends_on"]
        assert deps["kafka"]["condition"] == "service_healthy"
    assert services["refresher"]["depends_on"]["mysql"]["condition"] == "service_healthy"
    assert services["simulator"]["depends_on"]["kafka"]["condition"] == "service_healthy"

    # No cycle: compose would refuse to start.
    def visit(n: str, path: tuple[str, ...]) -> None:
        assert n not in path, f"dependency cycle {path + (n,)}"
        for d in services[n].get("depends_on", {}):
            visit(d, path + (n,))

    for n in services:
        visit(n, ())


def test_mounted_paths_and_init_scripts_exist(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, svc in compose["services"].items():
        for src, target in mounts(svc):
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name}: mounted {src} does not exist"
            else:
                assert src in named, f"{name}: volume {src} is not declared"
            assert target.is_absolute()
    init = [t for s, t in mounts(compose["services"]["mysql"]) if str(t) == "/docker-entrypoint-initdb.d"]
    assert init, "mysql has no init scripts mounted"
    host = host_path(compose["services"]["mysql"], init[0])
    assert host == INIT_SQL
    assert sorted(p.name for p in host.glob("*.sql")) == ["01-schema.sql", "02-sample-data.sql"]


@pytest.mark.parametrize("name", PROJECT_SERVICES)
def test_service_command_is_a_real_cli_verb_with_a_config_that_loads(
        compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    svc = compose["services"][name]
    assert svc["build"] == "."
    for k in list(os.environ):
        if k.startswith(("REF_", "KAFKA_", "REFSTREAM_", "TOPIC_", "EVENTS_", "REFRESH_")):
            monkeypatch.delenv(k)
    env = service_env(svc)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kind, args = parse_cli(svc["command"])
    listeners = kafka_listeners(compose)

    if kind == "simulate":
        assert args.bootstrap in listeners, f"simulator talks to {args.bootstrap}, kafka offers {listeners}"
        enrich_svc = compose["services"]["enrich"]
        _, eargs = parse_cli(enrich_svc["command"])
        for k, v in service_env(enrich_svc).items():
            monkeypatch.setenv(k, v)
        econf = load_enrich_config(host_path(enrich_svc, eargs.config))
        assert args.topic == econf.events.topic
        assert args.rate > 0 and args.devices == 5000
        return

    if kind == "refresh":
        assert args.verb == "daemon"
        conf = load_refresh_config(host_path(svc, args.config))
        assert conf.kafka["bootstrap.servers"] in listeners
        assert host_path(svc, conf.state_dir) is None  # state on the named volume, not in the image
        db = compose["services"]["mysql"]
        menv = service_env(db)
        for ds in conf.datasets.values():
            if ds.source.kind == "sql":
                url = make_url(ds.source.url)
                assert url.drivername == "mysql+pymysql"
                assert (url.host, url.port or 3306) == ("mysql", 3306)
                assert url.database == menv["MYSQL_DATABASE"]
                assert (url.username, url.password) == (menv["MYSQL_USER"], menv["MYSQL_PASSWORD"])
            else:
                f = host_path(svc, ds.source.path)
                assert f is not None and f.exists(), f"{ds.name}: {ds.source.path} is not mounted"
                with open(f, newline="") as fh:
                    header = next(csv.reader(fh))
                assert set(ds.key) <= set(header)
        # The refresher's healthcheck is a real verb too, and says "not yet" before the first publish.
        hc = svc["healthcheck"]["test"]
        assert hc[0] == "CMD-SHELL"
        _, hargs = parse_cli(shlex.split(hc[1]))
        assert hargs.verb == "status" and hargs.config == args.config and hargs.check
        res = run_healthcheck(svc, {"REFSTREAM_STATE_DIR": str(tmp_path / "state")})
        assert res.returncode == 1, res.stdout + res.stderr
        assert res.stderr.startswith("refresh: not healthy: dataset ") and "never published" in res.stderr, res.stderr
        return

    assert args.command == "run"
    conf = load_enrich_config(host_path(svc, args.config))
    assert conf.kafka["bootstrap.servers"] in listeners
    assert host_path(svc, conf.checkpoint) is None  # checkpoint survives restarts
    assert conf.output.kind == "kafka" and conf.output.topic not in (conf.events.topic, conf.dead_letter_topic)
    # Every dimension the job joins is a changelog the refresher publishes.
    rsvc = compose["services"]["refresher"]
    _, rargs = parse_cli(rsvc["command"])
    for k, v in service_env(rsvc).items():
        monkeypatch.setenv(k, v)
    rconf = load_refresh_config(host_path(rsvc, rargs.config))
    published = {d.name: d.topic for d in rconf.datasets.values()}
    assert conf.datasets == {d: published[d] for d in conf.datasets}
    assert env["PYSPARK_PYTHON"]
    assert service_env(rsvc)["REFSTREAM_STATE_DIR"] == env["REFSTREAM_STATE_DIR"]


def test_dockerfile_builds_the_project_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    assert re.search(r"openjdk-(17|21)-jre", text), "Spark needs a JRE"
    # The project with the job's extra, at the versions CI installs (constraints.txt).
    assert re.search(r"pip install -c constraints\.txt '\.\[enrich\]'(\s|$)", text, re.M)
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for src in re.findall(r"^COPY\s+(.+)\s+\S+$", text, re.M):
        for s in src.split():
            assert (ROOT / s).exists(), f"COPY {s}: missing"
            assert s.rstrip("/") not in ignored, f"COPY {s}: excluded by .dockerignore"
    assert "conf" in text.split("WORKDIR")[-1]  # the configs the services name are in the image too


def test_sample_data_matches_the_demo_seed(init_db: str) -> None:
    """The compose stack's init SQL runs on MariaDB (MySQL-compatible) and holds the demo's data."""
    engine = sa.create_engine(init_db)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT COUNT(*) FROM devices")).scalar_one() == 5000
            for n in (1, 17, 42, 4999, 5000):
                row = conn.execute(sa.text("SELECT device_id, model_id, site_id, owner, installed_on "
                                           "FROM devices WHERE device_id = :d"), {"d": f"d-{n}"}).one()
                assert tuple(row) == tuple(device(n).__dict__.values())
            models = conn.execute(sa.text("SELECT model_id, model_name, vendor, CAST(max_temp AS CHAR), "
                                          "last_update IS NOT NULL FROM models ORDER BY model_id")).all()
            assert sorted((m, n, v, t) for m, n, v, t, _ in models) == sorted(MODELS)
            assert all(r[4] for r in models)
    finally:
        engine.dispose()
    with open(ROOT / "conf" / "docker" / "data" / "sites.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == SITE_COLUMNS
    assert [tuple(r) for r in rows[1:]] == list(SITES)


def test_prometheus_scrapes_both_processes_and_grafana_gets_the_dashboard(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = yaml.safe_load((ROOT / "conf" / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in prom["scrape_configs"]}
    for job, name in (("refresher", "refresher"), ("enrich", "enrich")):
        cmd = services[name]["command"]
        conf = yaml.safe_load((ROOT / cmd[cmd.index("--config") + 1]).read_text())
        port = re.fullmatch(r"\$\{\w+:-(\d+)\}", str(conf["metrics"]["port"]))
        assert port, conf["metrics"]
        assert targets[job] == [f"{name}:{port.group(1)}"], f"prometheus scrapes {targets[job]}"
    assert {t for _, t in mounts(services["grafana"])} >= {Path("/etc/grafana/provisioning"),
                                                           Path("/var/lib/grafana/dashboards/refstream.json")}
    for svc in MONITORING:
        assert all(p.startswith("127.0.0.1:") for p in services[svc]["ports"])
    assert dashboard_metrics() >= {"refstream_refresh_runs", "refstream_enrich_events"}


def test_the_risk_service_is_the_one_the_jobs_call_reaches(compose: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    risk, job = compose["services"]["risk"], compose["services"]["enrich"]
    assert risk["build"] == "." and risk["command"][:3] == ["python", "-m", "demo.risk"]
    port = risk["command"][risk["command"].index("--port") + 1]
    assert risk["command"][risk["command"].index("--host") + 1] == "0.0.0.0"
    assert job["depends_on"]["risk"]["condition"] == "service_started"
    for k, v in service_env(job).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RISK_URL", raising=False)
    _, args = parse_cli(job["command"])
    conf = load_enrich_config(host_path(job, args.config))
    assert [c.url for c in conf.calls] == [f"http://risk:{port}/score"]


def test_grafana_reads_the_jobs_rollup_table_from_the_mysql_service(compose: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The job upserts a rollup into the MySQL service's database (rollups: in conf/docker/enrich.yaml),
    and Grafana's rollups dashboard reads that table, through a datasource with the same database and
    user, querying only columns the rollup writes."""
    services = compose["services"]
    job, grafana, menv = services["enrich"], services["grafana"], service_env(services["mysql"])
    for k, v in service_env(job).items():
        monkeypatch.setenv(k, v)
    _, args = parse_cli(job["command"])
    conf = load_enrich_config(host_path(job, args.config))
    (rollup,) = [r for r in conf.rollups if r.output.database is not None]
    db = rollup.output.database
    url = make_url(db.url)
    assert (url.drivername, url.host, url.port or 3306, url.database) == ("mysql+pymysql", "mysql", 3306,
                                                                          menv["MYSQL_DATABASE"])
    assert (url.username, url.password) == (menv["MYSQL_USER"], menv["MYSQL_PASSWORD"])
    assert job["depends_on"]["mysql"]["condition"] == "service_healthy"
    assert grafana["depends_on"]["mysql"]["condition"] == "service_healthy"

    sources = [s for f in sorted((ROOT / "conf" / "grafana" / "provisioning" / "datasources").glob("*.yaml"))
               for s in yaml.safe_load(f.read_text())["datasources"]]
    (mysql,) = [s for s in sources if s["type"] == "mysql"]
    assert mysql["url"] == f"{url.host}:{url.port or 3306}" and mysql["user"] == url.username
    assert mysql["jsonData"]["database"] == url.database
    # The password reaches Grafana through its environment (Grafana expands $VAR), not the file.
    assert mysql["secureJsonData"]["password"] == "$MYSQL_PASSWORD"
    assert service_env(grafana)["MYSQL_PASSWORD"] == menv["MYSQL_PASSWORD"]

    board = ROOT / "conf" / "grafana" / "rollups.json"
    assert Path("/var/lib/grafana/dashboards/rollups.json") in {t for _, t in mounts(grafana)}
    assert host_path(grafana, "/var/lib/grafana/dashboards/rollups.json") == board
    dash = json.loads(board.read_text())
    columns = {*rollup.by, "window_start", "window_end", "_kind", "_revision", "_events", "_finalized_by",
               "_cause", *(f"{c}_{m}" for c, metrics in rollup.metrics for m in metrics)}
    sqls = [t["rawSql"] for p in dash["panels"] for t in p.get("targets", [])]
    assert sqls and all(t["datasource"]["uid"] == mysql["uid"] for p in dash["panels"] for t in p["targets"])
    for sql in sqls:
        assert re.search(rf"\bFROM {db.table}\b", sql), sql
        names = {n for n in re.findall(r"[A-Za-z_]\w*", re.sub(r"\$__\w+", "", sql)) if "_" in n} - {db.table}
        assert names <= columns, f"{sql}: {sorted(names - columns)} are not columns of rollup {rollup.name}"
    assert any("_kind" in s for s in sqls)  # provisional, final and corrected windows told apart
