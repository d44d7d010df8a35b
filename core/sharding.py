"""Length-balanced data-parallel sharding of a :class:`~core.meta.KVBatchMeta`.

Concept: split the rows of a batch across ``dp_world`` data-parallel ranks so
that every rank does about the same amount of work (tokens) and, when rows are
grouped into micro-batches (packing or dynamic batching), every rank runs the
same number of micro-batches in each global batch; an uneven count deadlocks
the first collective that one rank reaches and another does not.

Invariants of ``shards, unsorted = shard_meta_for_dp(meta, dp_world=k, ...)``:
  * partition: the shards' keys are disjoint and together are ``meta.keys``;
  * inverse: ``concat_keys[unsorted[i]] == meta.keys[i]``, where ``concat_keys``
    are the shards' keys concatenated in rank order;
  * rows travel whole: a key keeps its own sequence length and tags;
  * with packing or dynamic batching: in each global batch every rank has the
    same number of micro-batches, each micro-batch's padded token count is at
    most the capacity, and ``micro_batch_indices`` tile the shard's rows.

``balanced_partition`` is the multi-way number-partitioning step underneath:
it never returns a partition whose largest part sum is above that of plain
LPT or sort-then-stride on the same input.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from core.checks import check_int, check_int_entries
from core.meta import KVBatchMeta
from core.packing import PACKING_ALGORITHMS, pack_sequences
from core.permutation import inverse_permutation

Weights = Sequence[int | float]
Part = tuple[int, ...]
Partition = tuple[Part, ...]
Labels = np.ndarray  # (n,) int64: the part each item is in
Shards = tuple[KVBatchMeta, ...]
Unsorted = tuple[int, ...]
MicroBatch = list[int]  # positions of one micro-batch's rows within its global batch
RankPlan = list[list[MicroBatch]]  # per rank, its micro-batches in step order

# Each refinement round makes one swap or move; rounds stop earlier when none helps.
_MAX_REFINE_ROUNDS = 512
_LEVEL_TOLERANCE = 1e-3  # levelling stops once the sync cost is within this of 1.0


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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
    labels = _balanced_labels(w.astype(np.float64), k, equal_size=equal_size)
    return _parts_from_labels(labels, k)


def _balanced_labels(w: np.ndarray, k: int, *, equal_size: bool, keep_nonempty: bool = False) -> Labels:
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
    best = min(candidates, key=lambda labels: _max_load(w, labels, k))  # first wins a tie
    return _refine(w, best, k, allow_moves=not equal_size, keep_nonempty=keep_nonempty)


def _max_load(w: np.ndarray, labels: Labels, k: int) -> float:
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
class _PartIndex:
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
    def build(cls, w: np.ndarray, labels: Labels, k: int, by_weight: np.ndarray) -> _PartIndex:
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


def _refine(w: np.ndarray, labels: Labels, k: int, *, allow_moves: bool, keep_nonempty: bool) -> Labels:
    """Lower the heaviest part by the best pairwise swap (or move) while one helps.

    A swap of item ``a`` (heaviest part ``h``) with a lighter item ``b`` of part
    ``p`` is accepted when ``max(load[h] - d, load[p] + d) < load[h]`` with
    ``d = w[a] - w[b]``; the best such swap puts both loads closest to their
    mean. For every ``(a, p)`` the best ``b`` is one of the two neighbours of
    ``w[a] - (load[h] - load[p]) / 2`` among ``p``'s weights (``_PartIndex``).
    Each accepted exchange strictly lowers the sum of squared loads, so the
    loop terminates, and no load ever rises to the current maximum, so the
    maximum never increases.
    """
    labels = labels.copy()
    if len(w) == 0 or k == 1:
        return labels
    by_weight = np.argsort(w, kind="stable")
    for _ in range(_MAX_REFINE_ROUNDS):
        loads = np.bincount(labels, weights=w, minlength=k)
        h = int(np.argmax(loads))
        top = loads[h]
        index = _PartIndex.build(w, labels, k, by_weight)
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


def _groups(labels: Labels, k: int) -> list[list[int]]:
    """Item indices of each part ``0..k-1``, ascending."""
    by_part = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=k))[:-1]
    return [g.tolist() for g in np.split(by_part, bounds)]


def _parts_from_labels(labels: Labels, k: int) -> Partition:
    """Parts as ascending index tuples, ordered by smallest index, empty parts last."""
    filled = sorted((tuple(g) for g in _groups(labels, k) if g), key=operator.itemgetter(0))
    return tuple(filled) + ((),) * (k - len(filled))


# ---------------------------------------------------------------- pad length


def global_pad_length(lengths: Sequence[int], *, multiple: int = 1) -> int:
    """The one sequence length all DP ranks pad to in a step: the longest length rounded up to ``multiple``.

    Ranks that pad to different lengths run collectives on tensors of
    different shapes; pass the lengths of every rank's rows in the step.

    Args:
        lengths: non-negative token counts of all rows in the step, across
            ranks (a sequence or a numpy integer array).
        multiple: round up to a multiple of this (``>= 1``), e.g. the
            tensor-parallel size times 2 for context parallelism.

    Returns:
        ``round_up(max(lengths), multiple)``; ``0`` for empty ``lengths``
        (nothing to pad).

    Raises:
        TypeError: ``lengths`` is not a sequence of ints, or ``multiple`` is not an int.
        ValueError: ``multiple < 1`` or a length is negative.

    Example:
        >>> global_pad_length([100, 250, 7], multiple=64)
        256
    """
    step = check_int("multiple", multiple, minimum=1)
    if isinstance(lengths, np.ndarray):
        lengths = lengths.ravel()
    longest = max(check_int_entries("lengths", lengths, minimum=0), default=0)
    return _round_up(longest, step)


# ---------------------------------------------------------------- specs


FieldValidator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _positive_int(name: str) -> FieldValidator:
    def check(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
        check_int(name, value, minimum=1)

    return check


def _known_algorithm(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"'algorithm' must be a str, one of {PACKING_ALGORITHMS}: got {type(value).__name__}")
    if value not in PACKING_ALGORITHMS:
        raise ValueError(f"'algorithm' must be one of {PACKING_ALGORITHMS}: got {value!r}")


@attrs.frozen
class PackingSpec:
    """Sequence packing per DP rank: rows are packed into micro-batches of bounded token count.

    A row's padded length is its length rounded up to
    ``sequence_length_pad_multiple``; a micro-batch holds at most
    ``max_tokens_per_microbatch`` padded tokens.

    Args:
        max_tokens_per_microbatch: the capacity of a micro-batch (``>= 1``).
        algorithm: the packer that fixes the micro-batch count, one of
            ``core.packing.PACKING_ALGORITHMS``.
        sequence_length_pad_multiple: round each row up to this many tokens (``>= 1``).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a count is below 1, or the algorithm is unknown.
    """

    max_tokens_per_microbatch: int = attrs.field(validator=_positive_int("max_tokens_per_microbatch"))
    algorithm: str = attrs.field(default="best_fit_decreasing", validator=_known_algorithm)
    sequence_length_pad_multiple: int = attrs.field(default=1, validator=_positive_int("sequence_length_pad_multiple"))


@attrs.frozen
class DynamicBatchingSpec:
    """Dynamic batching per DP rank: micro-batches of similar-length rows, each padded to its longest row.

    A micro-batch of ``c`` rows costs ``c * round_up(max length, sequence_length_round)``
    tokens, at most ``max_tokens_per_microbatch``.

    Args:
        max_tokens_per_microbatch: the capacity of a micro-batch (``>= 1``).
        sequence_length_round: the micro-batch's pad length is rounded up to this (``>= 1``).

    Raises:
        TypeError: a field is not an int.
        ValueError: a field is below 1.
    """

    max_tokens_per_microbatch: int = attrs.field(validator=_positive_int("max_tokens_per_microbatch"))
    sequence_length_round: int = attrs.field(default=1, validator=_positive_int("sequence_length_round"))


# ---------------------------------------------------------------- sharding


def shard_meta_for_dp(
    meta: KVBatchMeta,
    *,
    dp_world: int,
    batch_size: int | None = None,
    packing: PackingSpec | None = None,
    dynamic_batching: DynamicBatchingSpec | None = None,
) -> tuple[Shards, Unsorted]:
    """Split ``meta``'s rows across ``dp_world`` data-parallel ranks, balancing tokens.

    The rows are cut into consecutive global batches of ``batch_size`` rows
    (one global batch of all rows without it), and each global batch is split
    on its own; rank ``r``'s shard is the concatenation over global batches of
    its rows. Every shard keeps ``partition_id``, ``fields``, ``task_name``
    and ``extra_info``, and its own rows' lengths and tags.

    * Neither ``packing`` nor ``dynamic_batching``: each global batch is split
      into ``dp_world`` equal-size parts by :func:`balanced_partition` of its
      sequence lengths, rows kept in their original order inside a rank. When
      ``meta.sequence_lengths`` is None the split is contiguous instead (rank
      ``r`` gets the ``r``-th block of each global batch) and ``unsorted`` is
      the identity.
    * ``packing``: each global batch is packed with
      :func:`core.packing.pack_sequences` (bin count a multiple of
      ``dp_world``); when a smaller multiple of ``dp_world`` bins can still
      hold every row, that many are used instead. The rows are then
      rebalanced over the bins (never over capacity) so bins carry near-equal
      tokens, and the bins are dealt out in steps of ``dp_world``, heaviest
      bin to the rank with the fewest tokens so far.
    * ``dynamic_batching``: each global batch is sorted by length (longest
      first) and cut into consecutive runs: the smallest multiple of
      ``dp_world`` (at least ``dp_world``) of runs that fit capacity, cut so
      the costliest run is as cheap as a greedy cut allows; runs are dealt
      out as packed bins are.

    With packing or dynamic batching each shard's ``extra_info`` gains
    ``micro_batch_indices`` (per global batch, the ``(start, end)`` row ranges
    of the shard's micro-batches, as positions in the shard) and
    ``micro_batch_lengths`` (per global batch, each micro-batch's padded token
    count); every rank gets the same number of micro-batches per global batch
    while its row count may differ. Rows of a micro-batch keep their original
    order.

    Args:
        meta: the batch; ``sequence_lengths`` is needed to balance or pack.
        dp_world: the number of data-parallel ranks (``>= 1``).
        batch_size: rows per global batch (train step), or None for one global batch.
        packing: pack rows into micro-batches (exclusive with ``dynamic_batching``).
        dynamic_batching: group rows into padded micro-batches (exclusive with ``packing``).

    Returns:
        ``(shards, unsorted)``: one meta per rank, and the positions of
        ``meta``'s rows in the rank-order concatenation of the shards, so that
        ``concat_keys[unsorted[i]] == meta.keys[i]``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``dp_world`` or ``batch_size`` below 1; ``len(meta)`` not a
            multiple of ``batch_size``, or ``batch_size`` not a multiple of
            ``dp_world``; without packing, a global batch not a multiple of
            ``dp_world``; both packing and dynamic batching; lengths missing
            for packing or dynamic batching; a row longer than the capacity; a
            global batch that cannot give every rank the same number of non-empty
            micro-batches (e.g. fewer rows than ranks).

    Example:
        >>> m = KVBatchMeta("p", ["a", "b", "c", "d"], sequence_lengths=[9, 1, 8, 2])
        >>> shards, unsorted = shard_meta_for_dp(m, dp_world=2)
        >>> [s.keys for s in shards], unsorted
        ([('a', 'b'), ('c', 'd')], (0, 1, 2, 3))
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"'meta' must be a KVBatchMeta: got {type(meta).__name__}")
    dp = check_int("dp_world", dp_world, minimum=1)
    n = len(meta)
    if batch_size is None:
        gbs = n
    else:
        gbs = check_int("batch_size", batch_size, minimum=1)
        if n % gbs or gbs % dp:
            raise ValueError(
                f"'batch_size' must divide len(meta) and be a multiple of 'dp_world': got "
                f"len(meta)={n}, batch_size={gbs}, dp_world={dp}"
            )
    if packing is not None and not isinstance(packing, PackingSpec):
        raise TypeError(f"'packing' must be a PackingSpec or None: got {type(packing).__name__}")
    if dynamic_batching is not None and not isinstance(dynamic_batching, DynamicBatchingSpec):
        raise TypeError(f"'dynamic_batching' must be a DynamicBatchingSpec or None: got {type(dynamic_batching).__name__}")
    if packing is not None and dynamic_batching is not None:
        raise ValueError(
            "'packing' and 'dynamic_batching' are mutually exclusive: got both; pass one, "
            "e.g. shard_meta_for_dp(meta, dp_world=..., packing=PackingSpec(...))"
        )
    spec = packing if packing is not None else dynamic_batching
    micro = spec is not None
    if micro and meta.sequence_lengths is None:
        mode = "packing" if packing is not None else "dynamic_batching"
        raise ValueError(
            f"'sequence_lengths' is required for {mode}: got a meta without them; "
            f"set them first, e.g. attrs.evolve(meta, sequence_lengths=[...])"
        )
    if not micro and gbs % dp:
        raise ValueError(
            f"without packing, each global batch must split evenly over 'dp_world': got {gbs} rows "
            f"and dp_world={dp}; pass batch_size=<a multiple of {dp}> or trim the meta to a multiple of {dp} rows"
        )

    rows: list[list[int]] = [[] for _ in range(dp)]
    ranges: list[list[tuple[tuple[int, int], ...]]] = [[] for _ in range(dp)]
    tokens: list[list[tuple[int, ...]]] = [[] for _ in range(dp)]
    lengths = meta.sequence_lengths
    for offset in range(0, n, gbs) if gbs else ():
        if not micro:
            if lengths is None:
                step = gbs // dp
                plan = [[list(range(r * step, (r + 1) * step))] for r in range(dp)]
            else:
                parts = balanced_partition(lengths[offset : offset + gbs], dp)
                plan = [[list(part)] for part in parts]
        else:
            plan, loads = _plan_micro_batches(meta, offset, gbs, dp, spec)
            for r in range(dp):
                start = len(rows[r])
                spans = []
                for mb in plan[r]:
                    spans.append((start, start + len(mb)))
                    start += len(mb)
                ranges[r].append(tuple(spans))
                tokens[r].append(tuple(loads[r]))
        for r in range(dp):
            rows[r].extend(offset + i for mb in plan[r] for i in mb)

    shards = []
    for r in range(dp):
        shard = meta.subset(rows[r])
        if micro:
            shard = shard.with_extra_info(micro_batch_indices=ranges[r], micro_batch_lengths=tokens[r])
        shards.append(shard)
    return tuple(shards), inverse_permutation([i for r in range(dp) for i in rows[r]])


