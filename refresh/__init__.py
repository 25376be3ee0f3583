"""The refresher: snapshot reference tables and files, find changes, publish a Kafka changelog.

Entry points: :func:`refresh.config.load_config`, :class:`refresh.runner.Refresher`,
:func:`refresh.status.read_status`, the ``refresh`` CLI (:mod:`refresh.cli`).
"""
