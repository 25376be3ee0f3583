"""Building the SparkSession the job (and its tests) run in."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from pyspark.sql import SparkSession

from refstream import compat

#: The driver JVM's compiler on a cluster: C1 only. There the driver plans and schedules and runs
#: no task, and C2 compiling its code was half of its CPU while batches ran (docs/benchmarks.md,
#: "Driver CPU on a standalone cluster"). Not in local mode: the driver's JVM runs the tasks too.
DRIVER_JIT = "-XX:TieredStopAtLevel=1"

#: Shuffle (and so state) partitions on a cluster, where executors may be added: the number is fixed
#: by a stateful checkpoint's first run (docs/state.md), so it is set for growth, not for today.
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
CLUSTER_PARTITIONS = 4

#: Spark's setting for Unix sockets between the JVM and its Python processes. Their files go to the
#: JVM's temporary directory (``spark.python.unix.domain.socket.dir`` to move them), made with the
#: process's umask: with the usual 022, no other user can connect.
UNIX_SOCKETS = "spark.python.unix.domain.socket.enabled"

#: What anyone who reaches the driver's UI could do to the job, off unless a setting turns it on:
#: kill a job or stage (the micro-batch, and so the query), take executors' thread dumps, and take
#: heap histograms (``jcmd GC.class_histogram``: a full GC of the executor).
UI_DEFAULTS = {
    "spark.ui.killEnabled": "false",
    "spark.ui.threadDumpsEnabled": "false",
    "spark.ui.heapHistogramEnabled": "false",
}


def local_cores(master: str | None) -> int | None:
    """The task slots of a ``local``, ``local[N]``, ``local[*]`` or ``local[N,F]`` master; None for any
    other (a cluster, ``local-cluster[...]``, or ``spark-submit``'s choice)."""
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\*|\d+)(?:,\d+)?\]", master or "")
    if m is None:
        return None
    return (os.cpu_count() or 1) if m.group(1) == "*" else max(int(m.group(1)), 1)


def submitted_conf() -> dict[str, str]:
    """The Spark configuration of a driver JVM that runs before the session is built, i.e. under
    ``spark-submit``: its ``--conf``, ``--properties-file`` and ``spark-defaults.conf``. Empty when
    :func:`build_session` will start the JVM itself (its settings are then the builder's)."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return {}
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM
    return dict(SparkConf().getAll())


def session_conf(conf: Mapping[str, str] | None = None, *, ui: bool = False,
                 master: str | None = None, preset: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings :func:`build_session` gives the builder: its defaults, then ``conf`` over them.

    A default is left out when ``preset`` (:func:`submitted_conf`) holds its key: ``spark-submit
    --conf spark.sql.shuffle.partitions=...`` must win, since a stateful checkpoint keeps that
    number for life.

    ``ui=False`` turns Spark's UI off (tests, ``enrich validate``, benchmarks). ``ui=True`` leaves the
    key to Spark, whose default is on (port 4040, else the next free one), so that ``conf``,
    ``spark-submit --conf`` or a ``spark-defaults.conf`` in ``SPARK_CONF_DIR`` can turn it off.
    Either way :data:`UI_DEFAULTS` turn off the UI's kill links, thread dumps and heap histograms.

    With a ``master`` other than ``local...``, :data:`DRIVER_JIT` is added to
    ``spark.driver.extraJavaOptions`` unless that names a tiered compilation setting of its own.

    ``spark.sql.shuffle.partitions`` (the state partitions of a stateful job) defaults to the task
    slots of a local master, which cannot grow: more partitions than slots run in waves and pay each
    partition's per-batch costs (a RocksDB commit, a Kafka transaction) for no parallelism
    (docs/benchmarks.md); else to :data:`CLUSTER_PARTITIONS`.
    """
    defaults = {
        SHUFFLE_PARTITIONS: str(local_cores(master) or CLUSTER_PARTITIONS),
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        # Workers forked with the job's modules already imported (enrich.daemon).
        "spark.python.daemon.module": "enrich.daemon",
        # The sockets between the JVM and its Python processes (a collect()'s results, a worker's
        # connection, a state step's state server) as Unix sockets, not TCP ports of 127.0.0.1. Each
        # such server accepts one connection: any other local client that connects to its port first
        # (a Kafka client redialling a stopped broker whose port was reused) takes it, and the
        # Python side is refused - a failed batch, masked by PySpark as UnboundLocalError: 'sockfile'.
        # A Unix socket has no port to collide with.
        UNIX_SOCKETS: "true",
        # What the Python processes wait for those sockets (SPARK_AUTH_SOCKET_TIMEOUT: a connect, and
        # a state step's driver-side worker's reads): Spark's 15 s is short for a driver starved of CPU.
        "spark.python.authenticate.socketTimeout": "120s",
        **UI_DEFAULTS,
    }
    if not ui:
        defaults["spark.ui.enabled"] = "false"
    merged = {**{k: v for k, v in defaults.items() if k not in (preset or {})}, **dict(conf or {})}
    if master is not None and not master.startswith("local"):
        mine = merged.get("spark.driver.extraJavaOptions", "")
        if "TieredStopAtLevel" not in mine and "TieredCompilation" not in mine:
            merged["spark.driver.extraJavaOptions"] = f"{mine} {DRIVER_JIT}".strip()
    return merged


