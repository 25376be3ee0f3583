"""The identity of a checkpoint's transactional writers, fixed at the checkpoint's first start and
kept in it (``CheckpointLayout.sink_identity``): the query's scope and the base transactional id of
each topic it writes in transactions (the Kafka output, or the dead letters of the other sinks).

A restart finds its ledgers (:mod:`enrich.sinks.kafka.ledger`) by them: a replayed batch whose
writers had another scope or id, or whose ledger topic is gone, finds no record of what it wrote
and writes it again. So a start that would change them under a checkpoint that has run is refused,
with one line naming what changed, as the state settings are (:mod:`enrich.state.record`):

- the record missing from a checkpoint Spark has planned a batch in;
- ``output.kafka.transactional_id`` set to another id than the one recorded;
- the ledger topic of a topic written before missing from the broker;
- a batch planned and not committed (the job stopped or died in it) while none of the writers'
  ledgers holds a record any more: the broker dropped their offsets (``offsets.retention.minutes``
  passed while the job was stopped), so nothing can tell which of its slots committed it. The start
  is refused, naming the cause and how to go on, instead of writing the batch blind.

The scope is drawn at random at the first start and the derived ids come from it, not from the
checkpoint's path: two deployments whose checkpoints have the same path inside their containers
never share an id (they would fence each other's writers in a crash loop). A checkpoint moved to
another path keeps its identity: the ids are recorded, not derived again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from enrich.checkpoint import CheckpointLayout
from enrich.config import EnrichConfig
from enrich.sinks.kafka.ledger import ledger_topic
from enrich.sinks.kafka.writer import transactional_id_for
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError
from refstream.kafka import partitions_of

__all__ = ["SinkIdentity"]

_NEW = "point checkpoint: at a new directory to start over (the output starts at events.starting_offsets)"


@dataclass(frozen=True)
class SinkIdentity:
    """``scope``: the query's; ``ids``: topic -> the base transactional id of its writers."""

    scope: str
    ids: Mapping[str, str]

    def id_of(self, topic: str) -> str:
        return self.ids[topic]

    @classmethod
    def load(cls, layout: CheckpointLayout, cfg: EnrichConfig, *, check_ledgers: bool = True) -> SinkIdentity:
        """The checkpoint's identity for the topics ``cfg`` writes in transactions: recorded at its
        first start, compared at every later one (see the module doc); ``check_ledgers``: also ask
        the broker for the ledger topics of topics written before."""
        path = layout.sink_identity
        wanted = _wanted(cfg)
        if path.exists():
            try:
                kept = json.loads(path.read_text(encoding="utf-8"))
                scope, ids = str(kept["scope"]), {str(t): str(i) for t, i in dict(kept["transactional_ids"]).items()}
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}: not a sink identity record ({exc}); restore it from a backup of the "
                                  f"checkpoint, or {_NEW}") from None
        elif layout.planned_any():
            raise ConfigError(f"{path}: missing, and the checkpoint {layout.root} has run: its writers' identity "
                              f"is lost and a pending batch would be written again; restore the file from a backup "
                              f"of the checkpoint, or {_NEW}")
        else:
            scope, ids = uuid.uuid4().hex, {}
        written = dict(ids)
        for topic, configured in wanted.items():
            if topic in ids and configured is not None and ids[topic] != configured:
                raise ConfigError(f"{cfg.source}: output.kafka.transactional_id: {configured!r} differs from {ids[topic]!r}, which the "
                                  f"checkpoint {layout.root} writes {topic} with: a pending batch would be written "
                                  f"again; put it back, or {_NEW}")
            if topic not in ids:
                ids[topic] = configured or transactional_id_for(scope, topic)
        if check_ledgers and layout.planned_any():
            # A Kafka output's tasks write dead letters too, committed in the output topic's ledgers
            # (checked with it): the dead-letter topic's own ledger, the driver's, may hold nothing.
            shared = cfg.dead_letter_topic if cfg.output.kind == "kafka" else None
            for topic in (t for t in wanted if t in written and t != shared):
                if not partitions_of(cfg.kafka, ledger_topic(topic)):
                    raise ConfigError(f"{cfg.source}: the ledger topic {ledger_topic(topic)} of {topic} is gone "
                                      f"(deleted?): the record of the batches the checkpoint {layout.root} wrote is "
                                      f"lost and a pending batch would be written again; {_NEW}")
                _refuse_expired_ledgers(cfg, layout, topic, ids[topic], scope)
        if not path.exists() or ids != written:
            write_json_atomic(path, {"scope": scope, "transactional_ids": dict(sorted(ids.items()))})
        return cls(scope, ids)


