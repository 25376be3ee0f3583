"""Fixtures of the sinks' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import mysql_database


@pytest.fixture(scope="module")
def mysql_default_url(mysql_server_url: str) -> Iterator[str]:
    """A MariaDB database with the server's default collation (``utf8mb4_general_ci`` here), unlike
    ``mysql_url``'s ``utf8mb4_bin``: what a table created without a collation gets."""
    with mysql_database(mysql_server_url, "CHARACTER SET utf8mb4") as url:
        yield url
