"""Laws of length-balanced DP sharding (``core/sharding.py``).

Partition and inverse laws for every mode; micro-batch spans stamped on every
shard (tiling, one entry per global batch, uniform counts); capacity under
packing / dynamic batching; balance against ``balanced_partition`` and
``pack_sequences`` as references; ``global_pad_length``,
``shard_row_indices``, and the error paths.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.meta import KVBatchMeta
from core.packing import pack_sequences
from core.sharding import (
    DynamicBatchingSpec,
    PackingSpec,
    balanced_partition,
    global_pad_length,
    shard_like,
    shard_meta_for_dp,
    shard_row_indices,
)
from tests.property.references import micro_batch_tokens, padded_length
from tests.property.strategies import lognormal_lengths, micro_batching_cases, sharding_cases

MICRO = settings(max_examples=40)  # each example shards a whole meta; keeps the file fast
EVERY_MODE = st.one_of(sharding_cases(with_lengths=None).map(lambda c: (*c, None)), micro_batching_cases())
"""``(meta, dp_world, batch_size, spec)``: plain (spec None, lengths or not), packing or dynamic batching."""


def _global_batch_size_and_positions(meta: KVBatchMeta, batch_size: int | None) -> tuple[int, dict[str, int]]:
    """Rows per global batch, and each key's position in meta."""
    return batch_size or len(meta), {k: i for i, k in enumerate(meta.keys)}


def _concat_keys(shards: tuple[KVBatchMeta, ...]) -> list[str]:
    return [k for s in shards for k in s.keys]


# ---------------------------------------------------------------- shard_meta_for_dp: every mode


@given(st.one_of(sharding_cases(with_lengths=None).map(lambda c: (*c, None)), micro_batching_cases()))
@MICRO
def test_shard_meta_for_dp_partitions_the_keys(case: tuple) -> None:
    """The shards' keys are disjoint and together are exactly meta.keys; there is one shard per rank."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    assert len(shards) == dp
    concat = _concat_keys(shards)
    assert len(concat) == len(set(concat)) == len(meta)
    assert set(concat) == set(meta.keys)


@given(st.one_of(sharding_cases(with_lengths=None).map(lambda c: (*c, None)), micro_batching_cases()))
@MICRO
def test_shard_meta_for_dp_unsorted_inverts_the_concatenation(case: tuple) -> None:
    """concat_keys[unsorted[i]] == meta.keys[i] for every row i."""
    meta, dp, batch_size, spec = case
    shards, unsorted = _shard(meta, dp, batch_size, spec)
    concat = _concat_keys(shards)
    assert sorted(unsorted) == list(range(len(meta)))
    assert [concat[unsorted[i]] for i in range(len(meta))] == list(meta.keys)


@given(st.one_of(sharding_cases(with_lengths=None).map(lambda c: (*c, None)), micro_batching_cases()))
@MICRO
def test_shard_meta_for_dp_rows_keep_their_lengths_tags_and_batch_fields(case: tuple) -> None:
    """Each key keeps its length and tags; every shard keeps partition_id, fields, task_name, extra_info."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    source = {k: i for i, k in enumerate(meta.keys)}
    for shard in shards:
        assert (shard.partition_id, shard.fields, shard.task_name) == (meta.partition_id, meta.fields, meta.task_name)
        assert all(shard.extra_info[name] == value for name, value in meta.extra_info.items())
        rows = [source[k] for k in shard.keys]
        if meta.sequence_lengths is not None:
            assert shard.sequence_lengths == tuple(meta.sequence_lengths[i] for i in rows)
        if meta.tags is not None:
            assert shard.tags == tuple(meta.tags[i] for i in rows)


