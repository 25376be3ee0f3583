"""Data and the broker-bound baseline of the enrichment benchmark (``bench.enrich_bench``).

- :func:`publish_devices`: a ``devices`` dimension of N rows on its changelog topic, encoded with the
  contract codec (``schema_message`` + ``upsert_messages``), as the refresher would publish it; or N
  keys with several versions each, valid from times around a given one (the as-of benchmark).
- :func:`fill_events`: a backlog of ~150-byte JSON device events (the simulator's format).
- :func:`plain_copy`: consume-then-produce the events with confluent-kafka alone: the broker-bound limit.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
from confluent_kafka import KafkaError, Producer, TopicPartition

from demo.simulate import device_id, now_iso
from refstream import contract
from refstream import kafka as rkafka
from refstream.contract import Column, DatasetSchema

log = logging.getLogger(__name__)

DEVICES = DatasetSchema("devices", ("device_id",), (
    Column("device_id", "string"), Column("model_id", "string"), Column("site_id", "int64"),
    Column("owner", "string"), Column("installed", "timestamp")))
EVENT_DDL = ("device_id STRING, ts TIMESTAMP, temperature DOUBLE, battery INT, seq BIGINT, rssi INT, "
             "firmware STRING, status STRING")
JOIN_COLUMNS = ["model_id", "site_id", "owner"]

_FIRMWARE = ("fw-2.4.1", "fw-2.4.2", "fw-2.5.0", "fw-3.0.0-rc1")


def device_row(n: int, owner: str | None = None) -> dict[str, object]:
    """Row ``n`` (1-based) of the synthetic devices table."""
    return {"device_id": device_id(n), "model_id": f"m-{n % 97}", "site_id": n % 211,
            "owner": owner or f"team-{n % 13}", "installed": f"2024-03-{1 + n % 28:02d}T08:30:00"}


def _produce(p: Producer, topic: str, value: bytes | None, key: bytes | None,
             headers: list[tuple[str, bytes]] | None = None, partition: int = -1) -> None:
    while True:
        try:
            if headers:
                p.produce(topic, value, key, partition=partition, headers=headers)
            else:
                p.produce(topic, value, key, partition=partition)
            return
        except BufferError:
            p.poll(0.05)


def publish_devices(settings: Mapping[str, str], topic: str, rows: int, *, versions: int = 1,
                    at: datetime | None = None) -> float:
    """Publish the schema record and ``rows`` upserts to ``topic``; returns seconds taken.

    With ``versions`` > 1, every device gets that many versions (all of version 1, then all of
    version 2, ...: changelog order is time order), the owner ``team-<n % 13>-v<version>``, and a
    ``valid_from`` header (:func:`version_valid_from`) placing ``at`` inside a different version per
    device: as of ``at`` (+/- half a :data:`VERSION_STEP`), device ``n`` has version
    ``n % versions + 1``, so an as-of join of events made around ``at`` picks every version, the
    latest-version join only the last."""
    rkafka.ensure_topic(settings, topic, config=contract.TOPIC_CONFIG)
    p = rkafka.producer(settings, role="bulk", **{"enable.idempotence": True})
    started = time.monotonic()
    m = contract.schema_message(DEVICES)
    _produce(p, topic, m.value, m.key, m.headers)
    chunk = 50_000
    if versions <= 1:
        for lo in range(1, rows + 1, chunk):
            batch = [device_row(n) for n in range(lo, min(lo + chunk, rows + 1))]
            for m in contract.upsert_messages(DEVICES, batch, version=1):
                _produce(p, topic, m.value, m.key, m.headers)
            p.poll(0)
        p.flush(120)
        return time.monotonic() - started
    at = at or datetime.now(UTC)
    for v in range(1, versions + 1):
        for lo in range(1, rows + 1, chunk):
            ns = range(lo, min(lo + chunk, rows + 1))
            # The bulk encoder (Arrow in, contract bytes out) is ~5x the row-wise one: 3M versions are many.
            table = pa.Table.from_pylist([device_row(n, f"team-{n % 13}-v{v}") for n in ns])
            times = version_valid_from(np.arange(lo, ns.stop), v, versions, at)
            for b in contract.upsert_batches(DEVICES, table, version=v, valid_from=times):
                for i, (key, value) in enumerate(zip(b.keys, b.values, strict=True)):
                    _produce(p, topic, value, key, b.record_headers(i))
            p.poll(0)
    p.flush(300)
    return time.monotonic() - started


#: Versions of a device are this far apart in ``valid_from``; the events' times must stay within half
#: of it of ``at`` (:func:`publish_devices`) for the expected version to be the one valid then.
VERSION_STEP = timedelta(hours=1)


def version_valid_from(ns: np.ndarray, version: int, versions: int, at: datetime) -> pa.Array:
    """``valid_from`` of ``version`` (1-based, of ``versions``) of devices ``ns``: device ``n``'s
    version ``n % versions + 1`` starts half a step before ``at`` and the next one half a step after."""
    step = VERSION_STEP // timedelta(microseconds=1)
    at_us = (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    return pa.array(at_us + (version - 1 - ns % versions) * step - step // 2, contract.TIME_TYPE)


def expected_version(n: int, versions: int) -> int:
    """The version of device ``n`` valid around ``at`` (see :func:`publish_devices`)."""
    return n % versions + 1


def publish_change(p: Producer, topic: str, n: int, owner: str, version: int) -> None:
    """One upsert of device ``n`` with a new owner (the latency probe)."""
    for m in contract.upsert_messages(DEVICES, [device_row(n, owner)], version=version):
        _produce(p, topic, m.value, m.key, m.headers)
    p.flush(10)


class EventMaker:
    """~150-byte events in the simulator's format (``demo.simulate``), rendered cheaply."""

    def __init__(self, devices: int, seed: int = 7) -> None:
        self.devices = devices
        self.rng = random.Random(seed)
        rng = self.rng
        self.tails = [f',"temperature":{rng.uniform(-10.0, 45.0):.2f},"battery":{rng.randrange(0, 101)}'
                      for _ in range(997)]
        self.ends = [f',"rssi":{rng.randrange(-95, -40)},"firmware":"{rng.choice(_FIRMWARE)}","status":"ok"}}'
                     for _ in range(101)]
        self.seq = 0

    def event(self, device: str, ts: str) -> bytes:
        s = self.seq
        self.seq += 1
        return (f'{{"device_id":"{device}","ts":"{ts}"{self.tails[s % 997]},"seq":{s}'
                f'{self.ends[s % 101]}').encode()

    def random_device(self) -> str:
        return device_id(self.rng.randrange(1, self.devices + 1))

    def covering_numbers(self) -> Iterator[int]:
        """Device numbers that visit every device once per pass, each pass in a fresh random order."""
        order = list(range(1, self.devices + 1))
        while True:
            self.rng.shuffle(order)
            yield from order


