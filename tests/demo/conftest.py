"""Fixtures of the demo/deployment tests: a scratch MariaDB database loaded with the compose stack's
init SQL (conf/docker/mysql-init), and the repository root."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
INIT_SQL = ROOT / "conf" / "docker" / "mysql-init"


def sql_statements(text: str) -> list[str]:
    """Split an init script into statements (our scripts hold no ';' inside literals)."""
    text = re.sub(r"--[^\n]*", "", text)
    return [s.strip() for s in text.split(";") if s.strip()]


def load_init_sql(url: str) -> None:
    """Run every init script in name order, as the MySQL image's entrypoint does."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for script in sorted(INIT_SQL.glob("*.sql")):
                for stmt in sql_statements(script.read_text(encoding="utf-8")):
                    conn.exec_driver_sql(stmt)
    finally:
        engine.dispose()


@pytest.fixture
def init_db(mysql_server_url: str) -> Iterator[str]:
    """A fresh database on the test MariaDB holding the compose stack's schema and sample data.

    Own database rather than ``mysql_url``'s: the stack's table names (devices, models) are plain
    and other tests may use the same names in the session database."""
    name = f"refstream_stack_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(mysql_server_url + "/", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    url = f"{mysql_server_url}/{name}?charset=utf8mb4"
    try:
        load_init_sql(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
