"""Gaps: a device's silence judged against its expected cadence, in the time its own source
partition has reached (the pure core: no Spark, no Kafka).

:mod:`~enrich.gaps.config` is the ``gaps:`` section, :mod:`~enrich.gaps.engine` one bucket's devices
per micro-batch: gaps opened, closed and retracted, with their records; :mod:`~enrich.gaps.sources`
the source partitions that went quiet (``source_idle``) and came back.
"""
