"""The percentiles' KLL quantile sketches (Apache DataSketches' ``kll_doubles_sketch``), serialized.

A sketch of ``k`` = :data:`KLL_K` keeps every value while it holds fewer than ``k`` (no compaction
yet): its quantiles are then exact. Beyond that it compacts, at random, and a quantile it returns has
a true rank within :data:`KLL_RANK_ERROR` of the rank asked for (1.33 % for k = 200: DataSketches'
fit to the 99th percentile of the error it measured over many trials). Sketches merge with the same guarantee, which is what lets micro-batches and
corrections fold into a window's percentiles without its values.

Quantiles are read inclusively: ``p95`` is the least value with at least 95 % of the values at or
below it (the nearest-rank percentile, numpy's ``inverted_cdf``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from datasketches import kll_doubles_sketch

KLL_K = 200
#: The single-quantile normalized rank error of a sketch of :data:`KLL_K` (0.0133 for k = 200).
KLL_RANK_ERROR: float = kll_doubles_sketch.get_normalized_rank_error(KLL_K, False)


def build(values: np.ndarray) -> bytes:
    """A serialized sketch of ``values`` (float64, finite: the caller drops what is ignored)."""
    sketch = kll_doubles_sketch(KLL_K)
    sketch.update(np.ascontiguousarray(values, dtype=np.float64))
    return bytes(sketch.serialize())


def merge(parts: Sequence[bytes]) -> bytes:
    """One serialized sketch of the values of ``parts`` (one part comes back as it was)."""
    if len(parts) == 1:
        return parts[0]
    sketch = kll_doubles_sketch.deserialize(parts[0])
    for part in parts[1:]:
        sketch.merge(kll_doubles_sketch.deserialize(part))
    return bytes(sketch.serialize())


def quantiles(data: bytes, ranks: Sequence[float]) -> list[float | None]:
    """The sketch's quantiles at the normalized ``ranks``; None for an empty sketch."""
    sketch = kll_doubles_sketch.deserialize(data)
    if sketch.is_empty():
        return [None] * len(ranks)
    return list(sketch.get_quantiles(list(ranks), True))
