"""The ``rollups:`` section's loader: what it accepts and the errors naming the key at fault."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from enrich import config
from refstream.errors import ConfigError


def parse(*rollups: Any, state: bool = True) -> config.EnrichConfig:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": "d STRING, ts TIMESTAMP"},
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
        "rollups": list(rollups)}
    if state:
        data["state"] = {"key": "d", "timestamp": "ts"}
    return config.parse(data, "test.yaml")


def rollup(**over: Any) -> dict[str, Any]:
    return {"name": "d_1m", "by": ["d"], "window": "1m", "metrics": {"t": ["count", "p95"]},
            "output": {"parquet": {"path": "out/d_1m"}}, **over}


def test_a_rollup_is_read_with_its_durations_converted() -> None:
    (r,) = parse(rollup(correct_for="24h", metrics={"t": "mean", "d": ["count_distinct"]}, idle_finalize="2m",
                        fill=True)).rollups
    assert (r.idle_finalize, r.fill) == (timedelta(minutes=2), True)
    assert (r.name, r.by, r.window, r.correct_for) == ("d_1m", ("d",), timedelta(minutes=1), timedelta(hours=24))
    assert r.metrics == (("t", ("mean",)), ("d", ("count_distinct",)))
    assert r.output.parquet == Path("out/d_1m")
    assert r.columns == ("d", "t")
    assert parse().rollups == ()
    (k,) = parse(rollup(output={"kafka": {"topic": "r.d_1m"}})).rollups
    assert (k.output.kafka, k.output.parquet) == ("r.d_1m", None)
    assert parse(rollup()).rollups[0].correct_for is None          # the state's ttl, in the plan


@pytest.mark.parametrize(("rollups", "state", "error"), [
    ([rollup()], False, r"rollups: rollups need a state: section"),
    ({"name": "x"}, True, r"rollups: expected a list of rollups"),
    ([rollup(), rollup(output={"parquet": {"path": "other"}})], True, r"rollups\[1\]\.name: rollup name 'd_1m' is used twice"),
    ([rollup(), rollup(name="b")], True, r"rollups\[1\]\.output\.parquet: rollups 'd_1m' and 'b' write the same or nested directories"),
    ([rollup(), rollup(name="b", output={"parquet": {"path": "out/d_1m/b"}})], True,
     r"rollups\[1\]\.output\.parquet: rollups 'd_1m' and 'b' write the same or nested directories"),
    ([rollup(name="1m")], True, r"rollups\[0\]\.name: '1m' is not a name"),
    ([rollup(by=[])], True, r"rollups\[0\]\.by: expected one or more distinct columns"),
    ([rollup(by=["d", "d"])], True, r"rollups\[0\]\.by: expected one or more distinct columns"),
    ([rollup(window="0s")], True, r"rollups\[0\]\.window: must be a positive whole number of milliseconds"),
    ([rollup(correct_for="0s")], True, r"rollups\[0\]\.correct_for: must be positive"),
    ([rollup(idle_finalize="0s")], True, r"rollups\[0\]\.idle_finalize: must be positive"),
    ([rollup(metrics={"t": ["median"]})], True, r"rollups\[0\]\.metrics\.t: 'median' is not one of count, min"),
    ([rollup(metrics={"t": ["max", "max"]})], True, r"rollups\[0\]\.metrics\.t: a metric is listed twice"),
    ([rollup(metrics={})], True, r"rollups\[0\]\.metrics: expected at least one column"),
    ([rollup(output={})], True, r"rollups\[0\]\.output: a rollup needs an output"),
    ([rollup(output={"parquet": {"path": "p"}, "csv": {}})], True, r"rollups\[0\]\.output: unknown key"),
    ([rollup(windows="1m")], True, r"rollups\[0\]: unknown key"),
    ([rollup(output={"parquet": {"path": "ck/rollups"}})], True,
     r"rollups\[0\]\.output\.parquet\.path: ck/rollups overlaps checkpoint"),
    ([rollup(output={"kafka": {"topic": "dlq"}})], True,
     r"rollups\[0\]\.output\.kafka\.topic: 'dlq' is also dead_letter_topic"),
    ([rollup(output={"kafka": {"topic": "r"}}), rollup(name="b", output={"kafka": {"topic": "r"}})], True,
     r"rollups\[1\]\.output\.kafka: rollups 'd_1m' and 'b' write the same topic"),
])
def test_a_bad_rollup_is_refused_naming_the_key(rollups: Any, state: bool, error: str) -> None:
    with pytest.raises(ConfigError, match=r"^test\.yaml: " + error):
        parse(*rollups, state=state) if isinstance(rollups, list) else config.parse({
            "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": "d STRING"},
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
            "state": {"key": "d", "timestamp": "ts"}, "rollups": rollups}, "test.yaml")


def test_a_rollup_directory_inside_the_event_output_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollups\[0\]\.output\.parquet\.path: out/d_1m overlaps output\.parquet\.path"):
        config.parse({"kafka": {"bootstrap_servers": "127.0.0.1:9"},
                      "events": {"topic": "ev", "schema": "d STRING, ts TIMESTAMP"},
                      "output": {"parquet": {"path": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
                      "state": {"key": "d", "timestamp": "ts"}, "rollups": [rollup()]}, "test.yaml")
