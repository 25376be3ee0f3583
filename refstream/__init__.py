"""refstream: reference-data changelogs to Kafka and streaming enrichment of device events.

The ``refstream`` package holds what both long-running parts share: the changelog contract
(:mod:`refstream.contract`), configuration loading, error types, Kafka helpers and the embedded
broker used by the demo and the tests.
"""

__version__ = "0.1.0"
