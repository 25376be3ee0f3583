"""The test hook that kills a Kafka sink task's Python worker: which tasks it picks (no kill here)."""

from __future__ import annotations

from pathlib import Path

from enrich.kafka.tasks import KillPoint


def test_the_hook_names_a_batch_or_every_later_one_and_a_slot_or_any() -> None:
    assert KillPoint.from_env("3:1:/f") == KillPoint(3, 1, "/f", False)
    assert KillPoint.from_env("3+:*:/x:y") == KillPoint(3, None, "/x:y", True)
    assert KillPoint.from_env("") is None and KillPoint.from_env(None) is None


def test_tasks_it_does_not_pick_go_on(tmp_path: Path) -> None:
    flag = tmp_path / "killed"
    KillPoint(3, 1, str(flag)).fire(4, 1, None)          # another batch
    KillPoint(3, 1, str(flag)).fire(3, 0, None)          # another slot
    KillPoint(3, None, str(flag), later=True).fire(2, 0, None)  # before the batch
    assert not flag.exists()
    flag.write_text("1\n")                               # fired before: never again
    KillPoint(3, None, str(flag), later=True).fire(5, 0, None)
