"""Interfaces of the dimension machinery (driver side).

- :class:`ChangeFeed` reads one changelog topic in offset order up to a position the caller names,
  so the same position always yields the same records (replay after a restart).
- :class:`VersionLog` records, before a micro-batch runs, the changelog positions it uses.

``Positions`` maps a partition to the next offset to read: everything below it has been applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

Positions = dict[int, int]


@dataclass(frozen=True)
class Record:
    """One changelog record, detached from the Kafka client."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None]  # as the client gives them
    timestamp_ms: int | None = None  # the record's Kafka timestamp (publish time), when the broker gives one


class ChangeFeed(Protocol):
    topic: str

    def positions(self) -> Positions:
        """Where the records handed out so far end."""

    def read_to_end(self, timeout: float) -> list[Record]:
        """Records from the current positions to the end of every partition as it is now."""

    def read_until(self, target: Mapping[int, int], timeout: float) -> list[Record]:
        """Records from the current positions up to (excluding) ``target``; never beyond it."""

    def pending(self) -> int:
        """Records fetched but not handed out yet: a read that stopped before a partition's end."""

    def close(self) -> None: ...


class VersionLog(Protocol):
    def get(self, batch_id: int) -> dict[str, Positions] | None:
        """Positions recorded for ``batch_id`` (dataset -> positions), or None."""

    def put(self, batch_id: int, positions: Mapping[str, Positions],
            info: Mapping[str, Mapping[str, object]] | None = None) -> None:
        """Record durably (write, fsync, rename) before the batch runs; ``info`` (dataset -> facts
        such as rows, version, publish time of the newest change) is kept for ``enrich status``."""

    def latest(self) -> tuple[int, dict[str, Positions]] | None:
        """The highest batch id recorded and its positions."""

    def info(self, batch_id: int) -> dict[str, dict[str, object]]:
        """The ``info`` recorded with ``batch_id`` (empty when none)."""
