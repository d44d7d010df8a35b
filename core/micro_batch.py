"""Micro-batch planning: the rows of one global batch grouped into micro-batches and dealt to the DP ranks.

Concept: a :class:`PackingSpec` (rows packed into bins of bounded padded
tokens) or a :class:`DynamicBatchingSpec` (length-sorted runs, each padded to
its longest row) turns a global batch into micro-batches;
:func:`plan_global_batch` builds them and deals them to ``dp_world`` ranks in
steps of one micro-batch per rank.

Invariants of ``plan, loads = plan_global_batch(lengths, dp_world=k, spec=s)``:
  * partition: the micro-batches hold every row position exactly once, rows of
    a micro-batch in ascending order;
  * uniform count: every rank gets the same number (at least one) of
    non-empty micro-batches, so no rank waits at a collective another skips;
  * capacity: each micro-batch's padded token count (``loads``) is at most
    ``s.max_tokens_per_microbatch``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from core.checks import check_int, check_int_entries
from core.packing import PACKING_ALGORITHMS, pack_sequences, round_up
from core.partition import MAX_REFINE_ROUNDS, Labels, PartIndex, balanced_labels, label_groups, max_load, refine_labels

MicroBatch = list[int]  # positions of one micro-batch's rows within its global batch
RankPlan = list[list[MicroBatch]]  # per rank, its micro-batches in step order
RankLoads = list[list[int]]  # per rank, each micro-batch's padded token count

_LEVEL_TOLERANCE = 1e-3  # levelling stops once the sync cost is within this of 1.0


# ---------------------------------------------------------------- specs


FieldValidator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _positive_int(name: str) -> FieldValidator:
    def check(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
        check_int(name, value, minimum=1)

    return check


_FALLBACK_PACKER = "best_fit_decreasing"
"""The packer whose bins a plan starts from when ``PackingSpec.algorithm``'s need more bins than there are rows."""


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


# ---------------------------------------------------------------- micro-batch plans


Spec = PackingSpec | DynamicBatchingSpec


