"""Balanced multi-way number partitioning: split items into ``k`` parts of near-equal weight sums.

Concept: ``balanced_partition`` (the public entry) and the machinery under it,
Karmarkar-Karp largest differencing, LPT, sort-then-stride and a swap/move
refinement, which :mod:`core.micro_batch` reuses to level micro-batches.

Invariants of ``parts = balanced_partition(weights, k, equal_size=...)``:
  * partition: every index of ``weights`` is in exactly one part, and there
    are ``k`` parts (equal size: each of ``len(weights) // k`` items);
  * balance: its largest part sum is never above that of plain LPT or
    sort-then-stride on the same input;
  * determinism: equal inputs give equal parts, ascending inside a part,
    parts ordered by their smallest index, empty parts last.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence

import attrs
import numpy as np

from core.checks import check_int

Weights = Sequence[int | float]
Part = tuple[int, ...]
Partition = tuple[Part, ...]
Labels = np.ndarray  # (n,) int64: the part each item is in

# Each refinement round makes one swap or move; rounds stop earlier when none helps.
MAX_REFINE_ROUNDS = 512


# ---------------------------------------------------------------- validation


def _as_weights(weights: Weights) -> np.ndarray:
    """``weights`` as a 1-d int64 (all ints) or float64 array; rejects bools, NaN, inf and negatives."""
    if isinstance(weights, np.ndarray):
        if weights.ndim != 1:
            raise ValueError(f"'weights' must be 1-dimensional: got shape {weights.shape}")
        if weights.dtype.kind not in "iuf":
            raise TypeError(f"'weights' must hold ints or floats: got dtype {weights.dtype}")
        arr = weights.astype(np.int64 if weights.dtype.kind in "iu" else np.float64)
    else:
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise TypeError(f"'weights' must be a sequence of numbers: got {type(weights).__name__}")
        kinds = set(map(type, weights))
        if not all(issubclass(t, (int, float, np.integer, np.floating)) and not issubclass(t, (bool, np.bool_)) for t in kinds):
            for i, x in enumerate(weights):
                if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
                    raise TypeError(f"'weights' entries must be int or float: got {type(x).__name__} at index {i}")
        all_ints = all(issubclass(t, (int, np.integer)) for t in kinds)
        arr = np.array(weights, dtype=np.int64 if all_ints else np.float64)
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f"'weights' entries must be finite: got {arr[bad[0]]} at index {bad[0]}")
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        raise ValueError(f"'weights' entries must be >= 0: got {arr[negative[0]]} at index {negative[0]}")
    return arr


# ---------------------------------------------------------------- balanced partition


def balanced_partition(weights: Weights, parts: int, *, equal_size: bool = True) -> Partition:
    """Split item indices into ``parts`` groups whose weight sums are as even as possible.

    Three starting partitions are built: multi-way Karmarkar-Karp (largest
    differencing; in equal-size mode every state is seeded from ``parts``
    consecutive items of the descending order), greedy LPT (largest item to
    the lightest part; in equal-size mode in rounds of ``parts`` items, one
    per part) and sort-then-stride. The one with the lowest largest part sum
    is refined: the heaviest part swaps an item for a lighter item of another
    part (and, in non-equal mode, may also hand an item over) whenever that
    lowers the larger of the two parts' sums below the current maximum, until
    no such exchange exists or a bounded number of rounds has run. The result
    is deterministic, and its largest part sum is never above that of LPT or
    sort-then-stride.

    Args:
        weights: non-negative item weights (e.g. sequence lengths).
        parts: the number of parts (``>= 1``).
        equal_size: give every part exactly ``len(weights) // parts`` items;
            requires ``len(weights) % parts == 0``. With ``False`` part sizes
            are free, and parts may be empty (always when there are fewer items
            than parts).

    Returns:
        ``parts`` tuples of indices into ``weights``, each ascending; the parts
        are ordered by their smallest index, empty parts last. Together they
        hold every index exactly once.

    Raises:
        TypeError: ``weights`` is not a sequence of numbers, or ``parts`` is not an int.
        ValueError: ``parts < 1``; a weight is negative, NaN or infinite; or
            ``equal_size`` and ``len(weights)`` is not a multiple of ``parts``.

    Example:
        >>> balanced_partition([8, 7, 6, 5, 4, 2], 2)
        ((0, 2, 5), (1, 3, 4))
        >>> balanced_partition([9, 1, 1, 1], 2, equal_size=False)
        ((0,), (1, 2, 3))
    """
    w = _as_weights(weights)
    k = check_int("parts", parts, minimum=1)
    n = len(w)
    if equal_size and n % k:
        raise ValueError(
            f"equal-size partition needs len(weights) to be a multiple of parts: got {n} weights "
            f"and parts={k}; pass a multiple of {k} weights, or balanced_partition(weights, {k}, equal_size=False)"
        )
    labels = balanced_labels(w.astype(np.float64), k, equal_size=equal_size)
    return _parts_from_labels(labels, k)


def balanced_labels(w: np.ndarray, k: int, *, equal_size: bool, keep_nonempty: bool = False) -> Labels:
    """Labels of the best of KK / LPT / stride, refined by swaps (and moves when not ``equal_size``)."""
    n = len(w)
    if n == 0 or k == 1:
        return np.zeros(n, dtype=np.int64)
    order = np.lexsort((np.arange(n), -w))  # descending weight, ties by index
    candidates = (
        _karmarkar_karp(w, order, k, equal_size=equal_size),
        _lpt(w, order, k, equal_size=equal_size),
        _stride(order, k),
    )
    best = min(candidates, key=lambda labels: max_load(w, labels, k))  # first wins a tie
    return refine_labels(w, best, k, allow_moves=not equal_size, keep_nonempty=keep_nonempty)


def max_load(w: np.ndarray, labels: Labels, k: int) -> float:
    """The largest part sum of ``labels`` over ``k`` parts."""
    return float(np.bincount(labels, weights=w, minlength=k).max())


def _karmarkar_karp(w: np.ndarray, order: np.ndarray, k: int, *, equal_size: bool) -> Labels:
    """Multi-way largest differencing method.

    A state is ``k`` subsets in order of descending sum (kept as ascending
    negated sums); each subset is named by one of its items (a union-find
    root) or -1 when empty. The two states of largest spread (max - min sum)
    are merged, the heaviest subset of one with the lightest of the other,
    until one state is left. In equal-size mode no subset is ever empty.
    """
    n = len(w)
    parent = np.arange(n)
    states: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if equal_size:
        for seq, start in enumerate(range(0, n, k)):
            items = order[start : start + k]  # descending weight already
            states[seq] = (-w[items], items.copy())
    else:
        for seq, item in enumerate(order.tolist()):
            neg = np.zeros(k)
            neg[0] = -w[item]
            ids = np.full(k, -1, dtype=np.int64)
            ids[0] = item
            states[seq] = (neg, ids)
    heap = [(float(neg[0] - neg[-1]), seq) for seq, (neg, _) in states.items()]
    heapq.heapify(heap)
    seq = len(states)
    while len(heap) > 1:
        neg_a, ids_a = states.pop(heapq.heappop(heap)[1])
        neg_b, ids_b = states.pop(heapq.heappop(heap)[1])
        neg_b, ids_b = neg_b[::-1], ids_b[::-1]
        if equal_size:
            parent[ids_b] = ids_a
            ids = ids_a
        else:
            both = (ids_a >= 0) & (ids_b >= 0)
            parent[ids_b[both]] = ids_a[both]
            ids = np.where(ids_a >= 0, ids_a, ids_b)
        neg = neg_a + neg_b
        by_sum = np.argsort(neg, kind="stable")
        neg = neg[by_sum]
        states[seq] = (neg, ids[by_sum])
        heapq.heappush(heap, (float(neg[0] - neg[-1]), seq))
        seq += 1
    ((_, final_ids),) = states.values()
    while True:  # pointer jumping to the roots
        grand = parent[parent]
        if np.array_equal(grand, parent):
            break
        parent = grand
    part_of_root = np.full(n, -1, dtype=np.int64)
    present = final_ids >= 0
    part_of_root[final_ids[present]] = np.flatnonzero(present)
    return part_of_root[parent]


def _lpt(w: np.ndarray, order: np.ndarray, k: int, *, equal_size: bool) -> Labels:
    """Longest processing time first: each item, heaviest first, goes to the lightest part."""
    n = len(w)
    labels = [0] * n
    items, weight = order.tolist(), w.tolist()
    if equal_size:
        loads = [0.0] * k
        parts = range(k)
        for start in range(0, n, k):
            for item, p in zip(items[start : start + k], sorted(parts, key=loads.__getitem__)):
                labels[item] = p
                loads[p] += weight[item]
    else:
        heap = [(0.0, p) for p in range(k)]
        for item in items:
            load, p = heapq.heappop(heap)
            labels[item] = p
            heapq.heappush(heap, (load + weight[item], p))
    return np.array(labels, dtype=np.int64)


def _stride(order: np.ndarray, k: int) -> Labels:
    """Sort-then-stride: the ``j``-th heaviest item goes to part ``j % k``."""
    labels = np.empty(len(order), dtype=np.int64)
    labels[order] = np.arange(len(order)) % k
    return labels


@attrs.frozen(eq=False)
class PartIndex:
    """Items grouped by part, lightest first inside a part, for nearest-weight queries.

    ``keys`` are ``part * span + (weight - w_min)``: ascending overall, and
    part ``p``'s keys lie in ``[p * span, p * span + w_max - w_min]``, so one
    ``searchsorted`` answers queries into many parts at once.
    """

    items: np.ndarray  # (n,) int64: item ids, grouped by part, ascending weight inside a part
    weights: np.ndarray  # (n,) float64: the weights of ``items``
    starts: np.ndarray  # (k,) int64: position of each part's first item
    ends: np.ndarray  # (k,) int64: one past each part's last item
    keys: np.ndarray  # (n,) float64: ascending search keys (see the class docstring)
    span: float
    w_min: float
    w_max: float

    @classmethod
    def build(cls, w: np.ndarray, labels: Labels, k: int, by_weight: np.ndarray) -> PartIndex:
        """Index ``labels`` (``by_weight``: ``argsort(w)``, stable)."""
        label_type = np.int16 if k <= np.iinfo(np.int16).max else np.int64  # int16 sorts by radix
        items = by_weight[np.argsort(labels[by_weight].astype(label_type), kind="stable")]
        item_labels, weights = labels[items], w[items]
        part_ids = np.arange(k)
        w_min, w_max = float(w.min()), float(w.max())
        span = (w_max - w_min) + 1.0
        return cls(
            items=items,
            weights=weights,
            starts=np.searchsorted(item_labels, part_ids, side="left"),
            ends=np.searchsorted(item_labels, part_ids, side="right"),
            keys=item_labels * span + (weights - w_min),
            span=span,
            w_min=w_min,
            w_max=w_max,
        )

    def members(self, part: int) -> np.ndarray:
        """Item ids of ``part``, lightest first."""
        return self.items[self.starts[part] : self.ends[part]]

    def neighbours(self, parts: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions (into ``items``) of the nearest item at or below, and at or above, each target.

        ``targets[a, q]`` is looked up among the items of non-empty part
        ``parts[q]``; where no item lies on one side, the other side's is given.
        """
        clipped = np.clip(targets, self.w_min, self.w_max)
        queries = parts[None, :] * self.span + (clipped - self.w_min)
        pos = np.searchsorted(self.keys, queries.ravel()).reshape(queries.shape)
        lo, hi = self.starts[parts][None, :], self.ends[parts][None, :] - 1
        return np.clip(pos - 1, lo, hi), np.clip(pos, lo, hi)


