"""One bucket's calls in one micro-batch (enrich.calls.step) against a real HTTP service: the order
of a device's calls, refresh, needs, on_error, and the responses recorded for a replay."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from enrich.calls.client import CallFailed, Outcome
from enrich.calls.config import CallConfig, RetryConfig
from enrich.calls.record import read_record, write_record
from enrich.calls.step import BucketCalls, CallStep, read_tallies
from enrich.calls.template import Template
from enrich.checkpoint import CheckpointLayout
from tests.enrich.calls.server import Service, serve

MIN = 60_000_000
FAST = RetryConfig(attempts=2, backoff=timedelta(milliseconds=1))


@pytest.fixture
def service() -> Iterator[Service]:
    with serve() as svc:
        yield svc


def risk(svc: Service, path: str = "/score", **kw: Any) -> CallConfig:
    return CallConfig(name="risk", url=svc.url(path), retries=FAST,
                      body=Template({"device": "{device_id}", "events": "{state.events}"}),
                      response=(("score", "DOUBLE"), ("level", "STRING")), **kw)


def action(svc: Service, **kw: Any) -> CallConfig:
    return CallConfig(name="action", url=svc.url("/action"), needs=("risk",), refresh=timedelta(0),
                      body=Template({"score": "{risk.score}"}), response=(("action", "STRING"),), **kw)


class Bucket:
    """A bucket's events across batches: each :meth:`batch` runs the step as the processor would."""

    def __init__(self, tmp_path: Path, *calls: CallConfig) -> None:
        self.step = CallStep(calls, pa.string(), str(tmp_path))
        self.stored: pa.Table | None = None
        self.counts: dict[str, int] = {}
        self.batch_id = 0

    def batch(self, events: list[tuple[str, int, int | None]], *, keep_stored: bool = True,
              batch_id: int | None = None) -> BucketCalls:
        """``events``: (device, minute, events in state or None for an event not applied), in input order."""
        self.batch_id = batch_id if batch_id is not None else self.batch_id + 1
        table = pa.table({"device_id": [d for d, _, _ in events], "_partition": [0] * len(events),
                          "_offset": list(range(len(events)))})
        ts = np.array([m * MIN for _, m, _ in events], dtype=np.int64)
        state = pa.StructArray.from_arrays([pa.array([n for _, _, n in events], pa.int64())], names=["events"],
                                           mask=pa.array([n is None for _, _, n in events]))
        out = self.step.run(7, table, "device_id", ts, state, self.stored, ids=("q", self.batch_id))
        if keep_stored and out.table is not None:
            self.stored = out.table
        for (c, r), n in out.counts.items():
            self.counts[f"{c} {r}"] = self.counts.get(f"{c} {r}", 0) + n
        return out


def short(key: str) -> str:
    """An Idempotency-Key without the request's digest that ends it."""
    return key.rsplit("-", 1)[0]


def col(out: BucketCalls, name: str) -> list[Any]:
    return out.columns[name].to_pylist()


def test_once_calls_at_a_devices_first_event_and_later_events_see_it(service: Service, tmp_path: Path) -> None:
    b = Bucket(tmp_path, risk(service))
    # d2's second event comes first in the input but later in event time; the late event makes no call.
    out = b.batch([("d1", 1, 1), ("d2", 5, 2), ("d2", 3, 1), ("d1", 2, 2), ("d3", 0, None)])
    assert col(out, "risk_score") == [10.0, 10.0, 10.0, 10.0, None]
    assert {short(k): n for k, n in service.keys.items()} == {"q-1-d1-risk-0": 1, "q-1-d2-risk-0": 1}
    out = b.batch([("d1", 9, 3), ("d4", 9, 4)])
    assert col(out, "risk_score") == [10.0, 40.0] and service.paths["/score"] == 3


def test_a_duration_calls_again_once_the_result_is_older(service: Service, tmp_path: Path) -> None:
    b = Bucket(tmp_path, risk(service, refresh=timedelta(minutes=10)))
    out = b.batch([("d1", 0, 1), ("d1", 10, 2), ("d1", 11, 3), ("d1", 20, 4), ("d1", 22, 5)])
    assert col(out, "risk_score") == [10.0, 10.0, 30.0, 30.0, 50.0]
    out = b.batch([("d1", 30, 6), ("d1", 33, 7)])
    assert col(out, "risk_score") == [50.0, 70.0]


