"""The Python API (docs/api.md): its programs run as written (the one in an application that owns
its session with a mapping instead of the file, and available-now so that it ends), on real Spark
and the real broker."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import SparkSession

import enrich
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all

ROOT = Path(__file__).resolve().parents[2]
DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))


def readme_example() -> str:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text[text.index("## In an application that owns its session"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_session_owning_example_runs_the_job_in_an_application(spark: SparkSession, kafka: dict[str, str],
                                                           unique: Callable[[str], str], tmp_path: Path) -> None:
    data = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, n INT", "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
    }
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d1", "owner": "ann"}]))
    produce_events(kafka, data["events"]["topic"], [{"device_id": "d1", "n": 1}, {"device_id": "d2", "n": 2}])
    example = readme_example()
    assert 'enrich.load_config("conf/enrich.yaml")' in example and "enrich.EnrichJob(config)" in example
    code = (example.replace('enrich.load_config("conf/enrich.yaml")', "enrich.load_config(data)")
            .replace("enrich.EnrichJob(config)", "enrich.EnrichJob(config, available_now=True)"))
    scope: dict[str, object] = {"data": data}
    exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102 - the page's own example
    query = scope["query"]
    assert not query.isActive and query.exception() is None  # type: ignore[attr-defined]
    got = sorted((e["device_id"], e["owner"]) for e in (json.loads(m.value())
                                                         for m in read_all(kafka, data["output"]["kafka"]["topic"])))
    assert got == [("d1", "ann"), ("d2", None)]
    assert isinstance(scope["config"], enrich.config.EnrichConfig)


def api_program() -> str:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]


def test_the_api_pages_first_program_runs_as_written(kafka: dict[str, str], tmp_path: Path) -> None:
    """docs/api.md's first program, as a process of its own in an empty directory, against the
    broker named by KAFKA_BOOTSTRAP holding only its events topic: it exits 0, the refresher's
    changelog and the job's output are there, and it imports only the packages' public names."""
    import ast
    import os
    import subprocess
    import sys

    from tests.timing import bound

    program = api_program()
    for node in ast.walk(ast.parse(program)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("enrich",
                                                                                                       "refresh"):
            assert node.attr in __import__(node.value.id).__all__, f"{node.value.id}.{node.attr} is not public"
    produce_events(kafka, "api.events", [{"device_id": "d1", "temperature": 21.5},
                                         {"device_id": "d3", "temperature": 19.0}])
    (tmp_path / "program.py").write_text(program)
    env = {**os.environ, "KAFKA_BOOTSTRAP": kafka["bootstrap.servers"], "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "program.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=bound(300))
    assert done.returncode == 0, done.stderr[-3000:]
    got = sorted((e["device_id"], e["site"], e["_devices_matched"])
                 for e in (json.loads(m.value()) for m in read_all(kafka, "api.enriched")))
    assert got == [("d1", "s-1", True), ("d3", None, False)]
    assert (tmp_path / "var" / "api-checkpoint").is_dir()
