"""Laws and error paths of ``core.rollout_carry``: the carry's algebra and the driver's GRPO decisions against plain loops."""

from __future__ import annotations

import math
from collections import defaultdict

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.rollout_carry import (
    AdvantagePlan,
    RolloutCarry,
    dapo_selection,
    group_count,
    plan_advantages,
    zero_variance_group_fraction,
)
from tests.property.strategies import carry_and_index_blocks, carry_and_permutation, rollout_carries

# The plan is float32 math; the references below are float64 loops.
F32 = {"rel_tol": 1e-5, "abs_tol": 1e-6}
COLUMNS = [f.name for f in attrs.fields(RolloutCarry)]
options = st.fixed_dictionaries(
    {"leave_one_out": st.booleans(), "normalize_by_std": st.booleans(), "overlong_filter": st.booleans()}
)


def _carry(n: int = 3, **columns: list) -> RolloutCarry:
    base = {"rewards": [0.0] * n, "lengths": [1] * n, "group_ids": [0] * n, "prompt_ids": [0] * n, "truncated": [False] * n}
    return RolloutCarry(**{**base, **columns})


# ---------------------------------------------------------------- plain-Python references


def _groups(carry: RolloutCarry) -> dict[int, list[float]]:
    members: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(carry.rewards, carry.group_ids):
        members[g].append(r)
    return members


def _reference_plan(carry: RolloutCarry, *, leave_one_out: bool, normalize_by_std: bool, overlong_filter: bool) -> tuple[list[float], ...]:
    members = _groups(carry)
    baseline, std, advantages, mask = [], [], [], []
    for r, g, cut in zip(carry.rewards, carry.group_ids, carry.truncated):
        values = members[g]
        n = len(values)
        mean = math.fsum(values) / n
        b = ((math.fsum(values) - r) / (n - 1) if n > 1 else r) if leave_one_out else mean
        s = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        m = 0.0 if overlong_filter and cut else 1.0
        a = (r - b) / (s + 1e-6) if normalize_by_std else r - b
        baseline.append(b)
        std.append(s)
        advantages.append(a * m)
        mask.append(m)
    return baseline, std, advantages, mask


def _reference_dapo(carry: RolloutCarry, max_groups: int) -> tuple[int, ...]:
    members = _groups(carry)
    chosen: list[int] = []
    for g in carry.group_ids:  # in order of first appearance
        if g not in chosen and len(set(members[g])) > 1 and len(chosen) < max_groups:
            chosen.append(g)
    return tuple(i for i, g in enumerate(carry.group_ids) if g in chosen)


# ---------------------------------------------------------------- RolloutCarry


@given(rollout_carries())
def test_rollout_carry_columns_are_typed_tuples_of_one_entry_per_row(carry: RolloutCarry) -> None:
    """Every column converts to a tuple of its element type with ``size`` entries."""
    kinds = {"rewards": float, "lengths": int, "group_ids": int, "prompt_ids": int, "truncated": bool}
    for name, kind in kinds.items():
        column = getattr(carry, name)
        assert isinstance(column, tuple) and len(column) == carry.size
        assert all(type(v) is kind for v in column)


@pytest.mark.parametrize("column", ["lengths", "group_ids", "prompt_ids", "truncated"])
def test_rollout_carry_rejects_a_column_of_the_wrong_length(column: str) -> None:
    """A column with an entry too few is a ValueError naming the column and both counts."""
    with pytest.raises(ValueError, match=rf"'{column}' must have 3 entries \(one per reward\): got 2"):
        _carry(3, **{column: [1, 1]})


@pytest.mark.parametrize("bad", [0, -4])
def test_rollout_carry_rejects_a_length_below_one(bad: int) -> None:
    """A length < 1 is a ValueError naming 'lengths' and the bad value."""
    with pytest.raises(ValueError, match=rf"'lengths' must all be >= 1: got \[{bad}\]"):
        _carry(3, lengths=[2, bad, 3])


@given(rollout_carries(min_size=0))
def test_size_is_the_number_of_rows(carry: RolloutCarry) -> None:
    """``size`` equals the length of every column."""
    assert {len(getattr(carry, name)) for name in COLUMNS} == {carry.size}


@given(rollout_carries())
def test_subset_of_every_row_in_order_is_the_identity(carry: RolloutCarry) -> None:
    """``subset(range(size))`` equals the carry."""
    assert carry.subset(range(carry.size)) == carry


