"""Sequence packing: assigning sequences, by token length, to micro-batch bins of bounded capacity.

A packing of ``lengths`` under ``capacity`` is a tuple of bins, each a tuple of
indices into ``lengths``.

Invariants (every algorithm, every call that returns):
  * partition: every index appears in exactly one bin, and no bin is empty;
  * capacity: each bin's total length is ``<= capacity``;
  * count: the bin count is ``>= min_bin_count``, a multiple of
    ``bin_count_multiple`` and ``>= packing_lower_bound(lengths, capacity=...)``;
    extra bins are made by redistributing real sequences, never by padding with
    empty bins;
  * canonical order: indices ascend inside a bin, and bins are ordered by their
    smallest index (so ``concatenative`` bins read in input order);
  * determinism: equal inputs give equal bins; ties are broken by index.

Laws (see ``tests/property/test_packing.py``): the invariants above for all
algorithms; the count is the algorithm's own count rounded up to
``min_bin_count`` and the multiple, no more; ``first_fit_decreasing``,
``modified_first_fit_decreasing`` and ``concatenative`` equal plain reference
loops; ``best_fit_decreasing`` never uses more bins than plain BFD; with
distinct lengths, permuting the input only relabels the decreasing packings.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Sequence
from itertools import chain, islice, repeat
from typing import Literal, get_args

import numpy as np

from core.checks import check_int, check_int_entries

Lengths = tuple[int, ...]
Bin = tuple[int, ...]
Bins = tuple[Bin, ...]
_MutableBins = list[list[int]]

PackingAlgorithm = Literal[
    "best_fit_decreasing",
    "first_fit_decreasing",
    "modified_first_fit_decreasing",
    "concatenative",
]
PACKING_ALGORITHMS: tuple[str, ...] = get_args(PackingAlgorithm)


# ---------------------------------------------------------------- public API


def packing_lower_bound(lengths: Sequence[int], *, capacity: int) -> int:
    """The fewest bins any packing of ``lengths`` can use: ``ceil(sum / capacity)``, at least 1.

    The one exception is an empty ``lengths``, which needs 0 bins.

    Args:
        lengths: non-negative token counts, one per sequence.
        capacity: the most tokens a bin may hold (``> 0``).

    Returns:
        ``0`` for no sequences, else ``max(1, ceil(sum(lengths) / capacity))``.

    Raises:
        TypeError: ``lengths`` is not a sequence of ints, or ``capacity`` is not an int.
        ValueError: ``capacity <= 0`` or a length is negative.

    Example:
        >>> packing_lower_bound([5000, 5000, 0], capacity=8192)
        2
    """
    return _lower_bound(_check_lengths(lengths), check_int("capacity", capacity, minimum=1))


def _lower_bound(values: Lengths, cap: int) -> int:
    return max(1, -(-sum(values) // cap)) if values else 0


def pack_sequences(
    lengths: Sequence[int],
    *,
    capacity: int,
    algorithm: str = "best_fit_decreasing",
    bin_count_multiple: int = 1,
    min_bin_count: int = 1,
) -> tuple[tuple[int, ...], ...]:
    """Pack sequences into bins of at most ``capacity`` tokens.

    Algorithms (the decreasing ones take sequences longest first, ties by index):
      * ``best_fit_decreasing``: each sequence goes into the fullest bin it fits
        in. When that needs more bins than the lower bound, an improvement pass
        builds bins one at a time instead, filling each almost exactly (the
        longest sequences that still leave room for short ones, then an exact
        subset-sum over the short ones), and is kept only when it lowers the
        final bin count. It reaches ``ceil(sum / capacity)`` bins on
        typical RL batches where plain BFD often needs one more.
      * ``first_fit_decreasing``: each sequence goes into the first bin it fits in.
      * ``modified_first_fit_decreasing``: Johnson & Garey's MFFD. Sequences are
        large (``> C/2``), medium (``(C/3, C/2]``), small (``(11C/71, C/3]``)
        or tiny. Each large one opens a bin; going forward through those bins,
        a bin where the shortest medium fits takes the longest medium that fits;
        going backward through large bins without a medium, a bin where the two
        shortest small ones fit takes the shortest and then the longest small
        one that still fits; the rest is placed first-fit decreasing.
      * ``concatenative``: input order is kept; a new bin starts when the next
        sequence does not fit.

    When ``min_bin_count`` or ``bin_count_multiple`` asks for more bins than
    the algorithm made, the sequences are redistributed over the required
    count: ``concatenative`` splits its fullest bin at the most balanced point
    (bins stay contiguous runs of the input); the others spread all sequences
    longest first onto the least-loaded bin, or, if that would overflow a bin,
    split their fullest bin in two until the count is reached.

    Zero-length sequences are allowed. An empty ``lengths`` needs
    ``min_bin_count=0`` and then packs into ``()``.

    Args:
        lengths: non-negative token counts, one per sequence.
        capacity: the most tokens a bin may hold (``> 0``).
        algorithm: one of ``PACKING_ALGORITHMS``.
        bin_count_multiple: the bin count must be a multiple of this (``>= 1``),
            e.g. the data-parallel world size, so every rank gets as many
            micro-batches.
        min_bin_count: the bin count must be at least this (``>= 0``).

    Returns:
        Bins of indices into ``lengths``: ascending inside a bin, bins ordered by
        their smallest index.

    Raises:
        TypeError: an argument or a length is not an int, or ``algorithm`` is not a str.
        ValueError: ``capacity <= 0``, ``bin_count_multiple < 1``,
            ``min_bin_count < 0``, an unknown ``algorithm``, a negative length,
            a length above ``capacity``, or fewer sequences than the bins required.

    Example:
        >>> pack_sequences([6, 3, 5, 2], capacity=8)
        ((0, 3), (1, 2))
        >>> pack_sequences([6, 3, 5, 2], capacity=8, algorithm="concatenative")
        ((0,), (1, 2), (3,))
        >>> pack_sequences([6, 3, 5, 2], capacity=8, bin_count_multiple=4)
        ((0,), (1,), (2,), (3,))
    """
    values = _check_lengths(lengths)
    cap = check_int("capacity", capacity, minimum=1)
    multiple = check_int("bin_count_multiple", bin_count_multiple, minimum=1)
    minimum = check_int("min_bin_count", min_bin_count, minimum=0)
    if not isinstance(algorithm, str):
        raise TypeError(f"'algorithm' must be a str, one of {PACKING_ALGORITHMS}: got {type(algorithm).__name__}")
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"'algorithm' must be one of {PACKING_ALGORITHMS}: got {algorithm!r}")
    for index, length in enumerate(values if values and max(values) > cap else ()):
        if length > cap:
            raise ValueError(
                f"'lengths' entries must be <= capacity ({cap}): got {length} at index {index}; "
                f"truncate the sequence or raise 'capacity'"
            )
    n = len(values)
    required = round_up(max(minimum, _lower_bound(values, cap)), multiple)
    if required > n:
        raise ValueError(_too_few_message(required, n, multiple, minimum))
    if n == 0:
        return ()

    bins = _pack(algorithm, values, cap)
    target = round_up(max(minimum, len(bins)), multiple)
    # The improvement pass only pays when it saves a whole multiple of bins.
    goal = target - multiple
    if algorithm == "best_fit_decreasing" and goal >= required:
        improved = _fill_bins_one_at_a_time(values, cap, max_bins=goal)
        if improved is not None:
            bins = improved
            target = round_up(max(minimum, len(bins)), multiple)
    if target > n:
        raise ValueError(
            _too_few_message(target, n, multiple, minimum)
            + f" ({algorithm!r} needed {len(bins)} bins for these lengths)"
        )
    if target > len(bins):
        if algorithm == "concatenative":
            bins = _split_contiguous(bins, values, target)
        else:
            bins = _spread_longest_first(values, cap, target) or _split_fullest(bins, values, target)
    return tuple(sorted((tuple(sorted(b)) for b in bins), key=operator.itemgetter(0)))


# ---------------------------------------------------------------- validation


def _check_lengths(lengths: Sequence[int]) -> Lengths:
    return check_int_entries("lengths", lengths, minimum=0)


def round_up(count: int, multiple: int) -> int:
    """``count`` rounded up to a multiple of ``multiple`` (both ints, ``multiple >= 1``)."""
    return -(-count // multiple) * multiple


def _too_few_message(required: int, n: int, multiple: int, minimum: int) -> str:
    hint = "; pass min_bin_count=0 to allow an empty packing" if n == 0 else ""
    return (
        f"packing requires {required} bins (min_bin_count={minimum}, bin_count_multiple={multiple}) "
        f"but 'lengths' has only {n} sequences, and no bin may be empty{hint}"
    )


# ---------------------------------------------------------------- algorithms


def _decreasing(values: Lengths) -> list[int]:
    """Indices by decreasing length, ties by ascending index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def _best_fit_decreasing(values: Lengths, cap: int) -> _MutableBins:
    n = len(values)
    stride = n + 1
    bins: _MutableBins = []
    # Open bins keyed by slack * stride + bin id: ascending slack, then lowest id.
    keys: list[int] = []
    for item in _decreasing(values):
        length = values[item]
        pos = bisect.bisect_left(keys, length * stride)
        if pos == len(keys):
            bins.append([item])
            bisect.insort(keys, (cap - length) * stride + len(bins) - 1)
            continue
        slack, b = divmod(keys.pop(pos), stride)
        bins[b].append(item)
        bisect.insort(keys, (slack - length) * stride + b)
    return bins


