"""Hostile input through the whole job: a corpus of events no device should send - NUL and control
characters, invalid UTF-8, a megabyte key, JSON nested 100,000 deep, NaN, Infinity and 1e400, a 10 MB
event, unknown, duplicate and wrongly typed fields, far-future and year-1 times - among good ones,
through Kafka with per-device state and a call, to the Kafka output with PostgreSQL beside it, to
Parquet, and to MariaDB alone; and without state, through the fast parser to Kafka and through
`parser: spark` to the console. The job never stops (it ends its available-now run with exit 0), and
every event is in the output or among the dead letters exactly once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from refstream import kafka as rkafka
from tests.enrich.calls.server import Service, serve
from tests.enrich.helpers import read_all, read_settled
from tests.enrich.process import start_job
from tests.enrich.sinks.test_database_state import table
from tests.timing import bound

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIG = 12 << 20   # the record size the corpus's producer allows (the job keeps librdkafka's defaults)


def ev(device: Any = "d1", ts: Any = "2026-01-01T00:00:00Z", **more: Any) -> bytes:
    return json.dumps({"device_id": device, "ts": ts, "temp": 20.5, "n": 1, **more}).encode()


def corpus() -> list[tuple[bytes | None, bytes]]:
    """(key, value) of every record, good ones among them."""
    deep = b"[" * 100_000 + b"]" * 100_000
    hostile = [
        (b"k", b"\x00\x01\x02 not json"),
        (b"k", b'{"device_id": "d\xff\xfe", "ts": "2026-01-01T00:00:01Z", "temp": 1.0, "n": 2}'),  # invalid UTF-8
        (b"k", ev("d\u0000nul", n=3)),                                   # NUL in the key column
        (b"k", ev("d\u0007bell\nline\r", n=4)),                          # control characters
        (b"k", ev("x" * 900_000, n=5)),                                  # a megabyte-ish device id
        (b"k", deep),                                                    # 100,000 deep
        (b"k", b'{"device_id": "d2", "ts": "2026-01-01T00:00:02Z", "temp": NaN, "n": 6}'),
        (b"k", b'{"device_id": "d2", "ts": "2026-01-01T00:00:03Z", "temp": Infinity, "n": 7}'),
        (b"k", b'{"device_id": "d2", "ts": "2026-01-01T00:00:04Z", "temp": 1e400, "n": 8}'),
        (b"k", b'{"device_id": "d2", "ts": "2026-01-01T00:00:05Z", "temp": -1e400, "n": 9}'),
        (b"k", ev("d3", n=10, pad="p" * (10 << 20))),                    # a 10 MB event
        (b"k", ev("d3", n=11, unknown={"a": [1, 2, {"b": None}]}, extra="\u0000")),
        (b"k", b'{"device_id": "d3", "device_id": "d4", "ts": "2026-01-01T00:00:06Z", "n": 12, "n": 13}'),
        (b"k", ev("d3", n="twelve")),                                    # wrong types
        (b"k", ev(["d3"], n=14)),
        (b"k", ev("d3", ts=5, n=15)),
        (b"k", ev("d5", ts="9999-12-31T23:59:59Z", n=16)),               # far future
        (b"k", ev("d5", ts="0001-01-01T00:00:00Z", n=17)),               # year 1
        (b"k", ev("d\u00e9\u0301\U0001f600", n=18)),                     # combining marks, astral plane
        (None, ev("d6", n=19)),                                          # no Kafka key
        (b"K" * (1 << 20), ev("d6", n=20)),                              # a megabyte Kafka key
        (b"k", b""),                                                     # empty value
        (b"k", b"null"),
        (b"k", b"[]"),
    ]
    good = [(f"d{i % 4}".encode(), ev(f"d{i % 4}", f"2026-01-01T00:01:{i:02d}Z", n=100 + i)) for i in range(30)]
    return [r for pair in zip(good, hostile + [None] * (len(good) - len(hostile)), strict=True) for r in pair if r]


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with serve() as svc:
        yield svc


def produce(settings: dict[str, str], topic: str, records: list[tuple[bytes | None, bytes]]) -> None:
    rkafka.ensure_topic(settings, topic, partitions=2)
    p = Producer({**settings, "message.max.bytes": BIG, "linger.ms": 5})
    for i, (key, value) in enumerate(records):
        p.produce(topic, value, key, partition=i % 2)
    assert p.flush(60) == 0


def write(path: Path, kafka: dict[str, str], unique: Callable[[str], str], service: Service,
          output: dict[str, Any]) -> dict[str, Any]:
    cfg = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},   # librdkafka's defaults
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest"},
        "output": output,
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(path.parent / "checkpoint"),
        "max_events_per_batch": 20,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1h", "buckets": 4,
                  "aggregates": {"temp": ["mean", "max"]}},
        "calls": [{"name": "risk", "url": service.url("/score"), "refresh": "once", "on_error": "dead_letter",
                   "body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
                   "response": {"score": "DOUBLE", "level": "STRING"}}],
        "spark": {"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "2"},
    }
    path.write_text(yaml.safe_dump(cfg))
    return cfg


def run(cfg_path: Path, tmp_path: Path) -> None:
    log = tmp_path / f"{cfg_path.stem}.log"
    proc = start_job(cfg_path, log, "--available-now")
    assert proc.wait(bound(600)) == 0, log.read_text()[-4000:]


def stateless(path: Path, cfg: dict[str, Any], **events: str) -> dict[str, Any]:
    """``cfg`` without state and calls (the stateless path), written to ``path``."""
    cfg = {k: v for k, v in cfg.items() if k not in ("state", "calls")}
    cfg["events"] = {**cfg["events"], **events}
    path.write_text(yaml.safe_dump(cfg))
    return cfg


def dead_letters(kafka: dict[str, str], topic: str) -> list[tuple[tuple[int, int], str]]:
    """((partition, offset) of the event, the reason) of every dead letter on ``topic``."""
    out = []
    for m in read_all(kafka, topic):
        h = {k: v.decode() for k, v in m.headers() or []}
        assert h.get("error"), h
        out.append(((int(h["source.partition"]), int(h["source.offset"])), h["error"]))
    return out


def dead_offsets(kafka: dict[str, str], topic: str) -> Counter[tuple[int, int]]:
    return Counter(at for at, _ in dead_letters(kafka, topic))


def kafka_output(kafka: dict[str, str], cfg: dict[str, Any], records: list[tuple[bytes | None, bytes]]
                 ) -> tuple[list[dict[str, Any]], Counter[tuple[int, int]], Counter[tuple[int, int]]]:
    """The Kafka output's records, and the events written and dead by (partition, offset): between
    them every produced event once."""
    out = [json.loads(m.value()) for m in read_settled(kafka, cfg["output"]["kafka"]["topic"], 40)]
    written = Counter((r["_partition"], r["_offset"]) for r in out)
    dead = dead_offsets(kafka, cfg["dead_letter_topic"])
    assert written + dead == produced(records), (written & dead, produced(records) - (written + dead))
    return out, written, dead


def produced(records: list[tuple[bytes | None, bytes]]) -> Counter[tuple[int, int]]:
    """(partition, offset) of every record as produce() placed them."""
    return Counter((i % 2, i // 2) for i in range(len(records)))


def test_kafka_output_with_postgresql_beside_it(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
                                                 service: Service, pg_url: str) -> None:
    path = tmp_path / "enrich.yaml"
    tab = unique("hostile")
    cfg = write(path, kafka, unique, service, {"kafka": {"topic": unique("enriched")},
                                               "database": {"url": pg_url, "table": tab, "write": "events"}})
    records = corpus()
    produce(kafka, cfg["events"]["topic"], records)
    run(path, tmp_path)
    out, written, _ = kafka_output(kafka, cfg, records)
    import psycopg

    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(f'SELECT "_partition", "_offset" FROM "{tab}"').fetchall()
    assert Counter((int(p), int(o)) for p, o in rows) == written
    assert all(not isinstance(r.get("temp"), float) or abs(r["temp"]) != float("inf") for r in out)


def test_parquet_output(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
                        service: Service) -> None:
    import pyarrow.parquet as pq

    path, out = tmp_path / "enrich.yaml", tmp_path / "out"
    cfg = write(path, kafka, unique, service, {"parquet": {"path": str(out)}})
    records = corpus()
    produce(kafka, cfg["events"]["topic"], records)
    run(path, tmp_path)
    rows = sum(pq.read_table(d).num_rows for d in out.glob("batch_id=*"))
    dead = dead_offsets(kafka, cfg["dead_letter_topic"])
    assert max(dead.values()) == 1
    assert rows + len(dead) == len(records)


def test_mariadb_state_alone(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
                             service: Service, mysql_url: str) -> None:
    """No event output: the devices' event counts (nothing late, nothing expired) and the dead letters
    account for every event."""
    path = tmp_path / "enrich.yaml"
    tab = unique("hostile")
    cfg = write(path, kafka, unique, service, {"database": {"url": mysql_url, "table": tab, "write": "state"}})
    # Nothing late and nothing expired, the year-1 event included: every applied event is counted.
    cfg["state"].update(ttl="800000d", watermark="800000d")
    path.write_text(yaml.safe_dump(cfg))
    records = corpus()
    produce(kafka, cfg["events"]["topic"], records)
    run(path, tmp_path)
    dead = dead_offsets(kafka, cfg["dead_letter_topic"])
    assert max(dead.values()) == 1
    rows = table(mysql_url, tab).values()
    counted = sum(r["events"] for r in rows)
    assert counted + len(dead) == len(records), (counted, len(dead), len(records))


def test_stateless_fast_parser_to_kafka_and_spark_parser_to_the_console(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, service: Service) -> None:
    """The stateless job reads the corpus twice: with the fast parser to Kafka (every event written or
    dead once), then with ``parser: spark`` to the console (it ends its run, and leaves the same
    events dead, once each, but for the one too large for a Kafka record)."""
    fast_path, spark_path = tmp_path / "fast.yaml", tmp_path / "spark.yaml"
    cfg = stateless(fast_path, write(fast_path, kafka, unique, service, {"kafka": {"topic": unique("enriched")}}))
    records = corpus()
    produce(kafka, cfg["events"]["topic"], records)
    run(fast_path, tmp_path)
    _, _, dead = kafka_output(kafka, cfg, records)

    console = {**cfg, "output": {"console": {"rows": 100}}, "dead_letter_topic": unique("dlq"),
               "checkpoint": str(tmp_path / "checkpoint-console")}
    stateless(spark_path, console, parser="spark")
    run(spark_path, tmp_path)
    # The Kafka output refuses the event with the megabyte key (too large for a record); the console
    # shows it. Every other dead letter is the parsers' own, and both parsers agree on them.
    reasons = dict(dead_letters(kafka, cfg["dead_letter_topic"]))
    too_large = {at for at, why in reasons.items() if "too_large" in why}
    assert too_large == {(1, 20)}, reasons
    assert dead_offsets(kafka, console["dead_letter_topic"]) == dead - Counter(too_large)