def test_every_event_numbers_a_devices_calls_and_needs_chain_them(service: Service, tmp_path: Path) -> None:
    b = Bucket(tmp_path, risk(service), action(service))
    out = b.batch([("d1", 0, 1), ("d1", 1, 2), ("d1", 2, 3)])
    assert col(out, "action_action") == ["act-10.0"] * 3
    assert [short(k) for k in service.keys if "action" in k] == [f"q-1-d1-action-{n}" for n in range(3)]
    assert b.counts == {"risk ok": 1, "action ok": 3}


def test_on_error_null_counts_and_retries_at_the_next_event(service: Service, tmp_path: Path) -> None:
    service.fail_next = 2   # both tries of the first call fail; the next call succeeds
    b = Bucket(tmp_path, risk(service, "/status/500"), action(service))
    out = b.batch([("d1", 0, 1), ("d1", 1, 2)])
    assert col(out, "risk_score") == [None, 20.0] and col(out, "risk_level") == [None, "low"]
    # action needs risk: not made where risk failed, its fields null for that event
    assert col(out, "action_action") == [None, "act-20.0"] and out.reasons == [None, None]
    assert b.counts == {"risk error": 1, "risk retried": 1, "risk ok": 1, "action ok": 1}
    assert service.paths["/action"] == 1


def test_on_error_dead_letter_names_the_call(service: Service, tmp_path: Path) -> None:
    service.down = True
    b = Bucket(tmp_path, risk(service, on_error="dead_letter"))
    out = b.batch([("d1", 0, 1), ("d2", 0, 1)])
    assert out.reasons == ["call risk failed: HTTP 503"] * 2 and col(out, "risk_score") == [None, None]


def test_on_error_fail_fails_the_batch_and_records_nothing(service: Service, tmp_path: Path) -> None:
    service.down = True
    b = Bucket(tmp_path, risk(service, on_error="fail"))
    with pytest.raises(CallFailed, match="call risk failed for device d1: HTTP 503"):
        b.batch([("d1", 0, 1)])
    assert not CheckpointLayout(tmp_path).call_record(1, 7).exists()


def test_a_replay_reuses_the_recorded_responses(service: Service, tmp_path: Path) -> None:
    b = Bucket(tmp_path, risk(service), action(service))
    events = [("d1", 0, 1), ("d1", 1, 2), ("d2", 0, 1)]
    first = b.batch(events, keep_stored=False)
    record = CheckpointLayout(tmp_path).call_record(1, 7)
    assert {short(k) for k in read_record(record)} == {"q-1-d1-risk-0", "q-1-d2-risk-0", "q-1-d1-action-0", "q-1-d1-action-1",
                                        "q-1-d2-action-0"}
    service.delay = 0.0
    calls = sum(service.paths.values())
    # The service now fails: a replay must not see it (the same requests, so the same keys).
    service.down = True
    b.counts = {}
    again = b.batch(events, batch_id=1)
    assert sum(service.paths.values()) == calls
    assert {k: v.to_pylist() for k, v in again.columns.items()} == {k: v.to_pylist() for k, v in first.columns.items()}
    assert b.counts == {"risk replayed": 2, "action replayed": 3}
    # Without the record (a crash before it was written) the calls are made again, with the same keys.
    record.unlink()
    service.down = False
    b.batch(events, batch_id=1)
    assert all(n == 2 for k, n in service.keys.items() if "action" in k)


def test_the_first_attempt_to_record_wins(tmp_path: Path) -> None:
    path = tmp_path / "calls" / "3" / "1.json"
    mine = {"k": Outcome("ok", {"score": 1.0})}
    assert write_record(path, mine) == mine
    other = {"k": Outcome("ok", {"score": 2.0}), "j": Outcome("error", None, "HTTP 500")}
    kept = write_record(path, other)
    assert kept["k"].values == {"score": 1.0} and kept["j"].error == "HTTP 500"
    assert json.loads(path.read_text())["k"]["values"] == {"score": 1.0}
    assert [p.name for p in path.parent.iterdir()] == ["1.json"]


