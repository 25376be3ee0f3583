"""docs/deployment.md's "Your own data, natively" commands, as written, after the demo's seed step: the
shipped conf/refresh.yaml reads the tables and the file the seed leaves under var/demo, and
conf/enrich.yaml joins exactly the datasets and columns it publishes.

Run in a scratch directory holding a copy of conf/ (the commands' relative paths resolve against
the directory they start in), against a broker of the test's own, since the shipped files name
fixed topics."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from demo.broker import EmbeddedBroker
from demo.seed import seed_database, write_sites
from enrich.config import load as load_enrich
from refresh.config import load_config
from refstream.contract import OP_SCHEMA, DatasetSchema, header_map
from refstream.kafka import read_to_end
from tests.demo.conftest import ROOT
from tests.timing import bound

pytestmark = pytest.mark.integration  # a broker of its own, the CLIs as processes, Spark for the schema


def cli(*argv: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=bound(300))


def test_readme_native_commands_run_on_the_demo_seed(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("docker"))
    workdir = tmp_path / "var" / "demo"  # the demo's default --workdir, seeded as the demo seeds it
    (workdir / "data").mkdir(parents=True)
    seed_database(f"sqlite:///{workdir / 'refdata.db'}", 50)
    write_sites(workdir / "data" / "sites.csv")

    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        env = {**{k: v for k, v in os.environ.items() if k not in ("REF_DB_URL", "REF_DATA_DIR")},
               "KAFKA_BOOTSTRAP": broker.bootstrap, "PYTHONPATH": str(ROOT)}
        checked = cli("refresh", "--config", "conf/refresh.yaml", "validate", "--connect", cwd=tmp_path, env=env)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        ran = cli("refresh", "--config", "conf/refresh.yaml", "run", cwd=tmp_path, env=env)
        assert ran.returncode == 0, ran.stderr
        assert [line.split(":")[0] for line in ran.stdout.splitlines()] == ["devices", "models", "sites"]
        assert "devices: version 1 (diff): 50 rows read, 50 inserts" in ran.stdout

        config = load_config(tmp_path / "conf" / "refresh.yaml")
        published: dict[str, DatasetSchema] = {}
        for ds in config.datasets.values():
            for m in read_to_end({"bootstrap.servers": broker.bootstrap}, ds.topic, timeout=bound(20)):
                if header_map(m.headers()).get("op") == OP_SCHEMA:
                    published[ds.name] = DatasetSchema.from_json(m.value())
        assert set(published) == {"devices", "models", "sites"}

        # The job's config joins what was published: its topics, on keys and columns that exist.
        job = load_enrich(tmp_path / "conf" / "enrich.yaml")
        assert job.datasets == {name: config.datasets[name].topic for name in job.datasets}
        available: set[str] = set(job.events.schema.replace(",", " ").split()[::2])
        for j in job.joins:
            names = set(published[j.dataset].names)
            assert {e for e, _ in j.on} <= available, (j.dataset, j.on)
            assert set(j.columns or ()) <= names, (j.dataset, j.columns, names)
            available |= set(j.columns or ())
        checked = cli("enrich", "validate", "--config", "conf/enrich.yaml", "--connect", cwd=tmp_path, env=env)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        explained = cli("enrich", "validate", "--config", "conf/enrich.yaml", "--explain", cwd=tmp_path, env=env)
        assert explained.returncode == 0, explained.stdout + explained.stderr
        stages = [line for line in explained.stdout.splitlines() if line.startswith("  ") and ". " in line[:6]]
        assert [line.split()[1] for line in stages][:2] == ["read", "parse"] and "sink" in stages[-1], stages
        assert {line.split()[2] for line in stages if line.split()[1] == "join"} == set(job.datasets), stages
