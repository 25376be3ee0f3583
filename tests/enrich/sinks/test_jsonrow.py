"""Rows as the driver's Kafka records' JSON (enrich/sinks/jsonrow.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

from enrich.sinks.jsonrow import dumps, json_value


def test_values_json_cannot_hold_become_text_or_null() -> None:
    row = {"t": datetime(2026, 1, 1, tzinfo=UTC), "d": Decimal("1.50"), "b": b"\x00\x01",
           "nan": float("nan"), "inf": float("-inf"), "x": 1.5}
    assert json.loads(dumps({k: json_value(v) for k, v in row.items()})) == {
        "t": "2026-01-01T00:00:00.000000Z", "d": "1.50", "b": "AAE=", "nan": None, "inf": None, "x": 1.5}
