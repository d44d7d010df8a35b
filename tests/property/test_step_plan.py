"""Laws of the pure step split / merge (``core/step_plan.py``).

``StepLayout`` validation and its pad-multiple rule; ``stamp_step`` against
``global_pad_length`` (and idempotence); ``shard_step`` against
``shard_meta_for_dp`` as the reference, with the partition / inverse round
trip; ``micro_batch_spans`` reading back every shard's tiling; ``kept_rows`` as
a partition of what stays and what travels between the two shardings, and
``check_kept_rows`` accepting exactly that; ``legacy_meta``;
``merge_train`` as a per-step mean over ranks, or with ``loss_weight`` the token mean over the global batch.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES
from core.meta import KVBatchMeta
from core.micro_batch import DynamicBatchingSpec, PackingSpec
from core.sharding import global_pad_length, shard_meta_for_dp, shard_row_indices
from core.step_plan import (
    LEGACY_PARTITION,
    StepLayout,
    TrainResult,
    check_kept_rows,
    kept_rows,
    legacy_meta,
    merge_train,
    token_mean_metric,
    micro_batch_spans,
    shard_step,
    stamp_step,
)
from core.topology import NamedSharding
from tests.property.strategies import step_cases, train_results

STEP = settings(max_examples=40)  # each example shards a whole meta twice


# ---------------------------------------------------------------- StepLayout


@given(step_cases())
def test_step_layout_step_pad_multiple_is_pad_multiple_else_packing_else_tp(case: tuple[KVBatchMeta, StepLayout]) -> None:
    """step_pad_multiple is pad_multiple when set, else the packing pad multiple, else the TP size."""
    _, layout = case
    if layout.pad_multiple is not None:
        expected = layout.pad_multiple
    elif layout.packing is not None:
        expected = layout.packing.sequence_length_pad_multiple
    else:
        expected = layout.tensor_parallel
    assert layout.step_pad_multiple == expected


def test_step_layout_for_sharding_reads_dp_and_tp_sizes() -> None:
    """for_sharding takes dp_size and tensor_parallel from the NamedSharding, the rest from its arguments."""
    sharding = NamedSharding({"data_parallel": 2, "tensor_parallel": 4, "pipeline_parallel": 2})
    layout = StepLayout.for_sharding(sharding, train_global_batch_size=6, packing=PackingSpec(64, sequence_length_pad_multiple=8))
    assert (layout.dp_size, layout.tensor_parallel, layout.train_global_batch_size) == (2, 4, 6)
    assert layout.step_pad_multiple == 8
    assert StepLayout.for_sharding(sharding).step_pad_multiple == 4
    with pytest.raises(TypeError, match="'sharding' must be a NamedSharding: got dict"):
        StepLayout.for_sharding({"data_parallel": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "error", "pattern"),
    [
        ({"dp_size": 2, "packing": PackingSpec(8), "dynamic_batching": DynamicBatchingSpec(8)}, ValueError, r"'packing' and 'dynamic_batching' are mutually exclusive"),
        ({"dp_size": 2, "train_global_batch_size": 3}, ValueError, r"'train_global_batch_size' must be a positive multiple of the DP size 2: got 3"),
        ({"dp_size": 2, "train_global_batch_size": 0}, ValueError, r"'train_global_batch_size' must be a positive multiple of the DP size 2: got 0"),
        ({"dp_size": 2, "train_global_batch_size": 4.0}, TypeError, r"'train_global_batch_size' must be an int: got float"),
        ({"dp_size": 0}, ValueError, r"'dp_size' must be >= 1: got 0"),
        ({"dp_size": True}, TypeError, r"'dp_size' must be an int: got bool"),
        ({"dp_size": 1, "pad_multiple": 0}, ValueError, r"'pad_multiple' must be >= 1: got 0"),
        ({"dp_size": 1, "tensor_parallel": 0}, ValueError, r"'tensor_parallel' must be >= 1: got 0"),
        ({"dp_size": 1, "packing": {"max_tokens": 8}}, TypeError, r"'packing' must be a PackingSpec or None: got dict"),
        ({"dp_size": 1, "dynamic_batching": PackingSpec(8)}, TypeError, r"'dynamic_batching' must be a DynamicBatchingSpec or None: got PackingSpec"),
    ],
)
def test_step_layout_rejects_misuse(fields: dict, error: type[Exception], pattern: str) -> None:
    """Both specs, a global batch that is not a positive multiple of DP, and bad sizes are refused on construction."""
    with pytest.raises(error, match=pattern):
        StepLayout(**fields)


# ---------------------------------------------------------------- stamp_step


@given(step_cases())
def test_stamp_step_stamps_the_global_pad_length_once(case: tuple[KVBatchMeta, StepLayout]) -> None:
    """The stamp is global_pad_length of every row at the layout's multiple; stamping again is a no-op."""
    meta, layout = case
    stamped = stamp_step(meta, multiple=layout.step_pad_multiple)
    assert stamped.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == global_pad_length(meta.sequence_lengths, multiple=layout.step_pad_multiple)
    assert stamp_step(stamped, multiple=layout.step_pad_multiple) == stamped
    assert (stamped.keys, stamped.sequence_lengths, stamped.tags) == (meta.keys, meta.sequence_lengths, meta.tags)


