"""Benchmarks (``python -m bench.run NAME``, see bench/run.py); results in docs/benchmarks.md.
Diagnostic tools (profilers, the event-log reader) are in :mod:`bench.tools`."""
