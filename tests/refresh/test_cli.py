"""The ``refresh`` CLI: run, status, errors as one line with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refresh.cli import main
from refstream.kafka import end_offsets
from tests.refresh.conftest import changes, execute, read_topic
from tests.timing import bound

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_config(make_config, mysql_engine, mysql_url, unique, tmp_path):
    t, topic = unique("cli"), unique("ref.cli")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, v VARCHAR(5))", f"INSERT INTO {t} VALUES (1,'a')")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,v\n1,a\n2\n")
    cfg = make_config({"good": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic,
                                "schedule": {"every": "1h"}},
                       "bad": {"source": {"path": str(bad)}, "key": ["id"], "topic": unique("ref.bad")}})
    return cfg, t, topic


def test_run_and_status(cli_config, mysql_engine, kafka, capsys):
    cfg, t, topic = cli_config
    assert main(["--config", str(cfg.path), "run", "good"]) == 0
    out = capsys.readouterr().out
    assert "good: version 1 (diff): 1 rows read, 1 inserts, 0 updates, 0 deletes, 2 messages acknowledged" in out

    (cfg.state_dir / "_daemon").mkdir(parents=True)
    (cfg.state_dir / "_daemon" / "next_runs.json").write_text(json.dumps({"good": "2030-01-01T00:00:00+00:00"}))
    assert main(["--config", str(cfg.path), "status", "--json"]) == 0
    status = {s["dataset"]: s for s in json.loads(capsys.readouterr().out)}
    good = status["good"]
    assert (good["version"], good["rows"], good["last_result"], good["last_published"]) == (1, 1, "ok", 2)
    assert good["last_changes"] == {"inserts": 1, "updates": 0, "deletes": 0}
    assert good["next_run"] == "2030-01-01T00:00:00+00:00" and good["schedule"] == {"every": 3600.0}
    assert status["bad"]["last_result"] is None and status["bad"]["version"] == 0

    assert main(["--config", str(cfg.path), "status", "--check"]) == 1  # bad was never published
    assert capsys.readouterr().err.strip() == "refresh: not healthy: dataset bad: never published"
    assert main(["status", "--config", str(cfg.path)]) == 0  # options also after the verb
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:4] == ["DATASET", "MODE", "VERSION", "ROWS"]
    assert any(line.split()[:4] == ["good", "diff", "1", "1"] and "2030-01-01 00:00:00" in line
               for line in text.splitlines())


def test_failed_dataset_is_one_line_and_non_zero_but_others_still_run(cli_config, mysql_engine, kafka, capsys):
    cfg, t, topic = cli_config
    assert main(["--config", str(cfg.path), "run"]) == 1
    captured = capsys.readouterr()
    assert "good: version 1" in captured.out
    err = [line for line in captured.err.splitlines() if line.startswith("refresh:")]
    assert len(err) == 1 and err[0].startswith("refresh: bad: dataset bad: ") and "bad.csv:3: expected 2 fields" in err[0]
    assert "Traceback" not in captured.err
    assert main(["--config", str(cfg.path), "status"]) == 0
    assert "bad: last error: dataset bad:" in capsys.readouterr().out
    assert main(["--config", str(cfg.path), "status", "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refresh: not healthy: dataset bad: last run failed: dataset bad:") and "good" not in err


def test_full_republishes(cli_config, kafka, capsys):
    cfg, t, topic = cli_config
    assert main(["--config", str(cfg.path), "run", "good"]) == 0
    assert main(["--config", str(cfg.path), "run", "good", "--full"]) == 0
    assert "good: version 2 (full)" in capsys.readouterr().out
    assert changes(read_topic(kafka, topic), 2) == {'{"id":1}': {"id": 1, "v": "a"}}


def test_config_and_usage_errors(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.yaml"), "status"]) == 2
    assert capsys.readouterr().err.strip() == f"refresh: config file {tmp_path / 'missing.yaml'} not found"
    p = tmp_path / "c.yaml"
    p.write_text("kafka: {bootstrap_servers: x:1}\ndatasets:\n  d:\n    source: {path: a.csv}\n    key: [id]\n"
                 "    mode: diffx\n")
    assert main(["--config", str(p), "run", "d"]) == 2
    assert capsys.readouterr().err.strip() == f"refresh: {p}: datasets.d.mode: 'diffx' is not one of diff, incremental"
    p.write_text("kafka: {bootstrap_servers: x:1}\ndatasets:\n  d:\n    source: {path: a.csv}\n    key: [id]\n")
    assert main(["--config", str(p), "run", "nope"]) == 2
    assert "no dataset 'nope' (known: d)" in capsys.readouterr().err


def test_python_m_refresh_entry_point(cli_config):
    cfg, _, _ = cli_config
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "refresh", "--config", str(cfg.path), "--log-level", "warning",
                           "run", "good"], capture_output=True, text=True, timeout=bound(120), env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "good: version 1 (diff)" in proc.stdout
    assert "good: snapshot:" not in proc.stderr  # no progress bar on a pipe or a log file
    proc = subprocess.run([sys.executable, "-m", "refresh", "--config", str(cfg.path), "run", "bad"],
                          capture_output=True, text=True, timeout=bound(120), env=env, cwd=ROOT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("refresh:")]
    assert lines == [f"refresh: bad: dataset bad: {cfg.path.parent / 'bad.csv'}:3: expected 2 fields, got 1: '2'"]


def run_cli(*args: str, stderr_tty: bool = False) -> tuple[int, str, str]:
    """``python -m refresh ARGS`` in a subprocess; stderr on a pseudo-terminal when ``stderr_tty``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "refresh", *args]
    if not stderr_tty:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=bound(120), env=env, cwd=ROOT)
        return proc.returncode, proc.stdout, proc.stderr
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a width
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(bound(60)), out, b"".join(chunks).decode(errors="replace")


