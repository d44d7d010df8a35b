"""Laws of balanced multi-way number partitioning (``core/partition.py``).

Partition, ordering and determinism laws, balance bounds against plain
reference algorithms (sort-then-stride, LPT), and the error paths.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given

from core.partition import balanced_partition
from tests.property.strategies import equal_partition_cases, free_partition_cases, lognormal_lengths

# ---------------------------------------------------------------- plain references


def _stride_reference(weights: list[int], parts: int) -> list[list[int]]:
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    return [order[r::parts] for r in range(parts)]


def _lpt_reference(weights: list[int], parts: int, *, equal_size: bool) -> list[list[int]]:
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    if equal_size:
        for start in range(0, len(order), parts):
            lightest = sorted(range(parts), key=lambda p: (loads[p], p))
            for item, p in zip(order[start : start + parts], lightest):
                groups[p].append(item)
                loads[p] += weights[item]
        return groups
    heap = [(0, p) for p in range(parts)]
    for item in order:
        load, p = heapq.heappop(heap)
        groups[p].append(item)
        heapq.heappush(heap, (load + weights[item], p))
    return groups


def _max_sum(weights: list[int], groups: list[list[int]] | tuple[tuple[int, ...], ...]) -> int:
    return max((sum(weights[i] for i in g) for g in groups), default=0)



# ---------------------------------------------------------------- balanced_partition


@given(equal_partition_cases())
def test_balanced_partition_equal_size_is_a_partition_into_equal_parts(case: tuple[list[float], int]) -> None:
    """Equal-size mode: every index exactly once, every part of len(weights) // parts items."""
    weights, parts = case
    result = balanced_partition(weights, parts)
    assert len(result) == parts
    assert sorted(i for part in result for i in part) == list(range(len(weights)))
    assert {len(part) for part in result} <= {len(weights) // parts}


@given(free_partition_cases())
def test_balanced_partition_free_size_is_a_partition(case: tuple[list[float], int]) -> None:
    """Non-equal mode: ``parts`` parts holding every index exactly once."""
    weights, parts = case
    result = balanced_partition(weights, parts, equal_size=False)
    assert len(result) == parts
    assert sorted(i for part in result for i in part) == list(range(len(weights)))


@given(free_partition_cases())
def test_balanced_partition_parts_ascend_and_are_ordered_by_first_index(case: tuple[list[float], int]) -> None:
    """Indices ascend inside a part; non-empty parts are ordered by first index, empty parts last."""
    weights, parts = case
    result = balanced_partition(weights, parts, equal_size=False)
    assert all(list(part) == sorted(part) for part in result)
    firsts = [part[0] for part in result if part]
    assert firsts == sorted(firsts)
    assert all(not part for part in result[len(firsts) :])


@given(equal_partition_cases(integral=True))
def test_balanced_partition_equal_size_never_worse_than_stride_or_lpt(case: tuple[list[int], int]) -> None:
    """Equal size: the largest part sum is at most sort-then-stride's and equal-size LPT's."""
    weights, parts = case
    ours = _max_sum(weights, balanced_partition(weights, parts))
    assert ours <= _max_sum(weights, _stride_reference(weights, parts))
    assert ours <= _max_sum(weights, _lpt_reference(weights, parts, equal_size=True))


@given(free_partition_cases(integral=True))
def test_balanced_partition_free_size_never_worse_than_lpt(case: tuple[list[int], int]) -> None:
    """Non-equal size: the largest part sum is at most plain LPT's, and never below the lower bound."""
    weights, parts = case
    ours = _max_sum(weights, balanced_partition(weights, parts, equal_size=False))
    assert ours <= _max_sum(weights, _lpt_reference(weights, parts, equal_size=False))
    assert ours >= max(max(weights, default=0), math.ceil(sum(weights) / parts))


@given(free_partition_cases())
def test_balanced_partition_is_deterministic(case: tuple[list[float], int]) -> None:
    """Equal inputs give equal partitions (list, tuple and numpy inputs alike)."""
    weights, parts = case
    first = balanced_partition(weights, parts, equal_size=False)
    assert balanced_partition(tuple(weights), parts, equal_size=False) == first
    assert balanced_partition(np.asarray(weights), parts, equal_size=False) == first


def test_balanced_partition_meets_the_balance_target_on_lognormal_lengths() -> None:
    """N=512, 32 parts, seeds 0..19: mean over seeds of max/mean part sum is <= 1.001."""
    ratios = []
    for seed in range(20):
        weights = lognormal_lengths(512, seed)
        ratios.append(_max_sum(weights, balanced_partition(weights, 32)) / (sum(weights) / 32))
    assert sum(ratios) / len(ratios) <= 1.001


def test_balanced_partition_rejects_an_uneven_equal_size_split() -> None:
    """Equal size needs len(weights) % parts == 0; the message shows the non-equal call."""
    with pytest.raises(ValueError, match=r"got 5 weights and parts=2.*equal_size=False"):
        balanced_partition([1, 2, 3, 4, 5], 2)


def test_balanced_partition_rejects_bad_parts() -> None:
    """``parts`` must be an int >= 1."""
    with pytest.raises(ValueError, match="'parts' must be >= 1: got 0"):
        balanced_partition([], 0)
    with pytest.raises(TypeError, match="'parts' must be an int: got float"):
        balanced_partition([1.0], 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("weights", "error", "pattern"),
    [
        ([1, -2], ValueError, r"'weights' entries must be >= 0: got -2 at index 1"),
        ([1.0, float("nan")], ValueError, r"'weights' entries must be finite: got nan at index 1"),
        ([1, True], TypeError, r"'weights' entries must be int or float: got bool at index 1"),
        ([1, "2"], TypeError, r"'weights' entries must be int or float: got str at index 1"),
        ("12", TypeError, r"'weights' must be a sequence of numbers: got str"),
        (np.ones((2, 2)), ValueError, r"'weights' must be 1-dimensional"),
    ],
)
def test_balanced_partition_rejects_bad_weights(weights: object, error: type[Exception], pattern: str) -> None:
    """Weights must be a 1-d sequence of finite, non-negative numbers."""
    with pytest.raises(error, match=pattern):
        balanced_partition(weights, 1, equal_size=False)  # type: ignore[arg-type]