def fill_events(settings: Mapping[str, str], topic: str, n: int, partitions: int, devices: int,
                cover: bool = False) -> tuple[float, float, int]:
    """Produce ``n`` events keyed by device id; returns (seconds, mean value bytes, distinct devices).

    Devices are drawn at random from ``devices`` (2M draws over 1M devices touch about 86% of them),
    or, with ``cover``, every device once per pass over them (so ``min(n, devices)`` distinct)."""
    rkafka.ensure_topic(settings, topic, partitions=partitions)
    p = rkafka.producer(settings, role="bulk")
    maker = EventMaker(devices)
    covering = maker.covering_numbers() if cover else None
    seen = bytearray(devices + 1)
    started = time.monotonic()
    total = 0
    ts = now_iso()
    for i in range(n):
        if i % 1000 == 0:
            ts = now_iso()
            p.poll(0)
        num = next(covering) if covering is not None else maker.rng.randrange(1, devices + 1)
        seen[num] = 1
        dev = device_id(num)
        v = maker.event(dev, ts)
        total += len(v)
        _produce(p, topic, v, dev.encode())
    p.flush(300)
    return time.monotonic() - started, total / max(n, 1), seen.count(1)


def plain_copy(settings: Mapping[str, str], src: str, dst: str, n: int, partitions: int) -> float:
    """Consume ``n`` records of ``src`` and produce each to ``dst`` (same key and value) in one
    process; returns records/s, measured until the last record is acknowledged."""
    rkafka.ensure_topic(settings, dst, partitions=partitions)
    c = rkafka.consumer(settings, **{"fetch.wait.max.ms": 100, "max.partition.fetch.bytes": 8 << 20,
                                     "fetch.max.bytes": 64 << 20})
    c.assign([TopicPartition(src, p, 0) for p in rkafka.partitions_of(settings, src)])
    p = rkafka.producer(settings, role="bulk")
    produce, poll = p.produce, p.poll
    got = 0
    started = time.monotonic()
    last = started
    while got < n:
        msgs = c.consume(10_000, timeout=0.2)
        if not msgs:
            if time.monotonic() - last > 30:
                raise RuntimeError(f"plain copy stuck at {got} of {n} records of {src}")
            continue
        last = time.monotonic()
        for m in msgs:
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(f"plain copy: {m.error()}")
            while True:
                try:
                    produce(dst, m.value(), m.key())
                    break
                except BufferError:
                    poll(0.05)
            got += 1
        poll(0)
    p.flush(120)
    rate = got / (time.monotonic() - started)
    c.close()
    return rate


class SteadyEvents(threading.Thread):
    """Produces events at ``rate``/s until stopped; every 10 ms also one event of ``probe`` (the
    device whose change the latency measurement is waiting for), when set."""

    def __init__(self, settings: Mapping[str, str], topic: str, rate: float, devices: int) -> None:
        super().__init__(name="steady-events", daemon=True)
        self.settings, self.topic, self.rate, self.devices = dict(settings), topic, rate, devices
        self.probe: str | None = None
        self.produced = 0
        self._stop_evt = threading.Event()

    def run(self) -> None:
        p = rkafka.producer(self.settings, **{"linger.ms": 5, "compression.type": "lz4"})
        maker = EventMaker(self.devices, seed=11)
        started = time.monotonic()
        while not self._stop_evt.is_set():
            ts = now_iso()
            due = int((time.monotonic() - started) * self.rate) - self.produced
            for _ in range(max(due, 0)):
                dev = maker.random_device()
                _produce(p, self.topic, maker.event(dev, ts), dev.encode())
                self.produced += 1
            probe = self.probe
            if probe is not None:
                _produce(p, self.topic, maker.event(probe, ts), probe.encode())
            p.poll(0)
            time.sleep(0.01)
        p.flush(10)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(15)
