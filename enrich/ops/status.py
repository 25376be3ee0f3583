"""``enrich status``: what the job's last committed micro-batch used and how far behind it is.

Everything comes from the checkpoint (:mod:`enrich.ops.batches`) and the topics, so it works
while the job runs and after it stopped: per dimension the refresher's version, the rows, and the
age (now minus the publish time of the newest change the batch applied); the last batch's id and
time; input lag per events partition (end offset minus processed offset); dead letters produced
in the last hour.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import OFFSET_END, KafkaException, TopicPartition

from enrich.config import EnrichConfig
from enrich.ops.batches import Checkpoint
from enrich.source.offsets import TP, EndOffsetProbe
from refstream import kafka as rkafka
from refstream.errors import TransientError

DEAD_LETTER_WINDOW = timedelta(hours=1)


@dataclass(frozen=True, kw_only=True)
class DimensionStatus:
    dataset: str
    topic: str
    version: int | None
    rows: int | None
    changed_ms: int | None          # publish time of the newest change the batch applied
    age_seconds: float | None       # now - changed_ms
    positions: dict[int, int]
    complete_as_of: str | None = None  # the batch's dimension held every change valid up to then


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    checkpoint: str
    batch_id: int | None
    batch_committed_at: float | None
    dimensions: list[DimensionStatus] = field(default_factory=list)
    input_lag: dict[TP, int] = field(default_factory=dict)
    dead_letters_last_hour: int | None = None
    problems: list[str] = field(default_factory=list)  # what ``--check`` fails on

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "last_batch": None if self.batch_id is None else {
                "id": self.batch_id, "committed_at": _iso(self.batch_committed_at)},
            "dimensions": [{"dataset": d.dataset, "topic": d.topic, "version": d.version, "rows": d.rows,
                            "changed_at": _iso(d.changed_ms / 1000) if d.changed_ms is not None else None,
                            "age_seconds": None if d.age_seconds is None else round(d.age_seconds, 3),
                            "complete_as_of": d.complete_as_of,
                            "positions": {str(p): o for p, o in sorted(d.positions.items())}}
                           for d in self.dimensions],
            "input_lag": {f"{t}/{p}": lag for (t, p), lag in sorted(self.input_lag.items())},
            "dead_letters_last_hour": self.dead_letters_last_hour,
            "problems": self.problems,
        }


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def status(cfg: EnrichConfig, *, max_age: timedelta | None = None, now: float | None = None) -> JobStatus:
    """The job's status; ``problems`` lists what is wrong: no committed batch, and with ``max_age``
    a dimension older than that, or events waiting while the last batch is older than that."""
    now = time.time() if now is None else now
    ckpt = Checkpoint(cfg.checkpoint)
    last = ckpt.last_committed()
    if last is None:
        return JobStatus(checkpoint=str(cfg.checkpoint), batch_id=None, batch_committed_at=None,
                         problems=[f"{cfg.checkpoint}: no micro-batch committed yet"])
    info = ckpt.batch(last)
    dims: list[DimensionStatus] = []
    problems: list[str] = []
    partitioned = {j.dataset for j in cfg.partitioned_joins}
    for ds, topic in cfg.datasets.items():
        if ds in partitioned:
            # Kept by the executors: the batch's changelog range is in Spark's offset log (a source
            # of its own); its version, rows and age are not known to the driver.
            ends = info.source_end(topic)
            dims.append(DimensionStatus(dataset=ds, topic=topic, version=None, rows=None, changed_ms=None,
                                        age_seconds=None, positions=ends))
            continue
        facts = info.dimensions.get(ds, {})
        changed = facts.get("changed_ms")
        changed_ms = int(changed) if isinstance(changed, int | float) else None
        age = None if changed_ms is None else max(0.0, now - changed_ms / 1000)
        rows, version = facts.get("rows"), facts.get("version")
        dims.append(DimensionStatus(dataset=ds, topic=topic, version=int(version) if isinstance(version, int) else None,
                                    rows=int(rows) if isinstance(rows, int) else None, changed_ms=changed_ms,
                                    age_seconds=age, positions=info.positions.get(ds, {}),
                                    complete_as_of=complete if isinstance(complete := facts.get("complete_as_of"), str)
                                    else None))
        if max_age is not None and (age is None or age > max_age.total_seconds()):
            problems.append(f"dataset {ds}: the last batch ({last}) used a version "
                            + ("of unknown age" if age is None else f"{_human(age)} old")
                            + f", older than {_human(max_age.total_seconds())}")
    lag = input_lag(cfg, info.events_end)
    behind = sum(lag.values())
    if max_age is not None and behind > 0 and now - info.committed_at > max_age.total_seconds():
        problems.append(f"{behind} event(s) waiting on {cfg.events.topic} and no batch committed for "
                        f"{_human(now - info.committed_at)} (last batch {last}): the job is stalled or stopped")
    return JobStatus(checkpoint=str(cfg.checkpoint), batch_id=last, batch_committed_at=info.committed_at,
                     dimensions=dims, input_lag=lag, dead_letters_last_hour=dead_letters_since(
                         cfg, now - DEAD_LETTER_WINDOW.total_seconds()), problems=problems)


def input_lag(cfg: EnrichConfig, processed: dict[TP, int]) -> dict[TP, int]:
    """End offset (last stable offset) minus processed offset, per partition of the events topic."""
    probe = EndOffsetProbe(cfg.kafka)
    try:
        tps = probe.partitions([cfg.events.topic])
        ends = probe.probe(tps, known={tp: processed[tp] for tp in tps if tp in processed}).end
    finally:
        probe.close()
    # A partition the job has not read yet counts from its log start.
    return {tp: max(0, ends[tp] - processed.get(tp, 0)) for tp in tps}


def dead_letters_since(cfg: EnrichConfig, since: float) -> int:
    """Committed records in the dead-letter topic published at or after ``since`` (epoch seconds)."""
    parts = rkafka.partitions_of(cfg.kafka, cfg.dead_letter_topic)
    if not parts:
        return 0
    c = rkafka.consumer(cfg.kafka)
    try:
        asked = [TopicPartition(cfg.dead_letter_topic, p, int(since * 1000)) for p in parts]
        found = c.offsets_for_times(asked, timeout=10)
    except KafkaException as exc:
        raise TransientError(f"cannot look up offsets by time in {cfg.dead_letter_topic}: {exc}") from None
    finally:
        c.close()
    # No record at or after ``since``: -1 (the end); start there and count nothing.
    start = {tp.partition: (tp.offset if tp.offset >= 0 else OFFSET_END) for tp in found}
    return sum(1 for m in rkafka.read_to_end(cfg.kafka, cfg.dead_letter_topic, start)
               if (m.timestamp()[1] or 0) >= since * 1000)


def _human(seconds: float) -> str:
    s = int(round(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def render(st: JobStatus, now: float | None = None) -> str:
    """The status as text for a person."""
    now = time.time() if now is None else now
    lines = [f"checkpoint {st.checkpoint}"]
    if st.batch_id is None:
        lines.append("no micro-batch committed yet")
    else:
        assert st.batch_committed_at is not None
        lines.append(f"last batch {st.batch_id}, committed {_iso(st.batch_committed_at)} "
                     f"({_human(now - st.batch_committed_at)} ago)")
        lag = ", ".join(f"{t}/{p}: {n}" for (t, p), n in sorted(st.input_lag.items())) or "-"
        lines.append(f"input lag: {lag}")
        lines.append(f"dead letters in the last hour: {st.dead_letters_last_hour}")
        rows = [("dataset", "version", "rows", "age", "positions")]
        for d in st.dimensions:
            rows.append((d.dataset, "-" if d.version is None else str(d.version), "-" if d.rows is None else str(d.rows),
                         "-" if d.age_seconds is None else _human(d.age_seconds),
                         " ".join(f"{p}:{o}" for p, o in sorted(d.positions.items()))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [f"PROBLEM: {p}" for p in st.problems]
    return "\n".join(lines)