def refine_labels(w: np.ndarray, labels: Labels, k: int, *, allow_moves: bool, keep_nonempty: bool) -> Labels:
    """Lower the heaviest part by the best pairwise swap (or move) while one helps.

    A swap of item ``a`` (heaviest part ``h``) with a lighter item ``b`` of part
    ``p`` is accepted when ``max(load[h] - d, load[p] + d) < load[h]`` with
    ``d = w[a] - w[b]``; the best such swap puts both loads closest to their
    mean. For every ``(a, p)`` the best ``b`` is one of the two neighbours of
    ``w[a] - (load[h] - load[p]) / 2`` among ``p``'s weights (``PartIndex``).
    Each accepted exchange strictly lowers the sum of squared loads, so the
    loop terminates, and no load ever rises to the current maximum, so the
    maximum never increases.
    """
    labels = labels.copy()
    if len(w) == 0 or k == 1:
        return labels
    by_weight = np.argsort(w, kind="stable")
    for _ in range(MAX_REFINE_ROUNDS):
        loads = np.bincount(labels, weights=w, minlength=k)
        h = int(np.argmax(loads))
        top = loads[h]
        index = PartIndex.build(w, labels, k, by_weight)
        members = index.members(h)
        wa = w[members][:, None]
        best_value, best_move = top, None
        others = np.flatnonzero((np.arange(k) != h) & (index.ends > index.starts))
        if others.size and members.size:
            other_loads = loads[others][None, :]
            for cand in index.neighbours(others, wa - (top - other_loads) / 2.0):
                d = wa - index.weights[cand]
                value = np.where(d > 0, np.maximum(top - d, other_loads + d), np.inf)
                flat = int(np.argmin(value))
                if value.flat[flat] < best_value:
                    a, q = divmod(flat, others.size)
                    best_value = float(value.flat[flat])
                    best_move = (int(members[a]), int(index.items[cand[a, q]]), int(others[q]))
        if allow_moves and members.size and (members.size > 1 or not keep_nonempty):
            value = np.maximum(top - wa, loads[None, :] + wa)
            value[:, h] = np.inf
            value[wa[:, 0] <= 0, :] = np.inf
            flat = int(np.argmin(value))
            if value.flat[flat] < best_value:
                a, p = divmod(flat, k)
                best_value = float(value.flat[flat])
                best_move = (int(members[a]), -1, p)
        if best_move is None:
            break
        a_item, b_item, p = best_move
        labels[a_item] = p
        if b_item >= 0:
            labels[b_item] = h
    return labels


def label_groups(labels: Labels, k: int) -> list[list[int]]:
    """Item indices of each part ``0..k-1``, ascending."""
    by_part = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=k))[:-1]
    return [g.tolist() for g in np.split(by_part, bounds)]


def _parts_from_labels(labels: Labels, k: int) -> Partition:
    """Parts as ascending index tuples, ordered by smallest index, empty parts last."""
    filled = sorted((tuple(g) for g in label_groups(labels, k) if g), key=operator.itemgetter(0))
    return tuple(filled) + ((),) * (k - len(filled))

