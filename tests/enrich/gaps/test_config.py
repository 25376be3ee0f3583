"""The ``gaps:`` section's loader: what it accepts and the errors naming the key at fault."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from enrich import config
from refstream.errors import ConfigError


def parse(gaps: Any, state: bool = True, **top: Any) -> config.EnrichConfig:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": "d STRING, ts TIMESTAMP"},
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck", "gaps": gaps, **top}
    if state:
        data["state"] = {"key": "d", "timestamp": "ts"}
    return config.parse(data, "test.yaml")


def test_gaps_are_read_with_a_column_or_a_duration_and_their_defaults() -> None:
    g = parse({"expected_every": "report_interval_s", "output": {"kafka": {"topic": "device-gaps"}}}).gaps
    assert g is not None
    assert (g.every_column, g.every, g.after, g.idle_after, g.kafka) == (
        "report_interval_s", None, 3.0, timedelta(minutes=5), "device-gaps")
    assert g.columns == ("report_interval_s",)
    g = parse({"expected_every": "30s", "after": 2.5, "idle_after": "1m",
               "output": {"database": {"url": "postgresql://u@h/db", "table": "gaps"}}}).gaps
    assert g is not None
    assert (g.every, g.every_column, g.after, g.idle_after, g.kafka) == (
        timedelta(seconds=30), None, 2.5, timedelta(minutes=1), None)
    assert (g.database.table, g.database.write) == ("gaps", "events")
    assert parse(None).gaps is None
    assert config.parse({"kafka": {"bootstrap_servers": "x:1"}, "events": {"topic": "ev", "schema": "d STRING"},
                         "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq",
                         "checkpoint": "ck"}).gaps is None


@pytest.mark.parametrize(("gaps", "message"), [
    ({"expected_every": "-5s", "output": {"kafka": {"topic": "g"}}}, r"gaps\.expected_every: expected a duration"),
    ({"expected_every": 0, "output": {"kafka": {"topic": "g"}}}, r"gaps\.expected_every: must be positive and at most"),
    ({"expected_every": "30s", "after": 0, "output": {"kafka": {"topic": "g"}}}, r"gaps\.after: must be positive and at most 1000"),
    ({"expected_every": "30s", "idle_after": "0s", "output": {"kafka": {"topic": "g"}}},
     r"gaps\.idle_after: must be positive"),
    ({"expected_every": "30s", "output": {}}, r"gaps\.output: gaps need an output"),
    ({"expected_every": "30s", "output": {"kafka": {"topic": "out"}}}, r"gaps\.output\.kafka\.topic: 'out' is also"),
    ({"expected_every": "30s", "output": {"kafka": {"topic": "g"}}, "every": 1}, r"gaps: unknown key\(s\): every"),
])
def test_a_bad_gaps_section_is_an_error_naming_the_key(gaps: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^test\.yaml: " + message):
        parse(gaps)


def test_gaps_need_state() -> None:
    with pytest.raises(ConfigError, match=r"^test\.yaml: gaps: gaps need a state: section"):
        parse({"expected_every": "30s", "output": {"kafka": {"topic": "g"}}}, state=False)
