"""Diff engines compared on the same two snapshots in memory: pyarrow (``refresh.diff``), polars, duckdb.

    .venv/bin/python -m bench.refresh_engines [--rows 1000000] [--repeat 5]

The old snapshot is the benchmark table's 10 columns (:func:`bench.refresh_data.generate`, in the
types the SQL source reads them as); the new one changes 1% of it (80% updates, 10% inserts, 10%
deletes). Each engine computes the upsert rows and the deleted keys; all must agree. polars and
duckdb are not dependencies of the project: an engine that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.refresh_data import generate
from refresh.diff import diff, normalize

Result = tuple[int, int]


def tables(rows: int, seed: int = 7) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(seed)
    old = generate(1, rows, rng)
    old = normalize(old.set_column(2, "price", pc.cast(old.column("price"), pa.decimal128(12, 2))))
    n = max(10, rows // 100)
    picked = rng.choice(rows, int(n * 0.9), replace=False)
    upd, dele = np.sort(picked[: int(n * 0.8)]), picked[int(n * 0.8):]
    keep = np.ones(rows, bool)
    keep[dele] = False
    changed = np.zeros(rows, bool)
    changed[upd] = True
    mask = pa.array(changed)
    qty = pc.if_else(mask, pc.add(pc.fill_null(old.column("qty"), 0), 1), old.column("qty"))
    new = old.set_column(old.schema.get_field_index("qty"), "qty", qty)
    new = new.filter(pa.array(keep))
    inserts = normalize(generate(rows + 1, n - len(picked), rng))
    inserts = inserts.set_column(2, "price", pc.cast(inserts.column("price"), pa.decimal128(12, 2)))
    return old, pa.concat_tables([new, inserts.cast(new.schema)])


def run_pyarrow(old: pa.Table, new: pa.Table) -> Result:
    cs = diff("bench", old, new, ["id"])
    return cs.upserts.num_rows, cs.deletes.num_rows


def run_polars(old: pa.Table, new: pa.Table) -> Result:
    import polars as pl

    values = [c for c in new.column_names if c != "id"]
    o, n = pl.from_arrow(old), pl.from_arrow(new)
    j = n.join(o, on="id", how="full", suffix="_old", coalesce=False)
    inserted = j.filter(pl.col("id_old").is_null())
    deleted = j.filter(pl.col("id").is_null())
    matched = j.filter(pl.col("id").is_not_null() & pl.col("id_old").is_not_null())
    updated = matched.filter(pl.any_horizontal([pl.col(c).ne_missing(pl.col(c + "_old")) for c in values]))
    upserts = pl.concat([inserted.select(new.column_names), updated.select(new.column_names)]).to_arrow()
    return upserts.num_rows, deleted.height


def run_duckdb(old: pa.Table, new: pa.Table) -> Result:
    import duckdb

    values = [c for c in new.column_names if c != "id"]
    con = duckdb.connect()
    con.register("o", old)
    con.register("n", new)
    differs = " OR ".join(f"n.{c} IS DISTINCT FROM o.{c}" for c in values)
    upserts = con.sql(f"SELECT n.* FROM n LEFT JOIN o USING (id) WHERE o.id IS NULL OR {differs}").to_arrow_table()
    deleted = con.sql("SELECT o.id FROM o ANTI JOIN n USING (id)").to_arrow_table()
    con.close()
    return upserts.num_rows, deleted.num_rows


ENGINES: dict[str, Callable[[pa.Table, pa.Table], Result]] = {
    "pyarrow": run_pyarrow, "polars": run_polars, "duckdb": run_duckdb}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.refresh_engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    old, new = tables(args.rows)
    print(f"old {old.num_rows:,} rows, new {new.num_rows:,} rows; median of {args.repeat}")
    expected: Result | None = None
    for name, fn in ENGINES.items():
        if name != "pyarrow" and importlib.util.find_spec(name) is None:
            print(f"{name:8} not installed: skipped")
            continue
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            got = fn(old, new)
            times.append(time.perf_counter() - t0)
            if expected is None:
                expected = got
            if got != expected:
                raise SystemExit(f"{name}: {got} (upserts, deletes), expected {expected}")
        print(f"{name:8} {statistics.median(times):.3f} s (min {min(times):.3f} s); upserts, deletes = {got}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
