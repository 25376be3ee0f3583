"""The job with calls: end to end with Kafka output, a real HTTP service on 127.0.0.1 (issue 24):
results in the events and in the state, refresh once / every event / a duration, a needs chain,
the on_error modes, and the responses recorded for replays."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.ops.device import device_state
from enrich.pipeline import Pipeline
from refstream.errors import ConfigError, TerminalError
from tests.enrich.calls.server import Service, blackhole, free_port, serve
from tests.enrich.helpers import produce_events, read_all

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with serve() as svc:
        yield svc


def job_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
               calls: list[dict[str, Any]], batch: int = 6) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest"},
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": batch,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1h", "buckets": 4,
                  "aggregates": {"temp": ["mean"]}},
        "calls": calls,
    }


def run(spark: SparkSession, data: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    produce_events(data["kafka_settings"], data["events"]["topic"], events)
    cfg = {k: v for k, v in data.items() if k != "kafka_settings"}
    EnrichJob(config.parse(cfg, "test.yaml"), available_now=True).run(spark)
    out = [json.loads(m.value()) for m in read_all(data["kafka_settings"], data["output"]["kafka"]["topic"])]
    return sorted(out, key=lambda e: e["n"])


@pytest.mark.integration
def test_results_feed_the_state_refreshed_once_every_event_and_chained(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        service: Service) -> None:
    calls = [
        {"name": "action", "url": service.url("/action"), "needs": ["risk"], "refresh": "every event",
         "body": {"device": "{device_id}", "score": "{risk.score}"}, "response": {"action": "STRING"}},
        {"name": "risk", "url": service.url("/score"), "refresh": "once",
         "body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
         "response": {"score": "DOUBLE", "level": "STRING"}},
        {"name": "echo", "url": service.url("/echo"), "method": "GET", "refresh": "10m",
         "body": {"d": "{device_id}", "t": "n={n} at {ts}", "missing": "{temp}"}, "response": {"got": "STRING"}},
    ]
    data = job_config(kafka, unique, tmp_path, calls)
    data["kafka_settings"] = kafka
    events = [{"device_id": f"d{i % 3}", "ts": at(i * 3), "temp": None if i == 6 else float(i), "n": i}
              for i in range(12)]
    out = run(spark, data, events)
    assert [e["n"] for e in out] == list(range(12))
    for e in out:
        assert e["state"]["risk_score"] == e["risk_score"] and e["state"]["action_action"] == e["action_action"]
    by_dev: dict[str, list[dict[str, Any]]] = {}
    for e in out:
        by_dev.setdefault(e["device_id"], []).append(e)
    for dev, evs in by_dev.items():
        # once: called at the device's first event, with its state including that event
        first = evs[0]
        assert first["risk_score"] == 10 + first["temp"]
        assert all(e["risk_score"] == first["risk_score"] for e in evs), dev
        assert [e["action_action"] for e in evs] == [f"act-{first['risk_score']}"] * len(evs)
    # every event: one action call per event; once: one risk call per device; 10m: each 9 minutes apart
    assert service.paths["/action"] == 12 and service.paths["/score"] == 3
    # events of one device are 9 minutes apart: the 10m echo is called at its 1st, 3rd, ... event
    assert service.paths["/echo"] == 6
    # enrich lookup --state: the results read from the bucket's calls state variable, as the
    # device's last event carries them in its state struct
    cfg = config.parse({k: v for k, v in data.items() if k != "kafka_settings"}, "test.yaml")
    for dev, evs in by_dev.items():
        found = device_state(cfg, dev, spark=spark)
        assert found.found == "present" and found.state == evs[-1]["state"], dev
    gets = [b for p, b in service.bodies if p == "/echo"]
    d0 = [b for b in gets if b["d"] == "d0"]
    assert d0 == [{"d": "d0", "t": f"n=0 at {T0.isoformat()}", "missing": "0.0"},
                  {"d": "d0", "t": f"n=6 at {(T0 + timedelta(minutes=18)).isoformat()}"}]  # a null left out


@pytest.mark.integration
def test_errors_follow_on_error_and_an_expired_device_is_called_again(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    with serve(refuse={"d1"}) as svc:
        once = {"body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
                "response": {"score": "DOUBLE"}, "retries": {"attempts": 1}}
        calls = [{"name": "risk", "url": svc.url("/score"), **once},
                 {"name": "picky", "url": svc.url("/picky"), "on_error": "dead_letter", **once},
                 {"name": "down", "url": f"http://127.0.0.1:{free_port()}/x", "on_error": "null", **once}]
        data = job_config(kafka, unique, tmp_path, calls, batch=3)
        data["state"].update(ttl="5m", watermark="1m")
        data["kafka_settings"] = kafka
        # Three batches: the second moves the watermark past d0's and d1's expiry (0 + 5m); in the
        # third they come back with a fresh state, and once calls them again.
        events = [{"device_id": d, "ts": at(m), "temp": 1.0, "n": i} for i, (d, m) in enumerate(
            [("d0", 0), ("d1", 0), ("d2", 0), ("d2", 20), ("d2", 20.5), ("d2", 21), ("d0", 22), ("d1", 22),
             ("d2", 22)])]
        produce_events(kafka, data["events"]["topic"], events[:3])
        produce_events(kafka, data["events"]["topic"], events[3:6])
        caplog.set_level(logging.INFO, logger="enrich")
        out = run(spark, data, events[6:])
    assert [e["n"] for e in out] == [0, 2, 3, 4, 5, 6, 8]     # d1's events are dead letters
    assert [e["risk_score"] for e in out] == [11.0] * 7     # each call with events 1: 10 + 1
    assert [e["state"]["events"] for e in out] == [1, 1, 2, 3, 4, 1, 5]
    assert all(e["down_score"] is None and e["picky_score"] == e["risk_score"] for e in out)
    assert svc.paths["/score"] == 5    # d0, d1, d2, then d0 and d1 again after their expiry
    dead = read_all(kafka, data["dead_letter_topic"])
    assert sorted(json.loads(m.value())["n"] for m in dead) == [1, 7]
    assert {dict(m.headers())["error"] for m in dead} == {b"call picky failed: HTTP 503"}
    # counted per batch; a failed once call is made again at the device's next event
    assert "batch 0: calls down error 3, picky error 1, picky ok 2, risk ok 3" in caplog.text
    assert sum(int(n) for n in re.findall(r"down error (\d+)", caplog.text)) == 9
    # the driver's log: one line per batch and failing call, its count and an example error
    # (the executors log theirs in their own processes)
    failed = re.findall(r"batch (\d+): call (\w+) failed (\d+) time\(s\), e\.g\. device (d\d): (.+)", caplog.text)
    assert sorted((b, c, n) for b, c, n, _, _ in failed) == [
        ("0", "down", "3"), ("0", "picky", "1"), ("1", "down", "3"), ("2", "down", "3"), ("2", "picky", "1")]
    assert {(c, d, e.split(":")[0]) for _, c, _, d, e in failed if c == "picky"} == {("picky", "d1", "HTTP 503")}
    assert all(e.startswith("ClientConnectorError") for _, c, _, _, e in failed if c == "down")


@pytest.mark.integration
def test_on_error_fail_fails_the_batch(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                                       tmp_path: Path) -> None:
    calls = [{"name": "risk", "url": f"http://127.0.0.1:{free_port()}/x", "response": {"score": "DOUBLE"},
              "retries": {"attempts": 1}, "on_error": "fail"}]
    data = job_config(kafka, unique, tmp_path, calls)
    data["kafka_settings"] = kafka
    with pytest.raises(TerminalError, match="call risk failed for device d0: ClientConnectorError"):
        run(spark, data, [{"device_id": "d0", "ts": at(0), "temp": 1.0, "n": 0}])
    assert read_all(kafka, data["output"]["kafka"]["topic"]) == []


@pytest.mark.integration
def test_the_plan_checks_templates_against_the_columns_before_the_step(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    def plan(body: dict[str, Any], **kw: Any) -> Pipeline:
        calls = [{"name": "risk", "url": "http://127.0.0.1:1/x", "body": body, "response": {"score": "DOUBLE"},
                  **kw}]
        return Pipeline.build(config.parse(job_config(kafka, unique, tmp_path, calls), "enrich.yaml"), {})

    p = plan({"d": "{device_id}", "m": "{state.temp_mean}", "s": "{state.risk_score}"})
    assert p.state is not None and p.state.calls is not None
    assert p.join_pass.columns[-4:] == ("n", "risk_score", "state", "_late")
    assert p.state.schema["state"].dataType.fieldNames()[-2:] == ["temp_mean", "risk_score"]
    with pytest.raises(ConfigError, match=r"enrich.yaml: calls \(risk\).body: \{site\}: no such column before the "
                                          r"state step \(have: device_id, n, temp, ts\)"):
        plan({"s": "{site}"})
    with pytest.raises(ConfigError, match=r"\{state.temp_max\}: no such state field"):
        plan({"s": "{state.temp_max}"})
    with pytest.raises(ConfigError, match=r"result column 'risk_score' is also an event column"):
        Pipeline.build(config.parse({**job_config(kafka, unique, tmp_path, [
            {"name": "risk", "url": "http://127.0.0.1:1/x", "response": {"score": "DOUBLE"}}]),
            "events": {"topic": "e", "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, risk_score DOUBLE"}},
            "enrich.yaml"), {})


@pytest.mark.integration
def test_calls_added_to_and_removed_from_a_running_checkpoint(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        service: Service) -> None:
    data = job_config(kafka, unique, tmp_path, [], batch=2)
    del data["calls"]
    data["kafka_settings"] = kafka
    events = [{"device_id": f"d{i % 2}", "ts": at(i), "temp": float(i), "n": i} for i in range(8)]
    out = run(spark, data, events[:2])
    assert [e["state"]["events"] for e in out] == [1, 1] and "risk_score" not in out[0]
    # calls: added to a checkpoint whose query ran without them: its devices keep their state and
    # are called at their next event
    calls = [{"name": "risk", "url": service.url("/score"),
              "body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
              "response": {"score": "DOUBLE", "level": "STRING"}}]
    data["calls"] = calls
    # before the job runs with them, lookup --state gives the device's results as null
    cfg = config.parse({k: v for k, v in data.items() if k != "kafka_settings"}, "test.yaml")
    before = device_state(cfg, "d0", spark=spark).state
    assert before is not None and before["events"] == 1 and before["risk_score"] is None
    out = run(spark, data, events[2:4])
    assert [(e["n"], e["state"]["events"], e["risk_score"]) for e in out[2:]] == [(2, 2, 21.0), (3, 2, 22.0)]
    assert device_state(cfg, "d0", spark=spark).state == out[2]["state"]
    # and removed again: the state goes on without the results
    del data["calls"]
    out = run(spark, data, events[4:6])
    assert [(e["n"], e["state"]["events"], "risk_score" in e) for e in out[4:]] == [(4, 3, False), (5, 3, False)]
    # and put back: the results kept from before are seen again, no call made
    made = service.paths["/score"]
    data["calls"] = calls
    out = run(spark, data, events[6:])
    assert [(e["n"], e["state"]["events"], e["risk_score"]) for e in out[6:]] == [(6, 4, 21.0), (7, 4, 22.0)]
    assert service.paths["/score"] == made


def _pair_per_bucket(buckets: int) -> tuple[list[str], list[str]]:
    """Per bucket one device that comes back after its state expired and one that does not."""
    import pyarrow as pa

    from enrich.state.hashing import buckets_of

    names = [f"d{i}" for i in range(200)]
    of = buckets_of(pa.array(names), buckets)
    back = [next(n for n, b in zip(names, of, strict=True) if b == k) for k in range(buckets)]
    gone = [next(n for n, b in zip(names, of, strict=True) if b == k and n not in back) for k in range(buckets)]
    return back, gone


@pytest.mark.integration
def test_devices_expired_dropped_and_back_with_every_kind_of_call_result(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        service: Service) -> None:
    # Issue 39: a bucket where one device expired and came back in a batch while another expired for
    # good failed the state step (ArrowInvalid: Filter inputs must all be the same length), at every
    # restart. Each bucket here holds one of each, with results ok, error, timeout and every event.
    back, gone = _pair_per_bucket(4)
    with serve(delay=3.0) as slow:
        once = {"body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
                "response": {"score": "DOUBLE"}, "retries": {"attempts": 1}}
        calls = [{"name": "risk", "url": service.url("/score"), **once},
                 {"name": "down", "url": f"http://127.0.0.1:{free_port()}/x", **once},
                 {"name": "action", "url": service.url("/action"), "needs": ["risk"], "refresh": "every event",
                  "body": {"score": "{risk.score}"}, "response": {"action": "STRING"}},
                 {"name": "slow", "url": slow.url("/slow"), "refresh": "10m", "timeout": "200ms", **once}]
        data = job_config(kafka, unique, tmp_path, calls, batch=8)
        data["state"].update(ttl="1h", watermark="1m")
        data["kafka_settings"] = kafka
        first = [{"device_id": d, "ts": at(0), "temp": 1.0, "n": i} for i, d in enumerate(back + gone)]
        # A second batch moves the watermark two hours on; in the third the devices of `back` return.
        later = [{"device_id": "far", "ts": at(120 + i / 60), "temp": 1.0, "n": 8 + i} for i in range(8)]
        again = [{"device_id": d, "ts": at(121), "temp": 3.0, "n": 16 + i} for i, d in enumerate(back)]
        out = run(spark, data, first + later + again)
    assert [e["n"] for e in out] == list(range(20))
    for e in out:
        assert e["down_score"] is None and e["slow_score"] is None, e
        assert e["action_action"] == f"act-{e['risk_score']}", e
    # back with a fresh state: called once again, with events 1 and mean 3
    assert [(e["device_id"], e["state"]["events"], e["risk_score"]) for e in out[16:]] == [
        (d, 1, 13.0) for d in back]
    cfg = config.parse({k: v for k, v in data.items() if k != "kafka_settings"}, "test.yaml")
    for d in gone:
        assert device_state(cfg, d, spark=spark).found == "absent", d
    for d, e in zip(back, out[16:], strict=True):
        found = device_state(cfg, d, spark=spark)
        assert found.found == "present" and found.state == e["state"], d


def _batch_counts(log: str, batch: int) -> dict[str, int]:
    """The driver's ``batch N: calls <call> <result> <n>, ...`` line as ``{"<call> <result>": n}``."""
    m = re.search(rf"batch {batch}: calls (.+)", log)
    assert m, log[-2000:]
    return {" ".join(p.split()[:2]): int(p.split()[2]) for p in m.group(1).split(", ")}