@given(st.one_of(sharding_cases(with_lengths=None).map(lambda c: (*c, None)), micro_batching_cases()))
@MICRO
def test_shard_meta_for_dp_keeps_global_batches_in_order(case: tuple) -> None:
    """A shard holds global batch 0's rows, then global batch 1's, and so on."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    size, source = _global_batch_size_and_positions(meta, batch_size)
    for shard in shards:
        batch_of_row = [source[k] // size for k in shard.keys]
        assert batch_of_row == sorted(batch_of_row)


# ---------------------------------------------------------------- shard_meta_for_dp: no packing


@given(sharding_cases(with_lengths=None))
@MICRO
def test_shard_meta_for_dp_gives_each_rank_an_equal_share_of_each_global_batch(case: tuple) -> None:
    """Without packing, every rank gets batch_size // dp_world rows of every global batch."""
    meta, dp, batch_size = case
    shards, _ = _shard(meta, dp, batch_size, None)
    size, source = _global_batch_size_and_positions(meta, batch_size)
    for shard in shards:
        counts = np.bincount([source[k] // size for k in shard.keys], minlength=len(meta) // size)
        assert set(counts.tolist()) == {size // dp}


@given(sharding_cases(with_lengths=True))
@MICRO
def test_shard_meta_for_dp_balances_each_global_batch_like_balanced_partition(case: tuple) -> None:
    """Sharding then summing equals balanced_partition of each global batch (the reference)."""
    meta, dp, batch_size = case
    shards, _ = shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size)
    size, source = _global_batch_size_and_positions(meta, batch_size)
    lengths = list(meta.sequence_lengths)
    for start in range(0, len(meta), size):
        reference = balanced_partition(lengths[start : start + size], dp)
        expected = sorted(tuple(start + i for i in part) for part in reference)
        got = sorted(tuple(source[k] for k in s.keys if start <= source[k] < start + size) for s in shards)
        assert got == expected


@given(sharding_cases(with_lengths=False))
@MICRO
def test_shard_meta_for_dp_splits_contiguously_without_lengths(case: tuple) -> None:
    """Without lengths and packing, rank r gets the r-th block of each global batch and unsorted is the identity."""
    meta, dp, batch_size = case
    shards, unsorted = shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size)
    size = batch_size or len(meta)
    block = size // dp
    for r, shard in enumerate(shards):
        expected = [meta.keys[g + r * block + j] for g in range(0, len(meta), size) for j in range(block)]
        assert list(shard.keys) == expected
    if batch_size is None or batch_size == len(meta):
        assert unsorted == tuple(range(len(meta)))


@given(sharding_cases(with_lengths=False))
@MICRO
def test_shard_meta_for_dp_unsorted_is_the_identity_only_for_one_global_batch_or_one_rank(case: tuple) -> None:
    """Without lengths, unsorted is the identity exactly when there is one global batch or one rank."""
    meta, dp, batch_size = case
    _, unsorted = shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size)
    one_batch = batch_size is None or batch_size == len(meta)
    assert (unsorted == tuple(range(len(meta)))) == (one_batch or dp == 1)


def test_shard_meta_for_dp_unsorted_interleaves_global_batches_without_lengths() -> None:
    """The documented example: 4 rows, 2 ranks, 2 global batches give rank 0 rows a, c and unsorted (0, 2, 1, 3)."""
    shards, unsorted = shard_meta_for_dp(KVBatchMeta("p", list("abcd")), dp_world=2, batch_size=2)
    assert [s.keys for s in shards] == [("a", "c"), ("b", "d")]
    assert unsorted == (0, 2, 1, 3)
    assert [s.extra_info["micro_batch_indices"] for s in shards] == [(((0, 1),), ((1, 2),))] * 2


def test_shard_meta_for_dp_of_an_empty_meta_gives_empty_shards() -> None:
    """An empty meta has no global batches: every rank gets an empty shard, even with packing."""
    meta = KVBatchMeta("p", [], sequence_lengths=[])
    for spec in (None, PackingSpec(8)):
        shards, unsorted = shard_meta_for_dp(meta, dp_world=3, packing=spec)
        assert [len(s) for s in shards] == [0, 0, 0]
        assert [s.extra_info["micro_batch_indices"] for s in shards] == [(), (), ()]
        assert unsorted == ()


# ---------------------------------------------------------------- shard_meta_for_dp: micro-batches


def _shard(meta: KVBatchMeta, dp: int, batch_size: int | None, spec: object) -> tuple:
    if isinstance(spec, PackingSpec):
        return shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size, packing=spec)
    if isinstance(spec, DynamicBatchingSpec):
        return shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size, dynamic_batching=spec)
    return shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size)


