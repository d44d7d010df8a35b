"""GRPO math: group baselines, advantages, the clipped policy loss, k3 KL and the DAPO filter.

Every function is pure: it reads torch tensors, never writes to them, and
returns new tensors. Groups are the rows sharing a ``group_ids`` value (the
responses sampled for one prompt); group statistics are computed with
``index_add`` / ``scatter_reduce``, never a Python loop over groups.

Invariants:
  * statistics are per group: permuting rows permutes every per-row output;
  * a group whose rewards are all equal has std exactly 0 and baseline exactly
    that reward, so its advantages are exactly 0;
  * a group of one row has std 0, never NaN;
  * masked-out tokens never reach a loss or its gradient, whatever they hold
    (``-inf`` log-probabilities included), and an all-zero mask gives loss 0;
  * importance weights are constants on each token's loss: without them the
    clipped loss is bitwise what it is with all weights 1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from core.checks import check_int_entries

Rewards = Tensor  # [N] floating: one scalar reward per row
GroupIds = Tensor | Sequence[int]  # [N] integer: rows with equal ids form a group
Baseline = Tensor  # [N] floating: the baseline of each row's group
GroupStd = Tensor  # [N] floating: the reward std of each row's group
Advantages = Tensor  # [N] (per row) or [B, S] (per token) floating
TokenLogprobs = Tensor  # [B, S] floating: log pi(token) for each response token
TokenMask = Tensor  # [B, S] bool, or floating weights; 0 / False marks padding
TokenWeights = Tensor  # [B, S] floating, detached: a constant factor on each token's loss
Metrics = dict[str, Tensor]  # name -> 0-d detached tensor
LossLevel = Literal["token", "sequence"]
_LEVELS = ("token", "sequence")


# ---------------------------------------------------------------- validation


def _check_tensor(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor: got {type(value).__name__}")
    return value


def _check_floating(name: str, value: Any) -> Tensor:
    tensor = _check_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"'{name}' must have a floating dtype: got {tensor.dtype}; pass {name}.float()")
    return tensor


def _check_shape(name: str, tensor: Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"'{name}' must have shape {expected} ({meaning}): got {tuple(tensor.shape)}")


def _check_rewards(rewards: Any) -> Rewards:
    tensor = _check_floating("rewards", rewards)
    if tensor.dim() != 1:
        raise ValueError(f"'rewards' must be 1-D of shape [N] (one reward per row): got shape {tuple(tensor.shape)}")
    return tensor


def _check_group_ids(group_ids: Any, rewards: Rewards) -> Tensor:
    n = rewards.shape[0]
    if isinstance(group_ids, Tensor):
        if group_ids.dtype == torch.bool or group_ids.is_floating_point() or group_ids.is_complex():
            raise TypeError(
                f"'group_ids' must have an integer dtype: got {group_ids.dtype}; pass group_ids.long()"
            )
        ids = group_ids.to(device=rewards.device, dtype=torch.int64)
    elif isinstance(group_ids, Sequence) and not isinstance(group_ids, (str, bytes)):
        values = check_int_entries("group_ids", group_ids)
        ids = torch.tensor(values, dtype=torch.int64, device=rewards.device)
    else:
        raise TypeError(f"'group_ids' must be an integer tensor or a sequence of ints: got {type(group_ids).__name__}")
    if ids.dim() != 1 or ids.shape[0] != n:
        raise ValueError(
            f"'group_ids' must have shape ({n},) (one id per reward): got {tuple(ids.shape)}"
        )
    return ids


def _check_real(name: str, value: Any, *, low: float, low_open: bool, high: float = math.inf) -> float:
    """``value`` as a finite float in ``(low, high]`` (``low_open``) or ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"'{name}' must be a real number: got {type(value).__name__}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or number > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"'{name}' must be finite and in {bounds}: got {value!r}")
    return number


def _check_normalizer(normalizer: Any) -> float | None:
    if normalizer is None:
        return None
    if isinstance(normalizer, numbers.Real) and not isinstance(normalizer, bool) and float(normalizer) == 0.0:
        raise ValueError(
            "'normalizer' must be finite and in (0.0, inf): got 0; when the global count may be 0, "
            "pass normalizer=max(count, 1) (the numerator is then 0 too)"
        )
    return _check_real("normalizer", normalizer, low=0.0, low_open=True)


