"""Laws of sequence packing (``core/packing.py``).

Every algorithm, under any ``bin_count_multiple`` / ``min_bin_count``, returns a
partition of the indices into non-empty bins within capacity, with a bin count
that is a multiple of ``bin_count_multiple``, at least ``min_bin_count`` and at
least the lower bound. The decreasing algorithms and ``concatenative`` are
checked against plain reference loops; the best-fit improvement pass against a
concrete bimodal regression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import packing
from core.packing import PACKING_ALGORITHMS, pack_sequences, packing_lower_bound
from tests.property.strategies import (
    capacity_and_lengths,
    distinct_lengths_and_permutation,
    packing_algorithms,
    packing_cases,
    packing_requests,
)

Bins = tuple[tuple[int, ...], ...]
Case = tuple[list[int], int, int, int]  # (lengths, capacity, bin_count_multiple, min_bin_count)
DECREASING = [a for a in PACKING_ALGORITHMS if a != "concatenative"]


# ---------------------------------------------------------------- references


def _decreasing(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _canonical(bins: list[list[int]]) -> Bins:
    """Indices ascending inside each bin, bins by smallest index (every bin must be non-empty)."""
    assert all(bins), f"empty bin in {bins}"
    return tuple(sorted((tuple(sorted(b)) for b in bins), key=lambda b: b[0]))


def _first_fit_into(
    order: Sequence[int], lengths: Sequence[int], capacity: int, bins: list[list[int]], room: list[int]
) -> None:
    for i in order:
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])


def reference_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    bins: list[list[int]] = []
    _first_fit_into(_decreasing(lengths), lengths, capacity, bins, [])
    return _canonical(bins)


def reference_best_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in _decreasing(lengths):
        fits = [b for b in range(len(bins)) if lengths[i] <= room[b]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return _canonical(bins)


def reference_concatenative(lengths: Sequence[int], capacity: int) -> Bins:
    bins: list[list[int]] = []
    used = 0
    for i, length in enumerate(lengths):
        if bins and used + length <= capacity:
            bins[-1].append(i)
            used += length
        else:
            bins.append([i])
            used = length
    return _canonical(bins)


def reference_modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    c = capacity
    order = _decreasing(lengths)
    large = [i for i in order if lengths[i] * 2 > c]
    medium = [i for i in order if lengths[i] * 3 > c >= lengths[i] * 2]
    small = [i for i in order if lengths[i] * 71 > 11 * c and c >= lengths[i] * 3]
    bins = [[i] for i in large]
    room = [c - lengths[i] for i in large]
    with_medium = set()
    for b in range(len(bins)):
        fitting = [i for i in medium if lengths[i] <= room[b]]  # decreasing, ties by index
        if fitting:
            medium.remove(fitting[0])
            bins[b].append(fitting[0])
            room[b] -= lengths[fitting[0]]
            with_medium.add(b)
    for b in reversed(range(len(bins))):
        ascending = sorted(small, key=lambda i: (lengths[i], i))
        if b in with_medium or len(ascending) < 2 or lengths[ascending[0]] + lengths[ascending[1]] > room[b]:
            continue
        first = ascending[0]
        small.remove(first)
        second = next(i for i in small if lengths[i] <= room[b] - lengths[first])
        small.remove(second)
        bins[b] += [first, second]
        room[b] -= lengths[first] + lengths[second]
    placed = {i for b in bins for i in b}
    rest = [i for i in order if i not in placed]
    _first_fit_into(rest, lengths, c, bins, room)
    return _canonical(bins)


REFERENCES = {
    "first_fit_decreasing": reference_first_fit_decreasing,
    "modified_first_fit_decreasing": reference_modified_first_fit_decreasing,
    "concatenative": reference_concatenative,
}


def _bench_lengths(distribution: str, seed: int, n: int) -> list[int]:
    """The bench workload: lognormal or 80/20 bimodal lengths clipped to [16, 8192]."""
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        raw = rng.lognormal(mean=np.log(700), sigma=1.0, size=n)
    else:
        short = rng.random(n) < 0.8
        raw = np.where(short, rng.normal(200, 50, n), rng.normal(4000, 500, n))
    return np.clip(np.rint(raw), 16, 8192).astype(int).tolist()


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def _pack_case(case: Case, algorithm: str) -> Bins:
    lengths, capacity, multiple, minimum = case
    return pack_sequences(
        lengths, capacity=capacity, algorithm=algorithm, bin_count_multiple=multiple, min_bin_count=minimum
    )


def _assert_valid(bins: Bins, lengths: Sequence[int], capacity: int, multiple: int, minimum: int) -> None:
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(list(b) == sorted(b) for b in bins)
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) % multiple == 0
    assert len(bins) >= max(minimum, packing_lower_bound(lengths, capacity=capacity))


# ---------------------------------------------------------------- laws


@given(packing_cases(), packing_algorithms)
def test_pack_sequences_returns_partition_within_capacity(case: Case, algorithm: str) -> None:
    """Each index is in exactly one non-empty bin within capacity; the count obeys multiple, minimum, lower bound."""
    lengths, capacity, multiple, minimum = case
    _assert_valid(_pack_case(case, algorithm), lengths, capacity, multiple, minimum)


@given(packing_cases(), packing_algorithms)
def test_pack_sequences_adds_only_the_bins_required(case: Case, algorithm: str) -> None:
    """The count is the algorithm's own count rounded up to ``min_bin_count`` and the next multiple, no more."""
    lengths, capacity, multiple, minimum = case
    own = len(pack_sequences(lengths, capacity=capacity, algorithm=algorithm))
    assert len(_pack_case(case, algorithm)) == _round_up(max(minimum, own), multiple)


