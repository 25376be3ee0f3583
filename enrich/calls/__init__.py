"""External calls whose results feed the device state (``calls:`` in enrich.yaml, docs/state.md).

Inside the state step, per bucket of devices and micro-batch: after the state update, every call
the bucket's events need is issued at once (a device's calls in event-time order, chained by
``needs``), the responses recorded in the checkpoint before any output row of the bucket is
written, and the results written back into the device state.

- :mod:`enrich.calls.config`: the ``calls:`` section (frozen dataclasses, the ``needs`` graph).
- :mod:`enrich.calls.template`: request bodies from event fields, state fields and earlier results.
- :mod:`enrich.calls.fields`: the typed result columns ``<name>_<field>``.
- :mod:`enrich.calls.client`: the HTTP client (aiohttp, one session per Python worker).
- :mod:`enrich.calls.record`: the responses a bucket received in a batch, kept for replays.
- :mod:`enrich.calls.step`: one bucket's calls in one micro-batch.
"""