def _check_mask(mask: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A validated mask as floating weights of ``dtype`` (bool -> 0/1)."""
    tensor = _check_tensor("mask", mask)
    if tensor.dtype != torch.bool and not tensor.is_floating_point():
        raise TypeError(
            f"'mask' must be bool or floating: got {tensor.dtype}; pass mask.bool() for a 0/1 token mask"
        )
    _check_shape("mask", tensor, shape, "same as the values it masks")
    return tensor.to(dtype)


def _check_importance_weights(value: Any, shape: tuple[int, ...], selected: Tensor) -> Tensor:
    """Validated importance weights, detached: floating, of ``shape``, finite and >= 0 where ``selected``."""
    tensor = _check_floating("importance_weights", value)
    _check_shape("importance_weights", tensor, shape, "same as 'logprobs'")
    tensor = tensor.detach()
    bad = selected & ~(torch.isfinite(tensor) & (tensor >= 0))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            "'importance_weights' must be finite and >= 0 where 'mask' is non-zero: "
            f"got {tensor[row, col].item()!r} at [{row}, {col}]"
        )
    return tensor


# ---------------------------------------------------------------- group statistics


@attrs.frozen(eq=False)
class _GroupStats:
    """Dense group index and per-group statistics of one reward vector (internal)."""

    inverse: Tensor  # [N] int64: dense group index of each row
    counts: Tensor  # [G] floating: rows per group
    low: Tensor  # [G] floating: group minimum
    high: Tensor  # [G] floating: group maximum
    shifted: Tensor  # [N] floating: reward minus its group minimum
    shifted_sums: Tensor  # [G] floating: sum of ``shifted`` per group
    mean: Tensor  # [G] floating
    std: Tensor  # [G] floating: unbiased, exactly 0 for constant groups and singletons


def _group_stats(rewards: Rewards, ids: Tensor) -> _GroupStats:
    unique, inverse = torch.unique(ids, return_inverse=True)
    zeros = torch.zeros(unique.shape[0], dtype=rewards.dtype, device=rewards.device)  # [G]
    counts = zeros.index_add(0, inverse, torch.ones_like(rewards))
    low = zeros.scatter_reduce(0, inverse, rewards, reduce="amin", include_self=False)
    high = zeros.scatter_reduce(0, inverse, rewards, reduce="amax", include_self=False)
    # Shifting by the group minimum makes a constant group sum to exactly 0,
    # so its mean is exactly its reward and its std exactly 0.
    shifted = rewards - low[inverse]
    shifted_sums = zeros.index_add(0, inverse, shifted)
    mean = low + shifted_sums / counts
    centered = rewards - mean[inverse]  # [N]
    variance = zeros.index_add(0, inverse, centered * centered) / (counts - 1).clamp_min(1)
    std = torch.where(high == low, zeros, variance.sqrt())
    return _GroupStats(inverse, counts, low, high, shifted, shifted_sums, mean, std)


def group_baseline(
    rewards: Rewards, group_ids: GroupIds, *, leave_one_out: bool = False
) -> tuple[Baseline, GroupStd]:
    """The per-row baseline and reward std of each row's group.

    With ``n`` rows in row ``i``'s group ``g`` and ``S = sum_{j in g} r_j``:

        baseline_i = S / n                       (leave_one_out=False)
        baseline_i = (S - r_i) / (n - 1)         (leave_one_out=True, n > 1)
        baseline_i = r_i                         (leave_one_out=True, n == 1: advantage 0)
        std_i      = sqrt(sum_{j in g} (r_j - S/n)^2 / (n - 1))   (unbiased; 0 when n == 1)

    The std is always that of the whole group, also under ``leave_one_out``.
    A group with all-equal rewards has std exactly 0 and (non-LOO) baseline
    exactly its reward. Group ids may be any ints (negative, sparse, in any
    order); rows need not be contiguous.

    Args:
        rewards: [N] floating rewards.
        group_ids: [N] integer tensor or sequence of ints; equal ids form a group.
        leave_one_out: use the mean of the other group members (RLOO).

    Returns:
        ``(baseline, std)``, both [N] with the dtype and device of ``rewards``.

    Raises:
        TypeError: ``rewards`` is not a floating tensor, or ``group_ids`` is
            not integer.
        ValueError: ``rewards`` is not 1-D, or ``group_ids`` does not have
            one entry per reward.

    Example:
        >>> b, s = group_baseline(torch.tensor([1.0, 0.0, 3.0]), [7, 7, 9])
        >>> b.tolist(), s.tolist()
        ([0.5, 0.5, 3.0], [0.7071067690849304, 0.7071067690849304, 0.0])
    """
    rewards = _check_rewards(rewards)
    ids = _check_group_ids(group_ids, rewards)
    groups = _group_stats(rewards, ids)
    inv = groups.inverse
    std = groups.std[inv]  # [N]
    if not leave_one_out:
        return groups.mean[inv], std
    others = groups.counts[inv] - 1  # [N]: size of the rest of the group
    rest = groups.shifted_sums[inv] - groups.shifted  # [N]: shifted sum of the others
    loo = groups.low[inv] + rest / others.clamp_min(1)
    return torch.where(others > 0, loo, rewards), std


def grpo_advantages(
    rewards: Rewards,
    baseline: Baseline,
    std: GroupStd,
    *,
    normalize_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Advantages:
    """Per-row advantages from rewards and their group statistics.

        A_i = (r_i - b_i) / (std_i + epsilon)    (normalize_by_std=True)
        A_i = r_i - b_i                          (normalize_by_std=False)

    Args:
        rewards: [N] floating rewards.
        baseline: [N] floating baseline (see ``group_baseline``).
        std: [N] floating group std (see ``group_baseline``).
        normalize_by_std: divide by ``std + epsilon``.
        epsilon: a positive number that keeps the division finite for std 0.

    Returns:
        [N] advantages with the dtype of ``rewards``.

    Raises:
        TypeError: an input is not a floating tensor, or ``epsilon`` is not a number.
        ValueError: ``baseline`` or ``std`` differ in shape from ``rewards``;
            ``epsilon`` is not positive.
    """
    rewards = _check_rewards(rewards)
    shape = tuple(rewards.shape)
    _check_shape("baseline", _check_floating("baseline", baseline), shape, "same as 'rewards'")
    _check_shape("std", _check_floating("std", std), shape, "same as 'rewards'")
    eps = _check_real("epsilon", epsilon, low=0.0, low_open=True)
    centered = rewards - baseline
    if not normalize_by_std:
        return centered
    return centered / (std + eps)


def dapo_keep_mask(rewards: Rewards, group_ids: GroupIds, *, eps: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: keep the rows whose group's rewards vary.

        keep_i = (max_g r > min_g r) and (std_g > eps)    for g the group of row i

    with ``std_g`` the unbiased group std of ``group_baseline``. At ``eps=0``
    this keeps exactly the groups with non-constant rewards (the comparison
    of max and min is exact, free of rounding): those whose advantages are
    all 0 carry no gradient and are dropped.

    Args:
        rewards: [N] floating rewards.
        group_ids: [N] integer tensor or sequence of ints.
        eps: a non-negative std threshold.

    Returns:
        [N] bool tensor, True for rows to keep.

    Raises:
        TypeError: as for ``group_baseline``; ``eps`` is not a number.
        ValueError: as for ``group_baseline``; ``eps`` is negative.

    Example:
        >>> dapo_keep_mask(torch.tensor([1.0, 1.0, 0.0, 1.0]), [0, 0, 1, 1]).tolist()
        [False, False, True, True]
    """
    rewards = _check_rewards(rewards)
    ids = _check_group_ids(group_ids, rewards)
    threshold = _check_real("eps", eps, low=0.0, low_open=False)
    groups = _group_stats(rewards, ids)
    keep = (groups.high > groups.low) & (groups.std > threshold)  # [G]
    return keep[groups.inverse]


# ---------------------------------------------------------------- losses


def masked_mean(
    values: Tensor, mask: TokenMask, *, normalizer: float | None = None, dim: int | None = None
) -> Tensor:
    """Weighted mean of ``values`` where ``mask`` is non-zero.

        masked_mean = sum(values * mask) / D,    D = normalizer if given else sum(mask)

    reduced over all elements (``dim=None``) or along ``dim``. Where ``D`` is
    0 (nothing selected) the result is 0, never NaN; values at positions with
    mask 0 are ignored even when they are inf or NaN. Give ``normalizer`` for
    a global mean across micro-batches and ranks: each part then contributes
    ``sum(values * mask) / total`` and the parts add up.

    Args:
        values: floating tensor.
        mask: bool or floating weights, the shape of ``values``.
        normalizer: a positive denominator replacing ``sum(mask)``.
        dim: the dimension to reduce, or None for all.

    Returns:
        A 0-d tensor (``dim=None``) or ``values`` reduced along ``dim``.

    Raises:
        TypeError: ``values`` is not floating, ``mask`` is neither bool nor floating.
        ValueError: ``mask`` differs in shape from ``values``; ``normalizer`` is not positive.

    Example:
        >>> masked_mean(torch.tensor([1.0, 5.0, float("nan")]), torch.tensor([True, True, False]))
        tensor(3.)
    """
    values = _check_floating("values", values)
    weights = _check_mask(mask, tuple(values.shape), values.dtype)
    norm = _check_normalizer(normalizer)
    return _masked_mean(values, weights, norm, dim)


def _masked_mean(values: Tensor, weights: Tensor, normalizer: float | None, dim: int | None) -> Tensor:
    selected = weights != 0
    weighted = torch.where(selected, torch.where(selected, values, 0) * weights, 0)
    total = weighted.sum() if dim is None else weighted.sum(dim)
    if normalizer is not None:
        return total / normalizer
    count = weights.sum() if dim is None else weights.sum(dim)
    nonzero = count != 0
    return torch.where(nonzero, total / torch.where(nonzero, count, 1), 0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman's low-variance estimator).

        d = ref_logprobs - logprobs
        k3 = exp(d) - d - 1  >= 0,   == 0 iff d == 0

    Computed as ``expm1(d) - d`` and clamped at 0 so rounding never makes it
    negative. Average it with ``masked_mean``.

    Args:
        logprobs: floating log-probabilities of the policy, any shape.
        ref_logprobs: floating log-probabilities of the reference policy, same shape.

    Returns:
        A non-negative tensor of the same shape.

    Raises:
        TypeError: an input is not a floating tensor.
        ValueError: the shapes differ.
    """
    logprobs = _check_floating("logprobs", logprobs)
    ref = _check_floating("ref_logprobs", ref_logprobs)
    _check_shape("ref_logprobs", ref, tuple(logprobs.shape), "same as 'logprobs'")
    d = ref - logprobs
    return (torch.expm1(d) - d).clamp_min(0)


def masked_kl_k3(
    logprobs: Tensor, ref_logprobs: Tensor, mask: TokenMask, *, normalizer: float | None = None
) -> Tensor:
    """``masked_mean(kl_k3(logprobs, ref_logprobs), mask)`` where masked tokens reach neither the value nor the
    gradient, whatever they hold.

    ``masked_mean`` ignores a masked value, but the gradient of ``kl_k3`` at a
    masked token is ``0 * (1 - exp(ref - logprobs))``, NaN where the reference
    log-prob there is NaN or ``exp`` overflows; so both inputs are replaced by
    0 at masked tokens before ``kl_k3``. Kept tokens give the same value, bit
    for bit.

    Raises:
        TypeError, ValueError: as :func:`kl_k3` and :func:`masked_mean`.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> masked_kl_k3(lp, torch.tensor([-1.0, float("nan")]), torch.tensor([True, False])).backward()
        >>> bool(torch.isfinite(lp.grad).all()), lp.grad[1].item()
        (True, 0.0)
    """
    logprobs = _check_floating("logprobs", logprobs)
    ref = _check_floating("ref_logprobs", ref_logprobs)
    _check_shape("ref_logprobs", ref, tuple(logprobs.shape), "same as 'logprobs'")
    kept = _check_mask(mask, tuple(logprobs.shape), logprobs.dtype) != 0
    k3 = kl_k3(torch.where(kept, logprobs, 0), torch.where(kept, ref, 0))
    return masked_mean(k3, mask, normalizer=normalizer)


def clipped_policy_loss(
    logprobs: TokenLogprobs,
    prev_logprobs: TokenLogprobs,
    advantages: Advantages,
    mask: TokenMask,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: LossLevel = "token",
    normalizer: float | None = None,
    importance_weights: TokenWeights | None = None,
) -> tuple[Tensor, Metrics]:
    """The PPO/GRPO clipped surrogate loss, with DAPO's asymmetric clip bounds.

        ratio_t = exp(logprobs_t - prev_logprobs_t)
        loss_t  = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t) * w_t

    with ``w_t`` = ``importance_weights`` (constants: no gradient flows into
    them), or ``w_t = 1`` when None (then the loss and its gradient are
    bitwise those of the formula without ``w``). ``core.off_policy`` passes
    truncated behaviour-policy weights here.

    reduced with weights ``m_t`` = ``mask``:

        level="token":    sum_{b,t} loss * m / N,    N = normalizer or sum_{b,t} m
        level="sequence": sum_b seqmean_b / M,       M = normalizer or #{b : sum_t m_{b,t} > 0}
                          seqmean_b = sum_t loss_{b,t} m_{b,t} / sum_t m_{b,t}

    Pass ``normalizer`` (the token, or sequence, count over every micro-batch
    and rank) for global normalisation; the per-part losses then add up to
    the global mean. An all-zero mask gives loss 0. Masked-out tokens may hold
    anything (``-inf`` included): they reach neither the loss nor its gradient.

    Args:
        logprobs: [B, S] floating log-probs of the current policy (differentiable).
        prev_logprobs: [B, S] floating log-probs of the policy that sampled.
        advantages: [B] (one per sequence) or [B, S] (one per token) floating.
        mask: [B, S] bool, or floating weights.
        clip_low: lower clip range, ratio >= 1 - clip_low, in [0, 1].
        clip_high: upper clip range, ratio <= 1 + clip_high, >= 0.
        level: "token" or "sequence" averaging.
        normalizer: a positive denominator replacing the local count.
        importance_weights: [B, S] floating per-token weights, finite and
            >= 0 where ``mask`` is non-zero (anything elsewhere), detached.

    Returns:
        ``(loss, metrics)``: the 0-d loss, and detached 0-d token-mean (local,
        never ``normalizer``-scaled) metrics: ``clip_fraction`` (tokens where
        the clipped term is the minimum and differs), ``clip_fraction_low``
        (ratio < 1 - clip_low with A < 0), ``clip_fraction_high`` (ratio >
        1 + clip_high with A > 0), ``ratio_mean``, ``approx_kl`` (k3 of
        ``prev_logprobs`` against ``logprobs``) and ``token_count`` (sum of mask).

    Raises:
        TypeError: a tensor has the wrong dtype; a number is not a number.
        ValueError: shapes disagree; a clip bound, ``level`` or ``normalizer``
            is out of range; an importance weight where ``mask`` is non-zero
            is negative or not finite.

    Example:
        >>> lp = torch.zeros(1, 2)
        >>> loss, m = clipped_policy_loss(lp, lp, torch.tensor([1.0]), torch.tensor([[True, False]]))
        >>> loss.item(), m["clip_fraction"].item()
        (-1.0, 0.0)
    """
    logprobs = _check_floating("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"'logprobs' must be 2-D of shape [B, S]: got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    prev = _check_floating("prev_logprobs", prev_logprobs)
    _check_shape("prev_logprobs", prev, shape, "same as 'logprobs'")
    adv = _check_floating("advantages", advantages)
    if tuple(adv.shape) == shape[:1]:
        adv = adv.unsqueeze(-1).expand(shape)
    elif tuple(adv.shape) != shape:
        raise ValueError(
            f"'advantages' must have shape {shape[:1]} (one per sequence) or {shape} (one per token): "
            f"got {tuple(adv.shape)}"
        )
    weights = _check_mask(mask, shape, logprobs.dtype)
    low = _check_real("clip_low", clip_low, low=0.0, low_open=False, high=1.0)
    high = _check_real("clip_high", clip_high, low=0.0, low_open=False)
    if level not in _LEVELS:
        raise ValueError(f"'level' must be one of {list(_LEVELS)}: got {level!r}")
    norm = _check_normalizer(normalizer)
    selected = weights != 0  # [B, S] bool
    importance = None if importance_weights is None else _check_importance_weights(importance_weights, shape, selected)

    # Padding may hold -inf / NaN: replace it before any arithmetic so neither
    # the loss nor the gradient (through torch.where) ever sees it.
    lp = torch.where(selected, logprobs, 0)
    prev = torch.where(selected, prev, 0)
    adv = torch.where(selected, adv, 0)
    ratio = torch.exp(lp - prev)  # [B, S]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, S]
    if importance is not None:
        per_token = per_token * torch.where(selected, importance.to(per_token.dtype), 0)

    if level == "token":
        loss = _masked_mean(per_token, weights, norm, None)
    else:
        per_sequence = _masked_mean(per_token, weights, None, -1)  # [B]
        present = (weights.sum(-1) != 0).to(per_token.dtype)  # [B]
        loss = _masked_mean(per_sequence, present, norm, None)

    with torch.no_grad():
        r, a = ratio.detach(), adv.detach()
        metrics: Metrics = {
            "clip_fraction": _masked_mean((clipped.detach() < unclipped.detach()).to(r.dtype), weights, None, None),
            "clip_fraction_low": _masked_mean(((r < 1.0 - low) & (a < 0)).to(r.dtype), weights, None, None),
            "clip_fraction_high": _masked_mean(((r > 1.0 + high) & (a > 0)).to(r.dtype), weights, None, None),
            "ratio_mean": _masked_mean(r, weights, None, None),
            "approx_kl": _masked_mean(kl_k3(lp.detach(), prev.detach()), weights, None, None),
            "token_count": weights.detach().sum(),
        }
    return loss, metrics
