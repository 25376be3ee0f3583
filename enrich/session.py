"""Building the SparkSession the job (and its tests) run in."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession


def build_session(master: str | None = "local[*]", app_name: str = "refstream-enrich",
                  conf: Mapping[str, str] | None = None) -> SparkSession:
    """A SparkSession whose Python workers run this interpreter.

    ``master=None`` keeps whatever ``spark-submit`` set. Python workers must import this venv's
    packages, so PYSPARK_PYTHON defaults to ``sys.executable``.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    defaults = {
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"],
    }
    for k, v in {**defaults, **dict(conf or {})}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("REFSTREAM_SPARK_LOG_LEVEL", "WARN"))
    return spark
