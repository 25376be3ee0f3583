"""The refresher: snapshot reference tables and files, find changes, publish a Kafka changelog.

Python API (docs/api.md): :func:`load_config` (a YAML file or a mapping, checked as the CLI checks a
file), :class:`RefreshConfig`, :class:`Refresher` (runs of the datasets of one config) and
:class:`RunResult` (what a run did). Entry points: the ``refresh`` CLI (:mod:`refresh.cli`).
:class:`Refresher` is imported on first use: loading a config needs neither pyarrow nor a Kafka client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from refresh.config import RefreshConfig, load_config

if TYPE_CHECKING:
    from refresh.runner import Refresher, RunResult

__all__ = ["RefreshConfig", "Refresher", "RunResult", "load_config"]

_LAZY = {"Refresher": "refresh.runner", "RunResult": "refresh.runner"}


def __getattr__(name: str) -> Any:
    # Module-level __getattr__ (PEP 562): only an attribute not found otherwise lands here.
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
