"""The replay buffer of receipts: a pure FIFO of prompt-group receipts with a staleness bound.

Asynchronous GRPO decouples the collector (rollouts) from the trainer. The
collector writes each generation batch to the store and offers one
:class:`GroupReceipt` per prompt group (its rows' meta and carry, stamped with
the weight version that sampled them); the trainer samples whole groups. The
buffer holds receipts only, never tensors: the rows stay in the store.

Versions: the trainer's step ``s`` (counted from 1) trains with weights
version ``s - 1`` (version 0: the initial weights) and then publishes version
``s``. A receipt stamped ``weight_version`` is *eligible* at trainer version
``v`` when ``v - weight_version <= max_staleness``.

Invariants:
  * a state never holds more than ``capacity_groups`` groups, and no key
    appears in two of its groups (checked when built);
  * ``offer`` is all or nothing; ``sample`` returns the oldest eligible groups
    in arrival order, or none, and evicts exactly the receipts that can never
    become eligible again (versions only grow);
  * every receipt offered is, at any time, in exactly one of: returned by a
    ``sample``, evicted, or still buffered; no key is returned twice;
  * every group ``sample`` returns lies within the staleness bound, so with
    the collector's gate :func:`may_generate` and ``max_staleness = 0`` the
    trainer's step ``s`` trains exactly the batch generated for it, with
    weights ``s - 1`` (synchronous GRPO).

Example:
    >>> from core.meta import KVBatchMeta
    >>> from core.rollout_carry import RolloutCarry
    >>> def receipt(key: str, version: int) -> GroupReceipt:
    ...     carry = RolloutCarry(rewards=[1.0], lengths=[4], group_ids=[0], prompt_ids=[0], truncated=[False])
    ...     return GroupReceipt(KVBatchMeta("train", [key]), carry, weight_version=version, batch_seq=version + 1,
    ...                         entropy=[0.5], response_tokens=[2])
    >>> accepted, state = offer(init_replay(4), [receipt("a", 0), receipt("b", 1), receipt("c", 2)])
    >>> sampled, state = sample(state, 1, current_version=2, max_staleness=1)
    >>> [g.keys for g in sampled.groups], sampled.evicted_keys, state.keys
    ([('b',)], ('a',), ('c',))
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import attrs

from core.checks import check_int, check_int_entries
from core.meta import KVBatchMeta
from core.rollout_carry import RolloutCarry

Keys = tuple[str, ...]
Receipts = tuple["GroupReceipt", ...]


# ---------------------------------------------------------------- converters and validators


def _non_negative_int(name: str) -> Any:
    def convert(value: Any) -> int:
        return check_int(name, value, minimum=0)

    return convert


def _positive_int(name: str) -> Any:
    def convert(value: Any) -> int:
        return check_int(name, value, minimum=1)

    return convert


def _entropies(value: Any) -> tuple[float, ...]:
    out = tuple(float(v) for v in _sequence("entropy", value))
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"'entropy' entries must be finite and >= 0 (nats): got {v!r} at index {i}")
    return out


def _token_counts(value: Any) -> tuple[int, ...]:
    return check_int_entries("response_tokens", _sequence("response_tokens", value), minimum=0)


def _texts(value: Any) -> tuple[str, ...]:
    out = tuple(_sequence("responses", value))
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"'responses' entries must be str: got {type(text).__name__} at index {i}")
    return out


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"'{name}' must be a sequence with one entry per row, not a single string: got {value!r}")
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"'{name}' must be a sequence with one entry per row: got {type(value).__name__}") from None


def _instance_of(kind: type) -> Any:
    def check(_: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, kind):
            raise TypeError(f"'{attribute.name}' must be a {kind.__name__}: got {type(value).__name__}")

    return check


def _receipts(name: str) -> Any:
    def convert(value: Any) -> Receipts:
        if isinstance(value, GroupReceipt):
            raise TypeError(f"'{name}' must be a sequence of GroupReceipt, not a single one: wrap it, e.g. [receipt]")
        out = _sequence(name, value)
        for i, receipt in enumerate(out):
            if not isinstance(receipt, GroupReceipt):
                raise TypeError(f"'{name}' entries must be GroupReceipt: got {type(receipt).__name__} at index {i}")
        return out

    return convert


def _check_disjoint_keys(name: str, groups: Sequence[GroupReceipt], buffered: Collection[str] = ()) -> None:
    """Raise ``ValueError`` naming the first key of ``groups`` that is ``buffered`` or in an earlier group."""
    held = set(buffered)
    owner: dict[str, int] = {}
    for index, group in enumerate(groups):
        for key in group.keys:
            if key in held:
                raise ValueError(f"'{name}' must not hold a buffered key: {key!r} (group {index}) is already in the buffer")
            if key in owner:
                raise ValueError(f"'{name}' must not share keys between groups: {key!r} is in groups {owner[key]} and {index}")
            owner[key] = index


# ---------------------------------------------------------------- values


@attrs.frozen
class GroupReceipt:
    """The receipt of one prompt group's rows in the store: what the trainer needs to train on them.

    Attributes:
        meta: the group's rows in the store (keys, lengths, tags, fields).
        carry: the group's per-row carry (row ``i`` is key ``meta.keys[i]``).
        weight_version: the weights that sampled the group, >= 0.
        batch_seq: the generation batch it came from, >= 0 (batch ``s`` is
            meant for trainer step ``s``).
        entropy: per row, the summed sampling entropy in nats (finite, >= 0).
        response_tokens: per row, the generated tokens (EOS included), >= 0.
        responses: the decoded text of some leading rows, for logging: at
            most one per row.

    Raises:
        TypeError: ``meta`` is not a ``KVBatchMeta``, ``carry`` not a
            ``RolloutCarry``; a version or count is not an int; a response
            is not a str.
        ValueError: the group has no rows; ``meta``, ``carry``, ``entropy``
            and ``response_tokens`` disagree on the row count; a version,
            count or entropy is negative; more responses than rows.
    """

    meta: KVBatchMeta = attrs.field(validator=_instance_of(KVBatchMeta))
    carry: RolloutCarry = attrs.field(validator=_instance_of(RolloutCarry))
    weight_version: int = attrs.field(converter=_non_negative_int("weight_version"))
    batch_seq: int = attrs.field(converter=_non_negative_int("batch_seq"))
    entropy: tuple[float, ...] = attrs.field(converter=_entropies)
    response_tokens: tuple[int, ...] = attrs.field(converter=_token_counts)
    responses: tuple[str, ...] = attrs.field(default=(), converter=_texts)

    def __attrs_post_init__(self) -> None:
        n = len(self.meta)
        if n == 0:
            raise ValueError("'meta' must hold at least one row (a group is never empty): got 0 keys")
        for name, got in (("carry", self.carry.size), ("entropy", len(self.entropy)), ("response_tokens", len(self.response_tokens))):
            if got != n:
                raise ValueError(f"'{name}' must have {n} entries (one per key of 'meta'): got {got}")
        if len(self.responses) > n:
            raise ValueError(f"'responses' must have at most {n} entries (one per row): got {len(self.responses)}")

    @property
    def keys(self) -> Keys:
        """The group's row keys (``meta.keys``)."""
        return self.meta.keys

    @property
    def size(self) -> int:
        """The number of rows."""
        return len(self.meta)


