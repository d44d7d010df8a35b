"""Laws and error paths of ``core.replay``: the receipt FIFO against a plain reference, and a simulated asynchronous run."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.meta import KVBatchMeta
from core.replay import (
    GroupReceipt,
    ReplayState,
    Sampled,
    drain,
    init_replay,
    is_eligible,
    may_generate,
    offer,
    sample,
    version_lag,
)
from core.rollout_carry import RolloutCarry
from tests.property.strategies import (
    async_schedules,
    group_receipts,
    receipt_streams,
    replay_receipt,
    replay_scripts,
    replay_versions,
)

Script = tuple[int, list[GroupReceipt], list[tuple[Any, ...]]]
staleness_bounds = st.integers(0, 4)


def _keys(groups: Any) -> list[str]:
    return [key for group in groups for key in group.keys]


def _fill(capacity: int, receipts: list[GroupReceipt]) -> ReplayState:
    """A buffer holding the first ``capacity`` receipts."""
    accepted, state = offer(init_replay(capacity), receipts[:capacity])
    assert accepted
    return state


def _run_script(script: Script) -> tuple[list[GroupReceipt], list[Sampled], ReplayState]:
    """Play a script: returns the accepted receipts, every ``Sampled`` and the final state."""
    capacity, receipts, operations = script
    state, cursor, accepted_all, samples = init_replay(capacity), 0, [], []
    for op in operations:
        if op[0] == "offer":
            batch = receipts[cursor : cursor + op[1]]
            before = state
            accepted, state = offer(state, batch)
            assert accepted == (len(batch) <= before.free_groups)
            if accepted:
                accepted_all += batch
                cursor += len(batch)
            else:
                assert state is before
        else:
            sampled, state = sample(state, *op[1:])
            samples.append(sampled)
        assert len(state.groups) <= capacity
    return accepted_all, samples, state


# ---------------------------------------------------------------- GroupReceipt / ReplayState / Sampled


@given(group_receipts())
def test_group_receipt_columns_are_typed_tuples_of_one_entry_per_row(receipt: GroupReceipt) -> None:
    """entropy, response_tokens and responses convert to tuples of float / int / str; keys and size follow meta."""
    assert receipt.keys == receipt.meta.keys and receipt.size == len(receipt.meta) == receipt.carry.size >= 1
    assert all(type(v) is float for v in receipt.entropy) and len(receipt.entropy) == receipt.size
    assert all(type(v) is int for v in receipt.response_tokens) and len(receipt.response_tokens) == receipt.size
    assert isinstance(receipt.responses, tuple) and len(receipt.responses) <= receipt.size


def _receipt_args(n: int = 2, **changes: Any) -> dict[str, Any]:
    base = replay_receipt([f"k{i}" for i in range(n)], weight_version=1, batch_seq=2)
    return {**{f.name: getattr(base, f.name) for f in attrs.fields(GroupReceipt)}, **changes}


def test_group_receipt_rejects_rows_that_disagree() -> None:
    """meta, carry, entropy and response_tokens must agree on a row count >= 1; responses at most one per row."""
    with pytest.raises(ValueError, match=r"'entropy' must have 2 entries \(one per key of 'meta'\): got 3"):
        GroupReceipt(**_receipt_args(entropy=[0.0] * 3))
    with pytest.raises(ValueError, match=r"'response_tokens' must have 2 entries \(one per key of 'meta'\): got 1"):
        GroupReceipt(**_receipt_args(response_tokens=[1]))
    with pytest.raises(ValueError, match=r"'carry' must have 2 entries \(one per key of 'meta'\): got 3"):
        GroupReceipt(**_receipt_args(carry=_receipt_args(3)["carry"]))
    with pytest.raises(ValueError, match=r"'responses' must have at most 2 entries \(one per row\): got 3"):
        GroupReceipt(**_receipt_args(responses=["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"'meta' must hold at least one row \(a group is never empty\): got 0 keys"):
        GroupReceipt(**_receipt_args(meta=KVBatchMeta(), carry=RolloutCarry([], [], [], [], []), entropy=[], response_tokens=[]))


def test_group_receipt_rejects_bad_values() -> None:
    """Types are checked; versions, token counts and entropies must be >= 0."""
    with pytest.raises(TypeError, match=r"'meta' must be a KVBatchMeta: got dict"):
        GroupReceipt(**_receipt_args(meta={"keys": ["k0", "k1"]}))
    with pytest.raises(TypeError, match=r"'carry' must be a RolloutCarry: got tuple"):
        GroupReceipt(**_receipt_args(carry=(1.0, 0.0)))
    with pytest.raises(ValueError, match=r"'weight_version' must be >= 0: got -1"):
        GroupReceipt(**_receipt_args(weight_version=-1))
    with pytest.raises(TypeError, match=r"'batch_seq' must be an int: got float"):
        GroupReceipt(**_receipt_args(batch_seq=2.0))
    with pytest.raises(ValueError, match=r"'response_tokens' entries must be >= 0: got -3 at index 1"):
        GroupReceipt(**_receipt_args(response_tokens=[1, -3]))
    with pytest.raises(ValueError, match=r"'entropy' entries must be finite and >= 0 \(nats\): got nan at index 0"):
        GroupReceipt(**_receipt_args(entropy=[float("nan"), 0.0]))
    with pytest.raises(TypeError, match=r"'responses' must be a sequence with one entry per row, not a single string: got 'hi'"):
        GroupReceipt(**_receipt_args(responses="hi"))
    with pytest.raises(TypeError, match=r"'responses' entries must be str: got int at index 0"):
        GroupReceipt(**_receipt_args(responses=[7]))


@given(receipt_streams(min_size=1, max_size=6))
def test_replay_state_keys_and_free_groups(receipts: list[GroupReceipt]) -> None:
    """A state's keys are its groups' keys in arrival order; free_groups is capacity minus groups held."""
    state = ReplayState(len(receipts) + 2, receipts)
    assert state.keys == tuple(_keys(receipts))
    assert state.free_groups == 2


def test_replay_state_rejects_too_many_groups_and_shared_keys() -> None:
    """Groups must fit the capacity and never share a key; capacity_groups must be >= 1."""
    a, b = replay_receipt(["x", "y"], weight_version=0, batch_seq=1), replay_receipt(["z"], weight_version=0, batch_seq=1)
    with pytest.raises(ValueError, match=r"'groups' must hold at most capacity_groups=1 groups: got 2"):
        ReplayState(1, [a, b])
    with pytest.raises(ValueError, match=r"'groups' must not share keys between groups: 'y' is in groups 0 and 1"):
        ReplayState(3, [a, replay_receipt(["y"], weight_version=1, batch_seq=2)])
    with pytest.raises(ValueError, match=r"'capacity_groups' must be >= 1: got 0"):
        ReplayState(0)
    with pytest.raises(TypeError, match=r"'groups' entries must be GroupReceipt: got str at index 0"):
        ReplayState(2, ["x"])
    with pytest.raises(TypeError, match=r"'groups' must be a sequence of GroupReceipt, not a single one: wrap it, e.g. \[receipt\]"):
        ReplayState(2, a)


def test_sampled_evicted_keys_lists_the_evicted_receipts_keys_in_order() -> None:
    """evicted_keys is every key of the evicted receipts, receipt by receipt."""
    a, b = replay_receipt(["x", "y"], weight_version=0, batch_seq=1), replay_receipt(["z"], weight_version=0, batch_seq=1)
    assert Sampled(groups=(), evicted=(b, a)).evicted_keys == ("z", "x", "y")


# ---------------------------------------------------------------- init_replay / offer


@given(st.integers(1, 10))
def test_init_replay_is_empty_with_its_capacity(capacity: int) -> None:
    """A new buffer holds nothing, has every group free and has evicted nothing."""
    state = init_replay(capacity)
    assert state == ReplayState(capacity) and state.groups == () and state.free_groups == capacity and state.evicted_total == 0


@pytest.mark.parametrize(("bad", "error", "match"), [(0, ValueError, r"'capacity_groups' must be >= 1: got 0"), (True, TypeError, r"'capacity_groups' must be an int: got bool")])
def test_init_replay_rejects_a_bad_capacity(bad: object, error: type[Exception], match: str) -> None:
    """capacity_groups must be an int >= 1."""
    with pytest.raises(error, match=match):
        init_replay(bad)  # type: ignore[arg-type]


@given(st.integers(1, 6), receipt_streams(max_size=14), st.data())
def test_offer_is_all_or_nothing_and_never_exceeds_capacity(capacity: int, receipts: list[GroupReceipt], data: st.DataObject) -> None:
    """offer appends the whole batch in order when it fits the free groups, else returns the state unchanged."""
    state = init_replay(capacity)
    assert offer(state, []) == (True, state)
    cursor = 0
    while cursor < len(receipts):
        batch = receipts[cursor : cursor + data.draw(st.integers(1, capacity))]
        accepted, after = offer(state, batch)
        if len(batch) <= state.free_groups:
            assert accepted and after.groups == state.groups + tuple(batch)
            cursor += len(batch)
        else:
            assert not accepted and after is state
            after = attrs.evolve(state, groups=state.groups[data.draw(st.integers(1, len(state.groups))) :])  # room, as a sample makes
        assert len(after.groups) <= capacity
        state = after


def test_offer_rejects_repeated_keys_and_a_batch_that_can_never_fit() -> None:
    """A key already buffered or repeated in the batch, and a batch above the capacity, are errors (not a False)."""
    state = _fill(3, [replay_receipt(["a"], weight_version=0, batch_seq=1)])
    with pytest.raises(ValueError, match=r"'receipts' must not hold a buffered key: 'a' \(group 1\) is already in the buffer"):
        offer(state, [replay_receipt(["b"], weight_version=0, batch_seq=1), replay_receipt(["a"], weight_version=0, batch_seq=1)])
    with pytest.raises(ValueError, match=r"'receipts' must not share keys between groups: 'c' is in groups 0 and 1"):
        offer(state, [replay_receipt(["c"], weight_version=0, batch_seq=1), replay_receipt(["c"], weight_version=0, batch_seq=1)])
    too_many = [replay_receipt([f"n{i}"], weight_version=0, batch_seq=1) for i in range(4)]
    with pytest.raises(ValueError, match=r"'receipts' must have at most capacity_groups=3 groups \(it can never fit\): got 4; .* init_replay\(4\)"):
        offer(state, too_many)


def test_offer_rejects_a_single_receipt_and_a_non_state() -> None:
    """receipts is a sequence (a lone receipt shows the corrected call); state must be a ReplayState."""
    receipt = replay_receipt(["a"], weight_version=0, batch_seq=1)
    with pytest.raises(TypeError, match=r"'receipts' must be a sequence of GroupReceipt, not a single one: wrap it, e.g. \[receipt\]"):
        offer(init_replay(2), receipt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'state' must be a ReplayState: got int; start from init_replay\(capacity_groups\)"):
        offer(3, [receipt])  # type: ignore[arg-type]


# ---------------------------------------------------------------- is_eligible / sample


@given(group_receipts(), replay_versions, staleness_bounds)
def test_is_eligible_is_the_staleness_bound(receipt: GroupReceipt, current: int, staleness: int) -> None:
    """A receipt is eligible iff current_version - weight_version <= max_staleness."""
    assert is_eligible(receipt, current, staleness) == (current - receipt.weight_version <= staleness)


def test_is_eligible_rejects_bad_arguments() -> None:
    """receipt must be a GroupReceipt; versions are ints >= 0."""
    receipt = replay_receipt(["a"], weight_version=0, batch_seq=1)
    with pytest.raises(TypeError, match=r"'receipt' must be a GroupReceipt: got str"):
        is_eligible("a", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'max_staleness' must be >= 0: got -1"):
        is_eligible(receipt, 0, -1)


@given(receipt_streams(min_size=1), st.integers(1, 12), replay_versions, staleness_bounds)
def test_sample_returns_the_oldest_eligible_groups_in_arrival_order(
    receipts: list[GroupReceipt], wanted: int, current: int, staleness: int
) -> None:
    """sample matches a plain FIFO reference: evict the ineligible, then the first num_groups eligible or nothing."""
    state = _fill(len(receipts), receipts)
    wanted = min(wanted, state.capacity_groups)
    sampled, after = sample(state, wanted, current, staleness)
    eligible = [g for g in receipts if current - g.weight_version <= staleness]
    expected = eligible[:wanted] if len(eligible) >= wanted else []
    assert list(sampled.groups) == expected
    assert list(sampled.evicted) == [g for g in receipts if current - g.weight_version > staleness]
    assert list(after.groups) == eligible[len(expected):]
    assert after.evicted_total == len(sampled.evicted) and after.capacity_groups == state.capacity_groups
    assert all(is_eligible(g, current, staleness) for g in sampled.groups)


@given(replay_scripts())
def test_sample_partitions_the_receipts_and_never_returns_a_row_twice(script: Script) -> None:
    """Across any script, accepted receipts == returned + evicted + remaining (disjoint); no key is returned twice;
    evicted_keys are the evicted receipts' keys; evicted_total counts them; returned groups are within the bound."""
    accepted, samples, state = _run_script(script)
    _, _, operations = script
    returned = [g for s in samples for g in s.groups]
    evicted = [g for s in samples for g in s.evicted]
    parts = _keys(returned) + _keys(evicted) + list(state.keys)
    assert sorted(parts) == sorted(_keys(accepted)) and len(set(parts)) == len(parts)
    assert all(s.evicted_keys == tuple(_keys(s.evicted)) for s in samples)
    assert state.evicted_total == len(evicted)
    sample_ops = [op for op in operations if op[0] == "sample"]
    for s, (_, _, current, staleness) in zip(samples, sample_ops):
        assert all(is_eligible(g, current, staleness) for g in s.groups)
        assert not any(is_eligible(g, current, staleness) for g in s.evicted)