@given(packing_cases(), packing_algorithms)
def test_pack_sequences_is_deterministic(case: Case, algorithm: str) -> None:
    """Equal inputs give equal bins, whether lengths come as a list, a tuple, numpy ints or a numpy array."""
    lengths, capacity, multiple, minimum = case
    kwargs = dict(capacity=capacity, algorithm=algorithm, bin_count_multiple=multiple, min_bin_count=minimum)
    first = pack_sequences(lengths, **kwargs)
    assert pack_sequences(lengths, **kwargs) == first
    assert pack_sequences(tuple(lengths), **kwargs) == first
    assert pack_sequences([np.int32(x) for x in lengths], **kwargs) == first
    assert pack_sequences(np.asarray(lengths, dtype=np.int64), **kwargs) == first


@given(capacity_and_lengths(min_size=1))
def test_pack_sequences_matches_reference_loops(case: tuple[int, list[int]]) -> None:
    """FFD, MFFD and concatenative equal plain reference loops when no extra bins are asked for."""
    capacity, lengths = case
    for algorithm, reference in REFERENCES.items():
        expected = reference(lengths, capacity)
        assert pack_sequences(lengths, capacity=capacity, algorithm=algorithm) == expected, algorithm


@given(capacity_and_lengths(min_size=1))
def test_pack_sequences_best_fit_never_worse_than_plain_best_fit(case: tuple[int, list[int]]) -> None:
    """BFD never uses more bins than a plain BFD loop, and returns exactly its bins when those meet the bound."""
    capacity, lengths = case
    plain = reference_best_fit_decreasing(lengths, capacity)
    bins = pack_sequences(lengths, capacity=capacity)
    assert len(bins) <= len(plain)
    if len(plain) == packing_lower_bound(lengths, capacity=capacity):
        assert bins == plain


@given(packing_cases())
def test_pack_sequences_concatenative_bins_are_contiguous_runs(case: Case) -> None:
    """``concatenative`` bins, extra bins included, read back in input order: their concatenation is ``range(n)``."""
    bins = _pack_case(case, "concatenative")
    assert [i for b in bins for i in b] == list(range(len(case[0])))


@given(distinct_lengths_and_permutation(), st.sampled_from(DECREASING), st.integers(1, 3))
def test_pack_sequences_decreasing_algorithms_follow_relabelling(
    case: tuple[list[int], int, list[int]], algorithm: str, multiple: int
) -> None:
    """With distinct lengths, permuting the input permutes the indices and leaves the packing itself unchanged."""
    lengths, capacity, perm = case
    if _round_up(len(pack_sequences(lengths, capacity=capacity, algorithm=algorithm)), multiple) > len(lengths):
        multiple = 1
    permuted = [lengths[p] for p in perm]
    kwargs = dict(capacity=capacity, algorithm=algorithm, bin_count_multiple=multiple)
    original = {frozenset(b) for b in pack_sequences(lengths, **kwargs)}
    relabelled = {frozenset(perm[i] for i in b) for b in pack_sequences(permuted, **kwargs)}
    assert relabelled == original


