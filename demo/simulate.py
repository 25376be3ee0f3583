"""Device simulator: produces JSON device events to Kafka at a chosen rate (the demo's and the
benchmarks' event stream).

``python -m demo.simulate --bootstrap 127.0.0.1:9092 --topic device-events --rate 500 --devices 5000
--malformed 0.01 [--duration S] [--count N]``

An event, keyed by its ``device_id`` (the shape of ``events.schema`` in ``conf/enrich.yaml``, plus a
sequence number, signal strength and firmware so that it weighs ~150 bytes like real telemetry)::

    {"device_id":"d-17","ts":"2026-11-23T12:00:03.123Z","temperature":21.53,"battery":87,
     "seq":1234,"rssi":-67,"firmware":"fw-2.4.1","status":"ok"}

A share of events (``--malformed``) is deliberately broken, in the ways real devices break: not JSON
at all, truncated JSON, or a field of the wrong type. They exercise the job's dead-letter path.

``--rate 0`` (the default when ``--count`` is given without ``--rate``) produces as fast as the
broker takes: the burst mode used by the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from confluent_kafka import KafkaException

from refstream import kafka, version
from refstream.errors import RefstreamError, TransientError
from refstream.kafka import ensure_topic
from refstream.logs import setup_logging

log = logging.getLogger(__name__)

_FIRMWARE = ("fw-2.4.1", "fw-2.4.2", "fw-2.5.0", "fw-3.0.0-rc1")
_MALFORMED_KINDS = ("not_json", "truncated", "wrong_type")


def device_id(n: int) -> str:
    """The id of device number ``n`` (1-based); the demo's seed data uses the same ids."""
    return f"d-{n}"


def now_iso() -> str:
    """UTC time as ISO 8601 with milliseconds and ``Z`` (Spark's JSON reader parses it as TIMESTAMP)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _tail(rng: random.Random) -> str:
    return f',"temperature":{rng.uniform(-10.0, 45.0):.2f},"battery":{rng.randrange(0, 101)}'


def _end(rng: random.Random) -> str:
    return f',"rssi":{rng.randrange(-95, -40)},"firmware":"{rng.choice(_FIRMWARE)}","status":"ok"}}'


def make_event(device: str, ts: str, seq: int, rng: random.Random) -> bytes:
    """One well-formed event. Formatted by hand: json.dumps per event is the simulator's bottleneck."""
    return f'{{"device_id":"{device}","ts":"{ts}"{_tail(rng)},"seq":{seq}{_end(rng)}'.encode()


def make_malformed(device: str, ts: str, seq: int, rng: random.Random) -> bytes:
    """One broken event: not JSON, truncated JSON, or a field of the wrong type."""
    kind = rng.choice(_MALFORMED_KINDS)
    if kind == "not_json":
        return f"<device {device} seq={seq} temperature=??>".encode()
    good = make_event(device, ts, seq, rng)
    if kind == "truncated":
        # Cut after the device id: a device that crashes mid-write has still said who it is.
        return good[: rng.randrange(good.index(b',"ts"'), len(good) - 5)]
    obj = json.loads(good)
    obj["temperature"] = "hot"
    obj["battery"] = "low"
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class Stats:
    """What a run produced; ``delivered`` counts broker acknowledgements."""

    produced: int = 0
    malformed: int = 0
    delivered: int = 0
    failed: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def as_dict(self) -> dict[str, float | int]:
        el = self.elapsed
        return {"produced": self.produced, "malformed": self.malformed, "delivered": self.delivered,
                "failed": self.failed, "bytes": self.bytes, "seconds": round(el, 3),
                "events_per_s": round(self.delivered / el, 1) if el > 0 else 0.0,
                "avg_event_bytes": round(self.bytes / self.produced, 1) if self.produced else 0.0}


@dataclass(frozen=True)
class SimulatorConfig:
    """What to produce and how fast. ``rate <= 0`` means as fast as the broker takes."""

    topic: str = "device-events"
    rate: float = 500.0
    devices: int = 5000
    malformed: float = 0.01
    duration: float | None = None
    count: int | None = None
    partitions: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError("--devices must be at least 1")
        if not 0.0 <= self.malformed <= 1.0:
            raise ValueError("--malformed is a share between 0 and 1")
        if self.count is not None and self.count < 0:
            raise ValueError("--count must not be negative")
        if self.duration is not None and self.duration < 0:
            raise ValueError("--duration must not be negative")


# librdkafka settings tuned for throughput; callers' settings win.