def test_stamp_step_rejects_a_second_pad_length_and_missing_lengths() -> None:
    """The pad length is stamped once per step: another value, or a meta without lengths, is refused."""
    stamped = stamp_step(KVBatchMeta("p", ["a", "b"], sequence_lengths=[4, 2]), multiple=1)
    assert stamped.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4
    with pytest.raises(ValueError, match=r"stamped once per step: expected 8, got 4"):
        stamp_step(stamped, multiple=8)
    with pytest.raises(ValueError, match=r"'meta.sequence_lengths' is required to stamp a step's pad length: got None"):
        stamp_step(KVBatchMeta("p", ["a"]), multiple=1)
    with pytest.raises(TypeError, match=r"'meta' must be a KVBatchMeta: got list"):
        stamp_step(["a"], multiple=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- shard_step and micro_batch_spans


@given(step_cases(), st.booleans())
@STEP
def test_shard_step_is_shard_meta_for_dp_of_the_layout(case: tuple[KVBatchMeta, StepLayout], train: bool) -> None:
    """shard_step equals shard_meta_for_dp with the layout's DP size, specs, and global batch size when training."""
    meta, layout = case
    expected = shard_meta_for_dp(
        meta,
        dp_world=layout.dp_size,
        batch_size=layout.train_global_batch_size if train else None,
        packing=layout.packing,
        dynamic_batching=layout.dynamic_batching,
    )
    assert shard_step(meta, layout, train=train) == expected


@given(step_cases(), st.booleans())
@STEP
def test_shard_step_round_trips_through_unsorted(case: tuple[KVBatchMeta, StepLayout], train: bool) -> None:
    """The shards partition the rows; unsorted restores meta's order; shard_row_indices selects each shard."""
    meta, layout = case
    shards, unsorted = shard_step(meta, layout, train=train)
    concat = [k for s in shards for k in s.keys]
    assert [concat[unsorted[i]] for i in range(len(meta))] == list(meta.keys)
    assert [meta.subset(rows).keys for rows in shard_row_indices(shards, unsorted)] == [s.keys for s in shards]


@given(step_cases(), st.booleans())
@STEP
def test_micro_batch_spans_reads_back_every_shards_tiling(case: tuple[KVBatchMeta, StepLayout], train: bool) -> None:
    """Every shard's spans tile its rows, one entry per global batch (train: len // global batch size; else 1)."""
    meta, layout = case
    shards, _ = shard_step(meta, layout, train=train)
    size = layout.train_global_batch_size if train and layout.train_global_batch_size else len(meta)
    for shard in shards:
        spans = micro_batch_spans(shard.extra_info, len(shard))
        assert spans == shard.extra_info[MICRO_BATCH_INDICES]
        assert len(spans) == len(meta) // size
        flat = [span for step in spans for span in step]
        assert [a for a, _ in flat] == [0] + [b for _, b in flat[:-1]] and flat[-1][1] == len(shard)


@pytest.mark.parametrize(
    ("extra_info", "rows", "error", "pattern"),
    [
        ({}, 4, ValueError, r"'extra_info' must hold 'micro_batch_indices' \(stamped on every shard by shard_step\): got keys \[\]"),
        ({"train_global_batch_size": 2}, 4, ValueError, r"got keys \['train_global_batch_size'\]; shard the step with"),
        ({MICRO_BATCH_INDICES: (((0, 2), (3, 4)),)}, 4, ValueError, r"'micro_batch_indices' must tile range\(4\) in order with non-empty spans"),
        ({MICRO_BATCH_INDICES: (((0, 2),),)}, 4, ValueError, r"must tile range\(4\)"),
        ({MICRO_BATCH_INDICES: (((0, 2), (2, 2), (2, 4)),)}, 4, ValueError, r"must tile range\(4\)"),
        ({MICRO_BATCH_INDICES: (((0, 3), (3, 2), (2, 4)),)}, 4, ValueError, r"must tile range\(4\)"),
        ({MICRO_BATCH_INDICES: ((0, 4),)}, 4, TypeError, r"'micro_batch_indices' must be, per global batch, a sequence of \(start, end\) pairs"),
        ({MICRO_BATCH_INDICES: (((0, 4),),)}, -1, ValueError, r"'rows' must be >= 0: got -1"),
        ([], 0, TypeError, r"'extra_info' must be a mapping: got list"),
    ],
)
def test_micro_batch_spans_rejects_missing_and_non_tiling_spans(extra_info: object, rows: int, error: type[Exception], pattern: str) -> None:
    """Missing spans (no fallback), gaps, overlaps, empty or backward spans and malformed entries are refused."""
    with pytest.raises(error, match=pattern):
        micro_batch_spans(extra_info, rows)  # type: ignore[arg-type]


def test_micro_batch_spans_of_an_empty_shard_is_empty() -> None:
    """An empty step has no global batches, so no spans; that tiles range(0)."""
    assert micro_batch_spans({MICRO_BATCH_INDICES: ()}, 0) == ()


# ---------------------------------------------------------------- legacy_meta


# ---------------------------------------------------------------- kept_rows


@given(step_cases())
@STEP
def test_kept_rows_are_what_a_rank_computes_and_trains_on_and_the_rest_travels(case: tuple[KVBatchMeta, StepLayout]) -> None:
    """Rank r keeps exactly forward[r] & train[r]; every row of train[r] is kept by r or computed by another rank
    (which writes it), so what is written plus what is kept covers each train shard exactly once."""
    meta, layout = case
    forward, _ = shard_step(meta, layout, train=False)
    train, _ = shard_step(meta, layout, train=True)
    kept = kept_rows(forward, train)
    assert len(kept) == layout.dp_size
    written = [set(f.keys) - k for f, k in zip(forward, kept)]
    for r, shard in enumerate(train):
        assert kept[r] == set(forward[r].keys) & set(shard.keys)
        from_others = set().union(*(w for s, w in enumerate(written) if s != r)) & set(shard.keys)
        assert kept[r] | from_others == set(shard.keys) and not kept[r] & from_others
    assert sum(map(len, kept)) + sum(map(len, written)) == len(meta)
    check_kept_rows({key: r for r, keys in enumerate(kept) for key in keys}, train)  # accepted as computed


@given(step_cases())
@STEP
def test_check_kept_rows_rejects_a_row_kept_on_another_rank(case: tuple[KVBatchMeta, StepLayout]) -> None:
    """A kept row that the train sharding gives to another rank is named, with both ranks."""
    meta, layout = case
    train, _ = shard_step(meta, layout, train=True)
    if layout.dp_size == 1 or not train[0].keys:
        return
    key = train[0].keys[0]
    with pytest.raises(ValueError, match=rf"row {key!r}: the log-prob call kept its results on DP rank 1, but the train call gives it to DP rank 0"):
        check_kept_rows({key: 1}, train)
    check_kept_rows({"not-in-this-step": 1}, train)  # a kept row the train call does not use is not an error


def test_kept_rows_rejects_shardings_of_different_rows() -> None:
    """Two shardings of different rank counts or keys are refused, naming the difference."""
    forward, _ = shard_step(legacy_meta([3, 1, 2, 2]), StepLayout(dp_size=2), train=False)
    with pytest.raises(ValueError, match=r"'train' must have one shard per rank of 'forward' \(2\): got 1"):
        kept_rows(forward, (legacy_meta([3, 1, 2, 2]),))
    other, _ = shard_step(legacy_meta([3, 1, 2, 2, 4, 4]), StepLayout(dp_size=2), train=False)
    with pytest.raises(ValueError, match=r"'forward' and 'train' must shard the same keys: they differ in \['row4', 'row5'\]"):
        kept_rows(forward, other)


@given(st.lists(st.integers(0, 10_000), max_size=40))
def test_legacy_meta_names_rows_in_order_and_keeps_lengths(lengths: list[int]) -> None:
    """Keys are row0..row<n-1> in the legacy partition, with the lengths as given."""
    meta = legacy_meta(lengths)
    assert meta.partition_id == LEGACY_PARTITION
    assert meta.keys == tuple(f"row{i}" for i in range(len(lengths)))
    assert meta.sequence_lengths == tuple(lengths)


def test_legacy_meta_rejects_bad_lengths() -> None:
    """Lengths are non-negative ints."""
    with pytest.raises(ValueError, match=r"'lengths' entries must be >= 0: got -1 at index 1"):
        legacy_meta([2, -1])
    with pytest.raises(TypeError, match=r"'lengths' entries must be int: got float at index 0"):
        legacy_meta([1.5])
    with pytest.raises(TypeError, match=r"'lengths' must be a sequence of ints: got int"):
        legacy_meta(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- merge_train


@given(train_results())
def test_merge_train_averages_loss_over_ranks_and_keeps_per_rank_fields(results: list[dict]) -> None:
    """loss is the per-step mean over ranks; grad_norm is rank 0's; per-rank fields keep rank order."""
    merged = merge_train(results)
    steps = len(results[0]["loss"])
    assert isinstance(merged, TrainResult)
    for s in range(steps):
        assert merged.loss[s] == pytest.approx(math.fsum(r["loss"][s] for r in results) / len(results))
    assert merged.grad_norm == tuple(results[0]["grad_norm"])
    assert merged.micro_batches == tuple(tuple(r["micro_batches"]) for r in results)
    assert merged.micro_batch_metrics == tuple(tuple(r["metrics"]) for r in results)
    assert merged.forward_seq_lengths == tuple(r["forward_seq_length"] for r in results)


@given(train_results())
def test_merge_train_of_one_rank_is_that_rank(results: list[dict]) -> None:
    """With one DP rank, the merged loss is that rank's loss, step by step."""
    assert merge_train(results[:1]).loss == tuple(results[0]["loss"])


@given(st.lists(st.lists(st.lists(st.floats(-100, 100, width=32), max_size=6), min_size=1, max_size=3), min_size=1, max_size=4))
def test_merge_train_with_loss_weights_is_the_token_mean_over_every_rank(tokens: list[list[list[float]]]) -> None:
    """Ranks reporting each step's token-mean loss and token count merge to the mean over all ranks' tokens
    (0.0 for a step without tokens), however the tokens are spread over ranks."""
    steps = min(len(rank) for rank in tokens)
    results = [
        {
            "loss": [math.fsum(rank[s]) / len(rank[s]) if rank[s] else 0.0 for s in range(steps)],
            "loss_sum": [math.fsum(rank[s]) for s in range(steps)],
            "loss_weight": [float(len(rank[s])) for s in range(steps)],
            "grad_norm": [0.0] * steps, "metrics": [[]] * steps, "micro_batches": [1] * steps, "forward_seq_length": 4,
        }
        for rank in tokens
    ]
    for s, merged in enumerate(merge_train(results).loss):
        every = [t for rank in tokens for t in rank[s]]
        assert merged == pytest.approx(math.fsum(every) / len(every) if every else 0.0, rel=1e-9, abs=1e-9)


@given(train_results(), st.integers(1, 8))
def test_merge_train_with_equal_loss_weights_is_the_mean(results: list[dict], weight: int) -> None:
    """Equal weights on every rank (a mean-form loss, one count per micro-batch, equal micro-batch counts) give
    the plain mean over ranks."""
    weighted = [
        {**r, "loss_sum": [loss * weight for loss in r["loss"]], "loss_weight": [float(weight)] * len(r["loss"])}
        for r in results
    ]
    assert merge_train(weighted).loss == pytest.approx(merge_train(results).loss, rel=1e-9, abs=1e-9)


def test_merge_train_rejects_loss_weights_on_some_ranks_or_of_another_count() -> None:
    """``loss_sum`` and ``loss_weight`` come from every rank or none, one value per step, the weights >= 0."""
    one = {"loss": [1.0], "grad_norm": [0.1], "metrics": [[]], "micro_batches": [1], "forward_seq_length": 4}
    both = {**one, "loss_sum": [3.0], "loss_weight": [3.0]}
    with pytest.raises(ValueError, match=r"'loss_sum' and 'loss_weight' must be given by every DP rank or none: rank 0 of 2 gives \[\]"):
        merge_train([one, both])
    with pytest.raises(ValueError, match=r"rank 0 of 1 gives \['loss_weight'\]"):
        merge_train([{**one, "loss_weight": [3.0]}])
    with pytest.raises(ValueError, match=r"of rank 0 must be 1 values each \(one per step\), the weights >= 0: got \[3.0\] and \[1.0, 2.0\]"):
        merge_train([{**both, "loss_weight": [1.0, 2.0]}])
    with pytest.raises(ValueError, match=r"the weights >= 0: got \[3.0\] and \[-1.0\]"):
        merge_train([{**both, "loss_weight": [-1.0]}])


@given(st.lists(st.lists(st.lists(st.floats(0, 10, width=32), max_size=5), max_size=3), min_size=1, max_size=3))
def test_token_mean_metric_is_the_mean_over_every_token_of_the_step(tokens: list[list[list[float]]]) -> None:
    """Micro-batches reporting a metric as their token mean (and their token count), spread over ranks: the
    merged value is the mean over all their tokens (0.0 with none), not the mean of the micro-batches'."""
    results = [
        {
            "loss": [0.0], "grad_norm": [0.0], "micro_batches": [len(rank)], "forward_seq_length": 4,
            "metrics": [[{"kl": math.fsum(mb) / len(mb) if mb else 0.0, "token_count": float(len(mb))} for mb in rank]],
        }
        for rank in tokens
    ]
    every = [t for rank in tokens for mb in rank for t in mb]
    expected = math.fsum(every) / len(every) if every else 0.0
    assert token_mean_metric(merge_train(results), "kl") == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_token_mean_metric_needs_each_micro_batchs_token_count() -> None:
    """A micro-batch with the metric but no token count is refused by name; micro-batches without it are skipped."""
    result = merge_train([{"loss": [0.0], "grad_norm": [0.0], "micro_batches": [2], "forward_seq_length": 4,
                           "metrics": [[{"loss": 1.0}, {"kl": 0.5}]]}])
    with pytest.raises(KeyError, match=r"a micro-batch reports 'kl' without its 'token_count': got \['kl'\]"):
        token_mean_metric(result, "kl")
    assert token_mean_metric(result, "clip_fraction") == 0.0


def test_merge_train_rejects_ranks_with_different_step_counts() -> None:
    """Every rank must run the same number of optimizer steps (and there must be a rank)."""
    one = {"loss": [1.0], "grad_norm": [0.1], "metrics": [[]], "micro_batches": [1], "forward_seq_length": 4}
    two = {**one, "loss": [1.0, 2.0]}
    with pytest.raises(ValueError, match=r"every DP rank must run the same number of steps: got \[1, 2\]"):
        merge_train([one, two])
    with pytest.raises(ValueError, match=r"got \[\]"):
        merge_train([])
