"""Request templates: a call's ``body`` with placeholders filled per event.

``{field}`` is an event field or a join column, ``{state.x}`` a field of the device's state (this
event included), ``{call.field}`` a result of a call the template's call ``needs``. A value that is
exactly one placeholder is sent with its type (number, string, boolean, null); a placeholder inside
other text is formatted into the string. Times are sent as ISO 8601 text. For ``GET`` the body's
fields become query parameters and a null one is left out (:func:`query_params`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

# The scope of ``{state.x}`` is the state struct's name; no call may be named so.
from enrich.columns import STATE

__all__ = ["STATE", "Ref", "Template", "query_params"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\}")


@dataclass(frozen=True)
class Ref:
    """What a placeholder names: ``scope`` None for an event column, ``state`` for a state field, else
    a call's name; ``name`` the column or field."""

    scope: str | None
    name: str

    def __str__(self) -> str:
        return "{" + (f"{self.scope}.{self.name}" if self.scope else self.name) + "}"


@dataclass(frozen=True)
class Template:
    """A parsed body: JSON-like data (mappings, lists, scalars) whose strings may hold placeholders."""

    body: Any

    def refs(self) -> list[Ref]:
        """Every placeholder, in document order (repeats kept out)."""
        out: list[Ref] = []
        for text in _strings(self.body):
            for m in _PLACEHOLDER.finditer(text):
                ref = _ref(m)
                if ref not in out:
                    out.append(ref)
        return out

    def render(self, value: Callable[[Ref], Any]) -> Any:
        """The body with every placeholder replaced by ``value(ref)``."""
        return _render(self.body, value)


def _ref(m: re.Match[str]) -> Ref:
    return Ref(m.group(1), m.group(2)) if m.group(2) else Ref(None, m.group(1))


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _render(node: Any, value: Callable[[Ref], Any]) -> Any:
    if isinstance(node, str):
        whole = _PLACEHOLDER.fullmatch(node)
        if whole:
            return _typed(value(_ref(whole)))
        return _PLACEHOLDER.sub(lambda m: _text(value(_ref(m))), node)
    if isinstance(node, Mapping):
        return {k: _render(v, value) for k, v in node.items()}
    if isinstance(node, list):
        return [_render(v, value) for v in node]
    return node


def _typed(v: Any) -> Any:
    """A value as JSON carries it: NaN as null (JSON has none), times and decimals as text."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, Decimal | bytes):
        return str(v) if isinstance(v, Decimal) else v.hex()
    return v


def _text(v: Any) -> str:
    v = _typed(v)
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def query_params(body: Any) -> dict[str, str]:
    """A rendered body as ``GET`` query parameters: its top-level fields as text, nulls left out."""
    if not isinstance(body, Mapping):
        return {}
    return {str(k): _text(v) if not isinstance(v, Mapping | list) else _json(v)
            for k, v in body.items() if v is not None}


def _json(v: Any) -> str:
    import json

    return json.dumps(v, separators=(",", ":"))
