"""The test hook that kills a Kafka sink task's Python worker (tests/enrich/kill.py): which tasks it
picks (no kill here)."""

from __future__ import annotations

from pathlib import Path

from tests.enrich.kill import KillPoint


def test_the_hook_names_a_batch_or_every_later_one_and_a_slot_or_any() -> None:
    assert KillPoint.from_spec("3:1:/f") == KillPoint(3, 1, "/f", False)
    assert KillPoint.from_spec("3+:*:/x:y") == KillPoint(3, None, "/x:y", True)


def test_it_picks_one_task_once(tmp_path: Path) -> None:
    flag = tmp_path / "killed"
    assert not KillPoint(3, 1, str(flag)).picks(4, 1)                     # another batch
    assert not KillPoint(3, 1, str(flag)).picks(3, 0)                     # another slot
    assert not KillPoint(3, None, str(flag), later=True).picks(2, 0)      # before the batch
    assert not flag.exists()
    assert KillPoint(3, None, str(flag), later=True).picks(5, 1)          # a later batch, any slot
    assert flag.exists()
    assert not KillPoint(3, None, str(flag), later=True).picks(5, 0)      # fired before: never again