# ---------------------------------------------------------------- micro-batch plans


def _plan_micro_batches(
    meta: KVBatchMeta,
    offset: int,
    size: int,
    dp: int,
    spec: PackingSpec | DynamicBatchingSpec | None,
) -> tuple[RankPlan, list[list[int]]]:
    """Micro-batches of the global batch ``meta[offset:offset + size]``, dealt to ``dp`` ranks.

    Returns per rank its micro-batches (positions within the global batch) in
    step order, and per rank each micro-batch's padded token count.
    """
    lengths = (meta.sequence_lengths or ())[offset : offset + size]
    keys = meta.keys[offset : offset + size]
    if isinstance(spec, PackingSpec):
        step = spec.sequence_length_pad_multiple
    elif isinstance(spec, DynamicBatchingSpec):
        step = spec.sequence_length_round
    else:
        raise TypeError(f"'spec' must be a PackingSpec or DynamicBatchingSpec: got {type(spec).__name__}")
    cap = spec.max_tokens_per_microbatch
    padded = [_round_up(x, step) for x in lengths]
    for key, length, pad in zip(keys, lengths, padded):
        if pad > cap:
            raise ValueError(
                f"row {key!r} has {length} tokens ({pad} padded), above 'max_tokens_per_microbatch' "
                f"({cap}): it fits no micro-batch; raise the capacity or truncate the row"
            )
    if len(padded) < dp:
        raise ValueError(_too_few_rows(offset, len(padded), dp, dp))
    if isinstance(spec, PackingSpec):
        fewest = max(dp, _round_up(math.ceil(sum(padded) / cap), dp))
        if fewest > len(padded):
            raise ValueError(_too_few_rows(offset, len(padded), dp, fewest))
        bins, bin_loads, steps = _packed_bins(padded, dp, spec)
    else:
        bins, bin_loads = _dynamic_bins(padded, dp, cap, offset)
        steps = _group_steps(bin_loads, bins, dp)
    return _deal(bins, bin_loads, steps, dp)