class Simulator:
    """Produces events until ``count`` is reached, ``duration`` elapses or :meth:`stop` is called."""

    def __init__(self, settings: Mapping[str, str], config: SimulatorConfig) -> None:
        self.settings = dict(settings)
        self.config = config
        self.stats = Stats()
        self._stop = threading.Event()
        self._rng = random.Random(config.seed)

    def stop(self) -> None:
        self._stop.set()

    def _malformed_positions(self, batch: int) -> set[int]:
        """Which events of a batch to break: a binomial draw, so the share holds in every batch size."""
        share = self.config.malformed
        if share <= 0:
            return set()
        if share >= 1:
            return set(range(batch))
        rng = self._rng
        return {i for i in range(batch) if rng.random() < share} if batch < 64 else \
            set(rng.sample(range(batch), _binomial(rng, batch, share)))

    def _on_delivery(self, err: object, _msg: object) -> None:
        if err is None:
            self.stats.delivered += 1
        else:
            self.stats.failed += 1
            if self.stats.failed <= 5 or self.stats.failed % 10_000 == 0:
                log.warning("delivery failed (%d so far): %s", self.stats.failed, err)

    def run(self, on_tick: Callable[[Stats], None] | None = None) -> Stats:
        """Produce; returns when done, after every produced event is acknowledged (or timed out)."""
        cfg = self.config
        ensure_topic(self.settings, cfg.topic, partitions=cfg.partitions)
        producer = kafka.producer(self.settings, role="bulk", **{"enable.idempotence": True})
        rng, stats = self._rng, self.stats
        # Pre-rendered pieces: formatting floats and drawing five random numbers per event would cost
        # more than producing it. Prime pool sizes so that the pieces combine in ever new ways.
        keys = [device_id(n).encode() for n in range(1, cfg.devices + 1)]
        tails = [_tail(rng) for _ in range(4099)]
        ends = [_end(rng) for _ in range(1031)]
        n_tails, n_ends = len(tails), len(ends)
        stats.started = time.monotonic()
        deadline = stats.started + cfg.duration if cfg.duration is not None else None
        remaining = cfg.count
        seq = 0
        next_tick = stats.started + 5.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                if remaining is not None and remaining <= 0:
                    break
                if cfg.rate > 0:
                    # Pace by what should have been produced by now: no drift, bursts catch up.
                    due = int((now - stats.started) * cfg.rate) - stats.produced
                    if due <= 0:
                        self._stop.wait(min(0.01, 1.0 / cfg.rate))
                        producer.poll(0)
                        continue
                    batch = min(due, 10_000)
                else:
                    batch = 10_000
                if remaining is not None:
                    batch = min(batch, remaining)
                ts = now_iso()
                devs = rng.choices(keys, k=batch)
                bad_at = self._malformed_positions(batch)
                for i, dev in enumerate(devs):
                    seq += 1
                    if bad_at and i in bad_at:
                        value = make_malformed(dev.decode(), ts, seq, rng)
                    else:
                        value = (f'{{"device_id":"{dev.decode()}","ts":"{ts}"{tails[seq % n_tails]}'
                                 f',"seq":{seq}{ends[seq % n_ends]}').encode()
                    while True:
                        try:
                            producer.produce(cfg.topic, value, dev, on_delivery=self._on_delivery)
                            break
                        except BufferError:
                            producer.poll(0.05)  # local queue full: let the broker catch up
                    stats.bytes += len(value)
                stats.produced += batch
                stats.malformed += len(bad_at)
                if remaining is not None:
                    remaining -= batch
                producer.poll(0)
                if on_tick is not None and now >= next_tick:
                    on_tick(stats)
                    next_tick = now + 5.0
        finally:
            left = producer.flush(30)
            stats.finished = time.monotonic()
            if left:
                stats.failed += left
                log.error("%d events not acknowledged by the broker after 30 s", left)
        return stats


def _binomial(rng: random.Random, n: int, p: float) -> int:
    """A binomial draw by its normal approximation (n >= 64 here), clamped to [0, n]."""
    mean, sd = n * p, (n * p * (1 - p)) ** 0.5
    return max(0, min(n, round(rng.gauss(mean, sd))))


def _parse_x(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise ValueError(f"-X expects key=value, got {v!r}")
        out[k] = val
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo.simulate",
                                description="Produce simulated device events to Kafka.")
    p.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka bootstrap servers")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--topic", default="device-events")
    p.add_argument("--rate", type=float, default=None,
                   help="events per second (default 500; 0 = as fast as the broker takes, the default "
                        "with --count)")
    p.add_argument("--devices", type=int, default=5000, help="number of distinct devices d-1..d-N")
    p.add_argument("--malformed", type=float, default=0.01, help="share of malformed events (0..1)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--count", type=int, default=None, help="stop after this many events")
    p.add_argument("--partitions", type=int, default=1, help="partitions if the topic is created")
    p.add_argument("--seed", type=int, default=None, help="random seed (reproducible streams)")
    p.add_argument("-X", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="extra librdkafka producer setting (repeatable), e.g. -X security.protocol=SSL")
    p.add_argument("--json", action="store_true", help="print the final statistics as one JSON line")
    p.add_argument("--debug", action="store_true", help="tracebacks and debug logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(debug=args.debug)
    try:
        rate = args.rate if args.rate is not None else (0.0 if args.count is not None else 500.0)
        cfg = SimulatorConfig(topic=args.topic, rate=rate, devices=args.devices, malformed=args.malformed,
                              duration=args.duration, count=args.count, partitions=args.partitions,
                              seed=args.seed)
        settings = {"bootstrap.servers": args.bootstrap, **_parse_x(args.extra)}
        sim = Simulator(settings, cfg)
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        sim.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("producing to %s on %s: rate %s, %d devices, %.1f%% malformed", cfg.topic, args.bootstrap,
             f"{cfg.rate:g}/s" if cfg.rate > 0 else "unlimited", cfg.devices, cfg.malformed * 100)
    try:
        stats = sim.run(on_tick=lambda s: log.info("%d events produced, %d acknowledged, %d failed",
                                                   s.produced, s.delivered, s.failed))
    except (RefstreamError, KafkaException) as exc:
        if args.debug:
            raise
        hint = " (is the broker up?)" if isinstance(exc, TransientError | KafkaException) else ""
        print(f"simulate: {exc}{hint}", file=sys.stderr)
        return 1
    summary = stats.as_dict()
    if args.json:
        print(json.dumps(summary), flush=True)
    log.info("done: %s", summary)
    if stats.failed:
        print(f"simulate: {stats.failed} of {stats.produced} events were not acknowledged by the broker",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
