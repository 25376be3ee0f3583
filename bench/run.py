"""Benchmark entry point (``make bench ARGS="refresh --rows 1000000"``).

    python -m bench.run refresh [options of bench.refresh_bench]
    python -m bench.run readers [options of bench.refresh_readers]
    python -m bench.run encode  [options of bench.encode_bench]
    python -m bench.run enrich  [options of bench.enrich_bench]
    python -m bench.run kafka_io [options of bench.kafka_io]
    python -m bench.run cluster_cpu [options of bench.enrich_cluster_cpu]
    python -m bench.run partitioned [options of bench.partitioned_bench]
    python -m bench.run state_ops [options of bench.state_ops]
    python -m bench.run state_restart [options of bench.state_restart]
    python -m bench.run state_rescale [options of bench.state_rescale]
    python -m bench.run state_savepoint [options of bench.state_savepoint]
    python -m bench.run pipeline [options of bench.pipeline_latency]
    python -m bench.run demo_start [options of bench.demo_start]
    python -m bench.run soak    [options of bench.soak]
    python -m bench.run asof    [options of bench.asof_bench]
    python -m bench.run asof_job [options of bench.asof_job]
    python -m bench.run wait    [options of bench.wait_bench]
    python -m bench.run calls   [options of bench.calls]
    python -m bench.run database_sink [options of bench.database_sink]

Each benchmark is a module with a ``main(argv) -> int``; it is imported only when chosen, so one
benchmark's missing or broken module does not stop the other. Their figures are in
docs/benchmarks.md. The diagnostic tools (profilers, event-log reader) are in ``bench.tools``.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "refresh": ("bench.refresh_bench", "refresher: full diff-mode `refresh run` vs. reading the table"),
    "readers": ("bench.refresh_readers", "refresher: a MariaDB table read by PyMySQL vs ConnectorX"),
    "encode": ("bench.encode_bench", "refresher: change rows to contract JSON, bulk vs row-wise encoders"),
    "enrich": ("bench.enrich_bench", "enrichment job against its baselines: throughput, state, latency, memory"),
    "kafka_io": ("bench.kafka_io", "the job's Kafka source and transactional writer on their own"),
    "cluster_cpu": ("bench.enrich_cluster_cpu", "enrichment job on a standalone cluster: the driver's share "
                    "of the CPU"),
    "partitioned": ("bench.partitioned_bench", "partitioned vs broadcast dimension on a cluster: driver memory, "
                    "first batch, throughput"),
    "state_ops": ("bench.state_ops", "state store: per-key MapState calls vs one Arrow blob per group, per key"),
    "state_restart": ("bench.state_restart", "state of N devices: checkpoint size, restart after SIGKILL until output"),
    "state_rescale": ("bench.state_rescale", "state of N devices: enrich rescale to other numbers of state partitions"),
    "asof": ("bench.asof_bench", "as-of lookup against the latest-version lookup, per event (no Spark)"),
    "asof_job": ("bench.asof_job", "enrichment job with an as-of broadcast join vs the latest-version join, "
                 "on one versioned changelog"),
    "state_savepoint": ("bench.state_savepoint", "state of N devices: enrich savepoint, a fork's first run vs a "
                        "restart"),
    "corrections": ("bench.corrections_job", "corrections: the job with corrections on an as-of join vs without "
                    "(throughput, state kept), and a late version of 10k devices corrected"),
    "gaps": ("bench.gaps_bench", "gaps: judging a bucket's devices' silences per batch and tick (no Spark)"),
    "rollup_step": ("bench.rollup_step", "rollups: the rollup step's call per bucket with a full horizon held, "
                    "final windows kept apart vs one whole table (no Spark)"),
    "wait": ("bench.wait_bench", "waiting for completeness: deciding and storing a bucket's held events (no Spark)"),
    "calls": ("bench.calls", "calls: in the state step: calls/s per task vs concurrency / latency, the job with "
              "and without a call"),
    "database_sink": ("bench.database_sink", "enrichment job with output.database (write: state) vs Kafka "
                      "output only"),
    "demo_start": ("bench.demo_start", "the demo: from its start to the first enriched event it prints"),
    "pipeline": ("bench.pipeline_latency", "the demo's pipeline: the job's start-up, its batch time (Spark's "
                 "triggerExecution) and a database change's time to the enriched output"),
    "soak": ("bench.soak", "reliability: the topology under reference churn, SIGKILLs and PostgreSQL and call "
             "service restarts, then an accounting"),
}


def usage() -> str:
    lines = ["usage: python -m bench.run {" + ",".join(BENCHMARKS) + "} [options]", ""]
    width = max(map(len, BENCHMARKS))
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    lines += ["", "`python -m bench.run NAME --help` lists a benchmark's options; figures in docs/benchmarks.md.",
              "Diagnostic tools: `python -m bench.tools.NAME --help` (bench/tools/__init__.py lists them)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = BENCHMARKS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a dependency of the benchmark is missing: show the real error
        print(f"benchmark {name!r}: module {module_name} is not available ({exc})", file=sys.stderr)
        return 2
    main_fn = getattr(module, "main", None)
    if main_fn is None:
        print(f"benchmark {name!r}: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    return int(main_fn(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
