"""The enrichment job: device events from Kafka joined with reference dimensions kept current from
their changelog topics, written to Kafka, Parquet or the console.

Python API: :func:`load_config` (a YAML file or a mapping, checked as the CLI checks a file) and
:class:`EnrichJob`. Importing this package imports neither of them (nor pyspark, which the base
install, the refresher's, has not): each is imported on first use. The job's modules that Spark
runs in its Python processes (the source, the state step, the sinks) import only what they need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enrich.config import EnrichConfig, load_config
    from enrich.job import EnrichJob

__all__ = ["EnrichConfig", "EnrichJob", "load_config"]

_LAZY = {"EnrichConfig": "enrich.config", "load_config": "enrich.config", "EnrichJob": "enrich.job"}


def __getattr__(name: str) -> Any:
    # Module-level __getattr__ (PEP 562): only an attribute not found otherwise lands here.
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # found directly from now on
    return value