def _too_few_rows(offset: int, n: int, dp: int, needed: int) -> str:
    return (
        f"the global batch at rows [{offset}, {offset + n}) has {n} rows, too few for {needed} "
        f"non-empty micro-batches (the same number on each of dp_world={dp} ranks); "
        f"pass a larger batch_size or use fewer ranks"
    )


def _packed_bins(padded: list[int], dp: int, spec: PackingSpec) -> tuple[list[list[int]], list[int], list[int]]:
    """Bins (row positions, ascending) within capacity, their loads, and the step each bin runs in.

    The packer fixes the bin count ``B`` (a multiple of ``dp``). Candidates:
    the smallest multiple of ``dp`` at or above the lower bound (when below
    ``B``) and ``B`` itself, each as a non-equal :func:`balanced_partition`
    accepted only if every bin is non-empty and within capacity (skipped
    when the packer already reached that fewest count); and the
    packer's bins refined by swaps and moves (which never raise the largest
    load, so they stay within capacity). The fewest bins win, then the lowest
    largest load. The bins are then grouped heaviest first into steps of
    ``dp`` and levelled inside each step (see ``_level_steps``).
    """
    cap = spec.max_tokens_per_microbatch
    n = len(padded)
    packed = pack_sequences(
        padded, capacity=cap, algorithm=spec.algorithm, bin_count_multiple=dp, min_bin_count=dp
    )
    w = np.asarray(padded, dtype=np.float64)
    count = len(packed)
    labels = np.empty(n, dtype=np.int64)
    for b, members in enumerate(packed):
        labels[list(members)] = b
    best = _refine(w, labels, count, allow_moves=True, keep_nonempty=True)
    best_count, best_max = count, _max_load(w, best, count)
    fewest = max(dp, _round_up(math.ceil(sum(padded) / cap), dp))
    for tried in sorted({fewest, count}):
        if tried > count or tried > n or (tried == count and count == fewest and best_max <= cap):
            continue  # the packer already reached the fewest bins: levelling below evens them out
        candidate = _balanced_labels(w, tried, equal_size=False, keep_nonempty=True)
        loads = np.bincount(candidate, weights=w, minlength=tried)
        if np.bincount(candidate, minlength=tried).min() == 0 or loads.max() > cap:
            continue
        if tried < best_count or loads.max() < best_max:
            best, best_count, best_max = candidate, tried, float(loads.max())
            break
    bins = _groups(best, best_count)
    steps = _group_steps([sum(padded[i] for i in b) for b in bins], bins, dp)
    levelled = _level_steps(w, best, np.asarray(steps, dtype=np.int64))
    bins = _groups(levelled, best_count)
    return bins, [sum(padded[i] for i in b) for b in bins], steps