#: The slots whose ledgers are asked before a pending batch is refused for expired ledgers: more
#: than any plan's partitions (the source's, or the state partitions), fewer than a slow start.
LEDGER_PROBE_SLOTS = 64


def _refuse_expired_ledgers(cfg: EnrichConfig, layout: CheckpointLayout, topic: str, base_id: str,
                            scope: str) -> None:
    """Refuse a start whose pending batch cannot be checked against its writers' ledgers: a slot that
    writes records commits its ledger with them, so while ``topic`` holds records some ledger holds
    a record too, unless the broker dropped them all."""
    from enrich.sinks.kafka.ledger import Ledger
    from enrich.sinks.kafka.tasks import slot_id
    from enrich.sinks.kafka.writer import written_ends

    planned, committed = layout.planned(), layout.committed()
    if not planned or not committed or planned[-1] <= committed[-1]:
        return
    if not any(end > 0 for end in written_ends(cfg.kafka, [topic]).values()):
        return  # nothing written yet: no ledger to expect
    pending, ledger = planned[-1], ledger_topic(topic)
    # The driver's writer (dead letters, rollups) writes under the base id; the tasks' under slot ids.
    for writer in (base_id, *(slot_id(base_id, slot) for slot in range(LEDGER_PROBE_SLOTS))):
        book = Ledger(cfg.kafka, ledger, writer, scope, timeout=30)
        try:
            entry = book.read()
        finally:
            book.close()
        if entry.committed is not None or entry.begun is not None:
            return
    raise ConfigError(
        f"{cfg.source}: batch {pending} of the checkpoint {layout.root} was planned and not committed, and no "
        f"writer's ledger on {ledger} holds a record of the batches it committed (last: {committed[-1]}): the "
        f"broker dropped their offsets (offsets.retention.minutes, 7 days by default, passed while the job was "
        f"stopped), so batch {pending} may be in {topic} already and is not written blind. To write it again "
        f"(its events may then be in {topic} twice; each record names its event's _partition and _offset), start "
        f"a new checkpoint where batch {pending} begins: with state:, `enrich savepoint` and `enrich run "
        f"--from-savepoint`; without, point checkpoint: at a new directory with events.starting_offsets set to "
        f"the source offsets of batch {committed[-1]} in {layout.offsets / str(committed[-1])}. Keep "
        f"offsets.retention.minutes above the longest stop you plan")


def _wanted(cfg: EnrichConfig) -> dict[str, str | None]:
    """The topics ``cfg`` writes in transactions, each with the id the config sets (None: derived)."""
    out = cfg.output
    # The rollups' and gaps' topics, and their dead letters: the driver's to write, beside the output's tasks.
    rollups: dict[str, str | None] = {r.output.kafka: None for r in cfg.rollups if r.output.kafka is not None}
    if cfg.gaps is not None and cfg.gaps.kafka is not None:  # the driver writes the gaps' records too
        rollups[cfg.gaps.kafka] = None
    if out.kind == "kafka":
        assert out.topic is not None
        return {out.topic: out.transactional_id, **({cfg.dead_letter_topic: None} if cfg.driver_dead_letters else {}),
                **rollups}
    return {cfg.dead_letter_topic: None, **rollups}  # the driver's dead-letter writer (enrich.sinks.deadletter)
