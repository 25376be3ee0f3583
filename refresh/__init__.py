"""The refresher: snapshot reference tables and files, find changes, publish a Kafka changelog.

Entry points: :func:`load_config` (a YAML file or a mapping, checked as the CLI checks a file),
:class:`refresh.runner.Refresher`, :func:`refresh.status.read_status`, the ``refresh`` CLI
(:mod:`refresh.cli`).
"""

from refresh.config import RefreshConfig, load_config

__all__ = ["RefreshConfig", "load_config"]
