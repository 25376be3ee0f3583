"""The Kafka output of the job, exactly once: the sink on the driver (:mod:`.sink`), the task
writers on the executors (:mod:`.tasks`), the transaction and marker helpers both use, and the
driver's own transactional writer (:mod:`.writer`); the dead-letter records are
:mod:`enrich.sinks.deadletter`'s.

The protocol (docs/architecture.md, "The Kafka sink's protocol"). Every Spark task of a micro-batch
writes its own partition of the output in its own Kafka transaction:

1. *slot* = the task's partition index. The plan has no shuffle, so it is the index of the task's
   input range (``KafkaStreamReader.partitions``: the same offsets give the same list), and a task
   re-run, or the whole batch replayed after a crash, gets the same slot;
2. a transactional producer with the id ``<base>-<slot>``: ``init_transactions`` fences any older
   producer of that id - a zombie attempt of this task, the task of a killed run - and aborts its
   open transaction;
3. the last marker record of that id in ``<topic>.refstream-commits`` (key: the transactional id)
   says which batch the slot committed last: at or past this batch, the task writes nothing;
4. else, in one transaction: a ``begin`` record in the marker topic (with the output's written ends,
   committed or not, probed before ``init_transactions``), the task's enriched events to the output
   topic and its dead letters to the dead-letter topic (in row order: the order of events within an
   input partition is kept), then the commit marker ``{"batch_id", "slot", ...}``.

A row flagged ``_slow`` (an event the fast parser left to ``from_json``) makes the task abort its
transaction and report ``redo``: the job writes that slot again from the ``from_json`` plan.

One transactional id per slot and batches run one after the other, so one marker per id says it all
(the marker topic is compacted: its size is bounded by the number of slots). The task returns one
row of counts; the driver collects only those.

Some Kafka-protocol brokers (the test broker among them) expose the records of an aborted
transaction to read_committed readers. The ``begin`` record is how a task sees that this happened to
its slot's previous attempt at the same batch: it is then the last record of the id, with no commit
marker after it. Only then are the records visible since the ends that ``begin`` record names read
back, and those equal to this task's records (same input, same output) are not written again. On
Apache Kafka aborted records never show, and this path never runs.

Without the Kafka sink (Parquet, console), the driver writes each batch's dead letters with one
:class:`.writer.TransactionalBatchWriter` transaction, skipped when its marker says the batch is in.
"""
