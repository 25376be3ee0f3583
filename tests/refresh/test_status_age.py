"""``refresh status --check`` and the age of each dataset's last successful run (``max_age``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from refresh.cli import main
from refresh.config import Schedule, default_max_age, load_config
from refresh.stores.abc import CommittedState, RunRecord, RunResult
from refresh.stores.files import FileStateStore
from refstream.errors import ConfigError


def _config(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "a.csv").write_text("id\n1\n")
    path = tmp_path / "refresh.yaml"
    path.write_text(f"""
kafka: {{bootstrap_servers: "127.0.0.1:9"}}
state_dir: {tmp_path / "state"}
datasets:
  hourly: {{source: {{path: {tmp_path / "a.csv"}}}, key: [id], schedule: {{every: 1h}}}}
  nightly: {{source: {{path: {tmp_path / "a.csv"}}}, key: [id], schedule: {{cron: "0 2 * * *"}}}}
  manual: {{source: {{path: {tmp_path / "a.csv"}}}, key: [id]{extra}}}
""")
    return path


def _succeeded(store: FileStateStore, ds: str, ago: timedelta) -> None:
    store.commit(ds, CommittedState(version=1, rows=1), None)
    t = (datetime.now(UTC) - ago).isoformat()
    run = RunRecord(started=t, finished=t, result=RunResult(dataset=ds, ok=True, version=1, rows=1, inserts=1,
                                                            updates=0, deletes=0, published=2, seconds=0.1))
    store.write_status(ds, store.read_status(ds).after(run))


def test_max_age_defaults_to_three_schedule_intervals(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path))
    assert cfg.datasets["hourly"].max_age == timedelta(hours=3)
    assert cfg.datasets["nightly"].max_age == timedelta(days=3)
    assert cfg.datasets["manual"].max_age is None  # no schedule: no default limit
    assert default_max_age(Schedule(cron="*/5 * * * *")) == timedelta(minutes=15)
    cfg = load_config(_config(tmp_path, ", max_age: 30m"))
    assert cfg.datasets["manual"].max_age == timedelta(minutes=30)
    with pytest.raises(ConfigError, match=r"datasets\.manual\.max_age"):
        load_config(_config(tmp_path, ", max_age: soon"))


def test_check_names_each_dataset_whose_last_success_is_too_old(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path)
    store = FileStateStore(tmp_path / "state")
    _succeeded(store, "hourly", timedelta(hours=4))    # limit 3h: too old
    _succeeded(store, "nightly", timedelta(hours=30))  # limit 3 days: fine
    _succeeded(store, "manual", timedelta(days=10))    # no limit
    assert main(["--config", str(path), "status", "--check"]) == 1
    err = capsys.readouterr().err
    assert "dataset hourly: last successful run 4h ago, older than 3h" in err
    assert "nightly" not in err and "manual" not in err
    # --max-age applies to every dataset, schedule or not.
    assert main(["--config", str(path), "status", "--check", "--max-age", "2d"]) == 1
    err = capsys.readouterr().err
    assert "dataset manual: last successful run 10d ago, older than 2d" in err and "hourly" not in err
    assert main(["--config", str(path), "status", "--check", "--max-age", "11d"]) == 0
    assert main(["--config", str(path), "status", "--json"]) == 0
    assert '"max_age": 10800.0' in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        main(["--config", str(path), "status", "--check", "--max-age", "later"])
    assert usage.value.code == 2 and "'later' is not a duration" in capsys.readouterr().err