def test_sample_keeps_everything_eligible_when_too_few_and_still_evicts() -> None:
    """With fewer eligible groups than asked, nothing is returned, the stale ones are evicted and the rest kept in order."""
    stale, fresh = replay_receipt(["s"], weight_version=0, batch_seq=1), replay_receipt(["f"], weight_version=3, batch_seq=4)
    sampled, state = sample(_fill(2, [stale, fresh]), 2, 4, 1)
    assert sampled.groups == () and sampled.evicted == (stale,) and state.groups == (fresh,) and state.evicted_total == 1


def test_sample_rejects_bad_arguments() -> None:
    """num_groups in 1..capacity (more could never be buffered); versions are ints >= 0."""
    state = init_replay(2)
    with pytest.raises(ValueError, match=r"'num_groups' must be at most capacity_groups=2 \(more could never be buffered\): got 3"):
        sample(state, 3, 0, 0)
    with pytest.raises(ValueError, match=r"'num_groups' must be >= 1: got 0"):
        sample(state, 0, 0, 0)
    with pytest.raises(ValueError, match=r"'current_version' must be >= 0: got -1"):
        sample(state, 1, -1, 0)
    with pytest.raises(TypeError, match=r"'max_staleness' must be an int: got float"):
        sample(state, 1, 0, 0.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- version_lag / may_generate / drain


@given(replay_versions, replay_versions)
def test_version_lag_is_the_version_difference(a: int, b: int) -> None:
    """version_lag(current, weights) == current - weights for weights <= current."""
    current, weights = max(a, b), min(a, b)
    assert version_lag(current, weights) == current - weights


def test_version_lag_rejects_weights_from_the_future() -> None:
    """weight_version may not exceed current_version; both are ints >= 0."""
    with pytest.raises(ValueError, match=r"'weight_version' must be <= current_version=2: got 3"):
        version_lag(2, 3)
    with pytest.raises(ValueError, match=r"'current_version' must be >= 0: got -1"):
        version_lag(-1, 0)


@given(st.integers(0, 12), replay_versions, staleness_bounds)
def test_may_generate_allows_exactly_the_batches_within_the_bound(batch_seq: int, weights: int, staleness: int) -> None:
    """Batch s may be generated with weights w iff (s - 1) - w <= max_staleness; newer weights never close the gate."""
    allowed = may_generate(batch_seq, weights, staleness)
    assert allowed == ((batch_seq - 1) - weights <= staleness)
    assert not allowed or may_generate(batch_seq, weights + 1, staleness)
    assert not allowed or may_generate(batch_seq, weights, staleness + 1)


@given(st.integers(1, 12))
def test_may_generate_synchronous_waits_for_the_previous_steps_weights(step: int) -> None:
    """With max_staleness 0 batch s needs the weights of step s - 1: version s - 1 opens the gate, s - 2 does not."""
    assert may_generate(step, step - 1, 0)
    assert step < 2 or not may_generate(step, step - 2, 0)


def test_may_generate_rejects_bad_arguments() -> None:
    """batch_seq, weight_version and max_staleness are ints >= 0."""
    with pytest.raises(ValueError, match=r"'batch_seq' must be >= 0: got -1"):
        may_generate(-1, 0, 0)
    with pytest.raises(TypeError, match=r"'weight_version' must be an int: got str"):
        may_generate(1, "0", 0)  # type: ignore[arg-type]


@given(replay_scripts())
def test_drain_returns_every_receipt_and_empties_the_buffer(script: Script) -> None:
    """drain returns the buffered receipts in arrival order and an empty buffer of the same capacity and evicted_total."""
    _, _, state = _run_script(script)
    receipts, empty = drain(state)
    assert receipts == state.groups and empty.groups == ()
    assert empty.capacity_groups == state.capacity_groups and empty.evicted_total == state.evicted_total


def test_drain_rejects_a_non_state() -> None:
    """drain needs a ReplayState."""
    with pytest.raises(TypeError, match=r"'state' must be a ReplayState: got list"):
        drain([])  # type: ignore[arg-type]


# ---------------------------------------------------------------- a simulated asynchronous run


def _simulate(schedule: dict[str, Any]) -> list[tuple[int, tuple[GroupReceipt, ...]]]:
    """Play a collector and a trainer over one buffer; return, per trainer step, its version and trained groups.

    The collector holds at most one pending batch: it generates batch ``b`` only
    when ``may_generate`` allows it with the weights it holds, and retries the
    offer until it is accepted. ``sync`` gives it the trainer's latest weights.
    The trainer at version ``v`` samples its groups, and on success trains
    (``v += 1``). After the drawn actions, a fair round-robin runs three more
    steps (the pair never deadlocks).
    """
    groups, rows = schedule["groups_per_batch"], schedule["rows_per_group"]
    staleness = schedule["max_staleness"]
    state = init_replay(schedule["capacity_groups"])
    trainer_version, collector_version, next_batch = 0, 0, 1
    pending: list[GroupReceipt] | None = None
    trained: list[tuple[int, tuple[GroupReceipt, ...]]] = []

    def act(action: str) -> None:
        nonlocal state, trainer_version, collector_version, next_batch, pending
        if action == "sync":
            collector_version = trainer_version
        elif action == "generate":
            if pending is None and may_generate(next_batch, collector_version, staleness):
                pending = [
                    replay_receipt([f"b{next_batch}p{p}_r{r}" for r in range(rows)], weight_version=collector_version, batch_seq=next_batch)
                    for p in range(groups)
                ]
                next_batch += 1
            if pending is not None:
                accepted, state = offer(state, pending)
                pending = None if accepted else pending
        else:
            sampled, state = sample(state, groups, trainer_version, staleness)
            if sampled.groups:
                trained.append((trainer_version, sampled.groups))
                trainer_version += 1

    for action in schedule["actions"]:
        act(action)
    target = len(trained) + 3
    for _ in range(3 * target):
        for action in ("sync", "generate", "train"):
            act(action)
    assert len(trained) >= target, "the collector and the trainer deadlocked"
    assert state.evicted_total == 0
    return trained


@given(async_schedules())
def test_async_run_trains_every_group_within_the_staleness_bound(schedule: dict[str, Any]) -> None:
    """In any interleaving, every trained group's version lag is <= max_staleness and step s trains batch s, whole."""
    for step, (version, trained) in enumerate(_simulate(schedule), start=1):
        assert version == step - 1
        assert all(version_lag(version, g.weight_version) <= schedule["max_staleness"] for g in trained)
        assert {g.batch_seq for g in trained} == {step} and len(trained) == schedule["groups_per_batch"]


@given(async_schedules(max_staleness=0))
def test_async_run_with_zero_staleness_is_synchronous(schedule: dict[str, Any]) -> None:
    """With max_staleness 0 step s trains exactly the batch with batch_seq s, sampled by weights s - 1."""
    for step, (version, trained) in enumerate(_simulate(schedule), start=1):
        assert all(g.batch_seq == step and g.weight_version == step - 1 == version for g in trained)
