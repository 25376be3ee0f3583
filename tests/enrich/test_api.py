"""The Python API: the README's example run as written (a mapping instead of the file, and
available-now so that it ends), on real Spark and the real broker."""

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
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### From your own PySpark application"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_readme_example_runs_the_job_in_an_application(spark: SparkSession, kafka: dict[str, str],
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
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    query = scope["query"]
    assert not query.isActive and query.exception() is None  # type: ignore[attr-defined]
    got = sorted((e["device_id"], e["owner"]) for e in (json.loads(m.value())
                                                         for m in read_all(kafka, data["output"]["kafka"]["topic"])))
    assert got == [("d1", "ann"), ("d2", None)]
    assert isinstance(scope["config"], enrich.config.EnrichConfig)
