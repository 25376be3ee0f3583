"""The enrichment job: device events from Kafka joined with reference dimensions kept current from
their changelog topics, written to Kafka, Parquet or the console.

Python API: :func:`load_config` (a YAML file or a mapping, checked as the CLI checks a file) and
:class:`EnrichJob`. Importing this package does not import pyspark (the base install, the
refresher's, has none): :class:`EnrichJob` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from enrich.config import EnrichConfig, load_config

if TYPE_CHECKING:
    from enrich.job import EnrichJob

__all__ = ["EnrichConfig", "EnrichJob", "load_config"]


def __getattr__(name: str) -> Any:
    # Module-level __getattr__ (PEP 562): only an attribute not found otherwise lands here.
    if name == "EnrichJob":
        from enrich.job import EnrichJob

        globals()["EnrichJob"] = EnrichJob  # found directly from now on
        return EnrichJob
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
