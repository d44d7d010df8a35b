"""The rollout carry and the driver's GRPO step decisions over it.

A rollout returns, besides the receipt of its one bulk write, a *carry*: a few
scalars per row (reward, length, group, question id, whether the response was
cut off). The driver decides everything of a GRPO step from the carry alone:

* :func:`dapo_selection`: which groups DAPO dynamic sampling keeps;
* :func:`plan_advantages`: per-row baseline, std, advantage and sample mask;
* :func:`zero_variance_group_fraction`: the share of groups DAPO would drop.

Invariants:
  * a carry's columns all have one entry per row (checked when built);
  * the plan is a pure function of the carry and the options: the same carry
    gives bitwise the same advantages on every path (legacy or data plane);
  * rows of one group share their baseline and std; the sample mask is 0
    exactly on truncated rows when the overlong filter is on, else all 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from core.grpo import dapo_keep_mask, group_baseline, grpo_advantages

Floats = tuple[float, ...]
Ints = tuple[int, ...]
Bools = tuple[bool, ...]
Indices = tuple[int, ...]


def _floats(value: Any) -> Floats:
    return tuple(float(v) for v in value)


def _ints(value: Any) -> Ints:
    return tuple(int(v) for v in value)


def _bools(value: Any) -> Bools:
    return tuple(bool(v) for v in value)


@attrs.frozen
class RolloutCarry:
    """The small per-row slice a rollout hands the driver (row ``i`` of each column is row ``i`` of the batch).

    Attributes:
        rewards: the task's reward of each row.
        lengths: prompt plus response tokens of each row.
        group_ids: rows sampled from the same prompt instance share an id.
        prompt_ids: the task's id of each row's question (for reporting).
        truncated: the response hit ``max_new_tokens`` without an end-of-sequence.

    Raises:
        ValueError: the columns do not all have one entry per row, or a length is < 1.

    Example:
        >>> RolloutCarry(rewards=[1.0, 0.0], lengths=[6, 7], group_ids=[0, 0], prompt_ids=[3, 3],
        ...              truncated=[False, True]).size
        2
    """

    rewards: Floats = attrs.field(converter=_floats)
    lengths: Ints = attrs.field(converter=_ints)
    group_ids: Ints = attrs.field(converter=_ints)
    prompt_ids: Ints = attrs.field(converter=_ints)
    truncated: Bools = attrs.field(converter=_bools)

    def __attrs_post_init__(self) -> None:
        n = len(self.rewards)
        for name in ("lengths", "group_ids", "prompt_ids", "truncated"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"'{name}' must have {n} entries (one per reward): got {got}")
        bad = [x for x in self.lengths if x < 1]
        if bad:
            raise ValueError(f"'lengths' must all be >= 1: got {bad[:5]}")

    @property
    def size(self) -> int:
        """The number of rows."""
        return len(self.rewards)

    def subset(self, indices: Sequence[int]) -> RolloutCarry:
        """Rows at ``indices``, in that order.

        Raises:
            IndexError: an index is out of range.
        """
        idx = _ints(indices)
        out_of_range = [i for i in idx if not 0 <= i < self.size]
        if out_of_range:
            raise IndexError(f"'indices' must lie in [0, {self.size}): got {out_of_range[:5]}")
        return RolloutCarry(**{f.name: [getattr(self, f.name)[i] for i in idx] for f in attrs.fields(RolloutCarry)})

    def concat(self, *others: RolloutCarry) -> RolloutCarry:
        """Rows of ``self`` followed by the rows of each of ``others``.

        Raises:
            TypeError: an argument is not a ``RolloutCarry``.
        """
        for other in others:
            if not isinstance(other, RolloutCarry):
                raise TypeError(f"'others' must be RolloutCarry values: got {type(other).__name__}")
        parts = (self, *others)
        return RolloutCarry(**{
            f.name: [v for part in parts for v in getattr(part, f.name)] for f in attrs.fields(RolloutCarry)
        })


@attrs.frozen
class AdvantagePlan:
    """Per-row results of :func:`plan_advantages` (each a tuple of one entry per row).

    Attributes:
        baseline: the row's group baseline.
        std: the row's group reward std.
        advantages: the row's advantage (0 where the sample mask is 0).
        sample_mask: 1.0 for rows that count in the loss, 0.0 for filtered rows.
    """

    baseline: Floats = attrs.field(converter=_floats)
    std: Floats = attrs.field(converter=_floats)
    advantages: Floats = attrs.field(converter=_floats)
    sample_mask: Floats = attrs.field(converter=_floats)


def plan_advantages(
    carry: RolloutCarry,
    *,
    leave_one_out: bool = False,
    normalize_by_std: bool = True,
    overlong_filter: bool = False,
) -> AdvantagePlan:
    """Baselines, stds, advantages and the sample mask of a step's rows (float32 math, as on the workers).

    Args:
        carry: the step's rows.
        leave_one_out: the baseline of a row is the mean of the other rows of its group.
        normalize_by_std: divide advantages by the group std (+1e-6).
        overlong_filter: truncated rows get sample mask 0 and advantage 0.

    Raises:
        TypeError: ``carry`` is not a ``RolloutCarry``.
        ValueError: ``carry`` has no rows.
    """
    if not isinstance(carry, RolloutCarry):
        raise TypeError(f"'carry' must be a RolloutCarry: got {type(carry).__name__}")
    if carry.size == 0:
        raise ValueError("'carry' must have at least one row: got 0")
    rewards = torch.tensor(carry.rewards, dtype=torch.float32)
    baseline, std = group_baseline(rewards, list(carry.group_ids), leave_one_out=leave_one_out)
    advantages = grpo_advantages(rewards, baseline, std, normalize_by_std=normalize_by_std)
    mask = torch.ones_like(rewards)
    if overlong_filter:
        mask = mask * (~torch.tensor(carry.truncated, dtype=torch.bool)).to(mask.dtype)
        advantages = advantages * mask
    return AdvantagePlan(baseline.tolist(), std.tolist(), advantages.tolist(), mask.tolist())


def dapo_selection(carry: RolloutCarry, *, max_groups: int) -> Indices:
    """DAPO dynamic sampling: the rows of the first ``max_groups`` groups (in row order) whose rewards vary.

    Groups with constant rewards carry no gradient and are left out; so are
    the varying groups past the first ``max_groups``.

    Raises:
        TypeError: ``carry`` is not a ``RolloutCarry``.
        ValueError: ``max_groups`` is negative.

    Example:
        >>> c = RolloutCarry(rewards=[1, 1, 0, 1, 0, 1], lengths=[2] * 6, group_ids=[0, 0, 1, 1, 2, 2],
        ...                  prompt_ids=[0] * 6, truncated=[False] * 6)
        >>> dapo_selection(c, max_groups=1)
        (2, 3)
    """
    if not isinstance(carry, RolloutCarry):
        raise TypeError(f"'carry' must be a RolloutCarry: got {type(carry).__name__}")
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 0:
        raise ValueError(f"'max_groups' must be an int >= 0: got {max_groups!r}")
    if carry.size == 0:
        return ()
    keep = dapo_keep_mask(torch.tensor(carry.rewards, dtype=torch.float32), list(carry.group_ids)).tolist()
    chosen: list[int] = []
    rows: list[int] = []
    for i, (gid, kept) in enumerate(zip(carry.group_ids, keep)):
        if not kept:
            continue
        if gid not in chosen:
            if len(chosen) == max_groups:
                continue
            chosen.append(gid)
        rows.append(i)
    return tuple(rows)


def group_count(carry: RolloutCarry) -> int:
    """The number of distinct groups in ``carry``."""
    return len(set(carry.group_ids))


def zero_variance_group_fraction(carry: RolloutCarry) -> float:
    """The fraction of the carry's groups (distinct ``group_ids``) whose rewards are all equal.

    Such a group has advantage exactly 0 on every row, so it carries no
    gradient: this is the share of groups that DAPO dynamic sampling drops.
    The test is :func:`core.grpo.dapo_keep_mask`'s at ``eps=0`` on float32
    rewards (max == min, exactly), so it always agrees with
    :func:`dapo_selection`: ``1 - groups kept / groups``.

    Raises:
        TypeError: ``carry`` is not a ``RolloutCarry``.
        ValueError: ``carry`` has no rows (no groups).

    Example:
        >>> c = RolloutCarry(rewards=[1, 1, 0, 1, 0.5], lengths=[2] * 5, group_ids=[0, 0, 1, 1, 2],
        ...                  prompt_ids=[0] * 5, truncated=[False] * 5)
        >>> zero_variance_group_fraction(c)  # group 0 (1, 1) and the singleton group 2
        0.6666666666666666
    """
    if not isinstance(carry, RolloutCarry):
        raise TypeError(f"'carry' must be a RolloutCarry: got {type(carry).__name__}")
    if carry.size == 0:
        raise ValueError("'carry' must have at least one row (one group): got 0")
    keep = dapo_keep_mask(torch.tensor(carry.rewards, dtype=torch.float32), list(carry.group_ids)).tolist()
    groups = set(carry.group_ids)
    varying = {gid for gid, kept in zip(carry.group_ids, keep) if kept}
    return (len(groups) - len(varying)) / len(groups)
