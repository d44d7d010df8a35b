"""Laws of micro-batch planning (``core/micro_batch.py``): the specs, and ``plan_global_batch``.

For one global batch: the micro-batches partition its rows, every rank gets the
same number of non-empty micro-batches, and each reported load equals a plain
recount (``tests/property/references.py``) within capacity. The same laws
through ``shard_meta_for_dp`` are in ``test_sharding.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.micro_batch import DynamicBatchingSpec, PackingSpec, plan_global_batch
from core.packing import PACKING_ALGORITHMS
from tests.property.references import micro_batch_tokens
from tests.property.strategies import micro_batching_cases

MICRO = settings(max_examples=40)  # each example plans a whole global batch


def _first_global_batch(case: tuple) -> tuple[list[int], int, PackingSpec | DynamicBatchingSpec]:
    meta, dp, batch_size, spec = case
    return list(meta.sequence_lengths[: batch_size or len(meta)]), dp, spec


# ---------------------------------------------------------------- specs


def test_specs_have_documented_defaults() -> None:
    """A spec built with only the capacity uses BFD and no padding."""
    assert PackingSpec(8192) == PackingSpec(8192, "best_fit_decreasing", 1)
    assert DynamicBatchingSpec(4096).sequence_length_round == 1


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: PackingSpec(0), ValueError, "'max_tokens_per_microbatch' must be >= 1: got 0"),
        (lambda: PackingSpec(8, sequence_length_pad_multiple=0), ValueError, "'sequence_length_pad_multiple' must be >= 1"),
        (lambda: PackingSpec(8, algorithm="best_fit"), ValueError, r"'algorithm' must be one of .*got 'best_fit'"),
        (lambda: PackingSpec(8, algorithm=1), TypeError, "'algorithm' must be a str"),
        (lambda: PackingSpec(8.0), TypeError, "'max_tokens_per_microbatch' must be an int: got float"),
        (lambda: DynamicBatchingSpec(-1), ValueError, "'max_tokens_per_microbatch' must be >= 1: got -1"),
        (lambda: DynamicBatchingSpec(8, sequence_length_round=True), TypeError, "'sequence_length_round' must be an int: got bool"),
    ],
)
def test_specs_reject_invalid_fields(build: object, error: type[Exception], pattern: str) -> None:
    """Spec fields are validated on construction."""
    with pytest.raises(error, match=pattern):
        build()  # type: ignore[operator]


# ---------------------------------------------------------------- plan_global_batch


@given(micro_batching_cases())
@MICRO
def test_plan_global_batch_partitions_the_rows_into_ascending_micro_batches(case: tuple) -> None:
    """Every row position is in exactly one micro-batch, ascending inside it."""
    lengths, dp, spec = _first_global_batch(case)
    plan, _ = plan_global_batch(lengths, dp_world=dp, spec=spec)
    assert len(plan) == dp
    rows = [i for rank in plan for micro_batch in rank for i in micro_batch]
    assert sorted(rows) == list(range(len(lengths)))
    assert all(micro_batch == sorted(micro_batch) for rank in plan for micro_batch in rank)


@given(micro_batching_cases())
@MICRO
def test_plan_global_batch_gives_every_rank_the_same_count_of_non_empty_micro_batches(case: tuple) -> None:
    """Every rank gets the same number (>= 1) of micro-batches, none empty."""
    lengths, dp, spec = _first_global_batch(case)
    plan, _ = plan_global_batch(lengths, dp_world=dp, spec=spec)
    assert len({len(rank) for rank in plan}) == 1 and len(plan[0]) >= 1
    assert all(micro_batch for rank in plan for micro_batch in rank)


@given(micro_batching_cases())
@MICRO
def test_plan_global_batch_loads_are_plain_recounts_within_capacity(case: tuple) -> None:
    """Each load equals a plain recount of its micro-batch's padded tokens and is <= capacity."""
    lengths, dp, spec = _first_global_batch(case)
    plan, loads = plan_global_batch(lengths, dp_world=dp, spec=spec)
    for rank, rank_loads in zip(plan, loads):
        assert rank_loads == [micro_batch_tokens([lengths[i] for i in mb], spec) for mb in rank]
        assert all(load <= spec.max_tokens_per_microbatch for load in rank_loads)


@given(st.sampled_from([8, 14, 16]), st.integers(1, 3), st.sampled_from(PACKING_ALGORITHMS), st.data())
@settings(max_examples=300)  # small batches: cheap
def test_plan_global_batch_packs_whenever_the_default_packer_can(cap: int, dp: int, algorithm: str, data: st.DataObject) -> None:
    """The packer is a starting point, not a constraint: a plan exists for every algorithm exactly when it exists for
    the default one (an order-keeping packer that needs more bins than there are rows must not fail the step)."""
    lengths = data.draw(st.lists(st.integers(0, cap), min_size=1, max_size=8))

    def plan(spec: PackingSpec) -> object:
        try:
            return plan_global_batch(lengths, dp_world=dp, spec=spec)
        except ValueError:
            return None

    default = plan(PackingSpec(cap))
    chosen = plan(PackingSpec(cap, algorithm=algorithm))
    assert (default is None) == (chosen is None), (default, chosen)


def test_plan_global_batch_concatenative_falls_back_where_it_needs_more_bins_than_rows() -> None:
    """5, 12, 3 in order need 3 bins of 14, 4 for two ranks, more than the 3 rows; the plan packs them in 2."""
    plan, loads = plan_global_batch([5, 12, 3], dp_world=2, spec=PackingSpec(14, algorithm="concatenative"))
    assert sorted(tuple(mb) for rank in plan for mb in rank) == [(0, 2), (1,)] and sorted(sum(loads, [])) == [8, 12]


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: plan_global_batch([1, 2], dp_world=1, spec=None), TypeError, "'spec' must be a PackingSpec or DynamicBatchingSpec: got NoneType"),
        (lambda: plan_global_batch([1, -2], dp_world=1, spec=PackingSpec(8)), ValueError, "'lengths' entries must be >= 0: got -2 at index 1"),
        (lambda: plan_global_batch([1, 2], dp_world=0, spec=PackingSpec(8)), ValueError, "'dp_world' must be >= 1: got 0"),
        (lambda: plan_global_batch([1, 2], dp_world=1, spec=PackingSpec(8), keys=["a"]), ValueError, r"'keys' must have 2 entries \(one per length\): got 1"),
        (lambda: plan_global_batch([3, 9], dp_world=1, spec=PackingSpec(8), offset=4), ValueError, r"row 5 has 9 tokens \(9 padded\)"),
        (lambda: plan_global_batch([3, 9], dp_world=1, spec=PackingSpec(8), keys=["a", "b"]), ValueError, r"row 'b' has 9 tokens"),
        (lambda: plan_global_batch([1, 1, 1], dp_world=4, spec=DynamicBatchingSpec(8)), ValueError, r"has 3 rows, too few for 4"),
    ],
)
def test_plan_global_batch_rejects_misuse(call: object, error: type[Exception], pattern: str) -> None:
    """A wrong spec, bad lengths or counts, an over-long row and too few rows are refused by name."""
    with pytest.raises(error, match=pattern):
        call()  # type: ignore[operator]
