"""Durable per-dataset state under ``state_dir``: snapshots, committed state, run status, locks."""

__all__: list[str] = []
