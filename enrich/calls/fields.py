"""The result columns of the calls: ``<name>_<field>``, typed by the call's ``response:``, and the
conversion of a JSON response into them (an error naming the call and the field when it does not fit)."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa

__all__ = ["ARROW", "ResponseError", "ResponseType", "column", "columns", "read_response"]

#: The types a response field may be declared with.
ResponseType = Literal["STRING", "DOUBLE", "BIGINT", "INT", "BOOLEAN"]
ARROW: dict[str, pa.DataType] = {"STRING": pa.string(), "DOUBLE": pa.float64(), "BIGINT": pa.int64(),
                                 "INT": pa.int32(), "BOOLEAN": pa.bool_()}


class ResponseError(ValueError):
    """A response that is not a JSON object with the declared fields in their types."""


def column(call: str, field: str) -> str:
    """The output column (and state field) of ``call``'s result ``field``."""
    return f"{call}_{field}"


def columns(calls: Sequence[Any]) -> list[tuple[str, pa.DataType]]:
    """Every call's result columns, in configured order (calls, then their response fields)."""
    return [(column(c.name, f), ARROW[t]) for c in calls for f, t in c.response]


def read_response(call: str, response: tuple[tuple[str, str], ...], data: Any) -> dict[str, Any]:
    """The declared fields of a decoded JSON response, checked against their types (a JSON null is
    a null value); :class:`ResponseError` naming the call and the field otherwise."""
    if not isinstance(data, Mapping):
        raise ResponseError(f"call {call}: the response is not a JSON object")
    out: dict[str, Any] = {}
    for name, typ in response:
        if name not in data:
            raise ResponseError(f"call {call}: the response lacks field {name!r}")
        out[name] = _typed(call, name, typ, data[name])
    return out


def _typed(call: str, name: str, typ: str, v: Any) -> Any:
    if v is None:
        return None
    ok = {"STRING": isinstance(v, str),
          "DOUBLE": isinstance(v, int | float) and not isinstance(v, bool),
          "BIGINT": isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63,
          "INT": isinstance(v, int) and not isinstance(v, bool) and -2**31 <= v < 2**31,
          "BOOLEAN": isinstance(v, bool)}[typ]
    if ok and typ == "DOUBLE":
        try:
            v = float(v)
        except OverflowError:  # an integer past a double's range: never +-inf
            ok = False
        else:
            ok = math.isfinite(v)  # 1e400 reads as inf, NaN as nan: neither is a value of the call
    if not ok:
        raise ResponseError(f"call {call}: field {name!r} is {_SHOW.repr(v)}, not {typ}")
    return v


#: A value in an error: short, and safe for one nested 100k deep (plain repr would recurse).
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 40
