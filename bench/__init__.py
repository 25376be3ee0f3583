"""Benchmarks (``python -m bench.<name>``); results in docs/benchmarks.md."""