@given(packing_requests(), packing_algorithms)
def test_pack_sequences_raises_only_for_too_few_sequences(case: Case, algorithm: str) -> None:
    """Either a valid packing comes back, or a ValueError says the required count exceeds the number of sequences."""
    lengths, capacity, multiple, minimum = case
    try:
        bins = _pack_case(case, algorithm)
    except ValueError as error:
        found = re.search(r"requires (\d+) bins .* has only (\d+) sequences", str(error))
        assert found is not None, str(error)
        required, n = int(found[1]), int(found[2])
        assert n == len(lengths) < required
        assert required % multiple == 0
        assert required >= max(minimum, packing_lower_bound(lengths, capacity=capacity))
    else:
        _assert_valid(bins, lengths, capacity, multiple, minimum)


@given(capacity_and_lengths())
def test_packing_lower_bound_is_ceil_of_total_over_capacity(case: tuple[int, list[int]]) -> None:
    """The bound is ``ceil(sum / capacity)`` but at least 1 for a non-empty batch, and 0 for an empty one."""
    capacity, lengths = case
    expected = max(1, math.ceil(sum(lengths) / capacity)) if lengths else 0
    assert packing_lower_bound(lengths, capacity=capacity) == expected


@settings(max_examples=50)
@given(packing_cases(), st.integers(0, 6))
def test_split_fullest_keeps_partition_and_capacity(case: Case, extra: int) -> None:
    """The fallback that makes extra bins by halving the fullest bin keeps a partition within capacity."""
    lengths, capacity, _, _ = case
    values = tuple(lengths)
    start = packing._first_fit_decreasing(values, capacity)
    target = min(len(values), len(start) + extra)
    bins = _canonical(packing._split_fullest(start, values, target))
    assert len(bins) == target
    _assert_valid(bins, lengths, capacity, 1, 0)


def test_split_fullest_never_leaves_a_half_empty() -> None:
    """Regression: halving a bin of zero-length sequences still gives two non-empty bins."""
    assert _canonical(packing._split_fullest([[0, 1, 2]], (0, 0, 0), 3)) == ((0,), (1,), (2,))


# ---------------------------------------------------------------- examples and regressions


def test_pack_sequences_docstring_examples() -> None:
    """The examples in the docstring hold."""
    assert pack_sequences([6, 3, 5, 2], capacity=8) == ((0, 3), (1, 2))
    assert pack_sequences([6, 3, 5, 2], capacity=8, algorithm="concatenative") == ((0,), (1, 2), (3,))
    assert pack_sequences([6, 3, 5, 2], capacity=8, bin_count_multiple=4) == ((0,), (1,), (2,), (3,))
    assert packing_lower_bound([5000, 5000, 0], capacity=8192) == 2


def test_pack_sequences_best_fit_improvement_reaches_lower_bound() -> None:
    """Regression: plain BFD needs 3 bins for these lengths; the improvement pass packs them into the 2 of the bound."""
    lengths = [41, 21, 16, 24, 43, 50]
    assert len(reference_best_fit_decreasing(lengths, 100)) == 3
    assert pack_sequences(lengths, capacity=100) == ((0, 2, 4), (1, 3, 5))


def test_pack_sequences_best_fit_improvement_on_bimodal_batch() -> None:
    """Regression: a bimodal RL batch (bench seed 17, n=512) where plain BFD uses LB+1 bins packs into LB bins."""
    lengths = _bench_lengths("bimodal", 17, 512)
    bound = packing_lower_bound(lengths, capacity=8192)
    assert len(reference_best_fit_decreasing(lengths, 8192)) == bound + 1
    bins = pack_sequences(lengths, capacity=8192)
    assert len(bins) == bound
    _assert_valid(bins, lengths, 8192, 1, 1)


def test_pack_sequences_modified_first_fit_pairs_small_items_backward() -> None:
    """MFFD gives its first pair of small items to the large bin with the smallest large item."""
    bins = pack_sequences([60, 55, 16, 17, 30], capacity=100, algorithm="modified_first_fit_decreasing")
    assert bins == ((0, 4), (1, 2, 3))


@pytest.mark.parametrize("distribution", ["lognormal", "bimodal"])
def test_pack_sequences_best_fit_meets_lower_bound_on_bench_batches(distribution: str) -> None:
    """On 20 bench batches (n=512, capacity 8192) BFD hits ``ceil(sum / capacity)`` 19+ times, never more than +1."""
    excess = []
    for seed in range(20):
        lengths = _bench_lengths(distribution, seed, 512)
        excess.append(len(pack_sequences(lengths, capacity=8192)) - packing_lower_bound(lengths, capacity=8192))
    assert excess.count(0) >= 19, excess
    assert max(excess) <= 1, excess


