"""Waiting for completeness (``joins[].wait``): the state step's cost per bucket and batch of
deciding and storing its held events (no Spark): the held rows read from their stored bytes, this
batch's events admitted, :func:`enrich.state.wait.split` and the held rows stored again, as
``enrich.state.processor`` does when the held set changed.

    python -m bench.run wait [--held 0,10000,100000] [--fresh 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import numpy as np
import pyarrow as pa

from enrich.columns import TS_US
from enrich.ipc import from_ipc, to_ipc
from enrich.state import wait

T0_US = 1_767_225_600 * 10**6


def events(n: int, first: int, rng: np.random.Generator) -> pa.Table:
    """``n`` events of a typical shape: key, time, two values, Kafka position."""
    return pa.table({"device_id": pa.array(rng.integers(0, 50_000, n)).cast(pa.string()),
                     "temperature": rng.normal(20, 5, n), "battery": rng.integers(0, 100, n).astype(np.int32),
                     "_partition": np.zeros(n, np.int32), "_offset": np.arange(first, first + n, dtype=np.int64),
                     TS_US: T0_US + rng.integers(0, 600 * 10**6, n)})


def one(held: int, fresh: int, rng: np.random.Generator) -> float:
    """Seconds of one bucket's call: ``held`` rows waiting (none complete), ``fresh`` new events of
    which half are complete; the held set changes, so it is stored again."""
    spec = wait.WaitSpec.of({"d": timedelta(minutes=15)})
    facts = wait.BatchFacts(T0_US // 1000 + 60_000, {"d": T0_US + 300 * 10**6})
    stored = to_ipc(wait.admit(events(held, 0, rng).set_column(5, TS_US, pa.array(
        np.full(held, T0_US + 900 * 10**6))), facts)) if held else None
    new = events(fresh, held, rng)
    t0 = time.perf_counter()
    parts = [wait.admit(new, facts)]
    if stored is not None:
        parts.insert(0, from_ipc(stored))
    split = wait.split(spec, facts, pa.concat_tables(parts), TS_US)
    to_ipc(split.held)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run wait", description=__doc__.splitlines()[0])
    ap.add_argument("--held", default="0,10000,100000", help="held rows per bucket, comma-separated")
    ap.add_argument("--fresh", type=int, default=1000, help="events per bucket and batch")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    print(f"{'held rows':>10} {'fresh':>7} {'ms per bucket call (median)':>28}")
    for held in (int(h) for h in args.held.split(",")):
        times = [one(held, args.fresh, rng) for _ in range(args.rounds)]
        print(f"{held:>10,} {args.fresh:>7,} {statistics.median(times) * 1000:>28.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