@given(EVERY_MODE)
@MICRO
def test_shard_meta_for_dp_gives_every_rank_the_same_micro_batch_count(case: tuple) -> None:
    """In every mode: one micro_batch_indices entry per global batch on every rank, and in each global batch
    every rank has the same (non-zero) number of micro-batches."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    batches = len(meta) // (batch_size or len(meta))
    per_rank = [[len(g) for g in s.extra_info["micro_batch_indices"]] for s in shards]
    assert all(len(counts) == batches for counts in per_rank)
    for g in range(batches):
        assert len({counts[g] for counts in per_rank}) == 1
        assert per_rank[0][g] >= 1


@given(EVERY_MODE, st.data())
@MICRO
def test_shard_like_gives_another_meta_of_the_same_rows_the_split_shard_meta_for_dp_gives_it(case: tuple, data: st.DataObject) -> None:
    """Law: for metas ``a`` and ``b`` of the same keys and lengths (other fields, tags, extra_info),
    ``shard_like(b, *shard_meta_for_dp(a, ...)) == shard_meta_for_dp(b, ...)``."""
    a, dp, batch_size, spec = case
    tags = data.draw(st.none() | st.just([{"t": i} for i in range(len(a))]))
    b = KVBatchMeta(
        a.partition_id, a.keys, fields=tuple(dict.fromkeys((*a.fields, "advantages"))), sequence_lengths=a.sequence_lengths, tags=tags,
        extra_info={"global_forward_pad_seqlen": 64, "micro_batch_lengths": "stale"},
    )
    assert shard_like(b, *_shard(a, dp, batch_size, spec)) == _shard(b, dp, batch_size, spec)


@given(EVERY_MODE)
@MICRO
def test_shard_like_refuses_a_meta_of_other_rows(case: tuple) -> None:
    """Another key, or another length, at any row is a ValueError naming the row; so is another row count."""
    meta, dp, batch_size, spec = case
    if not len(meta):
        return
    split = _shard(meta, dp, batch_size, spec)
    other = "other" + "".join(meta.keys)  # longer than every key: not one of them
    renamed = KVBatchMeta(meta.partition_id, (other, *meta.keys[1:]), sequence_lengths=meta.sequence_lengths)
    with pytest.raises(ValueError, match=rf"row 0 of 'meta' is key {re.escape(repr(other))}"):
        shard_like(renamed, *split)
    if meta.sequence_lengths is not None:
        longer = KVBatchMeta(meta.partition_id, meta.keys, sequence_lengths=(meta.sequence_lengths[0] + 1, *meta.sequence_lengths[1:]))
        with pytest.raises(ValueError, match=r"row 0 of 'meta'"):
            shard_like(longer, *split)
    with pytest.raises(ValueError, match=r"must hold the \d+ rows"):
        shard_like(KVBatchMeta(meta.partition_id, (*meta.keys, other)), *split)


@given(EVERY_MODE)
@MICRO
def test_shard_meta_for_dp_micro_batches_tile_the_shard_rows(case: tuple) -> None:
    """In every mode, micro_batch_indices are non-empty, contiguous, in order, and cover the shard's rows exactly;
    global batch g's spans cover exactly the shard's rows from global batch g."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    size, source = _global_batch_size_and_positions(meta, batch_size)
    for shard in shards:
        position = 0
        for g, batch in enumerate(shard.extra_info["micro_batch_indices"]):
            first = position
            for start, end in batch:
                assert start == position and end > start
                position = end
            assert {source[k] // size for k in shard.keys[first:position]} == {g}
        assert position == len(shard)


@given(sharding_cases(with_lengths=None))
@MICRO
def test_shard_meta_for_dp_without_micro_batching_stamps_one_span_per_global_batch(case: tuple) -> None:
    """Without packing or dynamic batching each global batch is one micro-batch per rank (its whole share),
    and no micro_batch_lengths are stamped."""
    meta, dp, batch_size = case
    shards, _ = shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size)
    share = (batch_size or len(meta)) // dp
    batches = len(meta) // (batch_size or len(meta))
    for shard in shards:
        assert shard.extra_info["micro_batch_indices"] == tuple(((g * share, (g + 1) * share),) for g in range(batches))
        assert "micro_batch_lengths" not in shard.extra_info


