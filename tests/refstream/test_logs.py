"""setup_logging: the one handler setup of the entry points."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import datetime, timedelta

import pytest

from refstream.logs import RepeatSuppressor, line_key, setup_logging

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


FAIL = ("FAIL [rdkafka#producer-{n}] [thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: Connect to "
        "ipv4#127.0.0.1:9092 failed: Connection refused (after {ms}ms in state CONNECT)")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def suppressor(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> tuple[RepeatSuppressor, Clock]:
    logger = logging.getLogger("refstream.test.repeats")
    caplog.set_level(level, logger=logger.name)
    clock = Clock()
    return RepeatSuppressor(logger, 60.0, clock=clock), clock


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "refstream.test.repeats"]


def test_a_repeated_line_is_logged_once_then_once_per_window_with_its_count(caplog):
    s, clock = suppressor(caplog)
    for i in range(1200):  # a broker down: 20 lines a second for a minute, from three clients
        clock.now = i / 20
        s.log(logging.ERROR, "%s", FAIL.format(n=i % 3, ms=i % 7))
    s.flush()
    assert logged(caplog) == [("ERROR", FAIL.format(n=0, ms=0))]  # 59.95 s: the window is still open
    clock.now = 60.0
    s.flush()
    assert logged(caplog)[1:] == [("ERROR", FAIL.format(n=1199 % 3, ms=1199 % 7)
                                   + " (repeated 1199 times in the last 60 s)")]
    clock.now = 61.0
    s.log(logging.ERROR, "%s", FAIL.format(n=4, ms=0))  # counted in the next window
    clock.now = 121.0
    s.flush()
    assert logged(caplog)[2:] == [("ERROR", FAIL.format(n=4, ms=0) + " (repeated 1 time in the last 60 s)")]
    # A window without repeats is forgotten: the line, when it comes back, is new.
    clock.now = 190.0
    s.flush()
    s.log(logging.ERROR, "%s", FAIL.format(n=5, ms=3))
    assert len(logged(caplog)) == 4 and logged(caplog)[3] == ("ERROR", FAIL.format(n=5, ms=3))


def test_repeats_librdkafka_held_back_itself_are_counted_with_the_others(caplog):
    """Under load librdkafka logs fewer of the lines and notes how many it held back: the count says
    how often the failure happened all the same."""
    s, clock = suppressor(caplog)
    line = "Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT{note})"
    s.log(logging.ERROR, "%s", line.format(note=", 3 identical error(s) suppressed"))  # shown with its note
    for i, held in enumerate((40, 0, 25)):
        clock.now = 10.0 * (i + 1)
        s.log(logging.ERROR, "%s", line.format(note=f", {held} identical error(s) suppressed" if held else ""))
    clock.now = 60.0
    s.flush()
    assert logged(caplog) == [("ERROR", line.format(note=", 3 identical error(s) suppressed")),
                              ("ERROR", line.format(note="") + " (repeated 68 times in the last 60 s)")]


def test_other_lines_levels_and_addresses_are_not_counted_together(caplog):
    s, clock = suppressor(caplog, logging.WARNING)
    other_broker = FAIL.replace("127.0.0.1:9092", "127.0.0.2:9092")
    for text, level in [(FAIL.format(n=1, ms=0), logging.ERROR), (other_broker.format(n=1, ms=0), logging.ERROR),
                        (FAIL.format(n=1, ms=0), logging.WARNING), ("1/1 brokers are down", logging.ERROR),
                        ("2/2 brokers are down", logging.ERROR), ("a debug line", logging.INFO)]:
        s.log(level, "%s", text)
    assert [m for _, m in logged(caplog)] == [FAIL.format(n=1, ms=0), other_broker.format(n=1, ms=0),
                                              FAIL.format(n=1, ms=0), "1/1 brokers are down"]
    assert [lv for lv, _ in logged(caplog)][:3] == ["ERROR", "ERROR", "WARNING"]
    # At exit every count is logged, over the seconds its window really covered.
    clock.now = 12.2
    s.flush(everything=True)
    assert logged(caplog)[4:] == [("ERROR", "2/2 brokers are down (repeated 1 time in the last 12 s)")]


@pytest.mark.parametrize(("a", "b", "same"), [
    (FAIL.format(n=1, ms=0), FAIL.format(n=12, ms=1503), True),
    ("Disconnected (after 0.123ms in state UP, 3 identical error(s) suppressed)",
     "Disconnected (after 12.5ms in state UP, 40 identical error(s) suppressed)", True),
    # librdkafka's own suppression of repeats is a repeat of the line without it.
    ("Disconnected (after 0ms in state CONNECT)", "Disconnected (after 0ms in state CONNECT, 1 identical error(s) "
                                                  "suppressed)", True),
    ("kafka-1:9092/1: Connect failed", "kafka-2:9092/2: Connect failed", False),
    ("10.0.0.1:9092: Connect failed", "10.0.0.2:9092: Connect failed", False),
    ("broker 10.0.0.1:9092", "broker 10.0.0.1:9093", False),
])
def test_line_key_drops_timings_counts_and_client_names_not_addresses(a: str, b: str, same: bool) -> None:
    assert (line_key(a) == line_key(b)) is same