def _level_steps(w: np.ndarray, labels: Labels, steps: np.ndarray) -> Labels:
    """Lower each step's heaviest bin, so the ranks of a step finish together.

    Bin ``b`` runs in step ``steps[b]`` (one bin per rank per step); the cost
    of a plan is the sum over steps of the step's heaviest bin. Each round
    takes the step whose heaviest bin ``h`` is furthest above the step's mean
    and makes the best swap or move of items between ``h`` and another bin
    ``p`` that lowers ``h``, while ``p`` stays strictly below ``h``'s old load
    (same step) or strictly below its own step's heaviest bin (other steps).
    No step's maximum rises, so no bin exceeds capacity, and each exchange
    lowers a step's maximum or the number of bins tied at it, so the loop ends.
    Emptying a bin is not allowed.
    """
    labels = labels.copy()
    k = len(steps)
    step_count = int(steps.max()) + 1
    step_sizes = np.bincount(steps, minlength=step_count)
    by_weight = np.argsort(w, kind="stable")
    stale: set[int] = set()  # steps with no exchange when last tried
    for _ in range(_MAX_REFINE_ROUNDS):
        loads = np.bincount(labels, weights=w, minlength=k)
        step_max = np.full(step_count, -np.inf)
        np.maximum.at(step_max, steps, loads)
        step_mean = np.bincount(steps, weights=loads, minlength=step_count) / step_sizes
        if step_max.sum() <= (1.0 + _LEVEL_TOLERANCE) * step_mean.sum():
            break  # within 0.1% of perfect lockstep: further exchanges are not worth their cost
        gaps = step_max - step_mean
        index = _PartIndex.build(w, labels, k, by_weight)
        exchange = None
        full_pass = not stale
        for j in np.argsort(-gaps, kind="stable").tolist():
            if gaps[j] <= 0:
                break
            if j in stale:
                continue
            in_step = np.flatnonzero(steps == j)
            h = int(in_step[np.argmax(loads[in_step])])
            exchange = _best_level_exchange(w, loads, steps, step_max, h, float(step_mean[j]), index)
            if exchange is not None:
                break
            stale.add(j)
        if exchange is None:
            if full_pass:
                break
            stale.clear()  # bins changed since these steps were tried: try every step once more
            continue
        a_item, b_item, p = exchange
        stale.discard(int(steps[labels[a_item]]))
        stale.discard(int(steps[p]))
        if b_item >= 0:
            labels[b_item] = labels[a_item]
        labels[a_item] = p
    return labels


