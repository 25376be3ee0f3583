"""The percentiles' sketches: a window's values while it has few, a KLL quantile sketch (Apache
DataSketches' ``kll_doubles_sketch``) beyond that; serialized, one binary value per window.

A window of at most :data:`KLL_K` values keeps them as they are (*exact*: a zero byte, then the
values as little-endian float64): most windows of a per-device rollup hold a handful of events, and
their sketches are then built, merged and read by numpy over a whole table at once, with no Python
call per window. Beyond ``k`` values a window holds a KLL sketch of ``k`` = :data:`KLL_K`, which
compacts at random: a quantile it returns has a true rank within :data:`KLL_RANK_ERROR` of the rank
asked for (1.33 % for k = 200: DataSketches' fit to the 99th percentile of the error it measured over
many trials). Sketches merge with the same guarantee, which is what lets micro-batches and
corrections fold into a window's percentiles without its values. (A KLL sketch's first byte, its
preamble's size, is never zero.)

Quantiles are read inclusively: ``p95`` is the least value with at least 95 % of the values at or
below it (the nearest-rank percentile, numpy's ``inverted_cdf``), as KLL reads them; an exact
window's are exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasketches import kll_doubles_sketch

KLL_K = 200
#: The single-quantile normalized rank error of a sketch of :data:`KLL_K` (0.0133 for k = 200).
KLL_RANK_ERROR: float = kll_doubles_sketch.get_normalized_rank_error(KLL_K, False)

_EXACT = b"\x00"


def _values(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f8", offset=1)


def build(values: np.ndarray) -> bytes:
    """A serialized sketch of ``values`` (float64, finite: the caller drops what is ignored)."""
    values = np.ascontiguousarray(values, dtype="<f8")
    if len(values) <= KLL_K:
        return _EXACT + values.tobytes()
    sketch = kll_doubles_sketch(KLL_K)
    sketch.update(values)
    return bytes(sketch.serialize())


def merge(parts: Sequence[bytes]) -> bytes:
    """One serialized sketch of the values of ``parts`` (one part comes back as it was)."""
    if len(parts) == 1:
        return parts[0]
    exact = [_values(p) for p in parts if p[:1] == _EXACT]
    kll = [p for p in parts if p[:1] != _EXACT]
    values = np.concatenate(exact) if exact else np.zeros(0)
    if not kll:
        return build(values)
    sketch = kll_doubles_sketch.deserialize(kll[0])
    for part in kll[1:]:
        sketch.merge(kll_doubles_sketch.deserialize(part))
    if len(values):
        sketch.update(np.ascontiguousarray(values))
    return bytes(sketch.serialize())


def quantiles(data: bytes, ranks: Sequence[float]) -> list[float | None]:
    """The sketch's quantiles at the normalized ``ranks``; None for an empty sketch."""
    if data[:1] == _EXACT:
        values = np.sort(_values(data))
        if not len(values):
            return [None] * len(ranks)
        return [float(values[_nearest(r, len(values))]) for r in ranks]
    sketch = kll_doubles_sketch.deserialize(data)
    if sketch.is_empty():
        return [None] * len(ranks)
    return list(sketch.get_quantiles(list(ranks), True))


def _nearest(rank: float | np.ndarray, n: int | np.ndarray) -> np.ndarray:
    """The index in ``n`` sorted values of the inclusive quantile at ``rank``: the first whose
    cumulative count reaches ``ceil(rank * n)`` (DataSketches' reading, in the same float64 steps)."""
    return np.maximum(np.ceil(np.multiply(rank, n)), 1).astype(np.int64) - 1


# ------------------------------------------------------------------------------ whole tables

def _binary(offsets: np.ndarray, data: np.ndarray, valid: np.ndarray) -> pa.Array:
    """A binary array from int64 ``offsets``, uint8 ``data`` and a validity mask."""
    mask = pa.py_buffer(np.packbits(valid, bitorder="little")) if not valid.all() else None
    # Laid out with 64-bit offsets, then cast: past 2 GiB the cast refuses rather than wraps.
    return pa.Array.from_buffers(pa.large_binary(), len(valid), [
        mask, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data)],
        null_count=-1 if mask is not None else 0).cast(pa.binary())


