"""Transactions of two producers on one partition, ending at the same moment, batch after batch: every
committed record stays visible to read_committed readers (the producers ``refstream.kafka.producer``
builds end their transactions under ``transaction_end``, the embedded broker's workaround, which
tests/conftest.py turns on). Without it, this broker left the
partition's last stable offset stuck within 40 such batches in 4 of 6 trials."""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from refstream import kafka as rkafka
from refstream.kafka import SERIAL_TXN_ENDS_ENV, SERIAL_TXNS_ENV
from tests.timing import bound

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
                barrier.wait(bound(30))  # the commits start together
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
    got = [m.value() for m in rkafka.read_to_end(kafka, topic, timeout=bound(20))]
    assert len(got) == 2 * BATCHES * RECORDS, f"{len(got)} of {2 * BATCHES * RECORDS} visible to read_committed"


def _chain_link(settings: dict[str, str], topic: str, tid: str, parts: list[int], ready: Any, after: Any,
                opened: Any, wait_for: Any) -> None:
    """One process of the chain below: once all are ready, begin once ``after`` is set (if given),
    write ``parts``, say so (``opened``), then commit once ``wait_for`` is set or 3 s have passed."""
    p = rkafka.producer(settings, role="transactional", **{"transactional.id": tid})
    p.init_transactions(30)
    ready.wait(bound(60))
    if after is not None:
        after.wait(bound(60))
    p.begin_transaction()
    for part in parts:
        for i in range(RECORDS):
            p.produce(topic, f"{tid}:{part}:{i}".encode(), partition=part)
    p.flush(30)
    opened.set()
    if wait_for is not None:
        wait_for.wait(3)
    p.commit_transaction(30)


@pytest.mark.integration
def test_transactions_of_processes_that_would_end_beside_open_ones_all_become_visible(
        kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    """Three processes (as a job's Python workers are): A writes partition 0 and would commit while B
    is open there; B writes 0 and 1 and would commit while C is open on 1; C commits last. The
    embedded broker completes B and C at C's end but never A, whose partition's last stable offset
    then stays put for good (every run, without ``SERIAL_TXNS_ENV``); under the lock each process's
    transaction waits for the other's end, and every record is visible."""
    assert os.environ.get(SERIAL_TXNS_ENV), "tests/conftest.py turns the workaround on"
    topic = unique("txn-chain")
    rkafka.ensure_topic(kafka, topic, partitions=2)
    ctx = multiprocessing.get_context("spawn")
    ready, a_open, b_open, c_open = ctx.Barrier(3), ctx.Event(), ctx.Event(), ctx.Event()
    base = uuid.uuid4().hex[:8]
    links = [(f"{base}-a", [0], None, a_open, b_open), (f"{base}-b", [0, 1], a_open, b_open, c_open),
             (f"{base}-c", [1], b_open, c_open, None)]
    procs = [ctx.Process(target=_chain_link, args=(kafka, topic, tid, parts, ready, *events))
             for tid, parts, *events in links]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    got = [m.value() for m in rkafka.read_to_end(kafka, topic, timeout=bound(20))]
    assert len(got) == 4 * RECORDS, f"{len(got)} of {4 * RECORDS} visible to read_committed"


def test_a_process_that_waits_too_long_for_the_open_transaction_lock_names_its_holder(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each taker writes who it is into the lock; the error of a waiter past ``SERIAL_TXNS_WAIT`` says it."""
    import fcntl

    path = tmp_path / "open-txn.lock"
    monkeypatch.setenv(SERIAL_TXNS_ENV, str(path))
    monkeypatch.setattr(rkafka, "SERIAL_TXNS_WAIT", 0.2)
    first = rkafka._OpenTransactions()
    first.acquire()
    assert path.read_text().startswith(f"pid {os.getpid()} since ")
    first.release()
    with open(path, "a+b") as other:  # another open file: its lock conflicts, as another process's does
        fcntl.flock(other, fcntl.LOCK_EX)
        other.truncate(0)
        other.write(b"pid 4242 since 12:00:00: python -m enrich run")
        other.flush()
        with pytest.raises(TimeoutError, match=r"held by pid 4242 since 12:00:00: python -m enrich run"):
            rkafka._OpenTransactions().acquire()
