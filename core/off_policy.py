"""Decoupled PPO objective: behaviour / proximal / current policy (asynchronous GRPO).

With asynchronous rollouts a row may be sampled by weights older than the
trainer's. Three policies then meet in the loss of one token:

* the *behaviour* policy, whose weights sampled the token (log-probs recorded
  at generation);
* the *proximal* policy, the trainer's weights when the step began (log-probs
  recomputed by the trainer): the PPO trust region is centred on it;
* the *current* policy, the weights being optimised (differentiable log-probs).

The loss is the clipped surrogate between current and proximal, each token
weighted by the truncated importance weight of proximal against behaviour:

    w_t    = min(exp(proximal_t - behaviour_t), is_cap)      (a constant: detached)
    loss_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t) * w_t,
    r_t    = exp(current_t - proximal_t)

Invariants:
  * when behaviour == proximal (on-policy rows) every weight is exactly 1, so
    the loss and its gradient are bitwise those of
    :func:`core.grpo.clipped_policy_loss`, for any ``is_cap >= 1``;
  * every weight lies in ``[0, is_cap]`` and equals ``exp(proximal -
    behaviour)`` wherever that is at most ``is_cap``;
  * the weight is detached: no gradient flows into the behaviour log-probs,
    and into the proximal ones only through ``r_t`` (as into
    ``prev_logprobs`` of :func:`core.grpo.clipped_policy_loss`);
  * masked-out tokens never reach the loss, its gradient or a metric, whatever
    they hold (``-inf`` and NaN included);
  * a row of version lag 0 (sampled by the weights the trainer holds) has its
    behaviour log-probs taken from the proximal ones (:func:`behaviour_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from core.checks import check_int_entries
from core.grpo import (
    Advantages,
    LossLevel,
    Metrics,
    TokenLogprobs,
    TokenMask,
    TokenWeights,
    _check_floating,
    _check_mask,
    _check_real,
    _check_shape,
    _masked_mean,
    clipped_policy_loss,
    kl_k3,
)

VersionLag = Tensor | Sequence[int]  # [B] int or float, >= 0: trainer version minus the row's weight version


# ---------------------------------------------------------------- validation


def _check_token_logprobs(name: str, value: Any, shape: tuple[int, ...] | None = None, like: str = "") -> Tensor:
    """``value`` as a floating [B, S] tensor (of ``shape``, the shape of ``like``, when given)."""
    tensor = _check_floating(name, value)
    if shape is None:
        if tensor.dim() != 2:
            raise ValueError(f"'{name}' must be 2-D of shape [B, S]: got shape {tuple(tensor.shape)}")
    else:
        _check_shape(name, tensor, shape, f"same as '{like}'")
    return tensor


def _check_version_lag(value: Any, rows: int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"'version_lag' must have an integer or floating dtype: got {value.dtype}; pass version_lag.long()"
            )
        lag = value
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        lag = torch.tensor(check_int_entries("version_lag", value), dtype=torch.int64)
    else:
        raise TypeError(f"'version_lag' must be a tensor or a sequence of ints: got {type(value).__name__}")
    if tuple(lag.shape) != (rows,):
        raise ValueError(f"'version_lag' must have shape ({rows},) (one lag per row): got {tuple(lag.shape)}")
    bad = ~(lag >= 0)  # NaN fails too
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"'version_lag' entries must be >= 0: got {lag[index].item()!r} at index {index}")
    return lag.to(device)


def _check_is_cap(is_cap: Any) -> float:
    return _check_real("is_cap", is_cap, low=1.0, low_open=False)


# ---------------------------------------------------------------- behaviour log-probs


def behaviour_logprobs(
    generation_logprobs: TokenLogprobs, proximal_logprobs: TokenLogprobs, version_lag: VersionLag
) -> TokenLogprobs:
    """The behaviour policy's log-probs of each row: generation's when the row is stale, else the proximal ones.

        behaviour_{b,t} = generation_{b,t}   if version_lag_b > 0
                        = proximal_{b,t}     if version_lag_b == 0

    A row sampled by the very weights the trainer holds now (lag 0) has
    behaviour policy == proximal policy, so its importance weight is exactly
    1: the trainer's recomputed log-probs stand for it, and the small numeric
    mismatch between the sampler's and the trainer's kernels never reaches
    the loss of on-policy rows. A stale row keeps the log-probs its sampler
    recorded, the only record of the policy that drew it.

    Args:
        generation_logprobs: [B, S] floating log-probs recorded by the sampler.
        proximal_logprobs: [B, S] floating log-probs recomputed by the trainer.
        version_lag: [B] int or float tensor (or a sequence of ints), >= 0:
            the trainer's weight version minus the row's.

    Returns:
        [B, S]: each row, exactly (bitwise), the row of one of the inputs.

    Raises:
        TypeError: a log-prob tensor is not floating; ``version_lag`` is bool,
            complex or not a tensor / sequence of ints.
        ValueError: the log-probs are not [B, S] of one shape; ``version_lag``
            is not [B] or has an entry < 0 (or NaN).

    Example:
        >>> gen, prox = torch.full((2, 2), -1.0), torch.full((2, 2), -2.0)
        >>> behaviour_logprobs(gen, prox, torch.tensor([0, 3])).tolist()
        [[-2.0, -2.0], [-1.0, -1.0]]
    """
    prox = _check_token_logprobs("proximal_logprobs", proximal_logprobs)
    gen = _check_token_logprobs("generation_logprobs", generation_logprobs, tuple(prox.shape), "proximal_logprobs")
    lag = _check_version_lag(version_lag, prox.shape[0], prox.device)
    return torch.where(lag[:, None] > 0, gen, prox)


# ---------------------------------------------------------------- importance weights


def _importance_ratio(proximal: Tensor, behaviour: Tensor, selected: Tensor) -> Tensor:
    """``exp(proximal - behaviour)`` where ``selected``, 0 elsewhere; detached, padding never read."""
    with torch.no_grad():
        prox = torch.where(selected, proximal.detach(), 0)
        behav = torch.where(selected, behaviour.detach(), 0)
        return torch.where(selected, torch.exp(prox - behav), 0)


def truncated_importance_weights(
    proximal_logprobs: TokenLogprobs, behaviour_logprobs: TokenLogprobs, mask: TokenMask, *, is_cap: float
) -> TokenWeights:
    """Per-token truncated importance weights of the proximal policy against the behaviour policy.

        w_t = min(exp(proximal_t - behaviour_t), is_cap)    where mask_t != 0
        w_t = 0                                             where mask_t == 0

    Truncation bounds the variance a very stale or unlucky token can add; the
    weight is a constant of the loss (detached). Masked-out positions may hold
    anything (``-inf`` and NaN included): they are replaced before any
    arithmetic.

    Args:
        proximal_logprobs: [B, S] floating log-probs of the proximal policy.
        behaviour_logprobs: [B, S] floating log-probs of the behaviour policy.
        mask: [B, S] bool, or floating weights; 0 marks padding.
        is_cap: the truncation level, a finite real number >= 1.

    Returns:
        [B, S] detached weights with the dtype of ``proximal_logprobs``, in
        ``[0, is_cap]`` where the log-probs are finite.

    Raises:
        TypeError: a tensor has the wrong dtype; ``is_cap`` is not a real number.
        ValueError: shapes disagree; ``is_cap`` is below 1 or not finite.

    Example:
        >>> prox = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
        >>> behav = torch.log(torch.tensor([[0.5, 0.05, 0.0]]))
        >>> truncated_importance_weights(prox, behav, torch.tensor([[True, True, False]]), is_cap=2.0).tolist()
        [[1.0, 2.0, 0.0]]
    """
    prox = _check_token_logprobs("proximal_logprobs", proximal_logprobs)
    shape = tuple(prox.shape)
    behav = _check_token_logprobs("behaviour_logprobs", behaviour_logprobs, shape, "proximal_logprobs")
    weights = _check_mask(mask, shape, prox.dtype)
    cap = _check_is_cap(is_cap)
    selected = weights != 0
    return _truncate(_importance_ratio(prox, behav, selected), selected, cap)


def _truncate(ratio: Tensor, selected: Tensor, cap: float) -> Tensor:
    return torch.where(selected, ratio.clamp_max(cap), 0)


# ---------------------------------------------------------------- the decoupled loss


def decoupled_policy_loss(
    logprobs: TokenLogprobs,
    proximal_logprobs: TokenLogprobs,
    behaviour_logprobs: TokenLogprobs,
    advantages: Advantages,
    mask: TokenMask,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float = 2.0,
    level: LossLevel = "token",
    normalizer: float | None = None,
) -> tuple[Tensor, Metrics]:
    """The decoupled PPO loss: clipped against the proximal policy, importance-weighted to the behaviour policy.

        r_t    = exp(logprobs_t - proximal_t)
        w_t    = min(exp(proximal_t - behaviour_t), is_cap)       (detached)
        loss_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t) * w_t

    reduced as :func:`core.grpo.clipped_policy_loss` reduces it (``level``,
    ``normalizer``): the loss is exactly
    ``clipped_policy_loss(logprobs, proximal_logprobs, advantages, mask, ...,
    importance_weights=truncated_importance_weights(proximal_logprobs,
    behaviour_logprobs, mask, is_cap=is_cap))``. With behaviour == proximal
    it is bitwise ``clipped_policy_loss`` without weights, gradient included.

    Args:
        logprobs: [B, S] floating log-probs of the current policy (differentiable).
        proximal_logprobs: [B, S] floating log-probs of the proximal policy
            (the trainer's weights at the start of the step).
        behaviour_logprobs: [B, S] floating log-probs of the policy that
            sampled (see :func:`behaviour_logprobs`).
        advantages: [B] (one per sequence) or [B, S] (one per token) floating.
        mask: [B, S] bool, or floating weights.
        clip_low: lower clip range, r >= 1 - clip_low, in [0, 1].
        clip_high: upper clip range, r <= 1 + clip_high, >= 0.
        is_cap: the importance weight's truncation level, a finite real >= 1.
        level: "token" or "sequence" averaging.
        normalizer: a positive denominator replacing the local count.

    Returns:
        ``(loss, metrics)``: the 0-d loss, and the detached 0-d metrics of
        ``clipped_policy_loss`` (against the proximal policy) plus, as local
        masked token means: ``is_weight_mean`` (the truncated weight),
        ``is_truncated_frac`` (tokens where ``exp(proximal - behaviour) >
        is_cap``) and ``behaviour_kl`` (k3 estimate of KL(behaviour ||
        proximal) from the behaviour's samples: ``kl_k3(behaviour, proximal)``).

    Raises:
        TypeError: a tensor has the wrong dtype; a number is not a number.
        ValueError: shapes disagree; a clip bound, ``is_cap``, ``level`` or
            ``normalizer`` is out of range.

    Example:
        >>> lp = torch.zeros(1, 2)
        >>> loss, m = decoupled_policy_loss(lp, lp, lp - 1.0, torch.tensor([1.0]), torch.ones(1, 2), is_cap=2.0)
        >>> loss.item(), m["is_weight_mean"].item(), m["is_truncated_frac"].item()
        (-2.0, 2.0, 1.0)
    """
    lp = _check_token_logprobs("logprobs", logprobs)
    shape = tuple(lp.shape)
    prox = _check_token_logprobs("proximal_logprobs", proximal_logprobs, shape, "logprobs")
    behav = _check_token_logprobs("behaviour_logprobs", behaviour_logprobs, shape, "logprobs")
    weights = _check_mask(mask, shape, lp.dtype)
    cap = _check_is_cap(is_cap)
    selected = weights != 0
    ratio = _importance_ratio(prox, behav, selected)  # [B, S], detached
    importance = _truncate(ratio, selected, cap)
    loss, metrics = clipped_policy_loss(
        lp,
        prox,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        level=level,
        normalizer=normalizer,
        importance_weights=importance,
    )
    with torch.no_grad():
        p = torch.where(selected, prox.detach(), 0)
        b = torch.where(selected, behav.detach(), 0)
        metrics["is_weight_mean"] = _masked_mean(importance.to(lp.dtype), weights, None, None)
        metrics["is_truncated_frac"] = _masked_mean((ratio > cap).to(lp.dtype), weights, None, None)
        metrics["behaviour_kl"] = _masked_mean(kl_k3(b, p), weights, None, None)
    return loss, metrics
