"""Helpers for refresher tests: a config written to a temp dir, the topic read back, a MariaDB engine."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from refresh.config import RefreshConfig, load_config
from refstream import contract
from refstream.kafka import read_to_end
from tests.timing import bound


@dataclass(frozen=True)
class Record:
    key: bytes
    value: bytes | None
    headers: dict[str, str]
    partition: int
    offset: int

    @property
    def op(self) -> str:
        return self.headers.get("op", "")

    @property
    def version(self) -> int:
        return int(self.headers.get("version", "0"))

    def row(self) -> dict[str, Any] | None:
        return None if self.value is None else json.loads(self.value)


def read_topic(kafka: dict[str, str], topic: str, *, heartbeats: bool = False) -> list[Record]:
    """The topic's records; heartbeats (a run without changes publishes one; they change nothing) only
    when asked for."""
    return [Record(m.key(), m.value(), contract.header_map(m.headers()), m.partition(), m.offset())
            for m in read_to_end(kafka, topic, timeout=bound(20))
            if heartbeats or contract.header_map(m.headers()).get("op") != contract.OP_HEARTBEAT]


def changes(records: list[Record], version: int | None = None) -> dict[str, dict[str, Any] | None]:
    """key (as text) -> row (or None for a tombstone) of the change records, optionally of one version."""
    return {r.key.decode(): r.row() for r in records
            if r.op != "schema" and (version is None or r.version == version)}


def table_view(records: list[Record]) -> dict[str, dict[str, Any]]:
    """What a consumer that applies every record in order ends up with (the compacted view)."""
    view: dict[str, dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        if r.op == "schema":
            continue
        if r.value is None:
            view.pop(r.key.decode(), None)
        else:
            view[r.key.decode()] = json.loads(r.value)
    return view


def schemas(records: list[Record]) -> list[contract.DatasetSchema]:
    return [contract.DatasetSchema.from_json(r.value) for r in records if r.op == "schema" and r.value]


MakeConfig = Callable[..., RefreshConfig]


@pytest.fixture
def make_config(tmp_path: Path, kafka: dict[str, str]) -> MakeConfig:
    """``make_config(datasets={...}, kafka=..., retry=...)`` -> a loaded RefreshConfig (file in tmp_path)."""

    def make(datasets: dict[str, Any], *, kafka_settings: dict[str, str] | None = None,
             retry: dict[str, Any] | None = None, name: str = "refresh.yaml") -> RefreshConfig:
        doc = {"kafka": kafka_settings or {"bootstrap_servers": kafka["bootstrap.servers"]},
               "state_dir": str(tmp_path / "state"),
               "retry": retry or {"attempts": 2, "initial": "100ms", "maximum": "200ms"},
               "datasets": datasets}
        p = tmp_path / name
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        return load_config(p)

    return make


@pytest.fixture(scope="session")
def mysql_engine(mysql_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(mysql_url)
    yield engine
    engine.dispose()


def execute(engine: sa.Engine, *statements: str, params: list[dict[str, Any]] | None = None) -> None:
    with engine.begin() as conn:
        for s in statements:
            if params is not None:
                conn.execute(sa.text(s), params)
            else:
                conn.execute(sa.text(s))
