"""Diagnostic tools for the benchmarks: they explain a figure, they do not produce one of
docs/benchmarks.md. Each runs as ``python -m bench.tools.<name> --help``.

- ``pyspy``: py-spy samplers of a Spark job's Python processes (``bench.enrich_bench --py-spy``),
  and a summary of a sampled file by phase.
- ``jfr``: a Java Flight Recorder recording of a Spark JVM summarised by phase (Arrow hand-offs,
  Python I/O, shuffle, state store, generated code) and innermost frames.
- ``eventlog``: a Spark event log cut into each micro-batch's stages: wall time, task time, JVM CPU,
  shuffle.
- ``state_profile``: the state step alone (Parquet in, ``noop`` out) against the same parse without
  it, optionally under py-spy.
- ``engine_apply``: one call of the state engine's ``apply`` on one bucket, no Spark.
- ``dimension_bootstrap``: the driver's bootstrap of a broadcast dimension, step by step (run it
  under ``py-spy record``).
- ``task_pieces``: what the Kafka output's task does per event without state (parse, join, JSON),
  piece by piece, no Spark.
- ``asof_memory``: an as-of dimension's versions and index in a Python worker, per million versions.
"""
