"""The checkpoint's record of the state settings (``CheckpointLayout.state_record``).

The device state kept in Spark's state store is laid out by the ``state:`` settings (key, bucket
count, aggregates and their types); a start with other settings would misread it. So the first
start records them and every later start compares. It also records the buckets' grouping keys
(``bucket_ids``, :mod:`enrich.state.layout`: chosen at the first start, even over the number of
state partitions it starts with and every number that divides the bucket count, and kept for the
life of the state) and the number of state partitions (``state_partitions``: the first batch's,
then each ``enrich rescale``'s, :mod:`enrich.ops.rescale`; Spark's offset log holds the number it
runs with).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enrich.checkpoint import CheckpointLayout
from enrich.config import StateConfig
from enrich.joins.partitioned import PartitionedDim
from enrich.rollups.config import STATE_ENDINGS
from enrich.rollups.engine import state_schema
from enrich.rollups.spec import RollupSpec
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError

log = logging.getLogger(__name__)

#: The record's number of state partitions: the one Spark's offset log holds, as of the last start or rescale.
PARTITIONS = "state_partitions"
#: The record's grouping key of each bucket (:class:`enrich.state.layout.BucketLayout`).
BUCKET_IDS = "bucket_ids"
#: Whether the checkpoint's query waits for completeness (``joins[].wait``).
WAITS = "waits"
#: Whether the checkpoint's query keeps gaps (``gaps:``).
GAPS = "gaps"
#: Whether the checkpoint's query corrects events (``joins[].corrections``).
CORRECTIONS = "corrections"
#: The checkpoint's rollups: what their stored windows' layout depends on.
ROLLUPS = "rollups"
#: The rollups removed from the checkpoint: the rollup step deletes their windows; their names are not reused.
DROPPED = "rollups_dropped"

_RESTORE = "restore it from a backup of the checkpoint, or start a new checkpoint"


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
                     partitions: int | None = None, waits: bool | None = None,
                     rollups: Sequence[RollupSpec] | None = None, gaps: bool | None = None,
                     corrections: bool | None = None) -> BucketLayout | None:
    """Record the state settings in a new checkpoint; refuse a start whose settings differ from the
    recorded ones (or that adds or removes ``state:`` against a checkpoint that has run). Returns the
    checkpoint's bucket layout (None without ``state:``): a new checkpoint's is even over
    ``partitions`` state partitions (the number its first batch will have, which a new record
    needs) and over every number that divides ``state.buckets``. ``waits``: whether some join waits
    for completeness (``joins[].wait``), which adds an input to the query (the tick source) and
    keeps held events in the state: a start that turns it on or off against a checkpoint that has
    run is refused (None: not checked). ``rollups``: the rollups (:mod:`enrich.state.rollups`): what a
    start may add, remove or not change against a checkpoint that has run is :func:`_check_rollups`'s
    (None: not checked). ``gaps``: whether the job has ``gaps:``, which needs the tick source: turned
    on or off against a checkpoint that has run, refused (None: not checked); ``corrections`` the same
    for ``joins[].corrections``."""
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
        even = BucketLayout.even(cfg.buckets, partitions)
        write_json_atomic(path, {**record(cfg, spec, dims), BUCKET_IDS: list(even.ids), PARTITIONS: partitions,
                                 WAITS: bool(waits), ROLLUPS: rollup_record(rollups or ()), GAPS: bool(gaps),
                                 CORRECTIONS: bool(corrections)})
        return even
    kept = read_record(path)
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
    was = bool(kept.get(WAITS, False))  # records from before joins[].wait: no waiting
    if waits is not None and was != waits and layout.planned_any():
        raise ConfigError(f"{source}: joins[].wait: complete " + (
            "is new against the checkpoint {checkpoint}, whose query ran without it: waiting adds an input to "
            "the query (the tick source), which Spark cannot add to a checkpoint" if waits else
            "was removed against the checkpoint {checkpoint}, whose state may hold events waiting for "
            "completeness and whose query has an input (the tick source) it would lose"
        ).format(checkpoint=checkpoint) + f"; put it back, or {new}")
    if waits is not None and was != waits:  # nothing ran yet: the record follows the config
        kept = {**kept, WAITS: waits}
        write_json_atomic(path, kept)
    had = bool(kept.get(GAPS, False))
    if gaps is not None and had != gaps:
        if layout.planned_any():
            raise ConfigError(f"{source}: gaps: is {'new' if gaps else 'gone'} against the checkpoint {checkpoint}, "
                              f"whose query ran {'without' if gaps else 'with'} it: gaps add an input to the query (the "
                              f"tick source), which Spark cannot add to or drop from a checkpoint; put it "
                              f"{'away' if gaps else 'back'}, or {new}")
        kept = {**kept, GAPS: gaps}
        write_json_atomic(path, kept)
    fixed = bool(kept.get(CORRECTIONS, False))
    if corrections is not None and fixed != corrections:
        if layout.planned_any():
            raise ConfigError(f"{source}: joins[].corrections are {'new' if corrections else 'gone'} against the "
                              f"checkpoint {checkpoint}, whose query ran {'without' if corrections else 'with'} them: "
                              "corrections add an input to the query (the tick source), which Spark cannot add to or "
                              f"drop from a checkpoint; put them {'away' if corrections else 'back'}, or {new}")
        kept = {**kept, CORRECTIONS: corrections}
        write_json_atomic(path, kept)
    if rollups is not None:
        kept = _check_rollups(kept, rollup_record(rollups), layout, path, source, new)
    state_partitions(kept, path)
    return bucket_layout(kept, path)


def rollup_record(rollups: Sequence[RollupSpec]) -> list[dict[str, Any]]:
    """What the rollups' stored windows depend on: each one's name, keys, window, horizon (a longer one
    would take late events for windows already dropped, and write them again from revision 1),
    whether it needs the tick source (``idle_finalize``, a fill by a join's keys: Spark cannot add it
    to or remove it from a checkpoint), stored schema, and whether it keeps its windows' parts per
    state bucket (``moves``: windows kept without them could not be rebuilt from them)."""
    return [{"name": r.name, "by": list(r.by), "window_us": r.window_us, "correct_for_us": r.correct_for_us,
             "ticks": r.needs_ticks, "state_schema": str(state_schema(r)), "moves": r.moves} for r in rollups]


def _check_rollups(kept: dict[str, Any], now: list[dict[str, Any]], layout: CheckpointLayout, path: Path,
                   source: str, new: str) -> dict[str, Any]:
    """Against a checkpoint that has run: a rollup may be added (it counts events from the next batch
    on, no backfill) or removed (the rollup step deletes its windows from the state at the next batch,
    :func:`dropped_rollups`); one kept under its name must keep its layout; the first rollup, the last
    one, a change of the tick source (``idle_finalize``, a fill by a join's keys) and a removed name
    added back are refused."""
    was = kept.get(ROLLUPS, [])  # a record written by a start without rollups: none
    if was == now:
        return kept
    if not layout.planned_any():  # nothing ran yet: the record follows the config
        kept = {**kept, ROLLUPS: now}
        write_json_atomic(path, kept)
        return kept
    root = layout.root
    old, cur = by_name(was), by_name(now)
    if not old or not cur:
        what = (f"the first rollups {json.dumps(sorted(cur))} cannot be added to the checkpoint {root}, whose query "
                "ran without rollups" if cur else
                f"the last rollups {json.dumps(sorted(old))} cannot be removed from the checkpoint {root}")
        raise ConfigError(f"{source}: rollups: {what}: the rollup step is a keyed step of the query, which Spark "
                          f"cannot add to or drop from a checkpoint; keep at least one rollup, or {new}")
    ticked, ticks = any(r.get("ticks") for r in old.values()), any(r["ticks"] for r in cur.values())
    if ticked != ticks and not kept.get(WAITS) and not kept.get(GAPS) and not kept.get(CORRECTIONS):
        # waiting, gaps and corrections have the tick source either way
        raise ConfigError(f"{source}: rollups[].idle_finalize or a fill by a join's keys is "
                          f"{'new' if ticks else 'gone'} against the checkpoint {root}: it adds an input to the "
                          f"query (the tick source), which Spark cannot add to or drop from a checkpoint; put it "
                          f"back, or {new}")
    for name in sorted(old.keys() & cur.keys()):
        changed = rollup_changes(old[name], cur[name])
        if changed:
            raise ConfigError(f"{source}: rollup {name} changed against the checkpoint {root} ({', '.join(changed)}): "
                              "its windows are kept in the state laid out by its keys, window, horizon and metrics; "
                              "put it back, or give the changed rollup a new name (the old one's windows are "
                              "dropped, the new one starts with the next batch)")
    dropped = [str(n) for n in kept.get(DROPPED, [])]
    back = sorted((set(cur) - set(old)) & set(dropped))
    if back:
        raise ConfigError(f"{source}: rollup {back[0]} was removed from the checkpoint {root}: added back under its "
                          "name it would write its windows again from revision 1, under the revisions its outputs "
                          "hold; give it a new name")
    # The step deletes a dropped rollup's state variables at every start: a new name must not be one of them.
    taken = sorted(n for n in set(cur) - set(old) if any(n == d + e for d in dropped for e in STATE_ENDINGS))
    if taken:
        raise ConfigError(f"{source}: rollup {taken[0]} is named like the state of a rollup removed from the "
                          f"checkpoint {root}, which the job deletes at every start; give it another name")
    for name in sorted(set(cur) - set(old)):
        log.info("%s: rollup %s is new against the checkpoint %s: it counts events from the next batch on "
                 "(no backfill)", source, name, root)
    for name in sorted(set(old) - set(cur)):
        log.warning("%s: rollup %s is gone against the checkpoint %s: the next batch drops its windows from the "
                    "state; its outputs are left as they are", source, name, root)
    kept = {**kept, ROLLUPS: now, DROPPED: sorted({*dropped, *(set(old) - set(cur))})}
    write_json_atomic(path, kept)
    return kept


#: The rollup record's entries as the settings they come from.
_SETTING = {"window_us": "window", "correct_for_us": "correct_for", "state_schema": "metrics or their types",
            "moves": "moving its events when a late version corrects a column of it (joins[].corrections or "
                     "how: inner on the join it comes from)"}


def by_name(entries: object) -> dict[str, dict[str, Any]]:
    """Rollup record entries (:func:`rollup_record`, as read from a record or a savepoint) by name."""
    return {str(e.get("name")): e for e in entries if isinstance(e, dict)} if isinstance(entries, list) else {}


def rollup_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The settings in which two record entries of one rollup differ, as a config names them: those
    its kept windows are laid out by (the tick source is not one)."""
    return [_SETTING.get(k, k) for k in new if k != "ticks" and old.get(k) != new[k]]


def dropped_rollups(layout: CheckpointLayout) -> tuple[str, ...]:
    """The rollups removed from the checkpoint (their names), whose windows the rollup step deletes."""
    if not layout.state_record.exists():
        return ()
    got = read_record(layout.state_record).get(DROPPED, [])
    return tuple(str(n) for n in got) if isinstance(got, list) else ()


def read_record(path: Path) -> dict[str, Any]:
    """The state record at ``path``; a :class:`ConfigError` naming it when it is not one."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path}: not a state record ({exc}); {_RESTORE}") from None
    if not isinstance(kept, dict):
        raise ConfigError(f"{path}: not a state record (not a JSON object); {_RESTORE}")
    return kept


def state_partitions(kept: dict[str, Any], path: Path) -> int:
    """The record's number of state partitions (``path``: where it was read, for the error)."""
    partitions = kept.get(PARTITIONS)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ConfigError(f"{path}: {PARTITIONS}: {partitions!r} is not a number of state partitions; {_RESTORE}")
    return partitions


def bucket_layout(kept: dict[str, Any], path: Path) -> BucketLayout:
    """The record's bucket layout: one distinct non-negative int32 grouping key per bucket."""
    ids, buckets = kept.get(BUCKET_IDS), kept.get("buckets")
    if (not isinstance(ids, list) or len(ids) != buckets or len(set(ids)) != len(ids)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids)):
        raise ConfigError(f"{path}: {BUCKET_IDS}: not one distinct grouping key per bucket ({buckets!r} buckets); "
                          f"{_RESTORE}")
    return BucketLayout(tuple(ids))


def record_partitions(layout: CheckpointLayout, partitions: int) -> None:
    """Record ``partitions`` as the checkpoint's number of state partitions (after a rescale)."""
    path = layout.state_record
    kept = read_record(path)
    if kept.get(PARTITIONS) != partitions:
        write_json_atomic(path, {**kept, PARTITIONS: partitions})