@attrs.frozen
class ReplayState:
    """The buffer: receipts in arrival order (oldest first), at most ``capacity_groups`` of them.

    Attributes:
        capacity_groups: the most groups the buffer holds, >= 1.
        groups: the buffered receipts, oldest first.
        evicted_total: the groups evicted so far (too stale to train on).

    Raises:
        TypeError: a count is not an int; a group is not a ``GroupReceipt``.
        ValueError: ``capacity_groups < 1``; ``evicted_total < 0``; more
            groups than the capacity; a key in two groups.
    """

    capacity_groups: int = attrs.field(converter=_positive_int("capacity_groups"))
    groups: Receipts = attrs.field(default=(), converter=_receipts("groups"))
    evicted_total: int = attrs.field(default=0, converter=_non_negative_int("evicted_total"))

    def __attrs_post_init__(self) -> None:
        if len(self.groups) > self.capacity_groups:
            raise ValueError(
                f"'groups' must hold at most capacity_groups={self.capacity_groups} groups: got {len(self.groups)}"
            )
        _check_disjoint_keys("groups", self.groups)

    @property
    def keys(self) -> Keys:
        """Every buffered key, group by group in arrival order."""
        return tuple(key for group in self.groups for key in group.keys)

    @property
    def free_groups(self) -> int:
        """How many more groups fit."""
        return self.capacity_groups - len(self.groups)


