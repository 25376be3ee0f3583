"""Spark's ``hash()`` (Murmur3 x86_32, seed 42) of one Arrow column, vectorised in numpy.

The state step is keyed by ``pmod(hash(key), buckets)``. A bucket is where a device's state lives in
the checkpoint, so every way the job computes it must give Spark's own answer, bit for bit: Spark's
``hash`` in the plan (:meth:`enrich.state.layout.BucketLayout.column`) and this one, in the Python pass that
parses and packs the events. Spark hashes strings with its legacy byte-wise tail
(``Murmur3_x86_32.hashUnsafeBytes``: 4-byte little-endian words, then each remaining byte, sign
extended, as a word of its own; binary values alike), integers up to 32 bits and dates (days) with
``hashInt``, 64-bit integers and timestamps (microseconds) with ``hashLong``, booleans as the ints 1
and 0; a null leaves the seed. Other types (floating point, decimals, nested) have no hash here: a
state key must be of one of these (``enrich.state.spec.resolve`` says so at load).
``tests/enrich/state/test_hashing.py`` compares this with Spark's ``hash`` on real Spark.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SEED = 42
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def supports(typ: pa.DataType) -> bool:
    """Whether :func:`spark_hash` hashes a column of this Arrow type as Spark does."""
    return (_bytes_like(typ) or pa.types.is_boolean(typ) or pa.types.is_int8(typ) or pa.types.is_int16(typ)
            or pa.types.is_int32(typ) or pa.types.is_date32(typ) or pa.types.is_int64(typ)
            or pa.types.is_timestamp(typ))


def _bytes_like(typ: pa.DataType) -> bool:
    return (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ)
            or pa.types.is_large_binary(typ))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_k1(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _mix_h1(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)


def _fmix(h: np.ndarray, length: np.ndarray | int) -> np.ndarray:
    h = h ^ np.asarray(length).astype(np.uint32)
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _hash_ints(values: np.ndarray) -> np.ndarray:
    seed = np.full(len(values), SEED, dtype=np.uint32)
    return _fmix(_mix_h1(seed, _mix_k1(values.astype(np.int32).view(np.uint32))), 4)


def _hash_longs(values: np.ndarray) -> np.ndarray:
    v = values.astype(np.int64).view(np.uint64)
    low = (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    high = (v >> np.uint64(32)).astype(np.uint32)
    h = _mix_h1(np.full(len(values), SEED, dtype=np.uint32), _mix_k1(low))
    return _fmix(_mix_h1(h, _mix_k1(high)), 8)


#: Below this many values still hashing, the words left are mixed value by value: the vectorised
#: step's fixed cost per word position would make one long value cost seconds.
_FEW = 4


def _hash_strings(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offset_type = np.int64 if large else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=offset_type)[arr.offset:arr.offset + n + 1].astype(np.int64)
    data = arr.buffers()[2]
    buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    aligned = lengths - lengths % 4
    h = np.full(n, SEED, dtype=np.uint32)
    # Word by word over every value at once: the values still having a whole word at ``at`` are a
    # prefix of the values by length, longest first, so each position costs what it hashes.
    longest_first = np.argsort(-aligned, kind="stable")
    ascending = np.sort(aligned)
    at = 0
    while at < int(aligned.max(initial=0)):
        active = n - int(np.searchsorted(ascending, at, side="right"))
        if active <= _FEW:
            for row in longest_first[:active]:
                h[row] = _mix_words(int(h[row]), buf, int(starts[row]) + at, int(starts[row] + aligned[row]))
            break
        rows = longest_first[:active]
        p = starts[rows] + at
        h[rows] = _mix_h1(h[rows], _mix_k1(_words(buf, p)))
        at += 4
    for tail in range(3):  # Spark's tail: each byte, sign extended, mixed as a word
        rows = np.flatnonzero(lengths > aligned + tail)
        if len(rows) == 0:
            break
        byte = buf[starts[rows] + aligned[rows] + tail].view(np.int8).astype(np.int32).view(np.uint32)
        h[rows] = _mix_h1(h[rows], _mix_k1(byte))
    return _fmix(h, lengths)


def _words(buf: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The little-endian 32-bit words of ``buf`` at byte positions ``p``."""
    return (buf[p].astype(np.uint32) | (buf[p + 1].astype(np.uint32) << np.uint32(8))
            | (buf[p + 2].astype(np.uint32) << np.uint32(16)) | (buf[p + 3].astype(np.uint32) << np.uint32(24)))


def _mix_words(h: int, buf: np.ndarray, start: int, end: int) -> np.uint32:
    """``h`` mixed with the words of ``buf[start:end]`` (a multiple of 4 bytes) in order: the words'
    ``k`` at once in numpy, then the chain through ``h``, which is sequential, in plain integers."""
    ks = _mix_k1(buf[start:end].view("<u4").astype(np.uint32)).tolist()
    mask = 0xFFFFFFFF
    for k in ks:
        x = h ^ k
        h = ((((x << 13) | (x >> 19)) & mask) * 5 + 0xE6546B64) & mask
    return np.uint32(h)


def spark_hash(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Spark's ``hash(column)`` of every value, as int32 (``SEED`` where the value is null)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    typ = arr.type
    if _bytes_like(typ):
        out = _hash_strings(arr) if len(arr) else np.zeros(0, dtype=np.uint32)
    elif pa.types.is_boolean(typ):
        out = _hash_ints(arr.fill_null(False).to_numpy(zero_copy_only=False).astype(np.int32))
    elif pa.types.is_int8(typ) or pa.types.is_int16(typ) or pa.types.is_int32(typ) or pa.types.is_date32(typ):
        out = _hash_ints(arr.cast(pa.int32()).fill_null(0).to_numpy(zero_copy_only=False))
    elif pa.types.is_int64(typ) or pa.types.is_timestamp(typ):
        if pa.types.is_timestamp(typ) and typ.unit != "us":  # Spark hashes microseconds
            arr = arr.cast(pa.timestamp("us", typ.tz))
        out = _hash_longs(arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False))
    else:
        raise TypeError(f"no Spark hash of {typ} here")
    out = out.view(np.int32)
    if arr.null_count:
        out = np.where(arr.is_null().to_numpy(zero_copy_only=False), np.int32(SEED), out)
    return out


def buckets_of(arr: pa.Array | pa.ChunkedArray, buckets: int) -> np.ndarray:
    """``pmod(hash(arr), buckets)`` as Spark computes it (``BucketLayout.column`` in :mod:`enrich.state.layout`), int32."""
    return np.mod(spark_hash(arr).astype(np.int64), buckets).astype(np.int32)
