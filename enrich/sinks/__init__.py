"""Where enriched events go: Kafka (exactly-once), a database table (exactly-once, alone or with Kafka),
Parquet (a directory per batch), console."""

from __future__ import annotations

from collections.abc import Sequence

from enrich.config import EnrichConfig
from enrich.sinks.abc import Counted, EnrichedBatch, Sink

__all__ = ["Counted", "EnrichedBatch", "Sink", "make_sink"]


def make_sink(cfg: EnrichConfig, scope: str | None = None, transactional_id: str | None = None,
              event_fields: Sequence[str] = ()) -> Sink:
    """The configured sink; ``scope`` identifies the query and ``transactional_id`` is the base of
    the Kafka sink's transactional ids, or of the database output's dead letters' (see
    :mod:`enrich.sinks.kafka`; the checkpoint's, from
    :class:`enrich.sinks.identity.SinkIdentity`); ``event_fields``: the events' own columns (the
    database output's ``write: state`` rows hold the others)."""
    out = cfg.output
    if out.database is not None:
        assert scope is not None
        if out.kind == "kafka":
            from enrich.sinks.database.kafka import DatabaseKafkaSink

            assert transactional_id is not None
            return DatabaseKafkaSink(cfg, event_fields, transactional_id, scope)
        from enrich.sinks.database.sink import DatabaseSink

        return DatabaseSink(cfg, event_fields, scope, transactional_id)
    if out.kind == "kafka":
        from enrich.sinks.kafka.sink import KafkaSink

        assert out.topic is not None and transactional_id is not None
        return KafkaSink(cfg.kafka, out.topic, transactional_id, cfg.dead_letter_topic, scope)
    if out.kind == "parquet":
        from enrich.sinks.parquet import ParquetSink

        assert out.path is not None
        return ParquetSink(out.path)
    from enrich.sinks.console import ConsoleSink

    return ConsoleSink(out.rows)