@attrs.frozen
class Sampled:
    """What one :func:`sample` hands the trainer, and what it evicted.

    Attributes:
        groups: the groups to train on, oldest first; ``()`` when fewer than
            the requested number were eligible.
        evicted: the receipts dropped as too stale, oldest first (their keys
            are for the shell to clear from the store).
    """

    groups: Receipts = attrs.field(converter=_receipts("groups"))
    evicted: Receipts = attrs.field(converter=_receipts("evicted"))

    @property
    def evicted_keys(self) -> Keys:
        """Every key of the evicted receipts, in order."""
        return tuple(key for group in self.evicted for key in group.keys)


# ---------------------------------------------------------------- operations


def _check_state(state: Any) -> ReplayState:
    if not isinstance(state, ReplayState):
        raise TypeError(f"'state' must be a ReplayState: got {type(state).__name__}; start from init_replay(capacity_groups)")
    return state


def init_replay(capacity_groups: int) -> ReplayState:
    """An empty buffer that holds at most ``capacity_groups`` groups.

    Raises:
        TypeError: ``capacity_groups`` is not an int.
        ValueError: ``capacity_groups < 1``.
    """
    return ReplayState(capacity_groups)


def offer(state: ReplayState, receipts: Sequence[GroupReceipt]) -> tuple[bool, ReplayState]:
    """Append ``receipts`` (one generation batch) to the buffer, all or nothing.

    Args:
        state: the buffer.
        receipts: the batch's group receipts, in order.

    Returns:
        ``(True, new_state)`` with the receipts appended in order, or
        ``(False, state)`` unchanged when they do not all fit now
        (``len(receipts) > state.free_groups``): offer them again after a
        ``sample`` has made room.

    Raises:
        TypeError: ``state`` is not a ``ReplayState``; ``receipts`` is not a
            sequence of ``GroupReceipt`` (a single receipt included).
        ValueError: the batch can never fit (more groups than
            ``capacity_groups``); a key is already buffered or repeats within
            ``receipts``.
    """
    state = _check_state(state)
    batch = _receipts("receipts")(receipts)
    if len(batch) > state.capacity_groups:
        raise ValueError(
            f"'receipts' must have at most capacity_groups={state.capacity_groups} groups (it can never fit): "
            f"got {len(batch)}; split the batch or build the buffer with init_replay({len(batch)})"
        )
    _check_disjoint_keys("receipts", batch, state.keys)
    if len(batch) > state.free_groups:
        return False, state
    return True, attrs.evolve(state, groups=state.groups + batch)


def _check_versions(current_version: Any, max_staleness: Any) -> tuple[int, int]:
    return check_int("current_version", current_version, minimum=0), check_int("max_staleness", max_staleness, minimum=0)


def is_eligible(receipt: GroupReceipt, current_version: int, max_staleness: int) -> bool:
    """Whether ``receipt`` may train at trainer weight version ``current_version``.

        eligible  <=>  receipt.weight_version >= current_version - max_staleness

    Raises:
        TypeError: ``receipt`` is not a ``GroupReceipt``; a version is not an int.
        ValueError: ``current_version`` or ``max_staleness`` is negative.
    """
    if not isinstance(receipt, GroupReceipt):
        raise TypeError(f"'receipt' must be a GroupReceipt: got {type(receipt).__name__}")
    current, staleness = _check_versions(current_version, max_staleness)
    return receipt.weight_version >= current - staleness


