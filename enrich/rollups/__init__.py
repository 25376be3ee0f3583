"""Windowed rollups: per ``by`` values and tumbling event-time window, metrics written as provisional
rows, one final row and corrections (the pure core: no Spark, no Kafka).

:mod:`~enrich.rollups.spec` says what a rollup computes, :mod:`~enrich.rollups.partial` turns a
micro-batch's events into mergeable partial aggregates, :mod:`~enrich.rollups.engine` folds them
into a bucket's state and writes the rows; :mod:`~enrich.rollups.sketch` holds the percentiles' KLL
sketches.
"""
