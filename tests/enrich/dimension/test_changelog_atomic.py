"""A refresh is atomic for the running job (real MariaDB, refresher, broker, Spark local, Parquet sink).

A 50,000-row dataset is re-keyed (and every row's attributes changed) by one refresher run while
events flow: every enriched event is matched, and within a micro-batch all events carry attributes of
one version, old or new - never a dataset seen empty or half applied. The job's dimension ends with
exactly the rows under the new key.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml
from pyspark.sql import SparkSession

from enrich import config as enrich_config
from enrich.job import EnrichJob
from refresh.config import load_config
from refresh.publish import Publisher
from refresh.runner import Refresher
from refstream import contract
from refstream.contract import MessageBatch
from tests.enrich.helpers import produce_events, wait_for

pytestmark = pytest.mark.integration

ROWS = 50_000


class PacedPublisher(Publisher):
    """Sends the change set in steps of 5,000 records with a pause after each: the job runs several
    micro-batches while the refresh is being published (any of them would see it half applied if the
    records were visible before the commit)."""

    def _produce_batch(self, p: Any, topic: str, batch: MessageBatch) -> int:
        for i in range(0, len(batch), 5_000):
            super()._produce_batch(p, topic, MessageBatch(batch.keys[i:i + 5_000], batch.values[i:i + 5_000],
                                                          batch.headers))
            p.flush(10)
            time.sleep(0.1)
        return len(batch)


def batches(out: Path) -> dict[int, list[dict[str, Any]]]:
    got: dict[int, list[dict[str, Any]]] = {}
    for d in out.glob("batch_id=*"):
        got[int(d.name.split("=")[1])] = [r for f in sorted(d.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    return got


def test_a_re_key_of_50k_rows_is_never_seen_half_applied(spark: SparkSession, kafka: dict[str, str],
                                                         mysql_url: str, unique: Callable[[str], str],
                                                         tmp_path: Path) -> None:
    table, topic = unique("devices"), unique("ref.devices")
    engine = sa.create_engine(mysql_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (id INT PRIMARY KEY, alt INT NOT NULL UNIQUE, ver INT, "
                             f"attr VARCHAR(20))"))
        conn.execute(sa.text(f"INSERT INTO {table} SELECT seq, seq, 1, CONCAT('a1-', seq) FROM seq_1_to_{ROWS}"))
    engine.dispose()

    def refresher(key: str, publisher: type[Publisher] = Publisher) -> Refresher:
        path = tmp_path / f"refresh-{key}.yaml"
        path.write_text(yaml.safe_dump({
            "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]}, "state_dir": str(tmp_path / "state"),
            "datasets": {"devices": {"source": {"url": mysql_url, "table": table}, "key": key, "topic": topic}}}))
        return Refresher(load_config(path), publisher_factory=publisher, progress=False)

    refresher("id").run("devices")
    out = tmp_path / "out"
    cfg = enrich_config.parse({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id BIGINT, n INT", "starting_offsets": "earliest"},
        # on: by position: the event's device_id is the dataset's key, id before the re-key, alt after
        "joins": [{"dataset": "devices", "topic": topic, "on": "device_id", "columns": ["ver", "attr"]}],
        "output": {"parquet": {"path": str(out)}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "trigger": "100ms",
    }, "test.yaml")
    sent = 0
    rng = random.Random(8)

    def send(count: int = 50) -> None:
        nonlocal sent
        produce_events(kafka, cfg.events.topic, [{"device_id": rng.randint(1, ROWS), "n": sent + i}
                                                 for i in range(count)])
        sent += count

    def produced_all() -> bool:
        return sum(len(r) for r in batches(out).values()) == sent

    send()
    job = EnrichJob(cfg)
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    flowing = threading.Event()
    try:
        wait_for(produced_all, "the first events", runner)

        def events() -> None:
            while not flowing.is_set():
                send()
                time.sleep(0.02)

        sender = threading.Thread(target=events)
        sender.start()
        with sa.create_engine(mysql_url).begin() as conn:
            conn.execute(sa.text(f"UPDATE {table} SET ver = 2, attr = CONCAT('a2-', id)"))
        result = refresher("alt", PacedPublisher).run("devices")
        assert (result.deletes, result.inserts) == (ROWS, ROWS)
        wait_for(lambda: job.started.dims.schema("devices").key == ("alt",), "the re-key to reach the job", runner)
        time.sleep(0.5)  # events keep flowing across a few more batches
        flowing.set()
        sender.join(30)
        wait_for(produced_all, "every event", runner, timeout=180)
        state = job.started.dims.state("devices")
    finally:
        flowing.set()
        job.stop()
        runner.join(120)
    assert not runner.is_alive()

    got = batches(out)
    assert sorted(r["n"] for rows in got.values() for r in rows) == list(range(sent))
    seen = set()
    for batch_id, rows in got.items():
        assert all(r["_devices_matched"] for r in rows), f"batch {batch_id}: an event found no device"
        assert all(r["attr"] == f"a{r['ver']}-{r['device_id']}" for r in rows), f"batch {batch_id}: torn row"
        versions = {r["ver"] for r in rows}
        assert len(versions) == 1, f"batch {batch_id} mixes versions {versions}: a refresh half applied"
        seen |= versions
    assert seen == {1, 2}, "batches ran before and after the re-key"

    # The job's dimension: exactly the rows under the new key.
    state.compact()
    assert state.schema is not None and state.schema.key == ("alt",)
    assert state.base is not None and state.base.num_rows == ROWS
    keys = set(state.base.column("__key").to_pylist())
    assert keys == {contract.encode_key(["alt"], {"alt": i}) for i in range(1, ROWS + 1)}
