"""A real local Spark session, started once per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from enrich.session import build_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "refstream-tests", {"spark.driver.memory": "2g"})
    try:
        yield session
    finally:
        session.stop()