@given(micro_batching_cases())
@MICRO
def test_shard_meta_for_dp_micro_batches_respect_capacity_and_report_their_tokens(case: tuple) -> None:
    """Each micro_batch_lengths entry equals a plain recount of its rows and is <= capacity."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    for shard in shards:
        spans = shard.extra_info["micro_batch_indices"]
        tokens = shard.extra_info["micro_batch_lengths"]
        assert [len(g) for g in spans] == [len(g) for g in tokens]
        for batch_spans, batch_tokens in zip(spans, tokens):
            for (start, end), count in zip(batch_spans, batch_tokens):
                assert count == micro_batch_tokens(list(shard.sequence_lengths[start:end]), spec)
                assert count <= spec.max_tokens_per_microbatch


@given(micro_batching_cases().filter(lambda c: isinstance(c[3], PackingSpec)))
@MICRO
def test_shard_meta_for_dp_packing_is_never_worse_than_packing_alone(case: tuple) -> None:
    """Against pack_sequences per global batch (the reference): no more micro-batches per rank; as many only with no fuller one."""
    meta, dp, batch_size, spec = case
    shards, _ = _shard(meta, dp, batch_size, spec)
    size = batch_size or len(meta)
    padded = [padded_length(x, spec) for x in meta.sequence_lengths]
    for g, start in enumerate(range(0, len(meta), size)):
        lengths = padded[start : start + size]
        bins = pack_sequences(
            lengths, capacity=spec.max_tokens_per_microbatch, algorithm=spec.algorithm, bin_count_multiple=dp, min_bin_count=dp
        )
        (count,) = {len(s.extra_info["micro_batch_indices"][g]) for s in shards}
        assert count <= len(bins) // dp
        if count == len(bins) // dp:
            fullest = max(max(s.extra_info["micro_batch_lengths"][g]) for s in shards)
            assert fullest <= max(sum(lengths[i] for i in b) for b in bins)


def test_shard_meta_for_dp_packing_meets_count_and_sync_targets() -> None:
    """N=512, capacity 8192, dp=8 (lognormal): ceil(ceil(sum/cap)/dp) micro-batches per rank, sync cost <= 1.01."""
    for seed in range(4):
        lengths = lognormal_lengths(512, seed)
        meta = KVBatchMeta("p", [f"k{i}" for i in range(512)], sequence_lengths=lengths)
        shards, _ = shard_meta_for_dp(meta, dp_world=8, packing=PackingSpec(8192))
        loads = [s.extra_info["micro_batch_lengths"][0] for s in shards]
        assert {len(r) for r in loads} == {math.ceil(math.ceil(sum(lengths) / 8192) / 8)}
        sync = sum(max(step) for step in zip(*loads)) / (sum(lengths) / 8)
        assert sync <= 1.01


def test_shard_meta_for_dp_dynamic_batching_pads_to_the_longest_row() -> None:
    """Dynamic batching groups similar lengths; each micro-batch costs count x rounded longest row."""
    meta = KVBatchMeta("p", list("abcdefgh"), sequence_lengths=[8, 1, 7, 2, 8, 1, 7, 2])
    shards, unsorted = shard_meta_for_dp(meta, dp_world=2, dynamic_batching=DynamicBatchingSpec(16, sequence_length_round=4))
    assert [s.extra_info["micro_batch_lengths"] for s in shards] == [((16, 8),), ((16, 8),)]
    assert sorted(len(s) for s in shards) == [3, 5]
    assert [_concat_keys(shards)[unsorted[i]] for i in range(8)] == list(meta.keys)


# ---------------------------------------------------------------- shard_meta_for_dp: errors


def _meta(n: int, lengths: list[int] | None = None) -> KVBatchMeta:
    return KVBatchMeta("p", [f"k{i}" for i in range(n)], sequence_lengths=lengths if lengths is not None else [1] * n)


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: shard_meta_for_dp(_meta(4), dp_world=0), ValueError, "'dp_world' must be >= 1: got 0"),
        (lambda: shard_meta_for_dp(["a"], dp_world=1), TypeError, "'meta' must be a KVBatchMeta: got list"),
        (lambda: shard_meta_for_dp(_meta(6), dp_world=2, batch_size=4), ValueError, r"len\(meta\)=6, batch_size=4, dp_world=2"),
        (lambda: shard_meta_for_dp(_meta(6), dp_world=4, batch_size=6), ValueError, r"len\(meta\)=6, batch_size=6, dp_world=4"),
        (lambda: shard_meta_for_dp(_meta(5), dp_world=2), ValueError, r"got 5 rows and dp_world=2; pass batch_size="),
        (
            lambda: shard_meta_for_dp(_meta(4), dp_world=2, packing=PackingSpec(8), dynamic_batching=DynamicBatchingSpec(8)),
            ValueError,
            "mutually exclusive",
        ),
        (
            lambda: shard_meta_for_dp(KVBatchMeta("p", ["a", "b"]), dp_world=2, packing=PackingSpec(8)),
            ValueError,
            r"'sequence_lengths' is required for packing.*attrs.evolve\(meta, sequence_lengths=",
        ),
        (
            lambda: shard_meta_for_dp(_meta(2, [3, 9]), dp_world=1, packing=PackingSpec(8)),
            ValueError,
            r"row 'k1' has 9 tokens \(9 padded\), above 'max_tokens_per_microbatch' \(8\)",
        ),
        (
            lambda: shard_meta_for_dp(_meta(2, [3, 7]), dp_world=1, dynamic_batching=DynamicBatchingSpec(8, sequence_length_round=5)),
            ValueError,
            r"row 'k1' has 7 tokens \(10 padded\)",
        ),
        (lambda: shard_meta_for_dp(_meta(3), dp_world=4, packing=PackingSpec(8)), ValueError, r"has 3 rows, too few for 4"),
        (lambda: shard_meta_for_dp(_meta(4), dp_world=2, packing={"max_tokens": 8}), TypeError, "'packing' must be a PackingSpec"),
    ],
)
def test_shard_meta_for_dp_rejects_misuse(call: object, error: type[Exception], pattern: str) -> None:
    """Each documented misuse raises with a message naming the values involved."""
    with pytest.raises(error, match=pattern):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("spec", [PackingSpec(8), DynamicBatchingSpec(8)], ids=["packing", "dynamic"])
def test_shard_meta_for_dp_rejects_batches_without_a_uniform_micro_batch_count(spec: object) -> None:
    """5 full rows need 5 micro-batches, so 2 ranks cannot get the same number of non-empty ones."""
    meta = _meta(5, [8] * 5)
    with pytest.raises(ValueError, match=r"rows \[0, 5\) has 5 rows, too few for 6 non-empty micro-batches"):
        _shard(meta, 2, None, spec)


# ---------------------------------------------------------------- global_pad_length


@given(st.lists(st.integers(0, 10_000), max_size=30), st.integers(1, 128))
def test_global_pad_length_is_the_smallest_multiple_covering_every_length(lengths: list[int], multiple: int) -> None:
    """The result is a multiple of ``multiple``, >= every length, and the smallest such (0 for no lengths)."""
    pad = global_pad_length(lengths, multiple=multiple)
    assert pad % multiple == 0
    assert all(pad >= x for x in lengths)
    assert pad - multiple < max(lengths, default=0) or pad == 0
    assert global_pad_length(np.asarray(lengths, dtype=np.int64), multiple=multiple) == pad


@pytest.mark.parametrize(
    ("lengths", "multiple", "error", "pattern"),
    [
        ([1, 2], 0, ValueError, "'multiple' must be >= 1: got 0"),
        ([1, -2], 1, ValueError, "'lengths' entries must be >= 0: got -2 at index 1"),
        ([1, 2.5], 1, TypeError, "'lengths' entries must be int: got float at index 1"),
        (5, 1, TypeError, "'lengths' must be a sequence of ints: got int"),
    ],
)
def test_global_pad_length_rejects_bad_arguments(lengths: object, multiple: int, error: type[Exception], pattern: str) -> None:
    """``multiple`` must be >= 1 and lengths non-negative ints."""
    with pytest.raises(error, match=pattern):
        global_pad_length(lengths, multiple=multiple)  # type: ignore[arg-type]


@given(micro_batching_cases())
@settings(max_examples=40)
def test_shard_row_indices_select_each_shards_rows(case: tuple[KVBatchMeta, int, int | None, PackingSpec | DynamicBatchingSpec]) -> None:
    """Subsetting the caller's meta by shard_row_indices gives exactly each shard's keys, in order."""
    meta, dp, batch_size, spec = case
    kwargs = {"packing": spec} if isinstance(spec, PackingSpec) else {"dynamic_batching": spec}
    shards, unsorted = shard_meta_for_dp(meta, dp_world=dp, batch_size=batch_size, **kwargs)
    rows = shard_row_indices(shards, unsorted)
    assert [meta.subset(r).keys for r in rows] == [s.keys for s in shards]
    assert sorted(i for r in rows for i in r) == list(range(len(meta)))


def test_shard_row_indices_rejects_wrong_length() -> None:
    """unsorted must have one entry per sharded row."""
    meta = KVBatchMeta("p", ["a", "b"], sequence_lengths=[1, 2])
    shards, _ = shard_meta_for_dp(meta, dp_world=2)
    with pytest.raises(ValueError, match=r"'unsorted' must have 2 entries \(one per sharded row\): got 3"):
        shard_row_indices(shards, [0, 1, 2])
