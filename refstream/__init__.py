"""refstream: reference-data changelogs to Kafka and streaming enrichment of device events.

The ``refstream`` package holds what both long-running parts share: the changelog contract
(:mod:`refstream.contract`), configuration loading, error types, retry, Kafka helpers and atomic
writes. It imports no other package of the project (see docs/architecture.md, "Where things live").
"""

import importlib.metadata

__all__ = ["__version__", "version"]


def version() -> str:
    """The installed version of the ``refstream`` distribution (pyproject.toml's), as every CLI's
    ``--version`` prints it."""
    try:
        return importlib.metadata.version("refstream")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree never installed
        return "unknown (not installed)"


__version__ = version()
