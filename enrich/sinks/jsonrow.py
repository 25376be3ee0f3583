"""Rows as the JSON the driver's Kafka records carry (the rollups', the gaps'): times as
``2026-01-01T00:00:00.000000Z``, decimals as text, bytes as base64, NaN and infinities as null."""

from __future__ import annotations

import base64
import json
import math
from datetime import date, datetime, time
from decimal import Decimal

from refstream.contract import format_time

__all__ = ["dumps", "json_value"]


def json_value(v: object) -> object:
    """One value of a row (``pyarrow``'s ``to_pylist``) as JSON holds it."""
    if isinstance(v, datetime):
        return format_time(v)
    if isinstance(v, date | time | Decimal):
        return v.isoformat() if not isinstance(v, Decimal) else str(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN or infinity: a reference row's may hold one
    return v


def dumps(obj: dict[str, object]) -> bytes:
    """Compact JSON bytes; NaN and infinities refused."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