@given(carry_and_permutation(), st.data())
def test_subset_picks_rows_in_the_given_order(case: tuple[RolloutCarry, list[int]], data: st.DataObject) -> None:
    """Row ``k`` of ``subset(idx)`` is row ``idx[k]`` of the carry, in every column (repeats allowed)."""
    carry, perm = case
    idx = perm + data.draw(st.lists(st.integers(0, carry.size - 1), max_size=5))
    picked = carry.subset(idx)
    assert picked.size == len(idx)
    for name in COLUMNS:
        assert getattr(picked, name) == tuple(getattr(carry, name)[i] for i in idx)


@pytest.mark.parametrize("index", [3, -1, 100])
def test_subset_rejects_an_index_out_of_range(index: int) -> None:
    """An index outside ``[0, size)`` is an IndexError naming the range and the index."""
    with pytest.raises(IndexError, match=rf"'indices' must lie in \[0, 3\): got \[{index}\]"):
        _carry(3).subset([0, index])


@given(rollout_carries(min_size=0), rollout_carries(min_size=0), rollout_carries(min_size=0))
def test_concat_is_associative(a: RolloutCarry, b: RolloutCarry, c: RolloutCarry) -> None:
    """``(a + b) + c == a + (b + c) == a.concat(b, c)``, with sizes adding up."""
    left = a.concat(b).concat(c)
    assert left == a.concat(b.concat(c)) == a.concat(b, c)
    assert left.size == a.size + b.size + c.size


@given(rollout_carries(min_size=0))
def test_concat_of_nothing_or_an_empty_carry_is_the_identity(carry: RolloutCarry) -> None:
    """``concat()`` and concatenating an empty carry on either side give the carry back."""
    empty = carry.subset([])
    assert carry.concat() == carry.concat(empty) == empty.concat(carry) == carry


@given(carry_and_index_blocks(shuffle=False))
def test_concat_of_subsets_of_consecutive_blocks_round_trips(case: tuple[RolloutCarry, list[list[int]]]) -> None:
    """Cutting the rows into consecutive blocks, subsetting each and concatenating gives the carry back."""
    carry, blocks = case
    first, *rest = [carry.subset(block) for block in blocks]
    assert first.concat(*rest) == carry


@given(carry_and_index_blocks(shuffle=True))
def test_concat_of_subsets_of_a_partition_is_the_subset_of_their_union(case: tuple[RolloutCarry, list[list[int]]]) -> None:
    """For any partition of the rows into blocks, concatenating the blocks' subsets is the subset of the blocks joined."""
    carry, blocks = case
    first, *rest = [carry.subset(block) for block in blocks]
    joined = [i for block in blocks for i in block]
    assert sorted(joined) == list(range(carry.size))
    assert first.concat(*rest) == carry.subset(joined)


@pytest.mark.parametrize("other", [[1.0], {"rewards": [1.0]}, None])
def test_concat_rejects_a_non_carry_argument(other: object) -> None:
    """An argument that is not a RolloutCarry is a TypeError naming its type."""
    with pytest.raises(TypeError, match=rf"'others' must be RolloutCarry values: got {type(other).__name__}"):
        _carry(2).concat(_carry(1), other)  # type: ignore[arg-type]


# ---------------------------------------------------------------- plan_advantages


