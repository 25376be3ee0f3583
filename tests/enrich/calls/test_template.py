"""Request templates (enrich.calls.template): placeholders, types, GET query parameters."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from enrich.calls.template import Ref, Template, query_params

VALUES: dict[Ref, Any] = {Ref(None, "device_id"): "d1", Ref("state", "events"): 3, Ref("risk", "score"): 0.5,
                          Ref(None, "flag"): True, Ref(None, "gone"): None, Ref(None, "nan"): float("nan"),
                          Ref(None, "ts"): datetime(2026, 1, 1, tzinfo=UTC)}


def render(body: Any) -> Any:
    return Template(body).render(VALUES.__getitem__)


def test_a_whole_placeholder_keeps_its_type() -> None:
    assert render({"d": "{device_id}", "n": "{state.events}", "s": "{risk.score}", "f": "{flag}", "g": "{gone}"}) \
        == {"d": "d1", "n": 3, "s": 0.5, "f": True, "g": None}


def test_a_placeholder_inside_text_is_formatted_into_it() -> None:
    assert render({"t": "dev {device_id} has {state.events} events, {flag}, [{gone}]"}) \
        == {"t": "dev d1 has 3 events, true, []"}


def test_times_are_iso_text_nan_is_null_and_constants_and_nesting_pass() -> None:
    assert render({"at": "{ts}", "x": "{nan}", "k": 7, "nested": {"l": ["{device_id}", 1]}}) \
        == {"at": "2026-01-01T00:00:00+00:00", "x": None, "k": 7, "nested": {"l": ["d1", 1]}}


def test_refs_in_document_order_once_each() -> None:
    t = Template({"a": "{device_id}", "b": ["{state.events} {risk.score}"], "c": "{device_id}"})
    assert t.refs() == [Ref(None, "device_id"), Ref("state", "events"), Ref("risk", "score")]
    assert str(Ref("risk", "score")) == "{risk.score}"


def test_get_query_parameters_leave_nulls_out() -> None:
    assert query_params({"d": "d1", "n": 3, "f": False, "g": None, "o": {"x": 1}}) \
        == {"d": "d1", "n": "3", "f": "false", "o": '{"x":1}'}
