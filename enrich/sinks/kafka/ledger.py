"""Where a transactional writer of the job records the batches it committed: the offsets of a
consumer group of its own (Kafka's transactional offset commits, KIP-447), never records in a
shared topic.

A writer with transactional id ``T`` in a query of scope ``S`` owns the group ``T.S``. It keeps
offsets on partitions of the ledger topic ``<output>.refstream-ledger`` (two partitions, never
written to: a namespace for the offsets):

- partition 0 (:data:`COMMITTED`): ``batch + 1`` of the last batch committed, sent with
  ``send_offsets_to_transaction`` inside the batch's transaction: it commits with the data or not
  at all;
- partition 1 (:data:`BEGUN`): ``batch + 1`` of the last batch an attempt began, committed before
  the transaction begins, together with the written ends of the partitions the attempt writes, as
  that group's offsets on those partitions: where its records start (:class:`Entry`).

Reading them (an OffsetFetch of the group) waits for nothing but the group's own pending
transactional commit, which the writer's ``init_transactions`` has just completed or aborted.
Records in a shared topic, read at read_committed, wait behind every transaction open on their
partition - another task's, a killed worker's, another job's - and a writer that does not see its
own marker writes its batch again.

The begun batch and its ends serve brokers that expose the records of aborted transactions to
read_committed readers (the test broker among them): a writer that finds its previous attempt at
the same batch begun and not committed reads the records visible past those ends and does not write
them again. On Apache Kafka aborted records never show, and that read finds nothing. The test broker
also keeps a committed transaction - its records and its offsets - hidden while an older
transaction is open on a partition it wrote, so there a previous attempt that committed can look
unfinished: the writer first waits (bounded) until the partitions' read_committed ends reach their
written ends, so that every older transaction has ended, and then reads what a read_committed
consumer sees. Only records a consumer sees count as written: reading uncommitted records would
count an aborted attempt's as written wherever the broker hides them, and lose them.

A broker drops a group's offsets ``offsets.retention.minutes`` (Kafka's default: 7 days) after its
last commit, and with the topic they are on: a job stopped for longer, or whose ledger topic was
deleted, has lost the record of its last batch; the job refuses to start without the ledger topic
(:mod:`enrich.sinks.identity`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, Producer, TopicPartition

from refstream.kafka import consumer, ensure_topic

__all__ = ["BEGUN", "COMMITTED", "LEDGER_SUFFIX", "Entry", "Ledger", "ensure_ledger", "group_of", "ledger_topic"]

LEDGER_SUFFIX = ".refstream-ledger"
#: The ledger topic's partitions: the last batch committed, the last batch begun (``batch + 1``).
COMMITTED, BEGUN = 0, 1

TP = tuple[str, int]


def ledger_topic(topic: str) -> str:
    """The ledger topic of the writers to ``topic``."""
    return topic + LEDGER_SUFFIX


def ensure_ledger(settings: Mapping[str, str], topic: str) -> str:
    """Create ``topic``'s ledger topic if missing; its name."""
    name = ledger_topic(topic)
    ensure_topic(settings, name, partitions=2)
    return name


def group_of(transactional_id: str, scope: str | None) -> str:
    """The consumer group whose offsets are the ledger of ``transactional_id`` in ``scope``: a new
    query on a recreated checkpoint path (another scope, batch ids from 0 again) starts empty."""
    return f"{transactional_id}.{scope}" if scope else transactional_id


@dataclass(frozen=True)
class Entry:
    """What a writer's ledger says: the last batch committed, the last batch begun (None: none),
    and where the begun attempt's records start, per partition it writes."""

    committed: int | None
    begun: int | None
    ends: dict[TP, int]

    @property
    def unfinished(self) -> int | None:
        """The batch an attempt began and did not commit, if the last one did so."""
        if self.begun is not None and (self.committed is None or self.committed < self.begun):
            return self.begun
        return None


class Ledger:
    """The ledger of one transactional writer (see the module doc)."""

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str, scope: str | None, *,
                 timeout: float = 60.0) -> None:
        self.topic, self.timeout = topic, timeout
        self.group = group_of(transactional_id, scope)
        # Never joins its group: it only reads and commits the group's offsets.
        self._consumer: Consumer = consumer(settings, role="reader", **{"group.id": self.group})

    def read(self, written: Iterable[TP] = ()) -> Entry:
        """The ledger as the broker holds it, with the offsets kept on the ``written`` partitions."""
        written = list(written)
        tps = [TopicPartition(self.topic, COMMITTED), TopicPartition(self.topic, BEGUN),
               *(TopicPartition(t, p) for t, p in written)]
        got = self._consumer.committed(tps, timeout=self.timeout)
        for tp in got:
            if tp.error is not None:
                raise KafkaException(tp.error)
        committed, begun, *ends = (tp.offset for tp in got)
        return Entry(committed=committed - 1 if committed >= 0 else None, begun=begun - 1 if begun >= 0 else None,
                     ends={tp: o for tp, o in zip(written, ends, strict=True) if o != OFFSET_INVALID and o >= 0})

    def begin(self, batch_id: int, ends: Mapping[TP, int]) -> None:
        """Record, before the transaction begins, that an attempt at ``batch_id`` writes past ``ends``."""
        tps = [TopicPartition(self.topic, BEGUN, batch_id + 1), *(TopicPartition(t, p, o) for (t, p), o in ends.items())]
        self._consumer.commit(offsets=tps, asynchronous=False)

    def commit_in(self, producer: Producer, batch_id: int) -> None:
        """Send ``batch_id`` as committed into ``producer``'s open transaction."""
        producer.send_offsets_to_transaction([TopicPartition(self.topic, COMMITTED, batch_id + 1)],
                                             self._consumer.consumer_group_metadata(), self.timeout)

    def close(self) -> None:
        self._consumer.close()

