"""The demo's Ctrl-C handling: the first signal asks for an orderly stop, the same Ctrl-C delivered
twice (``timeout`` and ``make`` pass it on to a group that already got it) changes nothing, and a
later second Ctrl-C unwinds at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from demo.cli import _signals


def _interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in the main thread at its next bytecode


def test_first_signal_stops_in_order_a_duplicate_is_ignored_a_later_one_unwinds() -> None:
    stop = threading.Event()
    before = signal.getsignal(signal.SIGINT)
    with _signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.is_set()
        _interrupt()  # the same stop request once more: no exception
        time.sleep(1.1)
        with pytest.raises(KeyboardInterrupt):
            _interrupt()
    assert signal.getsignal(signal.SIGINT) is before