def _best_level_exchange(
    w: np.ndarray,
    loads: np.ndarray,
    steps: np.ndarray,
    step_max: np.ndarray,
    h: int,
    floor: float,
    index: _PartIndex,
) -> tuple[int, int, int] | None:
    """The best ``(item of h, item of p or -1 for a move, p)`` for ``_level_steps``, or None.

    An exchange moving ``d`` tokens out of ``h`` scores ``max(load[h] - d,
    load[p] + d)`` within ``h``'s step and ``max(load[h] - d, floor)`` (the
    step's mean) across steps; it must score below ``load[h]``.
    """
    top = loads[h]
    members = index.members(h)
    wa = w[members][:, None]
    others = np.flatnonzero(np.arange(len(loads)) != h)
    if others.size == 0 or members.size == 0:
        return None
    same = (steps[others] == steps[h])[None, :]
    other_loads = loads[others][None, :]
    ceiling = np.where(same, top, step_max[steps[others]][None, :])
    best_value, best = top, None

    def consider(d: np.ndarray, columns: np.ndarray, cand: np.ndarray | None) -> None:
        nonlocal best_value, best
        new_p = other_loads[:, columns] + d
        value = np.where(same[:, columns], np.maximum(top - d, new_p), np.maximum(top - d, floor))
        value = np.where((d > 0) & (new_p < ceiling[:, columns]), value, np.inf)
        flat = int(np.argmin(value))
        if value.flat[flat] < best_value:
            a, q = divmod(flat, value.shape[1])
            best_value = float(value.flat[flat])
            b_item = -1 if cand is None else int(index.items[cand[a, q]])
            best = (int(members[a]), b_item, int(others[columns][q]))

    swappable = np.flatnonzero(index.ends[others] > index.starts[others])
    if swappable.size:
        sub = others[swappable]
        sub_loads = loads[sub][None, :]
        useful = np.where(
            same[:, swappable], (top - sub_loads) / 2.0, np.minimum(ceiling[:, swappable] - sub_loads, top - floor)
        )
        for cand in index.neighbours(sub, wa - useful):
            consider(wa - index.weights[cand], swappable, cand)
    if members.size > 1:
        consider(np.broadcast_to(wa, (members.size, others.size)), np.arange(others.size), None)
    return best


