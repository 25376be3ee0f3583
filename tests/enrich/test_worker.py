"""enrich.worker.settle: inside a Spark task only, collects once per process and freezes what is
alive at every task's start (what a later task imports or caches is frozen too)."""

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


def test_inside_a_task_collected_once_and_frozen_at_every_task(fresh: None, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: object()))
    calls: list[str] = []
    real_freeze, real_collect = gc.freeze, gc.collect
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), real_freeze())[1])
    monkeypatch.setattr(gc, "collect", lambda *a: (calls.append("collect"), real_collect(*a))[1])
    worker.settle()
    assert gc.get_freeze_count() > 0 and worker._settled is True and calls == ["collect", "freeze"]
    kept = [[n] for n in range(1000)]  # tracked containers allocated after the first task's freeze
    untracked = gc.get_freeze_count()
    worker.settle()
    assert calls == ["collect", "freeze", "freeze"]
    # The second task's freeze took them in: a collection after it walks none of them. (Other
    # threads of the test process may free frozen objects in between; these alone are a thousand.)
    assert gc.get_freeze_count() >= untracked + len(kept) - 50
    assert all(not any(o is k for o in gc.get_objects()) for k in kept[:5])