def _first_fit(items: Sequence[int], values: Lengths, cap: int, bins: _MutableBins, slack: list[int]) -> None:
    """Place ``items`` first-fit decreasing into ``bins`` (with ``slack``), opening bins as needed; in place.

    Computed bin by bin: each bin in turn takes the longest unplaced item that
    fits, until none does. This gives exactly the packing of placing items
    longest first (ties: lowest index) into the first bin with room, in
    ``O(n log n)``.
    """
    n = len(values)
    pool = _keyed(items, values)
    for b in range(len(bins)):
        while pool and pool[0] // (n + 1) <= slack[b]:
            item = _pop_longest_at_most(pool, slack[b], n)
            bins[b].append(item)
            slack[b] -= values[item]
    while pool:
        bins.append([])
        slack.append(cap)
        while pool and pool[0] // (n + 1) <= slack[-1]:
            item = _pop_longest_at_most(pool, slack[-1], n)
            bins[-1].append(item)
            slack[-1] -= values[item]


def _first_fit_decreasing(values: Lengths, cap: int) -> _MutableBins:
    bins: _MutableBins = []
    _first_fit(range(len(values)), values, cap, bins, [])
    return bins


def _modified_first_fit_decreasing(values: Lengths, cap: int) -> _MutableBins:
    n = len(values)
    stride = n + 1
    order = _decreasing(values)
    large = [i for i in order if 2 * values[i] > cap]
    medium = _keyed([i for i in order if 3 * values[i] > cap >= 2 * values[i]], values)
    small = _keyed([i for i in order if 71 * values[i] > 11 * cap and cap >= 3 * values[i]], values)
    tiny = [i for i in order if 11 * cap >= 71 * values[i]]

    bins: _MutableBins = [[i] for i in large]
    slack = [cap - values[i] for i in large]
    # Forward through the large bins: where the shortest medium item fits, add the longest that fits.
    with_medium: set[int] = set()
    for b in range(len(bins)):
        if not medium or medium[0] // stride > slack[b]:
            continue
        item = _pop_longest_at_most(medium, slack[b], n)
        bins[b].append(item)
        slack[b] -= values[item]
        with_medium.add(b)
    # Backward through large bins without a medium item: where the two shortest small items
    # fit together, add the shortest and then the longest that still fits.
    for b in range(len(bins) - 1, -1, -1):
        if b in with_medium or len(small) < 2:
            continue
        if small[0] // stride + small[1] // stride > slack[b]:
            continue
        first = _pop_longest_at_most(small, small[0] // stride, n)
        second = _pop_longest_at_most(small, slack[b] - values[first], n)
        bins[b] += [first, second]
        slack[b] -= values[first] + values[second]
    rest = [n - key % stride for key in medium + small] + tiny
    _first_fit(rest, values, cap, bins, slack)
    return bins


def _keyed(items: Sequence[int], values: Lengths) -> list[int]:
    """Items as ascending keys ``length * (n + 1) + (n - index)``: among equal lengths the lowest index sorts last."""
    n = len(values)
    return sorted(values[i] * (n + 1) + (n - i) for i in items)


def _pop_longest_at_most(keys: list[int], limit: int, n: int) -> int:
    """Remove and return the longest item of ``keys`` (see ``_keyed``) not above ``limit``; ties: lowest index."""
    pos = bisect.bisect_right(keys, limit * (n + 1) + n) - 1
    return n - keys.pop(pos) % (n + 1)


def _concatenative(values: Lengths, cap: int) -> _MutableBins:
    bins: _MutableBins = []
    room = 0
    for item, length in enumerate(values):
        if not bins or length > room:
            bins.append([])
            room = cap
        bins[-1].append(item)
        room -= length
    return bins


def _pack(algorithm: str, values: Lengths, cap: int) -> _MutableBins:
    if algorithm == "best_fit_decreasing":
        return _best_fit_decreasing(values, cap)
    if algorithm == "first_fit_decreasing":
        return _first_fit_decreasing(values, cap)
    if algorithm == "modified_first_fit_decreasing":
        return _modified_first_fit_decreasing(values, cap)
    return _concatenative(values, cap)


# ---------------------------------------------------------------- improvement pass


def _fill_bins_one_at_a_time(
    values: Lengths,
    cap: int,
    *,
    max_bins: int,
    reserve_rank: int = 64,
    work: int = 1 << 24,
) -> _MutableBins | None:
    """Build bins one at a time, each filled as exactly as a cheap search can.

    A bin takes the largest unplaced item, then repeatedly the largest unplaced
    item that leaves room for small items (a gap of at least the
    ``reserve_rank``-th smallest unplaced length), or closes the gap exactly.
    The small remaining gap is then filled by an exact subset-sum over the
    unplaced lengths that fit (a bitset dynamic program, bounded by ``work``
    bit operations per call of this function). Filling every bin but the last
    exactly is what reaches ``ceil(sum / capacity)``.

    Returns None as soon as the space left unused in finished bins shows the
    result would need more than ``max_bins`` bins.
    """
    n = len(values)
    stride = n + 1
    # Unplaced items keyed by length * stride + (n - index): ascending length, and
    # among equal lengths the lowest index sorts last, so it is taken first.
    pool = sorted(values[i] * stride + (n - i) for i in range(n))
    count = np.bincount(np.asarray(values, dtype=np.int64), minlength=cap + 1)

    def take(pos: int) -> int:
        key = pool.pop(pos)
        count[key // stride] -= 1
        return key

    def take_length(length: int) -> int:
        return take(bisect.bisect_right(pool, length * stride + n) - 1)

    # Finished bins may leave at most this many tokens unused in total.
    waste_budget = max_bins * cap - sum(values)
    # Bit operations left for exact fills; beyond it, bins close with the longest item that fits.
    work_left = work
    bins: _MutableBins = []
    while pool:
        members = [take(len(pool) - 1)]
        gap = cap - members[0] // stride
        while pool and gap > 0:
            pos = bisect.bisect_right(pool, gap * stride + n) - 1
            if pos < 0:
                break
            if pool[pos] // stride == gap:
                members.append(take(pos))
                gap = 0
                break
            zeros = bisect.bisect_right(pool, n)
            reserve = pool[min(zeros + reserve_rank, len(pool)) - 1] // stride
            pos = bisect.bisect_right(pool, (gap - reserve) * stride + n) - 1
            if pos < 0:
                break
            key = take(pos)
            members.append(key)
            gap -= key // stride
        if gap > 0 and pool:
            zeros = bisect.bisect_right(pool, n)
            copies = max(8, min(128, (1 << 17) // gap))
            if (
                len(pool) - zeros >= 2
                and pool[zeros] // stride + pool[zeros + 1] // stride <= gap
                and work_left >= copies * gap
            ):
                work_left -= copies * gap
                for length in _exact_fill(count, gap, copies):
                    members.append(take_length(length))
                    gap -= length
            else:  # one item fits at most, or the work is spent: the longest items that fit
                pos = bisect.bisect_right(pool, gap * stride + n) - 1
                while pos >= 0:
                    key = take(pos)
                    members.append(key)
                    gap -= key // stride
                    pos = bisect.bisect_right(pool, gap * stride + n) - 1
        bins.append([n - key % stride for key in members])
        if pool:
            waste_budget -= gap
            if waste_budget < 0:
                return None
    return bins if len(bins) <= max_bins else None


def _exact_fill(count: np.ndarray, gap: int, max_copies: int) -> list[int]:
    """Lengths (a sub-multiset of ``count``) with the largest sum ``<= gap``, by bitset subset-sum.

    Only the ``max_copies`` longest candidate items are offered, which bounds
    the cost of one call to about ``max_copies * gap`` bit operations.
    """
    lengths = (np.flatnonzero(count[1 : gap + 1])[-max_copies:] + 1)[::-1]
    usable = (
        repeat(length, min(available, gap // length))
        for length, available in zip(lengths.tolist(), count[lengths].tolist())
    )
    copies = list(islice(chain.from_iterable(usable), max_copies))
    mask = (1 << (gap + 1)) - 1
    reach = 1
    history: list[int] = []
    for length in copies:
        history.append(reach)
        reach |= (reach << length) & mask
        if reach >> gap:
            break
    target = reach.bit_length() - 1
    chosen: list[int] = []
    for i in range(len(history) - 1, -1, -1):
        if target == 0:
            break
        if not (history[i] >> target) & 1:
            target -= copies[i]
            chosen.append(copies[i])
    return chosen


# ---------------------------------------------------------------- extra bins


def _split_contiguous(bins: _MutableBins, values: Lengths, target: int) -> _MutableBins:
    """Split the fullest multi-item run at its most balanced point until there are ``target`` runs.

    Runs stay contiguous and in input order; ties between equally full runs go
    to the earliest run.
    """
    runs = [list(b) for b in bins]
    heap = [(-sum(values[i] for i in run), run[0], k) for k, run in enumerate(runs) if len(run) > 1]
    heapq.heapify(heap)
    while len(runs) < target:
        neg_total, _, k = heapq.heappop(heap)
        run, total = runs[k], -neg_total
        prefix, best_cut, best_cost = 0, 1, total + 1
        for cut in range(1, len(run)):
            prefix += values[run[cut - 1]]
            cost = max(prefix, total - prefix)
            if cost < best_cost:
                best_cut, best_cost = cut, cost
        runs[k] = run[:best_cut]
        runs.append(run[best_cut:])
        for j in (k, len(runs) - 1):
            if len(runs[j]) > 1:
                heapq.heappush(heap, (-sum(values[i] for i in runs[j]), runs[j][0], j))
    return runs


def _spread_longest_first(values: Lengths, cap: int, target: int) -> _MutableBins | None:
    """Longest item first onto the least-loaded bin (LPT); None if a bin would overflow.

    Empty bins sort first among equally loaded ones, so with ``target <= n``
    every bin receives at least one item.
    """
    bins: _MutableBins = [[] for _ in range(target)]
    heap = [(0, 0, b) for b in range(target)]  # (load, item count, bin id)
    for item in _decreasing(values):
        load, count, b = heapq.heappop(heap)
        load += values[item]
        if load > cap:
            return None
        bins[b].append(item)
        heapq.heappush(heap, (load, count + 1, b))
    return bins


def _split_fullest(bins: _MutableBins, values: Lengths, target: int) -> _MutableBins:
    """Split the fullest multi-item bin into two balanced halves until there are ``target`` bins.

    Both halves are non-empty subsets of a bin that fit, so capacity holds.
    Equally full bins are split in order of their longest item, then lowest index.
    """
    out = [list(b) for b in bins]

    def entry(k: int) -> tuple[int, int, int, int]:
        return (-sum(values[i] for i in out[k]), -max(values[i] for i in out[k]), min(out[k]), k)

    heap = [entry(k) for k in range(len(out)) if len(out[k]) > 1]
    heapq.heapify(heap)
    while len(out) < target:
        k = heapq.heappop(heap)[-1]
        halves: _MutableBins = [[], []]
        loads = [0, 0]
        for item in sorted(out[k], key=lambda i: (-values[i], i)):
            side = 0 if (loads[0], len(halves[0])) <= (loads[1], len(halves[1])) else 1
            halves[side].append(item)
            loads[side] += values[item]
        out[k] = halves[0]
        out.append(halves[1])
        for j in (k, len(out) - 1):
            if len(out[j]) > 1:
                heapq.heappush(heap, entry(j))
    return out
