"""How a failed Kafka transaction is classed (``enrich.sinks.kafka.writer.classify``), without a broker."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from enrich.sinks.kafka.writer import classify
from refstream.errors import TerminalError, TransientError
from refstream.kafka import PRODUCERS, TRANSACTION_TIMEOUT_MS


def test_a_fence_is_terminal_unless_the_transaction_outlived_its_timeout() -> None:
    fenced = KafkaException(KafkaError(KafkaError.PRODUCER_FENCED))
    err = classify(fenced, "batch 3 slot 1", "tid-1", "out", open_for=2.0, timeout_ms=60_000)
    assert isinstance(err, TerminalError) and "another instance of this query is running?" in str(err)
    err = classify(fenced, "batch 3 slot 1", "tid-1", "out", open_for=59.0, timeout_ms=60_000)
    assert isinstance(err, TransientError)
    assert "open 59s, past its timeout (transaction.timeout.ms 60s)" in str(err)
    assert isinstance(classify(KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT)), "x", "t", "out"), TransientError)


def test_the_jobs_transactions_set_their_timeout() -> None:
    conf = PRODUCERS["transactional"].conf({"bootstrap.servers": "x"}, {})
    assert conf["transaction.timeout.ms"] == str(TRANSACTION_TIMEOUT_MS) and TRANSACTION_TIMEOUT_MS > 60_000
