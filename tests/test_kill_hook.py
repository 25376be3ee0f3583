"""The test hook that kills a Kafka sink task's Python worker or the whole job (tests/enrich/kill.py):
which tasks it picks, which processes are the job's (no kill here)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.enrich.kill import KillPoint, read_note, session_pids


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


def test_job_names_the_mode_that_kills_the_whole_job_between_two_slots_commits() -> None:
    assert KillPoint.from_spec("job:3+:*:/x:y") == KillPoint(3, None, "/x:y", later=True, job=True)
    assert KillPoint.from_spec("job:3:0:/f").job and not KillPoint.from_spec("3:0:/f").job


def test_the_job_is_the_session_and_the_note_is_the_flags_last_line(tmp_path: Path) -> None:
    assert os.getpid() in session_pids(os.getsid(0))
    assert os.getpid() not in session_pids(os.getsid(0) + 10**7)   # no such session
    flag = tmp_path / "killed"
    flag.write_text("123\n")
    assert read_note(flag) is None                                    # picked, nothing found yet
    flag.write_text('123\n{"batch": 4, "other": 1}\n')
    assert read_note(flag) == {"batch": 4, "other": 1}
