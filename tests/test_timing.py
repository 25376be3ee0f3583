"""The tests' bounds stretch with the machine (tests/timing.py): pure logic, plus the suite's own
per-test limit as tests/conftest.py sets it."""

from __future__ import annotations

import pytest

from tests import timing


def test_a_bound_is_stretched_by_the_runs_slowdown_within_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timing.ENV, "2.5")
    assert timing.bound(10) == 25
    monkeypatch.setenv(timing.ENV, "0.3")  # never shorter than written
    assert timing.bound(10) == 10
    monkeypatch.setenv(timing.ENV, "50")
    assert timing.bound(10) == 10 * timing.MAX_SLOWDOWN


def test_measuring_publishes_the_slowdown_for_workers_and_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timing.ENV, raising=False)
    monkeypatch.setattr(timing, "reference_loop_rate", lambda: timing.REFERENCE_RATE / 2)  # half as fast
    monkeypatch.setattr(timing, "busy_share", lambda span=0.5: 0.5)                       # half taken
    assert timing.measure() == 4.0 and timing.slowdown() == 4.0
    monkeypatch.setattr(timing, "reference_loop_rate", lambda: timing.REFERENCE_RATE * 2)  # faster: no less
    monkeypatch.setattr(timing, "busy_share", lambda span=0.5: 0.0)
    assert timing.measure() == 1.0


def test_the_busy_share_is_a_fraction() -> None:
    assert 0.0 <= timing.busy_share(0.05) <= 1.0


def test_the_per_test_limit_is_the_suites_stretched(request: pytest.FixtureRequest) -> None:
    mark = request.node.get_closest_marker("timeout")
    assert mark is not None and mark.args[0] == pytest.approx(timing.bound(900))


@pytest.mark.timeout(5)
def test_a_tests_own_limit_is_stretched_too(request: pytest.FixtureRequest) -> None:
    mark = request.node.get_closest_marker("timeout")
    assert mark is not None and mark.args[0] == pytest.approx(timing.bound(5))
