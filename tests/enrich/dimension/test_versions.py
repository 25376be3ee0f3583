"""Dimension versions in a running job (real Spark local, real broker, Parquet sink, read back).

- Each micro-batch enriches with exactly the changelog positions recorded for it in the checkpoint,
  while reference changes and events arrive concurrently.
- A batch in which no reference change arrived broadcasts nothing; a change set broadcasts one overlay
  whose size follows the change set, not the dimension.
- Dimension column types (decimal, timestamp) survive into the output.
- A batch replayed after a crash (its version recorded, its output and commit missing) rebuilds the
  version it used the first time, although the changelog moved on meanwhile.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from enrich.dimension.versions import FileVersionLog
from enrich.job import EnrichJob
from refstream import contract
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, parquet_job_config, produce_events, publish, read_all, wait_for

SCHEMA = DatasetSchema("devices", ("device_id",), (
    Column("device_id", "string"), Column("owner", "string"), Column("price", "decimal(10,2)"),
    Column("installed", "timestamp")))
ROWS = 3000
INSTALLED = datetime(2024, 3, 1, 8, 30, 0, 250000)


def row(i: int, owner: str) -> dict[str, Any]:
    return {"device_id": f"d{i}", "owner": owner, "price": "12.50", "installed": INSTALLED}


def batches(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Rows of every committed Parquet batch directory, by batch id."""
    got: dict[int, list[dict[str, Any]]] = {}
    for d in out.glob("batch_id=*"):
        got[int(d.name.split("=")[1])] = [r for f in sorted(d.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    return got


def owners_at(kafka: dict[str, str], topic: str, positions: dict[int, int]) -> dict[str, str | None]:
    """The dimension (device -> owner) made of the changelog records below ``positions``: the oracle,
    decoded straight from the topic, independent of the job's dimension code."""
    dim: dict[str, str | None] = {}
    for m in read_all(kafka, topic):
        if m.offset() >= positions.get(m.partition(), 0):
            continue
        ch = contract.decode(m.key(), m.value(), m.headers())
        if ch.op == contract.OP_SCHEMA:
            continue
        device = json.loads(ch.key)["device_id"]
        if ch.value is None:
            dim.pop(device, None)
        else:
            dim[device] = json.loads(ch.value)["owner"]
    return dim


def test_batches_use_their_recorded_versions_and_unchanged_batches_ship_nothing(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    cfg = parquet_job_config(kafka, unique, out, checkpoint)
    ref, events_topic = cfg.joins[0].topic, cfg.events.topic
    publish(kafka, ref, changelog(SCHEMA, [row(i, "v0") for i in range(ROWS)]))
    sent = 0

    def send(count: int = 20) -> None:
        nonlocal sent
        produce_events(kafka, events_topic, [{"device_id": f"d{(sent + i) % 12}", "n": sent + i}
                                             for i in range(count)], partitions=2)
        sent += count

    def produced_all() -> bool:
        return sum(len(r) for r in batches(out).values()) == sent

    send()
    job = EnrichJob(cfg)
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    try:
        wait_for(produced_all, "the first events", runner)
        shipper = job.started.dims.shipper
        assert shipper.broadcasts == 1, "the bootstrap ships one base"
        base_bytes = shipper.bytes_shipped
        assert base_bytes > 30_000

        # Batches without a reference change: nothing is broadcast again.
        first_batches = len(batches(out))
        for _ in range(3):
            send()
            wait_for(produced_all, "events of an unchanged dimension", runner)
        assert len(batches(out)) >= first_batches + 3
        assert (shipper.broadcasts, shipper.bytes_shipped) == (1, base_bytes)

        # Change sets (update; delete; delete then re-insert): one small overlay broadcast each.
        changes = [
            [row(i, "v1") for i in range(5)],
            [row(i, "v2") for i in range(5)] + [("delete", "d5")],
            [("delete", "d6"), row(6, "back"), row(0, "v3")],
        ]
        rounds: list[range] = []
        for k, change in enumerate(changes, 1):
            messages = []
            for c in change:  # in order: a delete followed by its re-insert
                if isinstance(c, dict):
                    messages += contract.upsert_messages(SCHEMA, [c], k + 1)
                else:
                    messages += contract.delete_messages(SCHEMA, [{"device_id": c[1]}], k + 1)
            publish(kafka, ref, messages)
            before = (shipper.broadcasts, shipper.bytes_shipped)
            send()
            rounds.append(range(sent - 20, sent))
            wait_for(produced_all, f"events after change set {k}", runner)
            assert shipper.broadcasts == before[0] + 1, "a change set ships one overlay, not a new base"
            assert 0 < shipper.bytes_shipped - before[1] < base_bytes / 20

        # Reference changes and events arriving at the same time.
        def churn() -> None:
            for k in range(10):
                publish(kafka, ref, contract.upsert_messages(SCHEMA, [row(i, f"c{k}") for i in range(12)], 10 + k))
                time.sleep(0.07)

        churn_start = sent
        changer = threading.Thread(target=churn)
        changer.start()
        for _ in range(10):
            send(10)
            time.sleep(0.05)
        changer.join(60)
        wait_for(produced_all, "events sent during the churn", runner)
        # A changelog position moves only to a partition-EOF offset (a transaction boundary), so the
        # batches racing the churn may all still pin the version before it; a round after the churn
        # must see its end.
        send()
        wait_for(produced_all, "events after the churn", runner)
    finally:
        job.stop()
        runner.join(120)
    assert not runner.is_alive()

    got = batches(out)
    assert sorted(r["n"] for rows in got.values() for r in rows) == list(range(sent))
    versions = FileVersionLog(checkpoint / "dimensions")
    for batch_id, rows in got.items():
        recorded = versions.get(batch_id)
        assert recorded is not None, f"batch {batch_id} has no recorded version"
        dim = owners_at(kafka, ref, recorded["devices"])
        for r in rows:
            assert (r["owner"], r["_devices_matched"]) == (dim.get(r["device_id"]), r["device_id"] in dim), \
                f"batch {batch_id}, event {r['n']}: not the version recorded for the batch"
    positions = {json.dumps(versions.get(b), sort_keys=True) for b in got}
    assert len(positions) >= 5, "batches should have seen several dimension versions"
    by_n = {r["n"]: r for rows in got.values() for r in rows}

    def seen(span: range, device: str) -> list[tuple[str | None, bool]]:
        return [(by_n[n]["owner"], by_n[n]["_devices_matched"]) for n in span if by_n[n]["device_id"] == device]

    assert set(seen(range(0, rounds[0].start), "d0")) == {("v0", True)}, "before any change"
    assert seen(rounds[0], "d0") == [("v1", True)] * 2, "an update changes later events"
    assert seen(rounds[1], "d5") == [(None, False)] * 2, "a delete"
    assert seen(rounds[2], "d6") == [("back", True)] * 2, "a delete then a re-insert in one batch"
    assert seen(rounds[2], "d0") == [("v3", True)] * 2
    assert {by_n[n]["owner"] for n in range(churn_start, sent)} & {f"c{k}" for k in range(10)}, \
        "the churn reached the output"

    # Dimension column types from the published schema reach the output.
    schema = pq.read_schema(next(out.glob("batch_id=*/*.parquet")))
    assert schema.field("price").type == pa.decimal128(10, 2)
    assert pa.types.is_timestamp(schema.field("installed").type)
    assert (by_n[0]["price"], by_n[0]["installed"]) == (Decimal("12.50"), INSTALLED)

    # Crash after the last batch was pinned, before its output and commit: the changelog moves on,
    # the restarted job replays the batch with the version recorded for it.
    last = max(got)
    shutil.rmtree(out / f"batch_id={last}")
    commits = checkpoint / "spark" / "commits"
    (commits / str(last)).unlink(missing_ok=True)
    (commits / f".{last}.crc").unlink(missing_ok=True)
    publish(kafka, ref, contract.upsert_messages(SCHEMA, [row(i, "after-crash") for i in range(12)], 99))
    first_new = sent
    send()
    EnrichJob(cfg, available_now=True).run(spark)
    again = batches(out)
    assert sorted(again[last], key=lambda r: r["n"]) == sorted(got[last], key=lambda r: r["n"]), \
        "the replayed batch must give the same output"
    rows_after = [r for rows in again.values() for r in rows]
    assert sorted(r["n"] for r in rows_after) == list(range(sent))
    assert {r["owner"] for r in rows_after if r["n"] >= first_new} == {"after-crash"}
