"""What an as-of dimension costs a Python worker in memory, per million versions kept.

For each ``--versions`` count, a fresh process builds the versions table (``--keys-per`` versions
per key, string ids, one string and one float column, as ``bench.asof_bench``) and its
``AsOfLookup``, and reports its RSS growth split into the Arrow table and the index (numpy arrays
and the key hash table), against a latest-version ``Lookup`` of the same keys.

    python -m bench.tools.asof_memory --versions 1000000 3000000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys


def rss() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(versions: int, per_key: int) -> dict[str, float]:
    import numpy as np

    from bench.asof_bench import dimension
    from enrich.joins import AsOfLookup, Lookup

    rng = np.random.default_rng(5)
    latest, table = dimension(versions // per_key, per_key, rng)
    gc.collect()
    r0 = rss()
    lookup = AsOfLookup(table, ["id"])
    gc.collect()
    r1 = rss()
    plain = Lookup(latest, ["id"])
    gc.collect()
    r2 = rss()
    v = lookup.versions
    arrays = sum(a.nbytes for a in (v.order, v.valid_from, v.sorted_times, v.starts, v.counts))
    del plain
    return {"versions": table.num_rows, "table": table.nbytes, "as_of_index_rss": r1 - r0, "index_arrays": arrays,
            "latest_table": latest.nbytes, "latest_index_rss": r2 - r1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.asof_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, nargs="+", default=[1_000_000, 3_000_000])
    ap.add_argument("--keys-per", type=int, default=3, help="versions per key (default %(default)s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.versions[0], args.keys_per)))
        return 0
    for n in args.versions:
        out = subprocess.run([sys.executable, "-m", "bench.tools.asof_memory", "--child", "--versions", str(n),
                              "--keys-per", str(args.keys_per)], check=True, capture_output=True, text=True)
        got = json.loads(out.stdout)
        m = got["versions"] / 1e6
        print(f"{got['versions']:,} versions ({args.keys_per} per key): table {got['table'] / m / 2**20:.0f} MB, "
              f"as-of index {got['as_of_index_rss'] / m / 2**20:.0f} MB (numpy arrays {got['index_arrays'] / m / 2**20:.0f}"
              f" MB) per million versions; the latest rows' table {got['latest_table'] / 2**20:.0f} MB and index "
              f"{got['latest_index_rss'] / 2**20:.0f} MB in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
