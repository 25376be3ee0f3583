"""Where snapshots come from: SQL (:mod:`refresh.sources.sql`) and files (:mod:`refresh.sources.files`)."""

from __future__ import annotations

from refresh.config import DatasetConfig, SqlSourceConfig
from refresh.sources.abc import Source

__all__ = ["open_source"]


def open_source(ds: DatasetConfig) -> Source:
    """The source of ``ds`` (imports the implementation it needs only)."""
    if isinstance(ds.source, SqlSourceConfig):
        from refresh.sources.sql import SqlSource

        return SqlSource(ds.name, ds.source, ds.key)
    from refresh.sources.files import FileSource

    return FileSource(ds.name, ds.source)
