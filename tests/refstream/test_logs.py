"""setup_logging: the one handler setup of the entry points."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta

import pytest

from refstream.logs import setup_logging

SCRIPT = """
import logging, sys
from refstream.logs import setup_logging
setup_logging({args})
logging.getLogger("refresh.x").debug("a debug line")
logging.getLogger("refresh.x").info("an info line")
logging.getLogger("py4j.clientserver").info("chatty")
"""


def run(args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(args=args)], capture_output=True, text=True,
                          check=True)


def test_stderr_at_info_by_default_and_chatty_libraries_quiet():
    err = run("").stderr
    assert "INFO refresh.x: an info line" in err
    assert "a debug line" not in err and "chatty" not in err


def test_debug_and_a_file(tmp_path):
    path = tmp_path / "out.log"
    res = run(f"debug=True, file={str(path)!r}")
    assert res.stderr == ""
    text = path.read_text()
    assert "DEBUG refresh.x: a debug line" in text and "INFO refresh.x: an info line" in text


JSON_SCRIPT = """
import logging
from refstream.logs import setup_logging
setup_logging(log_format="json")
log = logging.getLogger("refresh.x")
log.info("rows: %d, path: %s", 3, 'a "quoted"\\nname')
try:
    raise ValueError("boom")
except ValueError:
    log.exception("dataset %s failed", "d")
"""


def test_json_format_is_one_object_per_line_with_the_exception():
    err = subprocess.run([sys.executable, "-c", JSON_SCRIPT], capture_output=True, text=True, check=True).stderr
    lines = err.splitlines()
    assert len(lines) == 2, err  # the newline in the message and the traceback stay inside their line
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"time", "level", "logger", "message"}
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "refresh.x", 'rows: 3, path: a "quoted"\nname')
    assert datetime.fromisoformat(first["time"]).utcoffset() == timedelta(0)
    assert (second["level"], second["message"]) == ("ERROR", "dataset d failed")
    assert second["exc"].startswith("Traceback") and second["exc"].endswith("ValueError: boom")


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log format 'xml' is not one of text, json"):
        setup_logging(log_format="xml")  # type: ignore[arg-type]
