"""As-of lookup against the latest-version lookup, per event, on the executor side (no Spark).

A dimension of ``--rows`` keys (string ids, one string and one float column) is joined with batches
of ``--events`` events of random keys and times, the way a join pass task does
(``enrich.joins.join_table``): once against the latest rows (``Lookup``), once as of the events' times
against ``--versions`` versions per key (``AsOfLookup``, the versions spread over a day); both with
the newest ``--overlay`` fraction of the changes in an overlay, as between two compactions. Each round times
``--batches`` batches; the median round is reported, and the one-off cost of building each index.

    python -m bench.run asof --rows 1000000 --versions 3 --events 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa

DAY_US = 86_400_000_000
T0_US = 1_767_225_600_000_000  # 2026-01-01


def dimension(rows: int, versions: int, rng: np.random.Generator) -> tuple[pa.Table, pa.Table]:
    """The latest rows, and every version of every key (in changelog order: by time)."""
    from enrich.columns import DELETED, VALID_FROM

    ids = np.array([f"device-{i:08d}" for i in range(rows)], dtype=object)
    latest = pa.table({"id": pa.array(ids), "owner": pa.array(np.char.add("o", np.arange(rows).astype(str))),
                       "limit": pa.array(rng.random(rows))})
    keys = np.tile(ids, versions)
    times = T0_US + np.sort(rng.integers(0, DAY_US, rows * versions))
    order = np.argsort(times, kind="stable")
    all_versions = pa.table({
        "id": pa.array(keys[order]), "owner": pa.array(np.char.add("o", np.arange(rows * versions).astype(str))),
        "limit": pa.array(rng.random(rows * versions)), VALID_FROM: pa.array(times, pa.int64()),
        DELETED: pa.array(np.zeros(rows * versions, dtype=bool))})
    return latest, all_versions


def main(argv: list[str] | None = None) -> int:
    from enrich.columns import VALID_FROM
    from enrich.joins import AsOfLookup, JoinSpec, Lookup, join_table

    ap = argparse.ArgumentParser(prog="python -m bench.run asof", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="keys of the dimension (default %(default)s)")
    ap.add_argument("--versions", type=int, default=3, help="versions per key (default %(default)s)")
    ap.add_argument("--events", type=int, default=100_000, help="events per batch (default %(default)s)")
    ap.add_argument("--batches", type=int, default=5, help="batches per round (default %(default)s)")
    ap.add_argument("--overlay", type=float, default=0.01, help="share of versions in the overlay (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (default %(default)s)")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(3)
    latest, versions = dimension(args.rows, args.versions, rng)
    cut = int(versions.num_rows * (1 - args.overlay))
    # The latest-version join between two compactions too: the newest changes in an overlay.
    newest = versions.slice(cut).to_pandas().drop_duplicates("id", keep="last")
    changes = pa.Table.from_pandas(newest.drop(columns=[VALID_FROM]), preserve_index=False)
    t = time.perf_counter()
    plain, plain_overlay = Lookup(latest, ["id"]), Lookup(changes, ["id"])
    build_latest = time.perf_counter() - t
    t = time.perf_counter()
    base, overlay = AsOfLookup(versions.slice(0, cut), ["id"]), AsOfLookup(versions.slice(cut), ["id"])
    build_as_of = time.perf_counter() - t

    common = {"dataset": "devices", "pairs": (("device_id", "id"),), "key_types": (pa.string(),),
              "columns": (("owner", "owner"), ("limit", "limit")), "out_types": (pa.string(), pa.float64()),
              "matched": "_devices_matched", "inner": False}
    spec_latest, spec_as_of = JoinSpec(**common), JoinSpec(**common, time="ts")  # type: ignore[arg-type]
    ids = latest.column("id").to_numpy(zero_copy_only=False)
    batches = []
    for _ in range(args.batches):
        k = rng.integers(0, args.rows, args.events)
        batches.append(pa.table({"device_id": pa.array(ids[k]),
                                 "ts": pa.array(T0_US + rng.integers(-DAY_US // 10, DAY_US + DAY_US // 10, args.events),
                                                pa.timestamp("us", tz="UTC"))}))

    def round_of(fn: object) -> float:
        t0 = time.perf_counter()
        for b in batches:
            fn(b)  # type: ignore[operator]
        return (time.perf_counter() - t0) / (args.batches * args.events)

    rounds: dict[str, list[float]] = {"latest": [], "as of": []}
    for _ in range(args.repeat):
        rounds["latest"].append(round_of(lambda b: join_table(b, spec_latest, plain, plain_overlay)))
        rounds["as of"].append(round_of(lambda b: join_table(b, spec_as_of, base, overlay)))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"dimension: {args.rows:,} keys, {versions.num_rows:,} versions ({args.overlay:.0%} in the overlay); "
          f"batches of {args.events:,} events; median of {args.repeat} rounds of {args.batches} batches")
    print(f"  index build: latest {build_latest:.2f}s, as of {build_as_of:.2f}s (once per shipped version)")
    for k, v in med.items():
        print(f"  {k:<7} {v * 1e6:.3f} us/event  ({1 / v:,.0f} events/s)")
    print(f"  as of / latest: {med['as of'] / med['latest']:.2f}x per event")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