def sample(state: ReplayState, num_groups: int, current_version: int, max_staleness: int) -> tuple[Sampled, ReplayState]:
    """Take the oldest ``num_groups`` eligible groups, after evicting those that can never be eligible again.

    1. Evict every receipt with ``weight_version < current_version -
       max_staleness``: the trainer's version only grows, so it never becomes
       eligible again.
    2. If at least ``num_groups`` receipts remain (all eligible now), return
       the first ``num_groups`` in arrival order and remove them; otherwise
       return no group and keep them all (the eviction still happens).

    ``evicted_total`` grows by the number evicted.

    Args:
        state: the buffer.
        num_groups: the groups one trainer step needs, 1 to ``capacity_groups``.
        current_version: the trainer's weight version, >= 0.
        max_staleness: the largest version lag allowed, >= 0 (0: on-policy).

    Returns:
        ``(sampled, new_state)``.

    Raises:
        TypeError: ``state`` is not a ``ReplayState``; a count is not an int.
        ValueError: ``num_groups`` is below 1 or above ``capacity_groups``
            (it could never be met); a version is negative.
    """
    state = _check_state(state)
    wanted = check_int("num_groups", num_groups, minimum=1)
    if wanted > state.capacity_groups:
        raise ValueError(
            f"'num_groups' must be at most capacity_groups={state.capacity_groups} (more could never be buffered): "
            f"got {wanted}"
        )
    current, staleness = _check_versions(current_version, max_staleness)
    oldest = current - staleness
    evicted = tuple(g for g in state.groups if g.weight_version < oldest)
    remaining = tuple(g for g in state.groups if g.weight_version >= oldest)
    taken, kept = (remaining[:wanted], remaining[wanted:]) if len(remaining) >= wanted else ((), remaining)
    new_state = attrs.evolve(state, groups=kept, evicted_total=state.evicted_total + len(evicted))
    return Sampled(groups=taken, evicted=evicted), new_state


def version_lag(current_version: int, weight_version: int) -> int:
    """How many versions the weights ``weight_version`` are behind the trainer's ``current_version``.

    Raises:
        TypeError: a version is not an int.
        ValueError: a version is negative, or ``weight_version > current_version``
            (weights from the future).

    Example:
        >>> version_lag(5, 3)
        2
    """
    current = check_int("current_version", current_version, minimum=0)
    weights = check_int("weight_version", weight_version, minimum=0)
    if weights > current:
        raise ValueError(f"'weight_version' must be <= current_version={current}: got {weights}")
    return current - weights


def may_generate(batch_seq: int, weight_version: int, max_staleness: int) -> bool:
    """The collector's gate: whether batch ``batch_seq`` may be generated with weights ``weight_version``.

    Batch ``batch_seq`` is meant for trainer step ``batch_seq``, which trains
    with weights version ``batch_seq - 1``; it may be generated with weights
    ``weight_version`` iff

        (batch_seq - 1) - weight_version <= max_staleness.

    ``max_staleness = 0`` is synchronous: batch ``s`` waits for the weights of
    step ``s - 1``.

    Raises:
        TypeError: an argument is not an int.
        ValueError: an argument is negative.

    Example:
        >>> may_generate(3, 1, 0), may_generate(3, 2, 0), may_generate(3, 1, 1)
        (False, True, True)
    """
    seq = check_int("batch_seq", batch_seq, minimum=0)
    weights = check_int("weight_version", weight_version, minimum=0)
    staleness = check_int("max_staleness", max_staleness, minimum=0)
    return (seq - 1) - weights <= staleness


def drain(state: ReplayState) -> tuple[Receipts, ReplayState]:
    """Every buffered receipt (arrival order) and the emptied buffer (same capacity and ``evicted_total``).

    For shutting down: the shell clears the drained receipts' keys from the store.

    Raises:
        TypeError: ``state`` is not a ``ReplayState``.
    """
    state = _check_state(state)
    return state.groups, attrs.evolve(state, groups=())
