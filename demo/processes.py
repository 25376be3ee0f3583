"""Child processes of the demo, each in its own process group so that stopping one stops everything it
started (the enrichment job's JVM and Python workers included), and nothing is left behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class ChildExited(RuntimeError):
    """A child the demo depends on has exited on its own."""


class Child:
    """One long-running child process; its output goes to ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, list(argv), log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # A new session: Ctrl-C in the terminal reaches the demo only, which stops children in order.
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        log.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        """Raise :class:`ChildExited` naming the child, its exit code and its last log line."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ChildExited(f"{self.name} exited with code {self.proc.returncode} "
                              f"(last line of {self.log_path}: {last_line(self.log_path)!r})")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the child, wait, then sweep its process group (SIGTERM, SIGKILL). Returns the exit code.

        Only the leader gets the first SIGTERM, as ``docker stop`` does: the enrichment job must stop
        its Spark query while the JVM it started is still alive; the JVM and Python workers are in its
        group and go with it (or with the sweep)."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # the session leader's pid is the group id
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", self.name, timeout)
        # The leader may be gone while grandchildren (a JVM, Python workers) linger: sweep the group.
        if _group_alive(pgid):
            _killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            _killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(5)
        return self.proc.returncode


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log file (for one-line error messages)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:limit] if lines else ""
