"""Errors as one line."""

from __future__ import annotations

from refstream.errors import ConfigError, DataError, one_line


def test_our_errors_are_their_message_and_others_carry_their_type():
    assert one_line(ConfigError("conf.yaml: datasets.x.key: missing")) == "conf.yaml: datasets.x.key: missing"
    assert one_line(ValueError("bad value")) == "ValueError: bad value"
    assert one_line(DataError("")) == "DataError"
    assert one_line(RuntimeError()) == "RuntimeError"


def test_only_the_first_non_blank_line_is_kept():
    assert one_line(RuntimeError("\n  first line  \n\tat org.apache.Spark(...)\n")) == "RuntimeError: first line"
    assert one_line(DataError("\n\nfile x: line 3\ntrace")) == "file x: line 3"
