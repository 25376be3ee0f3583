"""The kill hook of the restart tests: a Kafka sink task that kills its own Python worker inside its
transaction, after sending its first records and before its commit.

Run the job through it: ``python -m tests.enrich.kill BATCH[+]:SLOT|*:FLAG run --config F ...``. It
replaces the sink's task writer with :class:`KillingTaskWriter` and runs ``enrich``'s CLI; the
writer travels to the workers pickled (its class by reference: the workers import this module, so
``tests`` must be on their ``PYTHONPATH``). The first task of ``SLOT`` (``*``: any) writing records in
batch ``BATCH`` (``+``: or a later one) kills its worker, once: ``FLAG`` is created first.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from confluent_kafka import Producer

from enrich.sinks.kafka.tasks import TaskWriter


@dataclass(frozen=True)
class KillPoint:
    """Which task kills its worker (see the module doc); ``from_spec`` reads ``BATCH[+]:SLOT|*:FLAG``."""

    batch_id: int
    slot: int | None
    flag: str
    later: bool = False

    @classmethod
    def from_spec(cls, value: str) -> KillPoint:
        batch, slot, flag = value.split(":", 2)
        return cls(int(batch.rstrip("+")), None if slot == "*" else int(slot), flag, batch.endswith("+"))

    def picks(self, batch_id: int, slot: int) -> bool:
        """Whether the task of ``slot`` in ``batch_id`` is the one (the first time only)."""
        if batch_id < self.batch_id or (batch_id != self.batch_id and not self.later):
            return False
        if self.slot is not None and slot != self.slot:
            return False
        try:  # once, also when tasks of two slots get here together
            fd = os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return True


@dataclass(frozen=True)
class KillingTaskWriter(TaskWriter):
    kill: KillPoint | None = None

    def sent(self, slot: int, producer: Producer) -> None:
        if self.kill is not None and self.kill.picks(self.batch_id, slot):
            producer.flush(30)  # the records reach the broker, the commit never does
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    import functools

    from enrich import cli
    from enrich.sinks.kafka import sink

    point = KillPoint.from_spec(argv[0])
    sink.TaskWriter = functools.partial(KillingTaskWriter, kill=point)  # type: ignore[misc]
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