def _dynamic_bins(padded: list[int], dp: int, cap: int, offset: int) -> tuple[list[list[int]], list[int]]:
    """Runs of the rows sorted by padded length (longest first), as micro-batches, and their costs.

    A run starting at sorted position ``i`` with ``c`` rows costs
    ``c * padded[i]``. The run count ``M`` is the smallest multiple of ``dp``
    (at least ``dp``) not below the fewest runs within capacity; the runs are
    those of the lowest cost limit needing at most ``M`` greedy runs, and the
    costliest runs are split until there are exactly ``M``.
    """
    n = len(padded)
    order = sorted(range(n), key=lambda i: (-padded[i], i))
    size = [padded[i] for i in order]

    def greedy(limit: int) -> list[int]:
        starts, i = [], 0
        while i < n:
            starts.append(i)
            i = n if size[i] == 0 else min(n, i + max(1, limit // size[i]))
        return starts + [n]

    runs = len(greedy(cap)) - 1
    target = max(dp, _round_up(runs, dp))
    if target > n:
        raise ValueError(_too_few_rows(offset, n, dp, target))
    lo, hi = size[0], cap  # the lowest limit with at most ``target`` runs lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) - 1 <= target:
            hi = mid
        else:
            lo = mid + 1
    bounds = greedy(lo)
    spans = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]

    def cost(span: tuple[int, int]) -> int:
        return (span[1] - span[0]) * size[span[0]]

    while len(spans) < target:
        j = max((j for j in range(len(spans)) if spans[j][1] - spans[j][0] > 1), key=lambda j: (cost(spans[j]), -j))
        start, stop = spans[j]
        cut = min(range(start + 1, stop), key=lambda t: (max(cost((start, t)), cost((t, stop))), t))
        spans[j : j + 1] = [(start, cut), (cut, stop)]
    return [sorted(order[a:b]) for a, b in spans], [cost(s) for s in spans]


def _group_steps(loads: list[int], bins: list[list[int]], dp: int) -> list[int]:
    """Step of each bin: bins sorted by load (heaviest first, ties by first row) in groups of ``dp``."""
    by_load = sorted(range(len(bins)), key=lambda b: (-loads[b], bins[b][0]))
    steps = [0] * len(bins)
    for position, b in enumerate(by_load):
        steps[b] = position // dp
    return steps


def _deal(bins: list[list[int]], loads: list[int], steps: list[int], dp: int) -> tuple[RankPlan, list[list[int]]]:
    """Deal each step's ``dp`` bins to the ranks: heaviest bin to the rank with the fewest tokens so far.

    Bins of one step have near-equal loads, so micro-batch ``j`` costs about
    the same on every rank, and the totals stay balanced.
    """
    plan: RankPlan = [[] for _ in range(dp)]
    rank_loads: list[list[int]] = [[] for _ in range(dp)]
    totals = [0] * dp
    step_bins: list[list[int]] = [[] for _ in range(max(steps) + 1)]
    for b, step in enumerate(steps):
        step_bins[step].append(b)
    for members in step_bins:
        lightest_first = sorted(range(dp), key=lambda r: (totals[r], r))
        for b, r in zip(sorted(members, key=lambda b: (-loads[b], bins[b][0])), lightest_first):
            plan[r].append(bins[b])
            rank_loads[r].append(int(loads[b]))
            totals[r] += int(loads[b])
    return plan, rank_loads


def shard_row_indices(shards: Sequence[KVBatchMeta], unsorted: Sequence[int]) -> Partition:
    """The caller-order row positions each shard holds, from :func:`shard_meta_for_dp`'s output.

    Rank ``r``'s rows are ``meta.subset(shard_row_indices(shards, unsorted)[r])``:
    the same rows, in the same order, as ``shards[r]``. The legacy in-memory
    path uses this to slice a batch exactly as the data-plane path fetches it.

    Raises:
        ValueError: ``unsorted`` is not a permutation of the shards' total row count.

    Example:
        >>> shards, unsorted = shard_meta_for_dp(meta, dp_world=2)
        >>> rows = shard_row_indices(shards, unsorted)
        >>> all(meta.subset(r).keys == s.keys for r, s in zip(rows, shards))
        True
    """
    total = sum(len(s) for s in shards)
    if len(unsorted) != total:
        raise ValueError(f"'unsorted' must have {total} entries (one per sharded row): got {len(unsorted)}")
    concat_to_caller = inverse_permutation(unsorted)
    out = []
    offset = 0
    for shard in shards:
        out.append(tuple(concat_to_caller[offset : offset + len(shard)]))
        offset += len(shard)
    return tuple(out)
