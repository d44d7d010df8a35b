"""Length-balanced data-parallel sharding of a :class:`~core.meta.KVBatchMeta`.

Concept: split the rows of a batch across ``dp_world`` data-parallel ranks,
one global batch (train step) at a time, so that every rank does about the
same amount of work (tokens) and runs the same number of micro-batches in
each global batch; an uneven count deadlocks the first collective that one
rank reaches and another does not. The split of one global batch is
:func:`core.partition.balanced_partition` (plain) or
:func:`core.micro_batch.plan_global_batch` (packing, dynamic batching).

Invariants of ``shards, unsorted = shard_meta_for_dp(meta, dp_world=k, ...)``:
  * partition: the shards' keys are disjoint and together are ``meta.keys``;
  * inverse: ``concat_keys[unsorted[i]] == meta.keys[i]``, where ``concat_keys``
    are the shards' keys concatenated in rank order;
  * rows travel whole: a key keeps its own sequence length and tags;
  * micro-batches: every shard carries ``micro_batch_indices``, one entry per
    global batch, whose spans tile the shard's rows in order; in each global
    batch every rank has the same number of micro-batches (one, the rank's
    whole share, without packing or dynamic batching), and with packing or
    dynamic batching each micro-batch's padded token count is at most the
    capacity.

``PackingSpec``, ``DynamicBatchingSpec`` (:mod:`core.micro_batch`) and
``balanced_partition`` (:mod:`core.partition`) are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.checks import check_int, check_int_entries
from core.fields import MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS
from core.meta import KVBatchMeta
from core.micro_batch import DynamicBatchingSpec, PackingSpec, RankPlan, plan_global_batch
from core.packing import round_up
from core.partition import Partition, balanced_partition
from core.permutation import inverse_permutation

__all__ = [
    "DynamicBatchingSpec",
    "PackingSpec",
    "Shards",
    "Unsorted",
    "balanced_partition",
    "global_pad_length",
    "shard_meta_for_dp",
    "shard_row_indices",
]

Shards = tuple[KVBatchMeta, ...]
Unsorted = tuple[int, ...]
Spans = tuple[tuple[int, int], ...]  # one global batch's micro-batches as (start, end) row spans of a shard


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
    return round_up(longest, step)


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
      ``meta.sequence_lengths`` is None the split is contiguous instead: rank
      ``r`` gets the ``r``-th block of ``batch_size // dp_world`` rows of each
      global batch. ``unsorted`` is then the identity only when there is one
      global batch or one rank; with several global batches and ranks, rank
      0's blocks of every global batch come first in the concatenation, so
      e.g. 4 rows, ``dp_world=2``, ``batch_size=2`` give ``(0, 2, 1, 3)``.
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

    Every shard's ``extra_info`` gains ``micro_batch_indices``: per global
    batch, the ``(start, end)`` row ranges of the shard's micro-batches, as
    positions in the shard; they tile the shard's rows in order. Without
    packing or dynamic batching each global batch is one micro-batch per rank
    (its whole share). With packing or dynamic batching ``extra_info`` also
    gains ``micro_batch_lengths`` (per global batch, each micro-batch's padded
    token count), and a rank's row count may differ from another's. In every
    mode each rank gets the same number of micro-batches per global batch, and
    rows of a micro-batch keep their original order.

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
        >>> shards[0].extra_info["micro_batch_indices"]
        (((0, 2),),)
        >>> shards, unsorted = shard_meta_for_dp(KVBatchMeta("p", ["a", "b", "c", "d"]), dp_world=2, batch_size=2)
        >>> [s.keys for s in shards], unsorted
        ([('a', 'c'), ('b', 'd')], (0, 2, 1, 3))
        >>> shards[0].extra_info["micro_batch_indices"]
        (((0, 1),), ((1, 2),))
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
    if spec is not None and meta.sequence_lengths is None:
        mode = "packing" if packing is not None else "dynamic_batching"
        raise ValueError(
            f"'sequence_lengths' is required for {mode}: got a meta without them; "
            f"set them first, e.g. attrs.evolve(meta, sequence_lengths=[...])"
        )
    if spec is None and gbs % dp:
        raise ValueError(
            f"without packing, each global batch must split evenly over 'dp_world': got {gbs} rows "
            f"and dp_world={dp}; pass batch_size=<a multiple of {dp}> or trim the meta to a multiple of {dp} rows"
        )

    rows: list[list[int]] = [[] for _ in range(dp)]
    spans: list[list[Spans]] = [[] for _ in range(dp)]
    tokens: list[list[tuple[int, ...]]] = [[] for _ in range(dp)]
    for offset in range(0, n, gbs) if gbs else ():
        if spec is None:
            plan: RankPlan = [[list(part)] for part in _even_split(meta.sequence_lengths, offset, gbs, dp)]
        else:
            plan, loads = plan_global_batch(
                meta.sequence_lengths[offset : offset + gbs],  # type: ignore[index]
                dp_world=dp,
                spec=spec,
                keys=meta.keys[offset : offset + gbs],
                offset=offset,
            )
            for r in range(dp):
                tokens[r].append(tuple(loads[r]))
        for r in range(dp):
            start = len(rows[r])
            batch_spans = []
            for micro_batch in plan[r]:
                batch_spans.append((start, start + len(micro_batch)))
                start += len(micro_batch)
                rows[r].extend(offset + i for i in micro_batch)
            spans[r].append(tuple(batch_spans))

    shards = []
    for r in range(dp):
        info: dict[str, object] = {MICRO_BATCH_INDICES: tuple(spans[r])}
        if spec is not None:
            info[MICRO_BATCH_LENGTHS] = tuple(tokens[r])
        shards.append(meta.subset(rows[r]).with_extra_info(**info))
    return tuple(shards), inverse_permutation([i for r in range(dp) for i in rows[r]])


def _even_split(lengths: Sequence[int] | None, offset: int, size: int, dp: int) -> Partition:
    """The plain split of global batch ``[offset, offset + size)``: ``dp`` equal-size parts (positions within it).

    Balanced by length when there are lengths, else contiguous blocks.
    """
    if lengths is None:
        block = size // dp
        return tuple(tuple(range(r * block, (r + 1) * block)) for r in range(dp))
    return balanced_partition(lengths[offset : offset + size], dp)


def shard_like(meta: KVBatchMeta, shards: Sequence[KVBatchMeta], unsorted: Sequence[int]) -> tuple[Shards, Unsorted]:
    """The split that :func:`shard_meta_for_dp` gave ``shards`` (of some meta), applied to ``meta``, a meta of
    the same rows: same keys in the same order, same ``sequence_lengths``; fields, tags and ``extra_info`` may
    differ (e.g. a field written since). No planning runs.

    Law (``tests/property/test_sharding.py``): for metas ``a`` and ``b`` of the same keys and lengths,
    ``shard_like(b, *shard_meta_for_dp(a, **kw)) == shard_meta_for_dp(b, **kw)``: the split depends on the
    lengths alone, and each shard is ``b``'s subset of its rows with the split's ``micro_batch_indices`` (and
    ``micro_batch_lengths``, when packed).

    Raises:
        TypeError: ``meta`` is not a KVBatchMeta.
        ValueError: ``shards`` and ``unsorted`` do not hold ``meta``'s rows: the first position whose key or
            length differs is named.

    Example:
        >>> a = KVBatchMeta("p", ["a", "b", "c", "d"], sequence_lengths=[9, 1, 8, 2])
        >>> b = a.with_fields(["advantages"])
        >>> shard_like(b, *shard_meta_for_dp(a, dp_world=2)) == shard_meta_for_dp(b, dp_world=2)
        True
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"'meta' must be a KVBatchMeta: got {type(meta).__name__}")
    rows = shard_row_indices(shards, unsorted)
    if sum(len(r) for r in rows) != len(meta):
        raise ValueError(f"'shards' must hold the {len(meta)} rows of 'meta': got {sum(len(r) for r in rows)} rows")
    lengths = meta.sequence_lengths or (None,) * len(meta)
    for shard, positions in zip(shards, rows):
        shard_lengths = shard.sequence_lengths or (None,) * len(shard)
        for j, i in enumerate(positions):
            if shard.keys[j] != meta.keys[i] or shard_lengths[j] != lengths[i]:
                raise ValueError(
                    f"'shards' must hold the rows of 'meta': row {i} of 'meta' is key {meta.keys[i]!r} of length "
                    f"{lengths[i]}, its place in the shards holds key {shard.keys[j]!r} of length {shard_lengths[j]}"
                )
    plan_keys = (MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS)
    out = tuple(
        meta.subset(positions).with_extra_info(**{k: shard.extra_info[k] for k in plan_keys if k in shard.extra_info})
        for shard, positions in zip(shards, rows)
    )
    return out, tuple(unsorted)


def shard_row_indices(shards: Sequence[KVBatchMeta], unsorted: Sequence[int]) -> Partition:
    """The caller-order row positions each shard holds, from :func:`shard_meta_for_dp`'s output.

    Rank ``r``'s rows are ``meta.subset(shard_row_indices(shards, unsorted)[r])``:
    the same rows, in the same order, as ``shards[r]``. The legacy in-memory
    path uses this to slice a batch exactly as the data-plane path fetches it.

    Raises:
        ValueError: ``unsorted`` is not a permutation of the shards' total row count.

    Example:
        >>> meta = KVBatchMeta("p", ["a", "b", "c", "d"], sequence_lengths=[5, 1, 4, 2])
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
