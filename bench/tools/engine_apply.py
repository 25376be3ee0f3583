"""What one call of the state engine costs: ``enrich.state.engine.apply`` on one bucket, no Spark.

The shape of the stateful benchmark's calls (``bench.enrich_bench --job-with-state``: 1M devices in
64 buckets, batches of 250,000 events): a bucket of ``--devices`` devices in state and ``--events``
events of random devices of the bucket, with the benchmark's aggregates (temperature: last, min,
max, mean; battery: last). The state is built by ``--warm`` earlier batches; each round times
``--calls`` calls on the same state and events and reports the median round.

    python -m bench.tools.engine_apply --devices 15600 --events 3900 --repeat 5

To compare two versions of the engine, run it from a snapshot of each (``git archive``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

HOUR_US = 3_600_000_000
T0_US = 1_700_000_000_000_000


def main(argv: list[str] | None = None) -> int:
    from enrich.state import engine
    from enrich.state.engine import StateSpec

    ap = argparse.ArgumentParser(prog="python -m bench.tools.engine_apply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=15_600, help="devices of the bucket (default %(default)s)")
    ap.add_argument("--events", type=int, default=3_900, help="events of the timed batch (default %(default)s)")
    ap.add_argument("--warm", type=int, default=4, help="batches of 2 x --events building the state first")
    ap.add_argument("--calls", type=int, default=50, help="calls per round (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (default %(default)s)")
    args = ap.parse_args(argv)

    spec = StateSpec(key="device_id", key_type=pa.string(), timestamp="_ts_us", ttl_us=HOUR_US,
                     aggregates=(("temperature", ("last", "min", "max", "mean"), pa.float64()),
                                 ("battery", ("last",), pa.float64())), timestamp_type=pa.int64())
    rng = np.random.default_rng(1)
    ids = np.array([f"device-{i:08d}" for i in range(args.devices)], dtype=object)

    def batch(n: int, t0: int) -> pa.Table:
        d = rng.integers(0, args.devices, n)
        return pa.table({"device_id": pa.array(ids[d]),
                         "_ts_us": pa.array(t0 + np.sort(rng.integers(0, 10_000_000, n)), pa.int64()),
                         "_partition": pa.array(np.zeros(n, np.int32)), "_offset": pa.array(np.arange(n, dtype=np.int64)),
                         "temperature": pa.array(rng.normal(20, 5, n)), "battery": pa.array(rng.uniform(0, 100, n))})

    state = spec.empty()
    for i in range(args.warm):
        state = engine.apply(spec, state, batch(2 * args.events, T0_US + i * 10_000_000), None).state
    events = batch(args.events, T0_US + (args.warm + 1) * 10_000_000)
    rounds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        for _ in range(args.calls):
            engine.apply(spec, state, events, T0_US)
        rounds.append((time.perf_counter() - start) / args.calls * 1000)
    print(f"engine.apply: {state.num_rows:,} devices in state, {args.events:,} events: "
          f"median {statistics.median(rounds):.2f} ms per call (rounds: {', '.join(f'{r:.2f}' for r in rounds)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
