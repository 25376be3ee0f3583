"""Encoding change rows to the contract's JSON: candidates side by side in one run.

    python -m bench.encode_bench --rows 1000000 --repeat 3
    python -m bench.run encode --rows 1000000 --repeat 3

Two tables: ``devices`` (the refresher benchmark's 10 columns, typed as the MariaDB reader types them) and
``every_type`` (a column of each type the contract knows, with nulls, NaN, unicode and escapes). Each
candidate produces the key and value bytes of every row; the figure is the median wall time of
``--repeat`` rounds, and every candidate's bytes are compared with today's row-wise encoder's (a
candidate that differs is reported as such: it could not be used).

    rowwise        contract.encode_key/encode_row over to_pylist() (the encoder before the bulk one)
    orjson_rows    orjson.dumps per row dict, columns pre-converted to text in Arrow, floats outside
                   [1e-4, 1e16) as orjson.Fragment(repr)
    msgspec_rows   msgspec.json.encode per row dict, the same pre-conversion (msgspec.Raw for floats)
    arrow_repr     refstream.encode with floats formatted by repr() value by value (pure Arrow + stdlib)
    bulk           refstream.encode as shipped: Arrow kernels, floats via orjson's numpy serialiser
    bulk_messages  bulk plus building the Message objects that upsert_messages yields
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from refstream import contract, encode

Encoded = tuple[list[bytes], list[bytes]]

# The producer of --produce has no broker on purpose: its connection errors are expected.
_QUIET = logging.getLogger("bench.encode_bench.kafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def devices(n: int, seed: int = 7) -> pa.Table:
    """The refresher benchmark's table as the MariaDB reader returns it."""
    from bench.refresh_data import generate

    t = generate(1, n, np.random.default_rng(seed))
    return pa.table({
        "id": t["id"], "name": t["name"], "price": pc.cast(t["price"], pa.decimal128(12, 2)),
        "updated_at": pc.cast(t["updated_at"], pa.timestamp("us")), "born": t["born"], "score": t["score"],
        "active": pc.cast(t["active"], pa.int64()), "notes": t["notes"], "qty": pc.cast(t["qty"], pa.int64()),
        "category": t["category"],
    })


def every_type(n: int, seed: int = 11) -> pa.Table:
    """One column of each contract type, realistic values with nulls and edge cases mixed in."""
    rng = np.random.default_rng(seed)
    nulls = rng.random(n) < 0.1
    floats = rng.normal(0, 1e3, n)
    floats[rng.random(n) < 0.01] = np.nan
    floats[rng.random(n) < 0.01] = 1e-7  # Python writes it 1e-07: the per-value path
    texts = pa.array(['plain', 'quote " \\ back', 'tab\tnew\nline', 'ünï ✓ 漢字 😀', 'ctl \x01'])
    pick = pa.array(rng.integers(0, len(texts), n))
    micros = rng.integers(0, 5 * 365 * 86_400_000_000, n) + 1_577_836_800_000_000
    return pa.table({
        "id": pa.array(np.arange(n)),
        "ok": pa.array(rng.random(n) < 0.5, mask=nulls),
        "n": pa.array(rng.integers(-10**12, 10**12, n), mask=nulls),
        "f": pa.array(floats, mask=nulls),
        "dec": pc.cast(pc.divide(pa.array(rng.integers(-10**9, 10**9, n)).cast(pa.decimal128(20, 0)),
                                 pa.scalar(Decimal("100"), pa.decimal128(3, 0))), pa.decimal128(20, 2)),
        "s": texts.take(pick),
        "raw": pa.array([None if m else bytes([i % 256, 7]) for i, m in enumerate(nulls)], pa.binary()),
        "day": pa.array(rng.integers(0, 20_000, n).astype(np.int32), pa.date32()),
        "ts": pa.array(micros, pa.timestamp("us"), mask=nulls),
        "tz": pa.array(micros, pa.timestamp("us", tz="UTC")),
        "dur": pa.array(rng.integers(-838 * 3_600_000_000, 838 * 3_600_000_000, n), pa.duration("us")),
        "tod": pa.array(rng.integers(0, 86_400_000_000, n), pa.time64("us")),
    })


# ------------------------------------------------------------------------------------------ candidates

def rowwise(t: pa.Table, key: list[str]) -> Encoded:
    keys, values = [], []
    for b in t.to_batches(max_chunksize=10_000):
        for row in b.to_pylist():
            keys.append(contract.encode_key(key, row))
            values.append(contract.encode_row(row))
    return keys, values