def build_groups(values: np.ndarray, counts: np.ndarray) -> pa.Array:
    """Per group, a serialized sketch of its values (``values``: every group's float64 values, one
    group after another, ``counts`` of them each); null for a group of none. Windows of at most
    :data:`KLL_K` values are laid out at once; only larger ones build a KLL sketch each."""
    counts = np.asarray(counts, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype="<f8")
    small = counts <= KLL_K
    sizes = np.where(small & (counts > 0), 1 + 8 * counts, 0)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.zeros(int(offsets[-1]), np.uint8)
    body = np.ones(len(data), bool)
    body[offsets[:-1][sizes > 0]] = False  # each window's tag byte stays zero
    ends = np.cumsum(counts)
    in_small = np.repeat(small, counts)
    data[body] = values[in_small].view(np.uint8)
    out = _binary(offsets, data, counts > 0)
    big = np.flatnonzero(~small)
    if len(big):
        made = [build(values[ends[g] - counts[g]:ends[g]]) for g in big.tolist()]
        mask = np.zeros(len(counts), bool)
        mask[big] = True
        out = pc.replace_with_mask(out, pa.array(mask), pa.array(made, pa.binary()))
    return out


def _layout(sketches: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A binary array's offsets (int64, from its own start), data bytes, validity and, per value,
    whether it is an exact one and how many values it holds if so (0 otherwise)."""
    sketches = sketches.cast(pa.binary())
    n = len(sketches)
    offsets = np.frombuffer(sketches.buffers()[1], np.int32)[sketches.offset:sketches.offset + n + 1].astype(np.int64)
    raw = sketches.buffers()[2]
    data = np.frombuffer(raw, np.uint8)[offsets[0]:offsets[-1]] if raw is not None and n else np.zeros(0, np.uint8)
    offsets -= offsets[0] if n else 0
    valid = np.asarray(sketches.is_valid().to_numpy(zero_copy_only=False), bool) & (np.diff(offsets) > 0)
    exact = valid.copy()
    exact[valid] = data[offsets[:-1][valid]] == 0
    return offsets, data, valid, exact, np.where(exact, (np.diff(offsets) - 1) // 8, 0)


def _gather(offsets: np.ndarray, data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The exact values of ``rows`` (a mask), one row after another, tag bytes left out."""
    lengths = np.diff(offsets)
    keep = np.repeat(rows, lengths)
    keep[offsets[:-1][rows]] = False
    return data[keep].view("<f8")


def merge_groups(sketches: pa.Array, starts: np.ndarray) -> pa.Array:
    """Per group (the runs of rows beginning at ``starts``), its non-null sketches merged; null for a
    group with none. Groups of exact sketches that stay within :data:`KLL_K` values are merged at once."""
    n = len(sketches)
    offsets, data, valid, exact, counts = _layout(sketches)
    sizes = np.diff(np.append(starts, n))
    gid = np.repeat(np.arange(len(starts)), sizes)
    total = np.bincount(gid, weights=counts, minlength=len(starts)).astype(np.int64)
    kll = np.bincount(gid, weights=valid & ~exact, minlength=len(starts)) > 0
    fast = ~kll & (total <= KLL_K)
    values = _gather(offsets, data, exact & fast[gid])
    out = build_groups(values, np.where(fast, total, 0))
    slow = np.flatnonzero(~fast)
    if len(slow):
        ends = np.append(starts[1:], n)
        every = sketches.to_pylist() if len(slow) > len(starts) // 8 else None
        made = []
        for g in slow.tolist():
            rows = every[starts[g]:ends[g]] if every is not None else sketches.slice(starts[g], ends[g] - starts[g]).to_pylist()
            made.append(merge([v for v in rows if v]))
        mask = np.zeros(len(starts), bool)
        mask[slow] = True
        out = pc.replace_with_mask(out, pa.array(mask), pa.array(made, pa.binary()))
    return out


def quantile_arrays(sketches: pa.Array, ranks: Sequence[float]) -> list[pa.Array]:
    """Per rank, each sketch's quantile (null for none): the exact ones by one sort of all their
    values, the KLL ones one read each."""
    n = len(sketches)
    offsets, data, valid, exact, counts = _layout(sketches)
    values = _gather(offsets, data, exact)
    gid = np.repeat(np.arange(n), counts)
    by_value = np.argsort(values, kind="stable")
    ordered = values[by_value[np.argsort(gid[by_value], kind="stable")]]  # by window, then value
    firsts = np.cumsum(counts) - counts
    has = counts > 0
    out = []
    for r in ranks:
        q = np.zeros(n)
        q[has] = ordered[firsts[has] + _nearest(r, counts[has])]
        out.append(q)
    kll = np.flatnonzero(valid & ~exact)
    if len(kll):
        rows = sketches.take(pa.array(kll)).to_pylist()
        for i, data_ in zip(kll.tolist(), rows, strict=True):
            for j, v in enumerate(quantiles(data_, ranks)):
                out[j][i] = np.nan if v is None else v
                has[i] = v is not None
    return [pa.array(q, pa.float64(), mask=~has) for q in out]
