"""End offsets against the real broker: the last stable offset (``committed``) moves only when a
transaction ends; the plain end offset counts what an open transaction wrote."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from refstream import kafka as rkafka

pytestmark = pytest.mark.integration


def test_the_committed_end_waits_for_the_transaction_and_a_missing_topic_has_none(
        kafka: dict[str, str], unique: Callable[[str], str]) -> None:
    topic = unique("ends")
    assert rkafka.end_offsets(kafka, topic, committed=True) is None
    rkafka.ensure_topic(kafka, topic)
    p = rkafka.producer(kafka, **{"transactional.id": unique("ends-txn")})
    p.init_transactions()
    p.begin_transaction()
    for i in range(5):
        p.produce(topic, b"%d" % i)
    p.flush()
    assert rkafka.end_offsets(kafka, topic, committed=True) == {0: 0}  # open: nothing a reader may read
    written = rkafka.end_offsets(kafka, topic)
    assert written is not None and written[0] > 0
    p.commit_transaction()
    assert rkafka.end_offsets(kafka, topic, committed=True) == {0: 6}  # five records and the marker