@contextmanager
def _loopback_driver(master: str | None) -> Iterator[None]:
    """Spark binds its UI to ``SPARK_LOCAL_IP``, else to every interface, and has no setting for the
    UI alone; the variable also sets the driver's own addresses. A local master's driver needs none
    beyond this machine, so the JVM it starts here gets 127.0.0.1 unless the environment names an
    address. A cluster's executors must reach the driver: there it is left to the user (README)."""
    if master is None or not master.startswith("local") or "SPARK_LOCAL_IP" in os.environ:
        yield
        return
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # read by the JVM launch only
    try:
        yield
    finally:
        del os.environ["SPARK_LOCAL_IP"]


#: Spark loggers whose warnings say nothing to an operator, held to ERROR in the driver's JVM (the
#: executors' too in local mode). The state server warns on every read of a state value that is not
#: there: each bucket's first batch, each timer-less bucket, hundreds of lines per batch.
QUIETED_LOGGERS = ("org.apache.spark.sql.execution.python.streaming.TransformWithStateInPySparkStateServer",)


def build_session(master: str | None = "local[*]", app_name: str = "refstream-enrich",
                  conf: Mapping[str, str] | None = None, *, ui: bool = False) -> SparkSession:
    """A SparkSession whose Python workers run this interpreter, unless ``spark.pyspark.python`` says.

    ``master=None`` keeps whatever ``spark-submit`` set, and a key its configuration holds keeps its
    value over the job's defaults (its JVM runs already: pass it ``--driver-java-options`` yourself,
    :data:`DRIVER_JIT` on a cluster). A local master's driver listens on 127.0.0.1 only
    (:func:`_loopback_driver`). Python workers must import this venv's
    packages, so PYSPARK_PYTHON defaults to ``sys.executable``. PySpark takes the workers' Python from
    PYSPARK_PYTHON alone (``spark.pyspark.python`` is read by ``spark-submit``, not by a session built
    in a running interpreter), so a ``spark.pyspark.python`` in ``conf`` is put there: e.g.
    ``./env/bin/python``, an environment shipped to the executors with ``spark.archives``
    (README, "On a Spark cluster"). ``ui``: see :func:`session_conf`. The session does not look for
    Python data sources in installed ``pyspark_*`` packages (the job reads only its own): that
    lookup started a Python process at the job's first data source
    (:func:`refstream.compat.spark_skip_python_data_source_lookup`).
    """
    python = dict(conf or {}).get("spark.pyspark.python")
    if python:
        os.environ["PYSPARK_PYTHON"] = python
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for k, v in session_conf(conf, ui=ui, master=master, preset=submitted_conf()).items():
        builder = builder.config(k, v)
    with _loopback_driver(master):
        spark = builder.getOrCreate()
    compat.spark_skip_python_data_source_lookup(spark)
    level = os.environ.get("REFSTREAM_SPARK_LOG_LEVEL", "WARN")
    spark.sparkContext.setLogLevel(level)
    if level.upper() in ("WARN", "ERROR", "FATAL", "OFF"):
        for name in QUIETED_LOGGERS:
            compat.spark_logger_level(spark, name, "ERROR")
    return spark