def _preconverted(b: pa.RecordBatch, raw: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Rows whose non-JSON values were turned into text in Arrow, floats into raw JSON where needed."""
    cols: dict[str, list[Any]] = {}
    for name, arr in zip(b.schema.names, b.columns, strict=True):
        t = arr.type
        if pa.types.is_floating(t):
            cols[name] = [None if v is None else (v if (v == 0 or 1e-4 <= abs(v) < 1e16) else
                                                  raw(encode._float_text(v))) for v in arr.to_pylist()]
        elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_string(t):
            cols[name] = arr.to_pylist()
        else:  # decimal, dates, times, binary: the bulk encoder's fragments, raw
            cols[name] = [raw(f) for f in encode.fragments(arr).to_pylist()]
    names = list(cols)
    return [dict(zip(names, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


def orjson_rows(t: pa.Table, key: list[str]) -> Encoded:
    import orjson

    keys, values = [], []
    for b in t.to_batches(max_chunksize=65_536):
        for row in _preconverted(b, orjson.Fragment):
            keys.append(orjson.dumps({k: row[k] for k in key}))
            values.append(orjson.dumps(row))
    return keys, values


def msgspec_rows(t: pa.Table, key: list[str]) -> Encoded:
    import msgspec

    enc = msgspec.json.Encoder()
    keys, values = [], []
    for b in t.to_batches(max_chunksize=65_536):
        for row in _preconverted(b, lambda s: msgspec.Raw(s.encode())):
            keys.append(enc.encode({k: row[k] for k in key}))
            values.append(enc.encode(row))
    return keys, values


def _bulk(t: pa.Table, key: list[str]) -> Encoded:
    keys, values = [], []
    for k, v in encode.encode_batches(t, key):
        keys += k
        values += v or []
    return keys, values


def arrow_repr(t: pa.Table, key: list[str]) -> Encoded:
    real = encode._float_fragments

    def repr_floats(arr: pa.Array) -> pa.Array:
        vals = pc.cast(arr, pa.float64()).to_pylist()
        return pa.array([encode._float_text(v) for v in vals], pa.large_string())

    encode._float_fragments = repr_floats  # type: ignore[assignment]
    try:
        return _bulk(t, key)
    finally:
        encode._float_fragments = real  # type: ignore[assignment]


def bulk_messages(t: pa.Table, key: list[str]) -> Encoded:
    schema = contract.DatasetSchema.from_arrow("bench", key, t.schema)
    keys, values = [], []
    for m in contract.upsert_messages(schema, t, 1):
        keys.append(m.key)
        values.append(m.value or b"")
    return keys, values


CANDIDATES: dict[str, Callable[[pa.Table, list[str]], Encoded]] = {
    "rowwise": rowwise, "orjson_rows": orjson_rows, "msgspec_rows": msgspec_rows,
    "arrow_repr": arrow_repr, "bulk": _bulk, "bulk_messages": bulk_messages,
}


# ---------------------------------------------------------------------------------------------- run

def _digest(out: Encoded) -> bytes:
    h = hashlib.blake2b()
    for part in out:
        for b in part:
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.digest()


def measure(table: pa.Table, key: list[str], names: list[str], repeat: int) -> Iterator[dict[str, Any]]:
    """Each candidate ``repeat`` times; only a digest of the bytes outlives a round, so no round runs with
    another's millions of objects alive."""
    reference = None if names[0] == "rowwise" else _digest(rowwise(table, key))
    for name in names:
        fn = CANDIDATES[name]
        times, digests = [], set()
        try:
            for _ in range(repeat):
                gc.collect()
                t0 = time.perf_counter()
                out = fn(table, key)
                times.append(time.perf_counter() - t0)
                digests.add(_digest(out))
                del out
        except ModuleNotFoundError as exc:  # msgspec is not a dependency: `pip install msgspec` to compare
            print(f"  {name:<14} skipped: {exc}")
            continue
        if reference is None:
            reference = next(iter(digests))
        med = statistics.median(times)
        yield {"candidate": name, "median_s": round(med, 3), "us_per_row": round(med / table.num_rows * 1e6, 2),
               "rounds": [round(x, 3) for x in times], "identical": digests == {reference}}


def produce_cost(table: pa.Table, repeat: int) -> dict[str, Any]:
    """Python-side cost of handing the table's upserts to the refresher's producer (Message objects and
    ``produce()`` with the contract's headers and a delivery callback, as refresh.publish does), with no
    broker: every message stays queued, so librdkafka's network work is not in it."""
    from refstream import kafka

    schema = contract.DatasetSchema.from_arrow("bench", [table.column_names[0]], table.schema)
    overrides = {"queue.buffering.max.messages": 10_000_000, "queue.buffering.max.kbytes": 2**31 - 1,
                 "message.timeout.ms": 600_000}
    times = []
    for _ in range(repeat):
        p = kafka.producer({"bootstrap.servers": "127.0.0.1:9"}, role="publisher", logger=_QUIET, **overrides)
        gc.collect()
        t0 = time.perf_counter()
        for m in contract.upsert_messages(schema, table, 1):
            p.produce("bench", key=m.key, value=m.value, headers=m.headers, on_delivery=lambda err, msg: None)
        times.append(time.perf_counter() - t0)
        p.purge()
        p.poll(0)
        del p
    med = statistics.median(times)
    return {"candidate": "encode+produce", "median_s": round(med, 3),
            "us_per_row": round(med / table.num_rows * 1e6, 2), "rounds": [round(x, 3) for x in times],
            "identical": True}


def _print(r: dict[str, Any]) -> None:
    print(f"  {r['candidate']:<14} {r['median_s']:>9.3f} {r['us_per_row']:>7.2f}  "
          f"{'yes' if r['identical'] else 'NO':<9}  {r['rounds']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.encode_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds per candidate (the median is reported)")
    ap.add_argument("--tables", default="devices,every_type")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--produce", action="store_true",
                    help="also time encoding + producer.produce() of every row with no broker (queued only)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    names = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in names if c not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidate(s) {unknown}; known: {list(CANDIDATES)}")
    results = []
    for tname in args.tables.split(","):
        table = {"devices": devices, "every_type": every_type}[tname](args.rows)
        print(f"\n{tname}: {table.num_rows} rows, {table.num_columns} columns, "
              f"{table.nbytes / 1e6:.0f} MB in Arrow (median of {args.repeat} rounds)")
        print(f"  {'candidate':<14} {'median s':>9} {'µs/row':>7}  identical  rounds")
        for r in measure(table, [table.column_names[0]], names, args.repeat):
            r["table"] = tname
            results.append(r)
            _print(r)
        if args.produce:
            r = {**produce_cost(table, args.repeat), "table": tname}
            results.append(r)
            _print(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["identical"] for r in results if r["candidate"] != "rowwise") else 1


if __name__ == "__main__":
    raise SystemExit(main())
