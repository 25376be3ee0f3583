"""What one operation on Spark's state store costs from a ``transformWithStateInPandas`` processor.

The question it answers: can a dimension of millions of rows live in the keyed state one row per
key (``MapState``, one state call per lookup or update), or must rows travel in blobs (one
``ValueState`` value holding many rows as Arrow IPC bytes)? Each round runs one available-now query
over ``--keys`` keys in ``--groups`` grouping keys, on the RocksDB state store, and times inside
the processor (so Spark's planning and the shuffle are not counted):

- ``map update`` / ``map get``: ``MapState.updateValue`` / ``getValue``, once per key;
- ``map iterate``: reading every entry back through ``MapState.iterator()``;
- ``blob update`` / ``blob get``: one ``ValueState`` value per grouping key holding all of its keys'
  rows as Arrow IPC bytes, written then read (and decoded) once.

    python -m bench.run state_ops --keys 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
OPS = ("map update", "map get", "map iterate", "blob update", "blob get")


def _processor() -> Any:
    import pandas as pd
    import pyarrow as pa
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    class Ops(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            key = StructType([StructField("k", StringType())])
            self.map = handle.getMapState("rows", key, StructType([StructField("v", StringType())]))
            self.blob = handle.getValueState("blob", StructType([StructField("b", BinaryType())]))

        def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: Any) -> Iterator[pd.DataFrame]:
            keys = pd.concat(list(rows))["k"].tolist()
            values = [k + "-" + "x" * 40 for k in keys]
            t: dict[str, float] = {}
            start = time.perf_counter()
            for k, v in zip(keys, values, strict=True):
                self.map.updateValue((k,), (v,))
            t["map update"] = time.perf_counter() - start
            start = time.perf_counter()
            found = sum(self.map.getValue((k,)) is not None for k in keys)
            t["map get"] = time.perf_counter() - start
            start = time.perf_counter()
            iterated = sum(1 for _ in self.map.iterator())
            t["map iterate"] = time.perf_counter() - start
            assert found == iterated == len(keys), (found, iterated, len(keys))
            table = pa.table({"k": keys, "v": values})
            start = time.perf_counter()
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            self.blob.update((sink.getvalue().to_pybytes(),))
            t["blob update"] = time.perf_counter() - start
            start = time.perf_counter()
            stored = self.blob.get()
            assert stored is not None
            back = pa.ipc.open_stream(stored[0]).read_all()
            t["blob get"] = time.perf_counter() - start
            assert back.num_rows == len(keys)
            yield pd.DataFrame({"group": [int(key[0])], "n": [len(keys)], **{op: [t[op]] for op in OPS}})

        def close(self) -> None:
            pass

    return Ops()


def one_round(spark: Any, work: Path, keys: int, groups: int) -> dict[str, float]:
    """Microseconds per key of every operation, summed over the groups."""
    from pyspark.sql import functions as F

    src, ck = work / "in", work / "ck"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(ck, ignore_errors=True)
    (spark.range(keys).select((F.col("id") % groups).alias("g"), F.concat(F.lit("d-"), F.col("id").cast("string"))
                              .alias("k")).write.parquet(str(src)))
    stream = spark.readStream.schema("g long, k string").parquet(str(src))
    schema = "group long, n long, " + ", ".join(f"`{op}` double" for op in OPS)
    out = stream.groupBy("g").transformWithStateInPandas(_processor(), outputStructType=schema, outputMode="Append",
                                                         timeMode="None")
    name = f"ops_{time.monotonic_ns()}"
    q = (out.writeStream.format("memory").queryName(name).option("checkpointLocation", str(ck))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    rows = spark.sql(f"select * from {name}").collect()
    total = sum(r["n"] for r in rows)
    assert total == keys, (total, keys)
    return {op: sum(r[op] for r in rows) / total * 1e6 for op in OPS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.run state_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--groups", type=int, default=2, help="grouping keys (one Python call each)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("refstream-bench-state-ops")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", str(args.groups))
             .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="refstream-state-ops-") as tmp:
        for i in range(args.repeat):
            rounds.append(one_round(spark, Path(tmp) / str(i), args.keys, args.groups))
    load = os.getloadavg()
    print(f"{args.keys:,} keys in {args.groups} groups, {args.master}, RocksDB; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| operation | us per key, median | rounds |")
    print("|---|---:|---|")
    for op in OPS:
        values = [r[op] for r in rounds]
        print(f"| {op} | {statistics.median(values):.2f} | {' / '.join(f'{v:.2f}' for v in values)} |")
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
