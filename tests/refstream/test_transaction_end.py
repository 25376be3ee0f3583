"""Transactions of two producers on one partition, ending at the same moment, batch after batch: every
committed record stays visible to read_committed readers (the producers ``refstream.kafka.producer``
builds end their transactions under ``transaction_end``, the embedded broker's workaround, which
tests/conftest.py turns on). Without it, this broker left the
partition's last stable offset stuck within 40 such batches in 4 of 6 trials."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable

import pytest

from refstream import kafka as rkafka
from refstream.kafka import SERIAL_TXN_ENDS_ENV

BATCHES, RECORDS = 40, 5


def ending_together(settings: dict[str, str], topic: str, tids: list[str]) -> None:
    """Each of ``tids`` writes ``RECORDS`` records per batch in a transaction; all commit at once."""
    barrier = threading.Barrier(len(tids))
    failures: list[BaseException] = []

    def slot(tid: str) -> None:
        try:
            for b in range(BATCHES):
                # A producer per batch, as the job's tasks have: its init_transactions ends nothing
                # here, but the broker bumps the epoch, which the race needs.
                p = rkafka.producer(settings, role="transactional", **{"transactional.id": tid})
                p.init_transactions(30)
                p.begin_transaction()
                for i in range(RECORDS):
                    p.produce(topic, f"{tid}:{b}:{i}".encode(), partition=0)
                p.flush(30)
                barrier.wait(30)  # the commits start together
                p.commit_transaction(30)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=slot, args=(t,)) for t in tids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures


@pytest.mark.integration
def test_concurrent_transaction_ends_on_one_partition_leave_every_commit_visible(
        kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    assert os.environ.get(SERIAL_TXN_ENDS_ENV), "tests/conftest.py turns the workaround on"
    topic = unique("txn-ends")
    rkafka.ensure_topic(kafka, topic)
    base = uuid.uuid4().hex[:8]
    ending_together(kafka, topic, [f"{base}-0", f"{base}-1"])
    got = [m.value() for m in rkafka.read_to_end(kafka, topic, timeout=20)]
    assert len(got) == 2 * BATCHES * RECORDS, f"{len(got)} of {2 * BATCHES * RECORDS} visible to read_committed"