@given(rollout_carries(), options)
def test_plan_advantages_matches_a_plain_loop(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """Baseline (mean or leave-one-out), std, advantage and mask equal a float64 loop within float32 tolerance."""
    plan = plan_advantages(carry, **opts)
    assert isinstance(plan, AdvantagePlan)
    expected = _reference_plan(carry, **opts)
    for got, want in zip((plan.baseline, plan.std, plan.advantages, plan.sample_mask), expected):
        assert len(got) == carry.size
        assert all(math.isclose(g, w, **F32) for g, w in zip(got, want)), (got, want)


@given(rollout_carries(), options)
def test_plan_advantages_rows_of_one_group_share_baseline_and_std(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """All rows of a group have bitwise the same std, and (without leave-one-out) the same baseline."""
    plan = plan_advantages(carry, **opts)
    stds: dict[int, set[float]] = defaultdict(set)
    baselines: dict[int, set[float]] = defaultdict(set)
    for g, s, b in zip(carry.group_ids, plan.std, plan.baseline):
        stds[g].add(s)
        baselines[g].add(b)
    assert all(len(v) == 1 for v in stds.values())
    if not opts["leave_one_out"]:
        assert all(len(v) == 1 for v in baselines.values())


@given(rollout_carries(), options)
def test_plan_advantages_constant_groups_have_zero_advantage_and_std(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """A group whose rewards are all equal has advantages and std exactly 0 and baseline exactly its reward."""
    plan = plan_advantages(carry, **opts)
    members = _groups(carry)
    for i, g in enumerate(carry.group_ids):
        if len(set(members[g])) == 1:
            assert plan.advantages[i] == 0.0 and plan.std[i] == 0.0
            assert plan.baseline[i] == carry.rewards[i]


@given(rollout_carries(), options)
def test_plan_advantages_overlong_filter_masks_exactly_the_truncated_rows(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """With the filter, the mask is 0 on truncated rows and 1 elsewhere and advantages are 0 where it is 0; without, it is all 1."""
    plan = plan_advantages(carry, **opts)
    if opts["overlong_filter"]:
        assert plan.sample_mask == tuple(0.0 if cut else 1.0 for cut in carry.truncated)
        assert all(a == 0.0 for a, m in zip(plan.advantages, plan.sample_mask) if m == 0.0)
    else:
        assert plan.sample_mask == (1.0,) * carry.size


@given(rollout_carries(), options)
def test_plan_advantages_filter_only_zeroes_masked_rows(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """The overlong filter leaves baseline, std and the unmasked rows' advantages bitwise unchanged."""
    on = plan_advantages(carry, **{**opts, "overlong_filter": True})
    off = plan_advantages(carry, **{**opts, "overlong_filter": False})
    assert on.baseline == off.baseline and on.std == off.std
    assert all(a == b for a, b, cut in zip(on.advantages, off.advantages, carry.truncated) if not cut)


@given(carry_and_permutation(), options)
def test_plan_advantages_permuting_rows_permutes_the_plan(case: tuple[RolloutCarry, list[int]], opts: dict[str, bool]) -> None:
    """The plan of permuted rows is the permuted plan.

    Baseline and mask are bitwise equal: rewards on a quarter grid make every group
    sum exact in float32, so summation order cannot matter. The std sums squares of
    non-dyadic deviations in row order, so it (and the normalised advantage) may
    differ in the last float32 bits: those are compared to a few ulps.
    """
    carry, perm = case
    plan = plan_advantages(carry, **opts)
    permuted = plan_advantages(carry.subset(perm), **opts)
    pick = lambda column: torch.tensor([column[i] for i in perm], dtype=torch.float32)  # noqa: E731
    as32 = lambda column: torch.tensor(column, dtype=torch.float32)  # noqa: E731
    assert torch.equal(as32(permuted.baseline), pick(plan.baseline))
    assert torch.equal(as32(permuted.sample_mask), pick(plan.sample_mask))
    torch.testing.assert_close(as32(permuted.std), pick(plan.std), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(as32(permuted.advantages), pick(plan.advantages), rtol=1e-6, atol=1e-6)


@given(rollout_carries(), options)
def test_plan_advantages_is_deterministic(carry: RolloutCarry, opts: dict[str, bool]) -> None:
    """The same carry and options give identical plans (tuples equal, bitwise) twice."""
    assert plan_advantages(carry, **opts) == plan_advantages(RolloutCarry(**attrs.asdict(carry)), **opts)


def test_plan_advantages_rejects_an_empty_carry() -> None:
    """A carry with no rows is a ValueError."""
    with pytest.raises(ValueError, match="'carry' must have at least one row: got 0"):
        plan_advantages(_carry(0))


@pytest.mark.parametrize("bad", [[1.0, 0.0], {"rewards": [1.0]}, None])
def test_plan_advantages_rejects_a_non_carry(bad: object) -> None:
    """A non-carry argument is a TypeError naming its type."""
    with pytest.raises(TypeError, match=rf"'carry' must be a RolloutCarry: got {type(bad).__name__}"):
        plan_advantages(bad)  # type: ignore[arg-type]


@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=0, max_size=6))
def test_advantage_plan_converts_columns_to_float_tuples(values: list[float]) -> None:
    """Every AdvantagePlan column becomes a tuple of floats equal to its input."""
    plan = AdvantagePlan(values, torch.tensor(values).tolist(), [int(v) for v in values], values)
    for column in attrs.astuple(plan, recurse=False):
        assert isinstance(column, tuple) and all(type(v) is float for v in column)
    assert plan.baseline == tuple(values) and plan.advantages == tuple(float(int(v)) for v in values)


# ---------------------------------------------------------------- dapo_selection and group_count


@given(rollout_carries(), st.integers(0, 8))
def test_dapo_selection_matches_a_plain_reference(carry: RolloutCarry, max_groups: int) -> None:
    """The selection is all rows of the first ``max_groups`` varying groups (by first appearance), in row order."""
    assert dapo_selection(carry, max_groups=max_groups) == _reference_dapo(carry, max_groups)


@given(rollout_carries(), st.integers(0, 8))
def test_dapo_selection_keeps_at_most_max_groups_varying_groups_in_row_order(carry: RolloutCarry, max_groups: int) -> None:
    """Rows increase, each selected row's group varies, and at most ``max_groups`` groups are selected, each whole."""
    rows = dapo_selection(carry, max_groups=max_groups)
    members = _groups(carry)
    assert list(rows) == sorted(set(rows))
    chosen = {carry.group_ids[i] for i in rows}
    assert len(chosen) <= max_groups
    assert all(len(set(members[g])) > 1 for g in chosen)
    assert set(rows) == {i for i, g in enumerate(carry.group_ids) if g in chosen}
    varying = {g for g, v in members.items() if len(set(v)) > 1}
    assert len(chosen) == min(max_groups, len(varying))


@given(rollout_carries(min_size=0))
def test_dapo_selection_with_zero_groups_is_empty(carry: RolloutCarry) -> None:
    """``max_groups=0`` selects nothing."""
    assert dapo_selection(carry, max_groups=0) == ()


def test_dapo_selection_of_an_empty_carry_is_empty() -> None:
    """A carry with no rows selects nothing, for any ``max_groups``."""
    assert dapo_selection(_carry(0), max_groups=3) == ()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_dapo_selection_rejects_a_bad_max_groups(bad: object) -> None:
    """``max_groups`` that is not an int >= 0 (a bool counts as bad) is a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"'max_groups' must be an int >= 0: got {bad!r}"):
        dapo_selection(_carry(2), max_groups=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[1.0, 0.0], None])
def test_dapo_selection_rejects_a_non_carry(bad: object) -> None:
    """A non-carry argument is a TypeError naming its type."""
    with pytest.raises(TypeError, match=rf"'carry' must be a RolloutCarry: got {type(bad).__name__}"):
        dapo_selection(bad, max_groups=1)  # type: ignore[arg-type]


@given(carry_and_permutation())
def test_group_count_counts_distinct_ids_and_ignores_row_order(case: tuple[RolloutCarry, list[int]]) -> None:
    """``group_count`` equals a loop's count of distinct ids, and permuting rows does not change it."""
    carry, perm = case
    seen: list[int] = []
    for g in carry.group_ids:
        if g not in seen:
            seen.append(g)
    assert group_count(carry) == len(seen) == group_count(carry.subset(perm))


@given(rollout_carries())
def test_zero_variance_group_fraction_counts_the_groups_dapo_drops(carry: RolloutCarry) -> None:
    """The fraction is 1 - (groups kept by dapo_selection with no group limit) / groups, and a plain loop's count."""
    groups = group_count(carry)
    kept = {carry.group_ids[i] for i in dapo_selection(carry, max_groups=groups)}
    fraction = zero_variance_group_fraction(carry)
    assert fraction == (groups - len(kept)) / groups == pytest.approx(1 - len(kept) / groups, abs=1e-15)
    constant = sum(len(set(rewards)) == 1 for rewards in _groups(carry).values())
    assert fraction == constant / groups and 0.0 <= fraction <= 1.0


@given(carry_and_permutation())
def test_zero_variance_group_fraction_ignores_row_order(case: tuple[RolloutCarry, list[int]]) -> None:
    """Permuting the rows leaves the fraction unchanged."""
    carry, perm = case
    assert zero_variance_group_fraction(carry.subset(perm)) == zero_variance_group_fraction(carry)


def test_zero_variance_group_fraction_extremes() -> None:
    """All-constant groups give 1.0 (singletons included); all-varying groups give 0.0."""
    assert zero_variance_group_fraction(_carry(3, rewards=[0.5, 0.5, 1.0], group_ids=[0, 0, 1])) == 1.0
    assert zero_variance_group_fraction(_carry(4, rewards=[0.0, 1.0, 1.0, 0.25], group_ids=[0, 0, 1, 1])) == 0.0


def test_zero_variance_group_fraction_rejects_an_empty_or_non_carry() -> None:
    """An empty carry has no groups; the argument must be a RolloutCarry."""
    with pytest.raises(ValueError, match=r"'carry' must have at least one row \(one group\): got 0"):
        zero_variance_group_fraction(_carry(0))
    with pytest.raises(TypeError, match=r"'carry' must be a RolloutCarry: got list"):
        zero_variance_group_fraction([1.0])  # type: ignore[arg-type]
