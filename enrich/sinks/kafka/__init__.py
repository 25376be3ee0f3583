"""The Kafka output of the job, exactly once: the sink on the driver (:mod:`.sink`), the task
writers on the executors (:mod:`.tasks`), each writer's record of the batches it committed
(:mod:`.ledger`), the transaction helpers and the driver's own transactional writer (:mod:`.writer`);
the dead-letter records are :mod:`enrich.sinks.deadletter`'s.

The protocol (docs/architecture.md, "The Kafka sink's protocol"). Every Spark task of a micro-batch
writes its own partition of the output in its own Kafka transaction:

1. *slot* = the task's partition index. The plan has no shuffle after the state step, so it is the
   index of the task's input range (``KafkaStreamReader.partitions``: the same offsets give the same
   list) or state partition, and a task re-run, or the whole batch replayed after a crash, gets the
   same slot and the same rows;
2. a transactional producer with the id ``<base>-<slot>``: ``init_transactions`` fences any older
   producer of that id - a zombie attempt of this task, the task of a killed run - and aborts its
   open transaction;
3. the slot's ledger (the offsets of its own consumer group, :mod:`.ledger`) says which batch it
   committed last: at or past this batch, the task writes nothing. Nothing but the slot's own
   transactions can hold that answer back;
4. else the ledger records the attempt (the batch, and the output's written ends, probed before
   ``init_transactions``), and in one transaction: the task's enriched events to the output topic
   and its dead letters to the dead-letter topic (in row order: the order of events within an
   input partition is kept), then the batch as committed in the ledger
   (``send_offsets_to_transaction``).

A row flagged ``_slow`` (an event the fast parser left to ``from_json``) makes the task abort its
transaction and report ``redo``: the job writes that slot again from the ``from_json`` plan. The
task returns one row of counts; the driver collects only those.

Some Kafka-protocol brokers (the test broker among them) expose the records of an aborted
transaction to read_committed readers. A task whose ledger shows its previous attempt at the same
batch begun and not committed reads the records visible past the ends that attempt recorded, and
does not write those equal to its own (same input, same output) again. On Apache Kafka aborted
records never show, and that read finds nothing.

Without the Kafka sink (Parquet, console), the driver writes each batch's dead letters with one
:class:`.writer.TransactionalBatchWriter` transaction, skipped when its ledger says the batch is in.
"""
