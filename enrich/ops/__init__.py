"""Operator tools that read a job's checkpoint and topics, while the job runs or after it stopped:
``enrich status`` (:mod:`enrich.ops.status`) and ``enrich lookup`` (:mod:`enrich.ops.lookup`)."""