@pytest.mark.integration
def test_a_service_that_never_answers_is_cut_off_by_the_breaker_and_the_budget(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Issue 39: a black-holed service held each batch for (calls x tries x timeout / concurrency).
    devices = 40
    with blackhole() as hole, blackhole() as stuck_hole:
        calls = [
            # fails twice in a row (2 tries of 1s each), then skipped for the hour
            {"name": "risk", "url": hole.url("/x"), "response": {"score": "DOUBLE"}, "timeout": "1s",
             "retries": {"attempts": 2, "backoff": "10ms"}, "concurrency": 2,
             "circuit_breaker": {"failures": 2, "cooldown": "1h"}},
            # a try would wait an hour and the breaker never opens: the budget ends the batch
            {"name": "stuck", "url": stuck_hole.url("/y"), "response": {"x": "DOUBLE"}, "timeout": "1h",
             "budget": "3s", "concurrency": 4, "circuit_breaker": {"failures": 1000}},
        ]
        data = job_config(kafka, unique, tmp_path, calls, batch=devices)
        data["kafka_settings"] = kafka
        caplog.set_level(logging.INFO, logger="enrich")
        out = run(spark, data, [{"device_id": f"d{i}", "ts": at(0), "temp": 1.0, "n": i} for i in range(devices)])
        accepted = hole.accepted
    assert [e["n"] for e in out] == list(range(devices))
    assert all(e["risk_score"] is None and e["stuck_x"] is None for e in out)
    counts = _batch_counts(caplog.text, 0)
    # skipped calls count as results of their own (refstream_enrich_calls_total{result="skipped"})
    assert counts.get("risk skipped", 0) >= devices // 2, counts
    assert sum(counts.get(f"risk {r}", 0) for r in ("error", "timeout", "skipped")) == devices, counts
    assert counts["stuck skipped"] == devices and "stuck ok" not in counts, counts
    # without the breaker: 80 connections (2 tries per device); with it a few per Python worker
    assert accepted < devices, accepted


@pytest.mark.integration
def test_a_bad_value_in_a_request_or_a_response_is_a_call_error_never_a_failed_query(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Issue 39: each of these stopped the query for good (every replay met the same value).
    answers = {"big": json.dumps({"score": 2**1100}), "digits": '{"score": ' + "7" * 400 + "}",
               "inf": '{"score": 1e400}', "nan": '{"score": NaN}', "deep": '{"score": ' + "[" * 100_000 + "]" * 100_000 + "}"}
    with serve(answers=answers) as svc:
        raw = {"url": svc.url("/raw"), "body": {"device": "{device_id}"}, "response": {"score": "DOUBLE"},
               "retries": {"attempts": 1}}
        calls = [{"name": "strict", "on_error": "fail", **raw}, {"name": "lax", "on_error": "null", **raw},
                 # the device id goes into the Idempotency-Key header of every call
                 {"name": "risk", "url": svc.url("/score"), "on_error": "fail", "response": {"score": "DOUBLE"},
                  "body": {"events": "{state.events}"}}]
        data = job_config(kafka, unique, tmp_path, calls, batch=20)
        data["kafka_settings"] = kafka
        devices = ["fine", "ctl\nnewline", "ctl\x01one", *answers]
        caplog.set_level(logging.INFO, logger="enrich")
        out = run(spark, data, [{"device_id": d, "ts": at(0), "temp": 1.0, "n": i} for i, d in enumerate(devices)])
    assert [(e["device_id"], e["strict_score"], e["lax_score"], e["risk_score"]) for e in out] == [
        ("fine", 1.5, 1.5, 10.0), ("ctl\nnewline", 1.5, 1.5, 10.0), ("ctl\x01one", 1.5, 1.5, 10.0)]
    # on_error fail: a value's error is a dead letter with its reason, not a failed batch
    # the original event, byte for byte, with the reason
    dead = {json.loads(m.value())["device_id"]: dict(m.headers())["error"].decode()
            for m in read_all(kafka, data["dead_letter_topic"])}
    assert set(dead) == set(answers)
    for d in ("big", "digits", "inf", "nan"):
        assert re.fullmatch(r"call strict failed: call strict: field 'score' is \S+, not DOUBLE", dead[d]), dead[d]
    assert dead["deep"] == "call strict failed: call strict: the response is nested too deep to read"
    assert _batch_counts(caplog.text, 0) == {"lax error": 5, "lax ok": 3, "risk ok": 8, "strict error": 5,
                                             "strict ok": 3}


@pytest.mark.integration
def test_headers_carry_the_token_and_no_log_line_shows_a_secret(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        service: Service, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RISK_TOKEN", "s3cret-token")
    service.headers.clear()  # the module's service: only this test's requests
    calls = [{"name": "risk", "url": service.url("/score") + "?api_key=k3y", "response": {"score": "DOUBLE"},
              "headers": {"Authorization": "Bearer ${RISK_TOKEN}"}, "body": {"events": "{state.events}"}},
             {"name": "down", "url": f"http://me:pa55@127.0.0.1:{free_port()}/x?token=k3y", "retries": {"attempts": 1},
              "headers": {"Authorization": "Bearer ${RISK_TOKEN}"}, "response": {"score": "DOUBLE"}}]
    data = job_config(kafka, unique, tmp_path, calls)
    produce_events(kafka, data["events"]["topic"], [{"device_id": "d0", "ts": at(0), "temp": 1.0, "n": 0}])
    caplog.set_level(logging.DEBUG, logger="enrich")
    cfg = config.load_config(data, source="test.yaml")
    EnrichJob(cfg, available_now=True).run(spark)
    out = [json.loads(m.value()) for m in read_all(kafka, data["output"]["kafka"]["topic"])]
    assert [(e["risk_score"], e["down_score"]) for e in out] == [(10.0, None)]
    sent = [h for h in service.headers if "-risk-" in h.get("Idempotency-Key", "")]
    assert sent and all(h["Authorization"] == "Bearer s3cret-token" for h in sent)
    assert "call down failed 1 time(s)" in caplog.text
    assert not any(s in caplog.text for s in ("s3cret", "pa55", "k3y")), caplog.text
