"""setup_logging: the one handler setup of the entry points."""

from __future__ import annotations

import subprocess
import sys

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