def test_error_is_one_line_and_the_traceback_only_with_debug(cli_config):
    cfg, _, _ = cli_config  # without --debug: test_python_m_refresh_entry_point
    rc, _, err = run_cli("--config", str(cfg.path), "--debug", "run", "bad")
    assert rc == 1 and "Traceback (most recent call last)" in err
    assert err.splitlines()[-1] == \
        f"refresh: bad: dataset bad: {cfg.path.parent / 'bad.csv'}:3: expected 2 fields, got 1: '2'"


def test_progress_bar_on_a_terminal(cli_config):
    cfg, _, _ = cli_config
    rc, out, err = run_cli("--config", str(cfg.path), "--log-level", "warning", "run", "good", stderr_tty=True)
    assert rc == 0 and "good: version 1 (diff)" in out
    assert "good: snapshot: 0 rows" in err  # tqdm's bar, drawn on the terminal (on a pipe: see above)


def test_no_wait_fails_in_one_line_while_the_dataset_is_busy(cli_config, capsys):
    from refresh.stores.files import FileStateStore

    cfg, _, _ = cli_config
    with FileStateStore(cfg.state_dir).lock("good"):
        assert main(["--config", str(cfg.path), "run", "good", "--no-wait"]) == 1
    assert capsys.readouterr().err.strip() == "refresh: dataset good: a refresh is already running (lock held)"
    assert main(["--config", str(cfg.path), "run", "good", "--no-wait"]) == 0


