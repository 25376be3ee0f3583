"""What the Kafka output's task does per event without state, piece by piece, no Spark, no broker.

The enrich benchmark's events (``bench.enrich_data.EventMaker``: ~150-byte JSON over ``--devices``
devices) and its ``devices`` join (three columns from a dimension of ``--devices`` rows), as the
task runs them (docs/benchmarks.md, "Enrichment job"): the fast parse
(``enrich.events.FastEvents``), the join (``enrich.joins.join_table``), the output's records and
JSON (``enrich.sinks.kafka.values.RecordMaker``) and the Python lists handed to the producer. Reading
from and producing to Kafka are not in it: confluent-kafka's calls per record, which the plain copy
pays too. Median µs per event over ``--repeat`` rounds of ``--events`` events:

    python -m bench.tools.task_pieces --events 250000 --devices 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa


def main(argv: list[str] | None = None) -> int:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    from bench.enrich_data import JOIN_COLUMNS, EventMaker
    from demo.simulate import device_id, now_iso
    from enrich import events
    from enrich.columns import ERROR, IDENTITY
    from enrich.events import FastEvents
    from enrich.events.fastparse import FastParser
    from enrich.joins import JoinSpec, Lookup, join_table
    from enrich.sinks.kafka.values import RecordMaker

    ap = argparse.ArgumentParser(prog="python -m bench.tools.task_pieces", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=250_000)
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)

    n = a.events
    maker = EventMaker(a.devices)
    ts = now_iso()
    devices = [maker.random_device() for _ in range(n)]
    src = pa.record_batch({
        "_key": pa.array([d.encode() for d in devices], pa.binary()),
        "_value": pa.array([maker.event(d, ts) for d in devices], pa.binary()),
        "_topic": pa.array(["events"] * n), "_partition": pa.array(np.zeros(n, np.int32)),
        "_offset": pa.array(np.arange(n, dtype=np.int64))})
    # bench.enrich_data.EVENT_DDL, spelled out: a DDL string needs a Spark session to parse.
    schema = StructType([StructField("device_id", StringType()), StructField("ts", TimestampType()),
                         StructField("temperature", DoubleType()), StructField("battery", IntegerType()),
                         StructField("seq", LongType()), StructField("rssi", IntegerType()),
                         StructField("firmware", StringType()), StructField("status", StringType())])
    parser = FastParser.for_schema(schema, (), "UTC")
    assert parser is not None
    parsed = StructType([*schema.fields, StructField(ERROR, StringType()),
                         *[StructField(k, t) for k, t in events.SOURCE_TYPES.items()]])
    fast = events.fast_schema(parsed)
    parse = FastEvents(parser, to_arrow_schema(fast, timezone="UTC"))
    ids = np.arange(1, a.devices + 1)
    dim = pa.table({"device_id": [device_id(int(i)) for i in ids], "model_id": [f"m-{i % 50}" for i in ids],
                    "site_id": pa.array(ids % 300, pa.int64()), "owner": [f"owner-{i}" for i in ids]})
    lookup = Lookup(dim, ["device_id"])
    types = {"model_id": StringType(), "site_id": LongType(), "owner": StringType()}
    spec = JoinSpec("devices", (("device_id", "device_id"),), (pa.string(),),
                    tuple((c, c) for c in JOIN_COLUMNS), tuple(to_arrow_schema(StructType(
                        [StructField(c, types[c])])).field(0).type for c in JOIN_COLUMNS),
                    "_devices_matched", False)
    out = {f.name: f for f in [*fast.fields, *[StructField(c, types[c]) for c in JOIN_COLUMNS],
                               StructField("_devices_matched", BooleanType())]}
    values = StructType([out[c] for c in [*schema.names, *JOIN_COLUMNS, "_devices_matched", *IDENTITY]])
    make = RecordMaker(values, ("_devices_matched",), "UTC")

    pieces: dict[str, list[float]] = {"parse": [], "join": [], "records and JSON": [], "producer's lists": []}
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        t = parse(src)
        t1 = time.perf_counter()
        t = join_table(t, spec, lookup, None, ERROR)
        t2 = time.perf_counter()
        rec = make(t)
        t3 = time.perf_counter()
        rec.column("value").to_pylist(), rec.column("key").to_pylist()
        t4 = time.perf_counter()
        for name, secs in zip(pieces, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            pieces[name].append(secs * 1e6 / n)
    print(f"{n:,} events over {a.devices:,} devices, median of {a.repeat} rounds (µs per event):")
    for name, us in pieces.items():
        print(f"  {name:18s} {statistics.median(us):.2f}")
    print(f"  {'total':18s} {sum(statistics.median(us) for us in pieces.values()):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
