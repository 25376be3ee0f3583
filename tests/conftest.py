"""Session-scoped real services (Kafka-protocol broker, MariaDB database) and factories for unique names.

- ``kafka``: librdkafka settings of a broker started once per session (the embedded Tansu broker,
  or ``REFSTREAM_TEST_BOOTSTRAP`` to run the suite against another broker, e.g. real Kafka).
- ``mysql_url``: SQLAlchemy URL of a database created for this session on the MariaDB at
  ``REFSTREAM_TEST_MYSQL`` (default ``mysql+pymysql://root@127.0.0.1:3306``), dropped at the end.
- ``unique``: ``unique("topic")`` -> ``topic-<random>`` so tests never share topics, tables or dirs.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

from demo.broker import EmbeddedBroker

# Spark's Python workers must run this interpreter (the venv), not the first python3 on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    external = os.environ.get("REFSTREAM_TEST_BOOTSTRAP")
    if external:
        yield {"bootstrap.servers": external}
        return
    log_path = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log_path) as broker:
        yield {"bootstrap.servers": broker.bootstrap}


@pytest.fixture(scope="session")
def mysql_server_url() -> str:
    return os.environ.get("REFSTREAM_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306")


@pytest.fixture(scope="session")
def mysql_url(mysql_server_url: str) -> Iterator[str]:
    import sqlalchemy as sa

    name = f"refstream_test_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(mysql_server_url + "/", isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"))
    try:
        yield f"{mysql_server_url}/{name}?charset=utf8mb4"
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        engine.dispose()


@pytest.fixture
def unique() -> Callable[[str], str]:
    def make(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture(autouse=True)
def _quiet_py4j() -> None:
    logging.getLogger("py4j").setLevel(logging.WARNING)