def test_status_shows_the_watermark_of_an_incremental_dataset(make_config, tmp_path, unique, capsys):
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'inc.db'}"
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE m (id INTEGER PRIMARY KEY, v TEXT, seq INTEGER)",
            "INSERT INTO m VALUES (1, 'a', 5), (2, 'b', 7)")
    cfg = make_config({"m": {"source": {"url": url, "table": "m"}, "key": ["id"], "topic": unique("ref.m"),
                             "mode": "incremental", "incremental": {"column": "seq"}}})
    assert main(["--config", str(cfg.path), "run"]) == 0
    execute(engine, "INSERT INTO m VALUES (3, 'c', 9)")
    assert main(["--config", str(cfg.path), "run"]) == 0
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)[0]
    assert (st["version"], st["rows"], st["watermark"], st["last_kind"], st["last_result"]) == (2, 3, 9, "incremental", "ok")
    assert st["last_changes"] == {"inserts": 1, "updates": 0, "deletes": 0} and st["next_run"] is None
    assert main(["--config", str(cfg.path), "status"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["m", "incremental", "2"] and row[-2:] == ["9", "-"]  # watermark, next run
    engine.dispose()


def test_refused_deletes_are_one_line_unhealthy_and_forced_per_dataset(make_config, mysql_engine, mysql_url,
                                                                         unique, kafka, capsys):
    t, topic = unique("cli_del"), unique("ref.cli_del")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} SELECT seq FROM seq_1_to_10")
    cfg = make_config({"d": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": topic}})
    assert main(["--config", str(cfg.path), "run", "d"]) == 0
    execute(mysql_engine, f"DELETE FROM {t} WHERE id > 5")
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "run", "d"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("refresh:")]
    assert err == ["refresh: d: dataset d: would delete 5 of 10 rows (limit 0.1, max_delete_fraction); refused, "
                   "nothing published: a partial source? If the deletes are meant, run "
                   "`refresh run d --allow-deletes`"]
    assert main(["--config", str(cfg.path), "status", "--check"]) == 1
    assert capsys.readouterr().err.startswith("refresh: not healthy: dataset d: last run refused: dataset d: "
                                              "would delete 5 of 10 rows")
    assert main(["--config", str(cfg.path), "status"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:4] == ["d", "diff", "1", "10"] and table[1].split()[6] == "refused"
    assert table[2].startswith("d: last error: dataset d: would delete 5 of 10 rows")
    # Forcing is per named dataset: a blanket `run --allow-deletes` is a usage error.
    assert main(["--config", str(cfg.path), "run", "--allow-deletes"]) == 2
    assert "--allow-deletes needs the datasets named" in capsys.readouterr().err
    assert main(["--config", str(cfg.path), "run", "d", "--allow-deletes"]) == 0
    assert "d: version 2 (diff): 5 rows read, 0 inserts, 0 updates, 5 deletes" in capsys.readouterr().out
    assert changes(read_topic(kafka, topic), 2) == {f'{{"id":{i}}}': None for i in range(6, 11)}
    assert main(["--config", str(cfg.path), "status", "--check"]) == 0


def test_refresh_run_waits_for_a_file_being_appended_to(make_config, tmp_path, unique, kafka):
    import logging
    import threading

    p, topic = tmp_path / "growing.csv", unique("ref.growing")
    p.write_text("id,v\n1,a\n")
    cfg = make_config({"g": {"source": {"path": str(p), "stable_for": "1s"}, "key": ["id"], "topic": topic}})
    waiting = threading.Event()

    class OnWait(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for it to settle" in record.getMessage():
                waiting.set()

    logger, handler = logging.getLogger("refresh.sources.files"), OnWait()
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    rc: list[int] = []
    cli = threading.Thread(target=lambda: rc.append(main(["--config", str(cfg.path), "run", "g"])))
    cli.start()
    try:
        assert waiting.wait(bound(30)), "refresh run read the file without waiting for it to settle"
        with p.open("a") as f:  # the writer goes on while the run waits
            f.write("2,b\n3,c\n")
    finally:
        cli.join(60)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert rc == [0]
    assert changes(read_topic(kafka, topic)) == {'{"id":1}': {"id": 1, "v": "a"}, '{"id":2}': {"id": 2, "v": "b"},
                                                 '{"id":3}': {"id": 3, "v": "c"}}


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"refresh {importlib.metadata.version('refstream')}"


def _files(state_dir: Path) -> dict[str, bytes]:
    """Every file of a state directory with its bytes, but the lock files (a dry run takes the lock)."""
    return {str(p.relative_to(state_dir)): p.read_bytes() for p in sorted(state_dir.rglob("*"))
            if p.is_file() and p.name != "lock"}


def test_dry_run_reports_the_counts_and_publishes_and_commits_nothing(cli_config, mysql_engine, kafka, capsys):
    cfg, t, topic = cli_config
    # Never published: every row would go out, with the schema record.
    assert main(["--config", str(cfg.path), "run", "good", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == ("good: dry run (diff): 1 rows read; would publish 1 inserts, "
                                               "0 updates, 0 deletes, 2 messages; nothing published")
    assert read_topic(kafka, topic) == [] and _files(cfg.state_dir) == {}
    assert main(["--config", str(cfg.path), "run", "good"]) == 0
    assert "good: version 1 (diff): 1 rows read, 1 inserts, 0 updates, 0 deletes, 2 messages acknowledged" \
        in capsys.readouterr().out

    execute(mysql_engine, f"UPDATE {t} SET v = 'b' WHERE id = 1", f"INSERT INTO {t} VALUES (2, 'c'), (3, 'd')")
    records, state, ends = read_topic(kafka, topic), _files(cfg.state_dir), end_offsets(kafka, topic)
    assert main(["--config", str(cfg.path), "run", "good", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == ("good: dry run (diff): 3 rows read; would publish 2 inserts, "
                                               "1 updates, 0 deletes, 3 messages; nothing published")
    assert end_offsets(kafka, topic) == ends         # nothing produced, not even an aborted transaction
    assert read_topic(kafka, topic) == records       # the topic as it was
    assert _files(cfg.state_dir) == state            # committed state, snapshot and status as they were
    # The real run publishes what the dry run announced.
    assert main(["--config", str(cfg.path), "run", "good"]) == 0
    assert "good: version 2 (diff): 3 rows read, 2 inserts, 1 updates, 0 deletes, 3 messages acknowledged" \
        in capsys.readouterr().out
    assert len(read_topic(kafka, topic)) == len(records) + 3


def test_dry_run_of_a_refused_change_set_fails_without_recording_it(make_config, mysql_engine, mysql_url,
                                                                   unique, kafka, capsys):
    t = unique("cli_dry")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} SELECT seq FROM seq_1_to_10")
    cfg = make_config({"d": {"source": {"url": mysql_url, "table": t}, "key": ["id"], "topic": unique("ref.d")}})
    assert main(["--config", str(cfg.path), "run", "d"]) == 0
    execute(mysql_engine, f"DELETE FROM {t} WHERE id > 5")
    state = _files(cfg.state_dir)
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "run", "d", "--dry-run"]) == 1
    assert "refresh: d: dataset d: would delete 5 of 10 rows" in capsys.readouterr().err
    assert _files(cfg.state_dir) == state  # not recorded as a refused run
    assert main(["--config", str(cfg.path), "run", "d", "--dry-run", "--allow-deletes"]) == 0
    assert "would publish 0 inserts, 0 updates, 5 deletes, 5 messages" in capsys.readouterr().out


def test_json_log_format(cli_config):
    cfg, _, _ = cli_config
    rc, out, err = run_cli("--config", str(cfg.path), "--log-format", "json", "run", "good", "--dry-run")
    assert rc == 0 and "good: dry run (diff)" in out
    records = [json.loads(line) for line in err.splitlines()]  # every stderr line is one JSON object
    assert any(r["logger"] == "refresh.runner" and r["level"] == "INFO"
               and r["message"].startswith("dataset good: dry run (diff): read 1 rows") for r in records)
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    # With --debug a failure logs its traceback inside the record; the one-line error stays plain text.
    rc, _, err = run_cli("--config", str(cfg.path.parent / "missing.yaml"), "status", "--log-format", "json",
                         "--debug")
    assert rc == 2
    *logged, last = err.splitlines()
    assert last == f"refresh: config file {cfg.path.parent / 'missing.yaml'} not found"
    (record,) = [json.loads(line) for line in logged]
    assert record["message"] == "refresh status failed" and "Traceback" in record["exc"]


def test_dry_run_of_an_incremental_dataset_keeps_its_watermark(make_config, tmp_path, unique, kafka, capsys):
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'dry.db'}"
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE m (id INTEGER PRIMARY KEY, v TEXT, seq INTEGER)", "INSERT INTO m VALUES (1, 'a', 5)")
    topic = unique("ref.m")
    cfg = make_config({"m": {"source": {"url": url, "table": "m"}, "key": ["id"], "topic": topic,
                             "mode": "incremental", "incremental": {"column": "seq", "lag": 0}}})
    assert main(["--config", str(cfg.path), "run"]) == 0
    execute(engine, "INSERT INTO m VALUES (2, 'b', 7)", "UPDATE m SET v = 'c', seq = 8 WHERE id = 1")
    state, ends = _files(cfg.state_dir), end_offsets(kafka, topic)
    capsys.readouterr()
    assert main(["--config", str(cfg.path), "run", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == ("m: dry run (incremental): 2 rows read; would publish 1 inserts, "
                                               "1 updates, 0 deletes, 2 messages; nothing published")
    assert _files(cfg.state_dir) == state and end_offsets(kafka, topic) == ends
    assert main(["--config", str(cfg.path), "run"]) == 0
    assert "m: version 2 (incremental): 2 rows read, 1 inserts, 1 updates" in capsys.readouterr().out
    engine.dispose()
