"""enrich.state.cache: the executors' local copies of the bucket tables, by token."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from enrich.state.cache import LOCAL_DIRS, TableCache


def test_files_by_token_under_the_first_local_dir_of_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCAL_DIRS, f"{tmp_path / 'a'},{tmp_path / 'b'}")
    cache = TableCache("run-1")
    assert cache.directory() == tmp_path / "a" / "refstream-state" / "run-1"
    assert cache.get("t1") is None
    cache.put("t1", b"one")
    cache.put("t2", b"two", previous="t1")
    assert cache.get("t1") is None and cache.get("t2") == b"two"
    assert TableCache("run-2").get("t2") is None  # another run of the job starts empty
    cache.remove()
    assert not cache.directory().exists() and cache.get("t2") is None


def test_a_cache_that_cannot_write_costs_reads_not_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv(LOCAL_DIRS, str(blocker))  # a file where the directory should be
    cache = TableCache("run-1")
    with caplog.at_level(logging.WARNING, logger="enrich.state.cache"):
        cache.put("t1", b"one")
    assert cache.get("t1") is None
    assert "cannot write" in caplog.text and str(cache.directory()) in caplog.text
