"""Reference dimensions: changelog topics followed by the driver, shipped to executors as Arrow.

See docs/dimension.md for how versions are pinned per micro-batch and why an unchanged dimension
costs nothing per batch.
"""
