"""Error types shared by the refresher and the enrichment job.

Transient errors (a broker or database that may come back) are retried with backoff;
terminal errors (bad configuration, bad data) are reported once and never retried.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractError",
    "DataError",
    "RefstreamError",
    "TerminalError",
    "TransientError",
    "one_line",
]


class RefstreamError(Exception):
    """Base class of every error refstream raises on purpose."""


class TerminalError(RefstreamError):
    """Retrying cannot help: the input or the configuration must change."""


class TransientError(RefstreamError):
    """The operation may succeed if retried later (network, broker, database unavailable)."""


class ConfigError(TerminalError):
    """A configuration file is missing, malformed, or has a bad value; the message names the key."""


class DataError(TerminalError):
    """Source data is unusable (duplicate keys, malformed file, empty snapshot); the message names
    the dataset and the file, line or key at fault."""


class ContractError(TerminalError):
    """A changelog record does not follow the topic contract."""


def one_line(exc: BaseException) -> str:
    """``exc`` as one line for a person (CLI output, status files, logs): the first non-blank line of
    its message (Spark's and drivers' messages may carry whole stack traces), prefixed with the
    exception's type unless it is one of ours (whose messages are written to stand alone)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if isinstance(exc, RefstreamError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