def test_a_stored_table_of_other_calls_is_conformed_and_a_changed_call_made_again(
        service: Service, tmp_path: Path) -> None:
    b = Bucket(tmp_path, risk(service))
    b.batch([("d1", 0, 1), ("d2", 0, 1)])
    assert b.stored is not None
    # action added (called at each device's next event); risk keeps its results, one field fewer
    b.step = CallStep((dataclasses.replace(risk(service), response=(("score", "DOUBLE"),)), action(service)),
                      pa.string(), str(tmp_path))
    b.stored = b.step.conform(b.stored)
    assert b.stored.schema == b.step.schema()
    assert b.stored.column("risk_score").to_pylist() == [10.0, 10.0]
    assert b.stored.column("action__ok").to_pylist() == [None, None]
    service.paths.clear()
    out = b.batch([("d1", 1, 2)])
    assert service.paths == {"/action": 1} and col(out, "action_action") == ["act-10.0"]
    # a result field of another type: that call starts over; a call removed: its columns dropped
    retyped = b.stored.set_column(b.stored.schema.get_field_index("risk_score"), "risk_score",
                                  b.stored.column("risk_score").cast(pa.string()))
    step = CallStep((risk(service),), pa.string(), str(tmp_path))
    again = step.conform(retyped)
    assert again.column_names == ["_key", "risk__ok", "risk__at", "risk_score", "risk_level"]
    assert again.column("risk__ok").to_pylist() == [None, None]
    assert CallStep((action(service),), pa.string(), str(tmp_path)).conform(b.stored).column(
        "action__ok").to_pylist() == [None, True]   # d2 (untouched), d1


def test_tallies_sum_over_buckets_with_the_lowest_buckets_first_error() -> None:
    a = BucketCalls({}, [], None, {("risk", "error"): 2, ("risk", "ok"): 1}, {"risk": (2, "device d3: HTTP 503")})
    b = BucketCalls({}, [], None, {("risk", "error"): 1}, {"risk": (1, "device d1: HTTP 500")})
    counts, failures = read_tallies({9: a.tally(), 4: b.tally(), 5: {}})
    assert counts == {("risk", "error"): 3, ("risk", "ok"): 1}
    assert failures == {"risk": (3, "device d1: HTTP 500")}


def test_a_template_changed_before_a_replay_makes_the_call_again_with_a_new_key(
        service: Service, tmp_path: Path) -> None:
    # Issue 39: the key named the device and the call only, so a replay after the template changed
    # reused the response recorded for another request.
    b = Bucket(tmp_path, risk(service))
    first = b.batch([("d1", 0, 1)], keep_stored=False)
    assert col(first, "risk_score") == [10.0]
    changed = dataclasses.replace(risk(service), body=Template({"device": "{device_id}", "events": 5}))
    b.step = CallStep((changed,), pa.string(), str(tmp_path))
    again = b.batch([("d1", 0, 1)], batch_id=1, keep_stored=False)
    assert col(again, "risk_score") == [50.0] and service.paths["/score"] == 2
    assert len(service.keys) == 2 and {short(k) for k in service.keys} == {"q-1-d1-risk-0"}
    # the same request replayed keeps its key and its recorded response; a rotated token too
    b.step = CallStep((dataclasses.replace(changed, headers=(("Authorization", "Bearer new"),)),), pa.string(),
                      str(tmp_path))
    b.counts = {}
    assert col(b.batch([("d1", 0, 1)], batch_id=1, keep_stored=False), "risk_score") == [50.0]
    assert b.counts == {"risk replayed": 1} and service.paths["/score"] == 2
    # a header that says what is asked is part of the request
    b.step = CallStep((dataclasses.replace(changed, headers=(("X-Model", "v2"),)),), pa.string(), str(tmp_path))
    b.batch([("d1", 0, 1)], batch_id=1, keep_stored=False)
    assert service.paths["/score"] == 3 and service.headers[-1]["X-Model"] == "v2"


def test_a_stale_result_is_made_again_at_the_devices_next_event_with_a_new_key_and_so_is_what_needs_it(
        service: Service, tmp_path: Path) -> None:
    """CallStep.stale (a late reference version changed a column the template reads): the device's
    result of that call is made again at its next event, whatever its refresh, in a new batch (a new
    Idempotency-Key), with the calls that need it; other devices keep theirs."""
    once = dataclasses.replace(action(service), refresh=None)  # made once, needing risk
    b = Bucket(tmp_path, risk(service), once)
    b.batch([("d1", 1, 1), ("d2", 1, 1)])
    assert {short(k) for k in service.keys} == {"q-1-d1-risk-0", "q-1-d2-risk-0", "q-1-d1-action-0",
                                                "q-1-d2-action-0"}
    assert b.stored is not None
    b.stored = b.step.stale(b.stored, {"risk": pa.array(["d1"])})
    b.batch([("d1", 2, 2), ("d2", 2, 2)])
    assert {short(k) for k in service.keys} - {"q-1-d1-risk-0", "q-1-d2-risk-0", "q-1-d1-action-0",
                                               "q-1-d2-action-0"} == {"q-2-d1-risk-0", "q-2-d1-action-0"}
    b.batch([("d1", 3, 3)])  # made again once, not at every event
    assert not {short(k) for k in service.keys if short(k).startswith("q-3-")}
