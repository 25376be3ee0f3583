"""``enrich status`` and ``enrich lookup`` against a checkpoint the real job wrote (local Spark, the
real broker): what each committed batch used, lag, dead letters, and the checks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import cli
from enrich.config import EnrichConfig
from enrich.job import EnrichJob
from enrich.ops.batches import Checkpoint
from enrich.ops.lookup import lookup
from enrich.ops.status import status
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError, DataError
from tests.enrich.helpers import changelog, produce_events, publish

DEVICES = DatasetSchema("devices", ("device_id",), (
    Column("device_id", "string"), Column("site_id", "int64"), Column("owner", "string")))
SITES = DatasetSchema("sites", ("site_id",), (Column("site_id", "int64"), Column("site_name", "string")))


@dataclass
class Ran:
    cfg: EnrichConfig
    path: Path          # the YAML file of cfg, for the CLI
    first: int          # last batch of the first run (devices version 1)
    second: int         # last batch of the second run (version 2: d1 updated, d2 deleted)
    jobs: list[EnrichJob]  # the two runs' jobs (their metrics)


def _events(*ids: str) -> list[dict[str, Any]]:
    return [{"device_id": d, "site_id": 1, "n": i} for i, d in enumerate(ids)]


@pytest.fixture(scope="module")
def ran(spark: SparkSession, kafka: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Ran:
    tmp = tmp_path_factory.mktemp("inspect")
    suffix = f"{time.monotonic_ns()}"
    data = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": f"inspect-events-{suffix}", "schema": "device_id STRING, site_id BIGINT, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": f"inspect-devices-{suffix}", "on": "device_id",
                   "columns": ["owner"]},
                  {"dataset": "sites", "topic": f"inspect-sites-{suffix}", "on": "site_id"}],
        "output": {"kafka": {"topic": f"inspect-out-{suffix}"}},
        "dead_letter_topic": f"inspect-dlq-{suffix}",
        "checkpoint": str(tmp / "checkpoint"),
        "trigger": "200ms",
        "metrics": {"port": 0},
    }
    path = tmp / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    from enrich import config

    cfg = config.load(path)
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [
        {"device_id": "d1", "site_id": 1, "owner": "ann"}, {"device_id": "d2", "site_id": 1, "owner": "bob"},
        {"device_id": "d3", "site_id": 1, "owner": "cy"}]))
    publish(kafka, cfg.joins[1].topic, changelog(SITES, [{"site_id": 1, "site_name": "Paris"},
                                                         {"site_id": 2, "site_name": "Oslo"}]))
    # Two partitions: the one with the broken event is written again from from_json's parse (a
    # second write of the batch), the other one not; the metrics count both writes.
    produce_events(kafka, cfg.events.topic, [*_events("d1", "d2", "zz"), b"{not json"], partitions=2)
    jobs = [EnrichJob(cfg, available_now=True)]
    jobs[0].run(spark)
    first = Checkpoint(cfg.checkpoint).last_committed()
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [{"device_id": "d1", "site_id": 2, "owner": "ann2"}],
                                                 [{"device_id": "d2"}], version=2, with_schema=False))
    produce_events(kafka, cfg.events.topic, _events("d1", "d2"))
    jobs.append(EnrichJob(cfg, available_now=True))
    jobs[1].run(spark)
    second = Checkpoint(cfg.checkpoint).last_committed()
    assert first is not None and second is not None and second > first
    return Ran(cfg, path, first, second, jobs)


def test_the_jobs_metrics_count_what_its_batches_did(ran: Ran) -> None:
    m = [j.started.metrics for j in ran.jobs]
    assert m[0] is not None and m[1] is not None
    v = [x.registry.get_sample_value for x in m]
    assert (v[0]("refstream_enrich_events_total", {"result": "enriched"}),
            v[0]("refstream_enrich_events_total", {"result": "dead_letter"})) == (3, 1)
    assert (v[1]("refstream_enrich_events_total", {"result": "enriched"}),
            v[1]("refstream_enrich_events_total", {"result": "dead_letter"})) == (2, 0)
    # Unmatched: zz (no devices row), then d2 (deleted); late: none without a state step.
    assert [(x("refstream_enrich_events_total", {"result": "unmatched"}),
             x("refstream_enrich_events_total", {"result": "late"})) for x in v] == [(1, 0), (1, 0)]
    assert (v[0]("refstream_enrich_dimension_version", {"dataset": "devices"}),
            v[0]("refstream_enrich_dimension_rows", {"dataset": "devices"})) == (1, 3)
    assert (v[1]("refstream_enrich_dimension_version", {"dataset": "devices"}),
            v[1]("refstream_enrich_dimension_rows", {"dataset": "devices"})) == (2, 2)
    assert v[1]("refstream_enrich_dimension_rows", {"dataset": "sites"}) == 2
    assert 0 <= (v[1]("refstream_enrich_dimension_age_seconds", {"dataset": "devices"}) or -1) < 600
    assert (v[1]("refstream_enrich_batch_duration_seconds_count", {}) or 0) >= 1


def test_lookup_gives_the_row_each_batch_used(ran: Ran) -> None:
    now = lookup(ran.cfg, "devices", "d1")
    assert (now.batch_id, now.found, now.row, now.version, now.complete) == (
        ran.second, "present", {"device_id": "d1", "site_id": 2, "owner": "ann2"}, 2, True)
    then = lookup(ran.cfg, "devices", "d1", ran.first)
    assert (then.found, then.row, then.version) == ("present", {"device_id": "d1", "site_id": 1, "owner": "ann"}, 1)
    assert lookup(ran.cfg, "devices", "d2").found == "deleted"
    assert lookup(ran.cfg, "devices", "d2", ran.first).row == {"device_id": "d2", "site_id": 1, "owner": "bob"}
    assert lookup(ran.cfg, "devices", "nope").found == "absent"
    # Any key form: the bare value, col=value, a JSON object; an integer key compares as text.
    assert lookup(ran.cfg, "sites", '{"site_id": 2}').row == {"site_id": 2, "site_name": "Oslo"}
    assert lookup(ran.cfg, "sites", "site_id=1").row == {"site_id": 1, "site_name": "Paris"}


def test_lookup_errors_name_what_is_wrong(ran: Ran) -> None:
    with pytest.raises(ConfigError, match="dataset 'owners' is not joined.*devices, sites"):
        lookup(ran.cfg, "owners", "d1")
    with pytest.raises(DataError, match=f"batch 999 is not a committed batch.*{ran.second}"):
        lookup(ran.cfg, "devices", "d1", 999)
    with pytest.raises(ConfigError, match="key columns are device_id, got owner"):
        lookup(ran.cfg, "devices", '{"owner": "ann"}')


def test_lookup_cli_prints_json_and_exits_1_when_not_seen(ran: Ran, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lookup", "--config", str(ran.path), "devices", "d1", "--batch", str(ran.first)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["found"], out["row"]["owner"], out["batch_id"]) == ("present", "ann", ran.first)
    assert cli.main(["lookup", "--config", str(ran.path), "devices", "d2"]) == 1
    assert json.loads(capsys.readouterr().out)["found"] == "deleted"
    assert cli.main(["lookup", "--config", str(ran.path), "rooms", "x"]) == 2
    assert "dataset 'rooms' is not joined" in capsys.readouterr().err


def test_status_reports_versions_rows_lag_and_dead_letters(ran: Ran, kafka: dict[str, str]) -> None:
    st = status(ran.cfg)
    assert st.batch_id == ran.second and st.problems == []
    dims = {d.dataset: d for d in st.dimensions}
    assert (dims["devices"].version, dims["devices"].rows) == (2, 2)   # d1 and d3; d2 deleted
    assert (dims["sites"].version, dims["sites"].rows) == (1, 2)
    assert all(d.age_seconds is not None and d.age_seconds < 600 for d in dims.values())
    assert set(st.input_lag.values()) == {0}
    assert st.dead_letters_last_hour == 1
    # Events the job has not read show as lag; with --max-age, a batch older than that while events
    # wait is a problem, and so is a dimension version older than that.
    produce_events(kafka, ran.cfg.events.topic, _events("d1", "d3", "d3"))
    later = status(ran.cfg, max_age=timedelta(seconds=5), now=time.time() + 3600)
    assert sum(later.input_lag.values()) == 3
    assert any("3 event(s) waiting" in p and "stalled or stopped" in p for p in later.problems)
    assert any(p.startswith("dataset devices:") and "older than 5s" in p for p in later.problems)
    assert any(p.startswith("dataset sites:") for p in later.problems)


def test_status_cli_check(ran: Ran, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--config", str(ran.path), "--check", "--max-age", "1h"]) == 0
    text = capsys.readouterr().out
    assert f"last batch {ran.second}" in text and "devices" in text and "sites" in text
    assert cli.main(["status", "--config", str(ran.path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["last_batch"]["id"] == ran.second
    assert [d["dataset"] for d in got["dimensions"]] == ["devices", "sites"]
    # A dimension version older than the allowed age fails the check, naming the dataset.
    time.sleep(1.2)
    assert cli.main(["status", "--config", str(ran.path), "--check", "--max-age", "1s"]) == 1
    assert "check failed: dataset devices:" in capsys.readouterr().err


def test_status_of_a_checkpoint_without_batches(tmp_path: Path, unique: Callable[[str], str]) -> None:
    from enrich import config

    (tmp_path / "ck" / "spark" / "offsets").mkdir(parents=True)
    cfg = config.parse({"kafka": {"bootstrap_servers": "127.0.0.1:1"},
                        "events": {"topic": unique("e"), "schema": "device_id STRING"},
                        "output": {"console": {}}, "dead_letter_topic": "dlq",
                        "checkpoint": str(tmp_path / "ck")}, "t.yaml")
    st = status(cfg)
    assert st.batch_id is None and st.problems == [f"{tmp_path / 'ck'}: no micro-batch committed yet"]
    with pytest.raises(DataError, match="not a job checkpoint"):
        Checkpoint(tmp_path / "nowhere")
