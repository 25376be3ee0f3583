"""The internal column names of the job's rows, in one place. Nothing here is a user's column: an
event field or a join column that clashes with one of these is refused when the pipeline is planned.

Events (:mod:`enrich.events`): ``_error`` (why a row is a dead letter, null for a good event), the
Kafka columns kept as ``_key``, ``_value``, ``_topic``, ``_partition``, ``_offset``, and ``_slow`` (an
event the fast parser left to ``from_json``). The state step (:mod:`enrich.state`) adds ``state`` and
``_late``, and uses ``_bucket``, ``_ts_us``, ``_max_ts``, ``_batch_time``, ``_state_<field>`` and the packed
``rows`` on its way. The Kafka sink's rows (:mod:`enrich.sinks.kafka`) flag ``_unmatched`` events.
"""

from __future__ import annotations

__all__ = ["BATCH_TIME", "BUCKET", "CORRUPT", "DELETED", "ERROR", "FLAT", "CAUSE", "CORRECTION", "IDENTITY", "INTERNAL", "KIND", "KIND_CORRECTION", "KIND_EVENT", "RETRACTED", "REVISION", "TAIL", "KEY_BYTES", "LATE", "LATE_AT_READ", "MAX_TS", "PACK_KIND", "PROVISIONAL", "RBUCKET", "ROLLUP_TIME",
           "ROWS", "SLOW", "SOURCE", "STATE", "TS_US", "UNMATCHED",
           "VALID_FROM"]

#: Why an event is a dead letter (null for a good one).
ERROR = "_error"
#: ``from_json``'s column of a value that does not fit the schema.
CORRUPT = "_corrupt_record"
#: Set by the fast parser (``enrich.events.fastparse``) on events it leaves to Spark's ``from_json``.
SLOW = "_slow"
#: Kafka columns carried along for the dead-letter topic and the output key: internal name -> Kafka's.
SOURCE = {"_key": "key", "_value": "value", "_topic": "topic", "_partition": "partition", "_offset": "offset"}
#: Where an event was read: what makes each event, and each output record, one of its own.
IDENTITY = ("_topic", "_partition", "_offset")
#: What an output record is (``event``; a correction of one is ``correction``): the last field of
#: every enriched event the job writes, after its identity.
KIND, KIND_EVENT, KIND_CORRECTION = "_kind", "event", "correction"
#: With corrections (enrich.state.corrections), after ``_kind``: the record's revision of its event
#: (0: as first written), a correction's cause, and whether it retracts its event (an inner join
#: lost its match: a fresh job would not write the event).
REVISION, CAUSE, RETRACTED = "_revision", "_cause", "_retracted"
#: What ends every enriched event after its identity (the columns present of these).
TAIL = (KIND, REVISION, CAUSE, RETRACTED)
#: The columns the output leaves out (the identity and the tail are added again at its end).
INTERNAL = (ERROR, *SOURCE, SLOW, *TAIL)

#: The columns the state step adds to every event: the device's state struct and the late flag.
STATE, LATE = "state", "_late"
#: The state step's grouping key, and each event's time in microseconds on its way through the step.
BUCKET, TS_US = "_bucket", "_ts_us"
#: The prefix of the flat state fields the step emits (folded into ``state`` after it).
FLAT = "_state_"
#: A packed chunk's greatest event time (the watermark's column) and its Arrow IPC rows.
MAX_TS, ROWS = "_max_ts", "rows"
#: The rollup step's input (enrich.state.rollups): its grouping key, the event time Spark's
#: watermark follows through the state step (just after the batch's watermark), and what a packed
#: value holds (events, a rollup's partials or rows, dead letters, counts).
RBUCKET, ROLLUP_TIME, PACK_KIND = "_rbucket", "_rollup_time", "_pack_kind"
#: The micro-batch's time (``current_timestamp()``, kept in the offset log): what an event's time is
#: checked against for ``state.max_future_skew`` on its way into the state step.
BATCH_TIME = "_batch_time"
#: A dimension row's canonical key bytes (the broadcast store's, a partitioned dimension's stored rows).
KEY_BYTES = "__key"
#: A broadcast dimension's overlay row that is a tombstone (an as-of dimension's version too).
DELETED = "__deleted"
#: When an as-of dimension's version holds from (its ``valid_from``, UTC microseconds).
VALID_FROM = "__valid_from"

#: Set on every event when some join waits for completeness (``joins[].wait``): true on an event the
#: state step released because ``max_wait`` expired before its datasets were complete as of its time.
PROVISIONAL = "_provisional"
#: A held event's late flag, as judged against the watermark of the batch that first read it.
LATE_AT_READ = "_late_at_read"

#: The Kafka sink's flag of an event some join found no row for.
UNMATCHED = "_unmatched"
#: The Kafka sink's flag of a correction (counted apart from the events; never unmatched or late).
CORRECTION = "_correction"
