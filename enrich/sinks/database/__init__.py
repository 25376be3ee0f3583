"""The database output of the job, exactly once: ``output.database`` (PostgreSQL, MySQL/MariaDB).

- :mod:`.connect`: connections from the config's URL, and each database's bulk upsert;
- :mod:`.tables`: the table (created if missing, the key as primary key, columns typed from the
  pipeline's output schema) and its fence table ``<table>_commits (query_id, slot, batch_id)``;
- :mod:`.slots`: one task's rows and fence row in ONE database transaction;
- :mod:`.sink`: the sink on the driver and the ``mapInArrow`` writer of the tasks;
- :mod:`.kafka`: the database together with Kafka (a slot's Kafka transaction commits only after its
  database transaction has);
- :mod:`.lookup`: ``enrich lookup --state`` answered from the table.

The protocol: every Spark task of a micro-batch writes its partition of the output (its *slot*,
the task's partition index, the same on a replay: see :mod:`enrich.sinks.kafka`) in one database
transaction that first inserts the fence row ``(query id, slot, batch id)`` and then upserts the
rows. A replayed batch whose fence row is committed writes nothing; two attempts of one slot at
once serialise on the fence row's primary key, and the second writes nothing. No two-phase commit,
no coordinator: the fence row and the rows commit together or not at all.
"""
