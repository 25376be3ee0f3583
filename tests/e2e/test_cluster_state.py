"""The job with a ``state:`` section and a partitioned dimension on a real standalone Spark cluster
(a master and two workers, ``--master spark://...``): the state step runs in the executors, its
state store (device state and the dimension's rows) in the checkpoint they share, and every
device's state and reference columns come out as the input implies, each event written once."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.joins.test_partitioned_job import SITES
from tests.enrich.process import start_job, write_config
from tests.enrich.spark_cluster import Cluster, both_executors
from tests.timing import bound

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)
DEVICES, TOTAL = 10, 999  # with the dead letter, two micro-batches of 500

pytestmark = pytest.mark.integration  # submits to the `cluster` fixture's master and workers


def at(seconds: int) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def temperature(n: int) -> float | None:
    return None if n % 11 == 0 else round(15 + (n * 7919 % 200) / 10, 1)


def test_device_state_and_a_partitioned_dimension_on_a_two_worker_standalone_cluster(cluster: Cluster,
                                                         kafka: dict[str, str], unique: Callable[[str], str],
                                                         tmp_path: Path) -> None:
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique, max_events_per_batch=500,
                       events={"topic": unique("events"), "starting_offsets": "earliest",
                               "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT, site_id STRING"},
                       state={"key": "device_id", "timestamp": "ts", "watermark": "2h", "buckets": 8,
                              "aggregates": {"temp": ["max", "mean"], "owner": ["last"], "city": ["last"]}},
                       spark={"spark.executor.memory": "512m", **both_executors(), "spark.driver.memory": "1g",
                              "spark.driver.host": "127.0.0.1", "spark.sql.shuffle.partitions": "2"})
    cfg["joins"][0]["strategy"] = "partitioned"
    # A broadcast join the state aggregates: joined in the plan, from the files the driver writes.
    cfg["joins"].append({"dataset": "sites", "topic": unique("ref.sites"), "on": "site_id"})
    config.write_text(yaml.safe_dump(cfg))
    publish(kafka, cfg["joins"][1]["topic"], changelog(SITES, [{"site_id": "s0", "city": "Oslo"},
                                                               {"site_id": "s1", "city": "Rome"}]))
    # d0's row is deleted: its events go on unmatched.
    publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                                for i in range(DEVICES)], deletes=[{"device_id": "d0"}]))
    # Keyed by device: each device's events on one of the two partitions, in the order of n and time.
    events = [{"device_id": f"d{n % DEVICES}", "ts": at(n), "temp": temperature(n), "n": n, "site_id": f"s{n % 2}"}
              for n in range(TOTAL)]
    produce_events(kafka, cfg["events"]["topic"], [*events, {"device_id": None, "ts": at(0), "n": -1}], partitions=2)
    log = tmp_path / "job.log"
    earlier = {a["id"] for a in cluster.apps()}  # the cluster is the session's: other tests' jobs ran on it
    proc = start_job(config, log, "--available-now", master=cluster.master)
    assert proc.wait(bound(600)) == 0, log.read_text()[-4000:]  # a standalone cluster on a loaded 2-core machine: 5+ min seen
    apps = [a["id"] for a in cluster.apps() if a["id"] not in earlier]
    assert len(apps) == 1, apps
    for i in range(2):  # each worker launched an executor for the job
        assert cluster.executor_logs(i, apps[0]), f"worker {i} ran no executor"

    rows = [json.loads(m.value()) for m in read_all(kafka, cfg["output"]["kafka"]["topic"])]
    got = Counter(r["n"] for r in rows)
    assert set(got) == set(range(TOTAL)) and max(got.values()) == 1, "an event lost or written twice"
    assert [json.loads(m.value())["n"] for m in read_all(kafka, cfg["dead_letter_topic"])] == [-1]
    # The k-th event of a device has events == k, and the device's running max and mean of temp
    # over its first k events (nulls ignored).
    seen: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["n"]):
        temps = seen.setdefault(r["device_id"], [])
        t = temperature(r["n"])
        if t is not None:
            temps.append(t)
        s = r["state"]
        assert s["events"] == r["n"] // DEVICES + 1, r
        assert s["temp_max"] == (max(temps) if temps else None), r
        assert (s["temp_mean"] is None) if not temps else math.isclose(s["temp_mean"], math.fsum(temps) / len(temps),
                                                                         rel_tol=1e-12), r
        owner = None if r["device_id"] == "d0" else r["device_id"].replace("d", "o")
        assert r["_late"] is False and r["owner"] == owner and s["owner_last"] == owner, r
        assert r["_devices_matched"] is (owner is not None), r
        assert r["city"] == s["city_last"] == ("Oslo" if r["n"] % 2 == 0 else "Rome"), r
    # More than one batch, and the state was kept across them in the cluster's state store.
    assert len(list((tmp_path / "checkpoint" / "spark" / "commits").glob("[0-9]*"))) >= 2
    # The driver learnt the dimension's schema, never its rows.
    text = log.read_text()
    assert "dataset devices: partitioned; schema" in text and "dataset devices: bootstrapped" not in text
