"""Parsing ``enrich lookup``'s KEY argument (pure logic)."""

from __future__ import annotations

import pytest

from enrich.ops.lookup import parse_key
from refstream.errors import ConfigError


def test_key_forms() -> None:
    assert parse_key("d1", ("device_id",), "devices") == {"device_id": "d1"}
    assert parse_key("device_id=d1", ("device_id",), "devices") == {"device_id": "d1"}
    assert parse_key("a=x=y", ("device_id",), "devices") == {"device_id": "a=x=y"}  # not a column: the value
    assert parse_key("site=a, slot=3", ("site", "slot"), "slots") == {"site": "a", "slot": "3"}
    assert parse_key('{"site": "a", "slot": 3, }'.replace(", }", "}"), ("site", "slot"), "slots") == \
        {"site": "a", "slot": "3"}
    assert parse_key('{"on": true}', ("on",), "flags") == {"on": "true"}


def test_bad_keys_name_the_dataset_and_columns() -> None:
    with pytest.raises(ConfigError, match="dataset slots: its key has columns site, slot"):
        parse_key("a", ("site", "slot"), "slots")
    with pytest.raises(ConfigError, match="dataset slots: key columns are site, slot, got site"):
        parse_key("site=a", ("site", "slot"), "slots")
    with pytest.raises(ConfigError, match="not a JSON object"):
        parse_key("{nope", ("site",), "slots")
