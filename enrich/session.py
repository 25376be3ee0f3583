"""Building the SparkSession the job (and its tests) run in."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

#: The driver JVM's compiler on a cluster: C1 only. There the driver plans and schedules and runs
#: no task, and C2 compiling its code was half of its CPU while batches ran (docs/benchmarks.md,
#: "Driver CPU on a standalone cluster"). Not in local mode: the driver's JVM runs the tasks too.
DRIVER_JIT = "-XX:TieredStopAtLevel=1"


def session_conf(conf: Mapping[str, str] | None = None, *, ui: bool = False,
                 master: str | None = None) -> dict[str, str]:
    """The settings :func:`build_session` gives the builder: its defaults, then ``conf`` over them.

    ``ui=False`` turns Spark's UI off (tests, ``enrich validate``, benchmarks). ``ui=True`` leaves the
    key to Spark, whose default is on (port 4040, else the next free one), so that ``conf``,
    ``spark-submit --conf`` or a ``spark-defaults.conf`` in ``SPARK_CONF_DIR`` can turn it off.

    With a ``master`` other than ``local...``, :data:`DRIVER_JIT` is added to
    ``spark.driver.extraJavaOptions`` unless that names a tiered compilation setting of its own.
    """
    defaults = {
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
    }
    if not ui:
        defaults["spark.ui.enabled"] = "false"
    merged = {**defaults, **dict(conf or {})}
    if master is not None and not master.startswith("local"):
        mine = merged.get("spark.driver.extraJavaOptions", "")
        if "TieredStopAtLevel" not in mine and "TieredCompilation" not in mine:
            merged["spark.driver.extraJavaOptions"] = f"{mine} {DRIVER_JIT}".strip()
    return merged


def build_session(master: str | None = "local[*]", app_name: str = "refstream-enrich",
                  conf: Mapping[str, str] | None = None, *, ui: bool = False) -> SparkSession:
    """A SparkSession whose Python workers run this interpreter, unless ``spark.pyspark.python`` says.

    ``master=None`` keeps whatever ``spark-submit`` set (its JVM runs already: pass it
    ``--driver-java-options`` yourself, :data:`DRIVER_JIT` on a cluster). Python workers must import this venv's
    packages, so PYSPARK_PYTHON defaults to ``sys.executable``. PySpark takes the workers' Python from
    PYSPARK_PYTHON alone (``spark.pyspark.python`` is read by ``spark-submit``, not by a session built
    in a running interpreter), so a ``spark.pyspark.python`` in ``conf`` is put there: e.g.
    ``./env/bin/python``, an environment shipped to the executors with ``spark.archives``
    (README, "On a Spark cluster"). ``ui``: see :func:`session_conf`.
    """
    python = dict(conf or {}).get("spark.pyspark.python")
    if python:
        os.environ["PYSPARK_PYTHON"] = python
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for k, v in session_conf(conf, ui=ui, master=master).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("REFSTREAM_SPARK_LOG_LEVEL", "WARN"))
    return spark
