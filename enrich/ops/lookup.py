"""``enrich lookup``: the dimension row a committed micro-batch used for one key.

The row is rebuilt from the changelog topic up to the positions the job recorded for that batch
(``<checkpoint>/dimensions/<n>.json``), so it is what every task of the batch looked up - not what
the topic says now. Compaction may since have removed records below those positions; the row is
then what the topic still holds below them, and the answer says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from enrich.config import EnrichConfig
from enrich.dimension.changelog import ChangelogFollower
from enrich.ops.batches import Checkpoint
from refstream import contract
from refstream.errors import ConfigError, ContractError, DataError

log = logging.getLogger(__name__)

#: ``present``: the batch saw the row; ``deleted``: its last change below the positions is a
#: tombstone; ``absent``: the key never appears below them.
Found = Literal["present", "deleted", "absent"]


@dataclass(frozen=True, kw_only=True)
class LookupResult:
    dataset: str
    topic: str
    batch_id: int
    key: dict[str, Any]
    found: Found
    row: dict[str, Any] | None            # the row as published (the contract's JSON values)
    version: int | None                   # the refresher's version of the change that set it
    partition: int | None
    offset: int | None
    positions: dict[int, int]
    complete: bool                        # False: the topic no longer holds everything below the positions

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "topic": self.topic, "batch_id": self.batch_id, "key": self.key,
                "found": self.found, "row": self.row, "version": self.version, "partition": self.partition,
                "offset": self.offset, "positions": {str(p): o for p, o in sorted(self.positions.items())},
                "complete": self.complete}


def parse_key(text: str, key_columns: tuple[str, ...], dataset: str) -> dict[str, str]:
    """``KEY`` as given on the command line: the value of a one-column key, or for any key a JSON
    object (``{"site": "a", "slot": 3}``) or ``col=value,col=value``; values compared as text."""
    text = text.strip()
    pairs: dict[str, Any]
    if text.startswith("{"):
        try:
            pairs = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"dataset {dataset}: key {text!r} is not a JSON object ({exc})") from None
    elif all("=" in part and part.split("=", 1)[0].strip() in key_columns for part in text.split(",")):
        pairs = dict(part.split("=", 1) for part in text.split(","))
    elif len(key_columns) == 1:
        pairs = {key_columns[0]: text}
    else:
        raise ConfigError(f"dataset {dataset}: its key has columns {', '.join(key_columns)}; give KEY as "
                          f"{','.join(c + '=...' for c in key_columns)} or a JSON object")
    got = {str(k).strip(): _text(v) for k, v in pairs.items()}
    if set(got) != set(key_columns):
        raise ConfigError(f"dataset {dataset}: key columns are {', '.join(key_columns)}, got {', '.join(got) or 'none'}")
    return got


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v.strip()
    return json.dumps(v)  # true/false/null and numbers as the contract writes them


def lookup(cfg: EnrichConfig, dataset: str, key: str, batch_id: int | None = None, *,
           timeout: float = 30.0) -> LookupResult:
    topics = cfg.datasets
    if dataset not in topics:
        raise ConfigError(f"dataset {dataset!r} is not joined by {cfg.source} (datasets: {', '.join(topics) or 'none'})")
    info = Checkpoint(cfg.checkpoint).batch(batch_id)
    topic = topics[dataset]
    if dataset in {j.dataset for j in cfg.partitioned_joins}:
        # Kept by the executors: the batch applied its changelog up to its source's end in Spark's offset log.
        target = info.source_end(topic)
    else:
        target = info.positions.get(dataset, {})
    if not target:
        raise DataError(f"batch {info.batch_id} of {cfg.checkpoint} recorded no positions for dataset {dataset}")
    feed = ChangelogFollower(cfg.kafka, topic)
    try:
        records, short = feed.read_until_available(target, timeout)
    finally:
        feed.close()
    schema: contract.DatasetSchema | None = None
    changes: dict[bytes, tuple[contract.Change, int, int]] = {}
    for rec in records:
        try:
            ch = contract.decode(rec.key, rec.value, rec.headers)
        except ContractError:
            continue  # the job skips such records too (and logged them)
        if ch.op == contract.OP_SCHEMA:
            schema = ch.schema
        elif ch.op in (contract.OP_UPSERT, contract.OP_DELETE):
            changes[ch.key] = (ch, rec.partition, rec.offset)
    if schema is None:
        raise DataError(f"dataset {dataset}: no schema record on {topic} below the positions of batch {info.batch_id}")
    wanted = parse_key(key, schema.key, dataset)
    hit: tuple[contract.Change, int, int] | None = None
    for kbytes, entry in changes.items():
        try:
            k = json.loads(kbytes)
        except ValueError:
            continue
        if isinstance(k, dict) and set(k) == set(wanted) and all(_text(k[c]) == wanted[c] for c in wanted):
            hit = entry  # dict order is first-seen; the stored entry is the key's last change
    found: Found = "absent" if hit is None else ("deleted" if hit[0].value is None else "present")
    row = json.loads(hit[0].value) if hit is not None and hit[0].value is not None else None
    return LookupResult(dataset=dataset, topic=topic, batch_id=info.batch_id, key=dict(wanted), found=found,
                        row=row, version=hit[0].version if hit else None, partition=hit[1] if hit else None,
                        offset=hit[2] if hit else None, positions=dict(target), complete=not short)