def plan_global_batch(
    lengths: Sequence[int],
    *,
    dp_world: int,
    spec: Spec,
    keys: Sequence[str] | None = None,
    offset: int = 0,
) -> tuple[RankPlan, RankLoads]:
    """The micro-batches of one global batch of rows with ``lengths``, dealt to ``dp_world`` ranks.

    ``spec`` picks the grouping (see :func:`core.sharding.shard_meta_for_dp`,
    which calls this once per global batch). ``keys`` and ``offset`` only name
    rows in error messages (the global batch's keys, and its first row's
    position in the whole batch).

    Returns:
        ``(plan, loads)``: per rank its micro-batches (row positions within
        the global batch, ascending inside a micro-batch) in step order, and
        per rank each micro-batch's padded token count.

    Raises:
        TypeError: ``spec`` is not a PackingSpec or DynamicBatchingSpec, or a
            count is not an int.
        ValueError: a row's padded length is above the capacity; there are too
            few rows for the same number of non-empty micro-batches on every rank.

    Example:
        >>> plan_global_batch([8, 1, 7, 2], dp_world=2, spec=PackingSpec(9))
        ([[[0, 1]], [[2, 3]]], [[9], [9]])
    """
    if isinstance(spec, PackingSpec):
        step = spec.sequence_length_pad_multiple
    elif isinstance(spec, DynamicBatchingSpec):
        step = spec.sequence_length_round
    else:
        raise TypeError(f"'spec' must be a PackingSpec or DynamicBatchingSpec: got {type(spec).__name__}")
    lengths = check_int_entries("lengths", lengths, minimum=0)
    dp = check_int("dp_world", dp_world, minimum=1)
    offset = check_int("offset", offset, minimum=0)
    names: Sequence[object] = range(offset, offset + len(lengths)) if keys is None else keys
    if len(names) != len(lengths):
        raise ValueError(f"'keys' must have {len(lengths)} entries (one per length): got {len(names)}")
    cap = spec.max_tokens_per_microbatch
    padded = [round_up(x, step) for x in lengths]
    for key, length, pad in zip(names, lengths, padded):
        if pad > cap:
            raise ValueError(
                f"row {key!r} has {length} tokens ({pad} padded), above 'max_tokens_per_microbatch' "
                f"({cap}): it fits no micro-batch; raise the capacity or truncate the row"
            )
    if len(padded) < dp:
        raise ValueError(_too_few_rows(offset, len(padded), dp, dp))
    if isinstance(spec, PackingSpec):
        fewest = max(dp, round_up(math.ceil(sum(padded) / cap), dp))
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

    The packer fixes the bin count ``B`` (a multiple of ``dp``); where it needs more bins than there are rows
    (an order-keeping packer can), :data:`_FALLBACK_PACKER`'s bins are the start instead. Candidates:
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
    try:
        packed = pack_sequences(
            padded, capacity=cap, algorithm=spec.algorithm, bin_count_multiple=dp, min_bin_count=dp
        )
    except ValueError:
        if spec.algorithm == _FALLBACK_PACKER:
            raise
        # An order-keeping packer ("concatenative") can need more bins than there are rows where another packer
        # does not; the plan reorders rows anyway, so start from the fallback's bins (it raises what is wrong).
        packed = pack_sequences(
            padded, capacity=cap, algorithm=_FALLBACK_PACKER, bin_count_multiple=dp, min_bin_count=dp
        )
    w = np.asarray(padded, dtype=np.float64)
    count = len(packed)
    labels = np.empty(n, dtype=np.int64)
    for b, members in enumerate(packed):
        labels[list(members)] = b
    best = refine_labels(w, labels, count, allow_moves=True, keep_nonempty=True)
    best_count, best_max = count, max_load(w, best, count)
    fewest = max(dp, round_up(math.ceil(sum(padded) / cap), dp))
    for tried in sorted({fewest, count}):
        if tried > count or tried > n or (tried == count and count == fewest and best_max <= cap):
            continue  # the packer already reached the fewest bins: levelling below evens them out
        candidate = balanced_labels(w, tried, equal_size=False, keep_nonempty=True)
        loads = np.bincount(candidate, weights=w, minlength=tried)
        if np.bincount(candidate, minlength=tried).min() == 0 or loads.max() > cap:
            continue
        if tried < best_count or loads.max() < best_max:
            best, best_count, best_max = candidate, tried, float(loads.max())
            break
    bins = label_groups(best, best_count)
    steps = _group_steps([sum(padded[i] for i in b) for b in bins], bins, dp)
    levelled = _level_steps(w, best, np.asarray(steps, dtype=np.int64))
    bins = label_groups(levelled, best_count)
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
    for _ in range(MAX_REFINE_ROUNDS):
        loads = np.bincount(labels, weights=w, minlength=k)
        step_max = np.full(step_count, -np.inf)
        np.maximum.at(step_max, steps, loads)
        step_mean = np.bincount(steps, weights=loads, minlength=step_count) / step_sizes
        if step_max.sum() <= (1.0 + _LEVEL_TOLERANCE) * step_mean.sum():
            break  # within 0.1% of perfect lockstep: further exchanges are not worth their cost
        gaps = step_max - step_mean
        index = PartIndex.build(w, labels, k, by_weight)
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
    index: PartIndex,
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
    target = max(dp, round_up(runs, dp))
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


def _deal(bins: list[list[int]], loads: list[int], steps: list[int], dp: int) -> tuple[RankPlan, RankLoads]:
    """Deal each step's ``dp`` bins to the ranks: heaviest bin to the rank with the fewest tokens so far.

    Bins of one step have near-equal loads, so micro-batch ``j`` costs about
    the same on every rank, and the totals stay balanced.
    """
    plan: RankPlan = [[] for _ in range(dp)]
    rank_loads: RankLoads = [[] for _ in range(dp)]
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

