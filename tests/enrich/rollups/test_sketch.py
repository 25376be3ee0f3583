"""The percentiles' sketches, whole tables at once against one window at a time and against numpy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from enrich.rollups import sketch

RANKS = [0.0, 0.01, 0.5, 0.95, 0.99, 1.0]
K = sketch.KLL_K

# Group sizes around the exact limit, with empty groups among them.
sizes = st.lists(st.sampled_from([0, 1, 2, 3, 7, K - 1, K, K + 1, 450]), min_size=1, max_size=8)


def groups_of(rng: np.random.Generator, counts: list[int]) -> list[np.ndarray]:
    return [rng.integers(-40, 40, c).astype(np.float64) / 4 for c in counts]


def check_reading(values: np.ndarray, got: list[float | None], exact: bool, error: float) -> None:
    """``got`` (the quantiles at ``RANKS``) as numpy's nearest rank of ``values`` when ``exact``, else
    each with a true rank within ``error`` of the one asked for; None each for no values."""
    if not len(values):
        assert got == [None] * len(RANKS)
        return
    ordered = np.sort(values)
    for r, q in zip(RANKS, got, strict=True):
        if exact:
            assert q == np.quantile(values, r, method="inverted_cdf"), (len(values), r)
        else:
            lo, hi = (np.searchsorted(ordered, q, side=s) / len(values) for s in ("left", "right"))
            assert lo - error <= r <= hi + error, (len(values), r)


@settings(max_examples=40, deadline=None)
@given(counts=sizes, seed=st.integers(0, 2**16))
def test_a_tables_sketches_read_as_numpys_nearest_rank_below_k_and_within_the_error_above(
        counts: list[int], seed: int) -> None:
    groups = groups_of(np.random.default_rng(seed), counts)
    built = sketch.build_groups(np.concatenate(groups), np.array(counts))
    assert built.null_count == counts.count(0)
    got = sketch.quantile_arrays(built, RANKS)
    for i, values in enumerate(groups):
        one = [q[i].as_py() for q in got]
        if 0 < len(values) <= K:  # the table's reading is one window's (KLL compacts at random)
            assert one == sketch.quantiles(sketch.build(values), RANKS)
        check_reading(values, one, len(values) <= K, sketch.KLL_RANK_ERROR)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(sizes, min_size=1, max_size=5), seed=st.integers(0, 2**16), nulls=st.booleans())
def test_merging_a_tables_groups_keeps_every_value(parts: list[list[int]], seed: int, nulls: bool) -> None:
    """Each group's parts merged at once, as one window merged part by part would be: exact while the
    whole stays within k values (the same values as one sketch of them all), else within the error."""
    rng = np.random.default_rng(seed)
    rows: list[bytes | None] = []
    starts, wholes = [], []
    for counts in parts:
        starts.append(len(rows))
        values = groups_of(rng, counts)
        rows.extend(sketch.build(v) if len(v) or not nulls else None for v in values)
        wholes.append(np.concatenate(values))
    table = pa.array(rows, pa.binary())
    merged = sketch.merge_groups(table.slice(0), np.array(starts))
    assert len(merged) == len(parts)
    got = sketch.quantile_arrays(merged, RANKS)
    no_kll = all(len(b or b"\0") <= 1 + 8 * K for b in rows)
    for g, whole in enumerate(wholes):
        check_reading(whole, [q[g].as_py() for q in got], len(whole) <= K and no_kll, 2 * sketch.KLL_RANK_ERROR)


def test_a_small_window_is_its_values_and_a_large_one_a_kll_sketch() -> None:
    small = sketch.build(np.array([3.0, 1.0, 2.0]))
    assert small == b"\x00" + np.array([3.0, 1.0, 2.0], "<f8").tobytes()
    assert sketch.build(np.arange(K + 1, dtype=np.float64))[:1] != b"\x00"
    # Two small parts past k together become a KLL sketch, which reads within the error.
    big = sketch.merge([sketch.build(np.arange(150, dtype=np.float64)),
                        sketch.build(np.arange(150, 300, dtype=np.float64))])
    assert big[:1] != b"\x00"
    median = sketch.quantiles(big, [0.5])[0]
    assert median is not None and abs(median - 149) <= 300 * sketch.KLL_RANK_ERROR + 1


def test_sliced_tables_read_from_their_own_start() -> None:
    table = sketch.build_groups(np.array([5.0, 1.0, 2.0, 9.0]), np.array([1, 0, 3]))
    tail = table.slice(1)
    assert [q.as_py() for q in sketch.quantile_arrays(tail, [1.0])[0]] == [None, 9.0]
    merged = sketch.merge_groups(tail, np.array([0]))
    assert sketch.quantiles(merged[0].as_py(), [0.0, 1.0]) == [1.0, 9.0]
