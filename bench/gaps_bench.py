"""Gaps (``gaps:``): the state step's cost per bucket and batch of judging its devices' silences (no
Spark): a bucket's gap table read from its stored bytes, :func:`enrich.gaps.engine.advance` with a
batch of events (or a tick: none), and the table stored again, as ``enrich.state.processor`` does.

    python -m bench.run gaps [--devices 2000,20000] [--events 1000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

from enrich.gaps.engine import EVERY, KEY, PARTITION, TS, GapSpec, advance
from enrich.ipc import from_ipc, to_ipc

S = 1_000_000
T0_US = 1_767_225_600 * S
SPEC = GapSpec(key="device_id", key_type=pa.string(), after=3.0, refs=(("site", pa.string()),), ttl_us=3600 * S)


def events(devices: np.ndarray, at_s: int) -> pa.Table:
    """One event per device, a second apart at most, four partitions, 30 s interval."""
    n = len(devices)
    return pa.table({KEY: pa.array([f"d{i}" for i in devices]), TS: T0_US + at_s * S + np.arange(n, dtype=np.int64),
                     PARTITION: (devices % 4).astype(np.int32), EVERY: np.full(n, 30 * S, np.int64),
                     "site": pa.array([f"s{i % 50}" for i in devices])})


def one(stored: bytes, batch: pa.Table, times: dict[int, int]) -> tuple[float, int]:
    """Seconds of one call and the records it wrote."""
    t0 = time.perf_counter()
    got = advance(SPEC, from_ipc(stored), None, batch, times, None)
    to_ipc(got.table)
    return time.perf_counter() - t0, got.records.num_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run gaps", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="2000,20000", help="devices per bucket, comma-separated")
    ap.add_argument("--events", type=int, default=1000, help="events per bucket and batch")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    print(f"{'devices':>8} {'call':>28} {'ms (median)':>12} {'records':>8}")
    for n in (int(d) for d in args.devices.split(",")):
        stored = to_ipc(advance(SPEC, None, None, events(np.arange(n), 0), {}, None).table)
        cases = [
            ("a batch of events, no gap", lambda n=n: (events(rng.choice(n, min(args.events, n), replace=False), 10),
                                                       {p: T0_US + 10 * S for p in range(4)})),
            ("a tick, nothing due", lambda: (events(np.arange(0), 0), {p: T0_US + 40 * S for p in range(4)})),
            ("a tick opening every gap", lambda: (events(np.arange(0), 0), {p: T0_US + 400 * S for p in range(4)})),
        ]
        for name, make in cases:
            runs = [one(stored, *make()) for _ in range(args.rounds)]
            print(f"{n:>8} {name:>28} {1000 * statistics.median(t for t, _ in runs):>12.1f} {runs[0][1]:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
