"""The checkpoint's writer identity (``enrich.sinks.identity``): recorded at the first start, and a
start that would change it under a checkpoint that has run refused with one line naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from enrich import config
from enrich.checkpoint import CheckpointLayout
from enrich.sinks.identity import SinkIdentity
from enrich.sinks.kafka.ledger import ensure_ledger, ledger_topic
from refstream.errors import ConfigError
from refstream.kafka import admin


def cfg(checkpoint: Path, bootstrap: str = "127.0.0.1:9", **output: Any) -> config.EnrichConfig:
    return config.parse({
        "kafka": {"bootstrap_servers": bootstrap}, "events": {"topic": "ev", "schema": "device_id STRING"},
        "output": {"kafka": {"topic": "out", **output}}, "dead_letter_topic": "dlq",
        "checkpoint": str(checkpoint)}, "test.yaml")


def planned(layout: CheckpointLayout) -> None:
    """Spark planned a batch here (an offset log entry)."""
    layout.offsets.mkdir(parents=True, exist_ok=True)
    (layout.offsets / "0").write_text("v1\n")


def test_the_first_start_records_it_and_later_starts_and_moves_keep_it(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path / "ck")
    first = SinkIdentity.load(layout, cfg(layout.root), check_ledgers=False)
    assert json.loads(layout.sink_identity.read_text()) == {"scope": first.scope,
                                                             "transactional_ids": {"out": first.id_of("out")}}
    planned(layout)
    assert SinkIdentity.load(layout, cfg(layout.root), check_ledgers=False) == first
    moved = CheckpointLayout(tmp_path / "elsewhere")
    shutil.copytree(layout.root, moved.root)
    assert SinkIdentity.load(moved, cfg(moved.root), check_ledgers=False) == first
    # Parquet output: the dead letters' writer gets an id of its own, recorded beside.
    parquet = config.parse({"kafka": {"bootstrap_servers": "127.0.0.1:9"},
                            "events": {"topic": "ev", "schema": "device_id STRING"},
                            "output": {"parquet": {"path": str(tmp_path / "pq")}}, "dead_letter_topic": "dlq",
                            "checkpoint": str(moved.root)}, "test.yaml")
    both = SinkIdentity.load(moved, parquet, check_ledgers=False)
    assert both.scope == first.scope and both.id_of("out") == first.id_of("out") and "dlq" in both.ids


def test_a_kafka_output_with_gaps_records_the_drivers_dead_letter_writer_and_the_gaps_topic(tmp_path: Path) -> None:
    """The driver writes the gap records an output cannot take as dead letters (beside the output's
    tasks, which write the events' own): its writer gets an id, as the gaps' topic's writer does."""
    layout = CheckpointLayout(tmp_path / "ck")
    data = {"kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "events": {"topic": "ev", "schema": "device_id STRING, ts TIMESTAMP"},
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": str(layout.root),
            "state": {"key": "device_id", "timestamp": "ts"},
            "gaps": {"expected_every": "10s", "output": {"kafka": {"topic": "gaps"}}}}
    ident = SinkIdentity.load(layout, config.parse(data, "test.yaml"), check_ledgers=False)
    assert set(ident.ids) == {"out", "dlq", "gaps"} and len(set(ident.ids.values())) == 3


def test_a_configured_id_is_recorded_and_another_one_later_refused(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path / "ck")
    assert SinkIdentity.load(layout, cfg(layout.root, transactional_id="job-a"), check_ledgers=False).id_of("out") \
        == "job-a"
    planned(layout)
    with pytest.raises(ConfigError, match=r"^test\.yaml: output\.kafka\.transactional_id: 'job-b' differs from "
                                          r"'job-a', which the checkpoint .* writes out with"):
        SinkIdentity.load(layout, cfg(layout.root, transactional_id="job-b"), check_ledgers=False)


def test_a_missing_or_damaged_record_of_a_checkpoint_that_has_run_is_refused(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path / "ck")
    SinkIdentity.load(layout, cfg(layout.root), check_ledgers=False)
    planned(layout)
    layout.sink_identity.write_text("{broken")
    with pytest.raises(ConfigError, match=r"sink\.json: not a sink identity record"):
        SinkIdentity.load(layout, cfg(layout.root), check_ledgers=False)
    layout.sink_identity.unlink()
    with pytest.raises(ConfigError, match=r"sink\.json: missing, and the checkpoint .* has run"):
        SinkIdentity.load(layout, cfg(layout.root), check_ledgers=False)
    assert not layout.sink_identity.exists(), "nothing recorded over it"


def test_a_deleted_ledger_topic_is_refused(kafka: dict[str, str], unique: Callable[[str], str],
                                          tmp_path: Path) -> None:
    out = unique("out")
    layout = CheckpointLayout(tmp_path / "ck")
    conf = config.parse({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": "ev", "schema": "device_id STRING"}, "output": {"kafka": {"topic": out}},
        "dead_letter_topic": "dlq", "checkpoint": str(layout.root)}, "test.yaml")
    SinkIdentity.load(layout, conf)       # a new checkpoint: nothing to check
    ensure_ledger(kafka, out)             # what the sink creates at start
    planned(layout)
    SinkIdentity.load(layout, conf)
    for f in admin(kafka).delete_topics([ledger_topic(out)]).values():
        f.result()
    with pytest.raises(ConfigError, match=rf"the ledger topic {ledger_topic(out)} of {out} is gone"):
        SinkIdentity.load(layout, conf)


@pytest.mark.integration  # starts `python -m enrich run` (Spark) itself, twice
def test_two_deployments_with_the_same_checkpoint_path_never_share_a_transactional_id(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """Two deployments whose checkpoints have the same path inside their containers, writing one
    topic: here the first one's checkpoint is moved away once it has run, and the second one starts
    a new checkpoint at the same path. Their writers' ids differ, so they never fence each other."""
    from tests.enrich.process import committed_count, seed, start_job, write_config
    from tests.timing import bound

    config = tmp_path / "enrich.yaml"
    data = write_config(config, kafka, unique)
    seed(kafka, data, 50)
    path, out = Path(data["checkpoint"]), data["output"]["kafka"]["topic"]
    ids = []
    for deployment in ("a", "b"):
        log = tmp_path / f"{deployment}.log"
        assert start_job(config, log, "--available-now").wait(bound(300)) == 0, log.read_text()[-3000:]
        ids.append(json.loads(CheckpointLayout(path).sink_identity.read_text())["transactional_ids"][out])
        path.rename(tmp_path / deployment)
    assert ids[0] != ids[1]
    assert committed_count(kafka, out) == 100  # each deployment wrote every event


def test_a_pending_batch_is_checked_against_the_drivers_writer_ledger_too(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A topic the driver writes (the dead letters of a Parquet output, a rollup's topic) has its
    ledger under the base id, not the tasks' slot ids: a pending batch after one it committed is
    not taken for one whose ledgers the broker dropped."""
    import pyarrow as pa

    from enrich.sinks.kafka.writer import TransactionalBatchWriter

    dlq = unique("dlq")
    layout = CheckpointLayout(tmp_path / "ck")
    conf = config.parse({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": "ev", "schema": "device_id STRING"}, "output": {"parquet": {"path": str(tmp_path / "o")}},
        "dead_letter_topic": dlq, "checkpoint": str(layout.root)}, "test.yaml")
    ident = SinkIdentity.load(layout, conf)
    with TransactionalBatchWriter(kafka, dlq, ident.id_of(dlq), scope=ident.scope) as writer:
        writer.write(0, pa.table({"value": [b"a dead letter"]}))
    layout.offsets.mkdir(parents=True)
    layout.commits.mkdir(parents=True)
    for n in (0, 1):
        (layout.offsets / str(n)).write_text("v1\n")
    (layout.commits / "0").write_text("v1\n")
    assert SinkIdentity.load(layout, conf).ids == ident.ids   # batch 1 pending, the driver's ledger has 0
