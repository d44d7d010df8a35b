"""Baseline algorithms the benchmarks compare against (not used by the library).

Each is the simple method a user would otherwise reach for: sort-then-stride
sharding, plain multi-way Karmarkar-Karp as found in verl, plain best-fit
decreasing packing and round-robin dealing of bins.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Parts = tuple[tuple[int, ...], ...]


def sort_then_stride(weights: Sequence[int], parts: int) -> Parts:
    """Sort indices by weight (descending) and deal them with a stride: part r gets order[r::parts]."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    return tuple(tuple(sorted(order[r::parts])) for r in range(parts))


def karmarkar_karp_verl_style(weights: Sequence[int], parts: int) -> Parts:
    """Multi-way largest differencing, equal-size variant, with no refinement.

    Items sorted ascending are cut into consecutive chunks of ``parts``; each
    chunk seeds a state with one item per subset. The two states of largest
    spread are merged (heaviest subset of one with the lightest of the other)
    until one state is left.
    """
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, start in enumerate(range(0, len(order), parts)):
        subsets = sorted(((weights[i], [i]) for i in order[start : start + parts]), key=lambda s: -s[0])
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), counter, subsets))
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return tuple(tuple(sorted(ids)) for _, ids in heap[0][2])


def best_fit_decreasing_plain(lengths: Sequence[int], capacity: int) -> Parts:
    """Textbook best-fit decreasing: each item, longest first, goes to the fullest bin it fits in."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best = -1
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity and (best < 0 or load > loads[best]):
                best = b
        if best < 0:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[best].append(i)
            loads[best] += lengths[i]
    return tuple(tuple(sorted(b)) for b in bins)


def deal_round_robin(bin_loads: Sequence[int], dp: int) -> list[list[int]]:
    """Per-rank micro-batch loads when bin ``i`` goes to rank ``i % dp`` at step ``i // dp``."""
    return [list(bin_loads[r::dp]) for r in range(dp)]
