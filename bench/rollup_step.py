"""Rollups: the rollup step's cost per bucket and call with a full correction horizon held (no Spark):
:class:`enrich.state.rollups.RollupProcessor` (through PySpark's ``TwsTester``: state as bytes in
memory, no state store) against folding one whole table of the bucket's windows per call
(:func:`enrich.rollups.engine.advance` over every window held, read and written as Arrow IPC), the
way a bucket's windows were kept before the final ones were kept apart.

    python -m bench.run rollup_step [--devices 80,1600] [--events 60] [--horizon-minutes 60] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql.streaming.tws_tester import TwsTester

from enrich.columns import PACK_KIND, ROWS
from enrich.ipc import to_ipc
from enrich.rollups import engine, partial
from enrich.rollups.packs import partial_kind
from enrich.rollups.spec import RollupSpec
from enrich.state.rollups import RollupProcessor

MIN = 60_000_000
T0 = 29_000_000 * MIN  # minutes since the epoch, early 2025
BUCKET = 7


def spec_of(horizon_min: int) -> RollupSpec:
    """The demo's device_1m: by device, per minute, ``temperature: [count, mean, max, p95]``, ``battery: [last]``."""
    return RollupSpec(name="device_1m", by=("device_id",), by_types=(pa.string(),), window_us=MIN,
                      correct_for_us=horizon_min * MIN,
                      metrics=(("temperature", ("count", "mean", "max", "p95"), pa.float64()),
                               ("battery", ("last",), pa.int64())))


def events(rng: np.random.Generator, devices: int, n: int, at_us: int) -> pa.Table:
    """``n`` events of random devices of the bucket within the minute at ``at_us``."""
    dev = rng.integers(0, devices, n)
    return pa.table({"device_id": pa.array([f"d{i}" for i in dev]),
                     "_ts_us": pa.array(at_us + rng.integers(0, MIN, n), pa.int64()),
                     "_partition": pa.array(np.zeros(n, np.int32)), "_offset": pa.array(np.arange(n), pa.int64()),
                     "temperature": pa.array(rng.normal(30, 5, n)), "battery": pa.array(rng.integers(0, 100, n))})


def held(spec: RollupSpec, rng: np.random.Generator, devices: int, minutes: int) -> pa.Table:
    """A bucket's windows after ``minutes`` minutes of events of every device: the last one open."""
    parts = partial.partials(spec, pa.concat_tables([events(rng, devices, 2 * devices, T0 + m * MIN)
                                                    for m in range(minutes)]))
    return engine.advance(spec, None, parts, T0 + (minutes - 1) * MIN + MIN // 2).state


def cases(spec: RollupSpec, stored: bytes, batch: pa.Table, now: int,
          rounds: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(case, the call on one whole table, the step's call) for a bucket whose windows are ``stored``."""
    watermark = now + MIN // 2
    frame = pd.DataFrame({"_0": [BUCKET], "_1": [pd.Timestamp(0, tz="UTC")],
                          PACK_KIND: [partial_kind(0, 0)], ROWS: [to_ipc(batch)]})

    def one_table(watermark_us: int) -> None:
        state = engine.state_from_ipc(stored, spec)
        engine.state_to_ipc(engine.advance(spec, state, batch, watermark_us).state)

    def tester() -> TwsTester:
        init = pd.DataFrame({"_0": [BUCKET], "_1": ["device_1m"], "_2": [stored]})
        t = TwsTester(RollupProcessor((spec,)), initialStatePandas=[(BUCKET, init)], timeMode="EventTime",
                      eventTimeExtractor=lambda _: 2**62)
        t.setWatermark(watermark // 1000)
        return t

    t = tester()
    # The watermark past the open minute: it goes final, the oldest leaves the horizon (a new tester
    # per round: the state must hold the full horizon each time).
    fresh = [tester() for _ in range(rounds)]
    passed = now + MIN + MIN // 2
    return [("a batch on time", lambda: one_table(watermark), lambda: t.testInPandas(BUCKET, frame)),
            ("a minute passes", lambda: one_table(passed), lambda: fresh.pop().setWatermark(passed // 1000))]


def timed(call: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run rollup_step", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="80,1600", help="devices per bucket, comma-separated (the demo: 80)")
    ap.add_argument("--events", type=int, default=60, help="events per bucket and batch")
    ap.add_argument("--horizon-minutes", type=int, default=60, help="correct_for (the default, state.ttl: 1h)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    spec = spec_of(args.horizon_minutes)
    rng = np.random.default_rng(7)
    now = T0 + args.horizon_minutes * MIN  # the open minute's start
    print(f"{'devices':>8} {'windows held':>12} {'call':>24} {'whole table ms':>15} {'kept apart ms':>14} {'ratio':>6}")
    for devices in (int(d) for d in args.devices.split(",")):
        whole = held(spec, rng, devices, args.horizon_minutes + 1)
        batch = partial.partials(spec, events(rng, devices, args.events, now))
        for name, before, after in cases(spec, engine.state_to_ipc(whole), batch, now, args.rounds):
            b, a = timed(before, args.rounds), timed(after, args.rounds)
            print(f"{devices:>8} {whole.num_rows:>12} {name:>24} {b:>15.1f} {a:>14.1f} {a / b:>6.2f}")
    return 0
