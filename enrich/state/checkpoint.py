"""The checkpoint's record of the state settings (``CheckpointLayout.state_record``).

The device state kept in Spark's state store is laid out by the ``state:`` settings (key, bucket
count, aggregates and their types); a start with other settings would misread it. So the first
start records them and every later start compares. It also records the number of state partitions
its first batch will have, which the buckets' grouping keys are spread over (:mod:`enrich.state.layout`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enrich.checkpoint import CheckpointLayout
from enrich.config import StateConfig
from enrich.state.dimension import PartitionedDim
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError

#: The record's number of state partitions the bucket layout is spread over.
PARTITIONS = "state_partitions"


def record(cfg: StateConfig, spec: StateSpec, dims: Sequence[PartitionedDim] = ()) -> dict[str, Any]:
    """What :func:`check_checkpoint` keeps: the settings the stored state's layout depends on (the
    partitioned dimensions: their datasets, topics and stored columns, in order; their types may
    change with the published schema, see ``enrich.state.processor``)."""
    return {"key": cfg.key, "buckets": cfg.buckets,
            "aggregates": {c: list(aggs) for c, aggs in cfg.aggregates},
            "state_schema": str(spec.state_schema()),
            "partitioned": [{"dataset": d.dataset, "topic": d.topic, "columns": d.stored.names} for d in dims]}


def check_checkpoint(layout: CheckpointLayout, cfg: StateConfig | None, spec: StateSpec | None,
                     source: str = "config", dims: Sequence[PartitionedDim] = (), *,
                     partitions: int | None = None) -> BucketLayout | None:
    """Record the state settings in a new checkpoint; refuse a start whose settings differ from the
    recorded ones (or that adds or removes ``state:`` against a checkpoint that has run). Returns the
    checkpoint's bucket layout (None without ``state:``): a new checkpoint's is spread over
    ``partitions`` state partitions, which a new record needs."""
    checkpoint, path = layout.root, layout.state_record
    if not path.exists():
        if cfg is None:
            return None
        if layout.planned_any():
            raise ConfigError(f"{source}: state: the checkpoint {checkpoint} was written by a query without "
                              "state:; point checkpoint: at a new directory to start one with state (it "
                              "starts from events.starting_offsets)")
        if partitions is None:
            raise ConfigError(f"{source}: state: the checkpoint {checkpoint} has no device state yet; the job "
                              "has not started on it")
        assert spec is not None
        kept = {**record(cfg, spec, dims), PARTITIONS: partitions}
        write_json_atomic(path, kept)
        return bucket_layout(kept, cfg, path)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path}: not a state record ({exc}); restore it from a backup of the checkpoint, "
                          "or start a new checkpoint") from None
    new = "point checkpoint: at a new directory to start over (device state starts empty)"
    if cfg is None:
        raise ConfigError(f"{source}: state: the checkpoint {checkpoint} keeps device state; put the state: "
                          f"section back, or {new}")
    assert spec is not None
    now = record(cfg, spec, dims)
    for name in ("key", "buckets", "aggregates", "state_schema", "partitioned"):
        if kept.get(name) != now[name]:
            what = {"state_schema": "the aggregated columns' types",
                    "partitioned": "the partitioned joins (datasets, topics, selected columns)"
                    }.get(name, f"state.{name}")
            raise ConfigError(f"{source}: {what} changed against the checkpoint {checkpoint}, whose device state "
                              f"was kept with {json.dumps(kept.get(name))}, now {json.dumps(now[name])}; "
                              f"put it back, or {new}")
    return bucket_layout(kept, cfg, path)


def bucket_layout(kept: dict[str, Any], cfg: StateConfig, path: Path) -> BucketLayout:
    """The bucket layout of the record at ``path``."""
    partitions = kept.get(PARTITIONS)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ConfigError(f"{path}: {PARTITIONS}: {partitions!r} is not a number of state partitions; restore "
                          "it from a backup of the checkpoint, or start a new checkpoint")
    return BucketLayout.balanced(cfg.buckets, partitions)