def test_pack_sequences_extra_bins_balance_load() -> None:
    """Extra bins are made by spreading real sequences, longest first onto the lightest bin."""
    assert pack_sequences([8, 1, 1, 1, 1], capacity=16, bin_count_multiple=2) == ((0,), (1, 2, 3, 4))
    assert pack_sequences([4, 4, 4, 4], capacity=16, min_bin_count=4) == ((0,), (1,), (2,), (3,))


def test_pack_sequences_accepts_zero_lengths() -> None:
    """Zero-length sequences are packed like any other, never dropped."""
    assert pack_sequences([0, 0, 0], capacity=1) == ((0, 1, 2),)
    assert pack_sequences([0, 5, 0], capacity=5, min_bin_count=3) == ((0,), (1,), (2,))


def test_pack_sequences_empty_lengths_needs_min_bin_count_zero() -> None:
    """An empty batch packs into no bins when ``min_bin_count=0`` and is rejected otherwise."""
    assert pack_sequences([], capacity=8, min_bin_count=0) == ()
    with pytest.raises(ValueError, match=r"requires 1 bins .* only 0 sequences.*min_bin_count=0"):
        pack_sequences([], capacity=8)


# ---------------------------------------------------------------- misuse


def test_pack_sequences_rejects_length_above_capacity() -> None:
    """A sequence longer than the capacity is named by index, length and capacity."""
    with pytest.raises(ValueError, match=r"<= capacity \(8\): got 9 at index 2"):
        pack_sequences([1, 2, 9], capacity=8)


def test_pack_sequences_rejects_too_few_sequences() -> None:
    """More required bins than sequences is a ValueError naming both counts."""
    with pytest.raises(ValueError, match=r"requires 4 bins \(min_bin_count=1, bin_count_multiple=4\) but .* only 3"):
        pack_sequences([1, 1, 1], capacity=8, bin_count_multiple=4)
    with pytest.raises(ValueError, match=r"requires 5 bins .* only 3 sequences"):
        pack_sequences([1, 1, 1], capacity=8, min_bin_count=5)
    with pytest.raises(ValueError, match=r"requires 4 bins .* only 3 sequences.*'concatenative' needed 3 bins"):
        pack_sequences([3, 3, 3], capacity=5, algorithm="concatenative", bin_count_multiple=2)


def test_pack_sequences_rejects_bad_arguments() -> None:
    """Bad capacity, multiple, minimum or algorithm raise, naming the argument."""
    with pytest.raises(ValueError, match=r"'capacity' must be >= 1: got 0"):
        pack_sequences([1], capacity=0)
    with pytest.raises(TypeError, match=r"'capacity' must be an int: got float"):
        pack_sequences([1], capacity=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'bin_count_multiple' must be >= 1: got 0"):
        pack_sequences([1], capacity=8, bin_count_multiple=0)
    with pytest.raises(ValueError, match=r"'min_bin_count' must be >= 0: got -1"):
        pack_sequences([1], capacity=8, min_bin_count=-1)
    with pytest.raises(TypeError, match=r"'min_bin_count' must be an int: got bool"):
        pack_sequences([1], capacity=8, min_bin_count=True)
    with pytest.raises(ValueError, match=r"'algorithm' must be one of \('best_fit_decreasing', .*\): got 'bfd'"):
        pack_sequences([1], capacity=8, algorithm="bfd")
    with pytest.raises(TypeError, match=r"'algorithm' must be a str"):
        pack_sequences([1], capacity=8, algorithm=None)  # type: ignore[arg-type]


def test_pack_sequences_rejects_bad_lengths() -> None:
    """Negative, non-int or bool lengths, or a non-sequence, raise naming the index."""
    with pytest.raises(ValueError, match=r"'lengths' entries must be >= 0: got -1 at index 1"):
        pack_sequences([1, -1], capacity=8)
    with pytest.raises(TypeError, match=r"'lengths' entries must be int: got float at index 0"):
        pack_sequences([1.5], capacity=8)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"'lengths' entries must be int: got bool at index 1"):
        pack_sequences([1, True], capacity=8)
    with pytest.raises(TypeError, match=r"'lengths' must be a sequence of ints: got int"):
        pack_sequences(5, capacity=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'lengths' must be a sequence of ints: got str"):
        pack_sequences("123", capacity=8)  # type: ignore[arg-type]


def test_packing_lower_bound_rejects_bad_arguments() -> None:
    """The bound validates like ``pack_sequences``."""
    with pytest.raises(ValueError, match=r"'capacity' must be >= 1: got -3"):
        packing_lower_bound([1], capacity=-3)
    with pytest.raises(ValueError, match=r"'lengths' entries must be >= 0: got -2 at index 0"):
        packing_lower_bound([-2], capacity=8)
