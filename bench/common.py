"""What the benchmarks share: the broker they measure against."""

from __future__ import annotations

from contextlib import ExitStack


def broker_settings(stack: ExitStack, bootstrap: str | None) -> dict[str, str]:
    """Client settings for ``bootstrap``, or for an embedded broker that ``stack`` stops at exit."""
    if bootstrap:
        return {"bootstrap.servers": bootstrap}
    from demo.broker import EmbeddedBroker

    broker = stack.enter_context(EmbeddedBroker())
    return {"bootstrap.servers": broker.bootstrap}
