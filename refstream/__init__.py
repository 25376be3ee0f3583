"""refstream: reference-data changelogs to Kafka and streaming enrichment of device events.

The ``refstream`` package holds what both long-running parts share: the changelog contract
(:mod:`refstream.contract`), configuration loading, error types, retry, Kafka helpers and atomic
writes. It imports no other package of the project (see docs/architecture.md, "Where things live").
"""

__version__ = "0.1.0"
