"""enrich.worker.settle: freezes the objects alive at a Python worker's first task, once, and only
inside a Spark task."""

from __future__ import annotations

import gc

import pytest
from pyspark import TaskContext

from enrich import worker


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(worker, "_settled", False)
    yield
    gc.unfreeze()


def test_outside_a_task_nothing_is_frozen(fresh: None) -> None:
    before = gc.get_freeze_count()
    worker.settle()
    assert gc.get_freeze_count() == before
    assert worker._settled is False  # a later call inside a task still freezes


def test_inside_a_task_frozen_once(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: object()))
    freezes: list[int] = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze())[1])
    worker.settle()
    frozen = gc.get_freeze_count()
    assert frozen > 0 and worker._settled is True and freezes == [1]
    kept = [object() for _ in range(10)]  # allocated after: not frozen by a second call
    worker.settle()
    # No second freeze. (The count itself may fall: another thread of the test process can free a
    # frozen object in between.)
    assert freezes == [1] and gc.get_freeze_count() <= frozen
    assert kept
