"""enrich.worker.settle: inside a Spark task only, collects once per process and freezes what is
alive at every task's start (what a later task imports or caches is frozen too)."""

from __future__ import annotations

import gc
import weakref

import pytest
from pyspark import TaskContext

from enrich import worker


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(worker, "_tasks", 0)
    yield
    gc.unfreeze()


def test_outside_a_task_nothing_is_frozen(fresh: None) -> None:
    before = gc.get_freeze_count()
    worker.settle()
    assert gc.get_freeze_count() == before
    assert worker._tasks == 0  # a later call inside a task is still the first: it collects, then freezes


def test_inside_a_task_collected_once_and_frozen_at_every_task(fresh: None, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: object()))
    calls: list[str] = []
    real_freeze, real_collect = gc.freeze, gc.collect
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), real_freeze())[1])
    real_unfreeze = gc.unfreeze
    monkeypatch.setattr(gc, "collect", lambda *a: (calls.append("collect"), real_collect(*a))[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze())[1])
    worker.settle()
    assert gc.get_freeze_count() > 0 and worker._tasks == 1 and calls == ["unfreeze", "collect", "freeze"]
    kept = [[n] for n in range(1000)]  # tracked containers allocated after the first task's freeze
    untracked = gc.get_freeze_count()
    worker.settle()
    assert calls == ["unfreeze", "collect", "freeze", "freeze"]
    # The second task's freeze took them in: a collection after it walks none of them. (Other
    # threads of the test process may free frozen objects in between; these alone are a thousand.)
    assert gc.get_freeze_count() >= untracked + len(kept) - 50
    assert all(not any(o is k for o in gc.get_objects()) for k in kept[:5])


def test_a_cycle_let_go_among_frozen_objects_is_collected_at_the_next_refreeze(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: object()))
    monkeypatch.setattr(worker, "REFREEZE_EVERY", 3)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a     # type: ignore[attr-defined]
    ref = weakref.ref(a)
    worker.settle()             # task 1: frozen with the rest
    del a, b
    gc.collect()
    assert ref() is not None    # frozen: a collection does not walk it
    worker.settle()             # task 2
    assert ref() is not None
    worker.settle()             # task 3: thawed, collected, frozen again
    assert ref() is None
