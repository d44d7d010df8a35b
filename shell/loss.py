"""``GRPOLoss``: the GRPO loss as a picklable ``loss_fn`` for a policy backend's train step.

The math is :func:`core.grpo.clipped_policy_loss` (plus ``kl_coef`` times the
masked k3 KL to the reference policy), or, for async GRPO (``is_cap`` set),
:func:`core.off_policy.decoupled_policy_loss` with the behaviour log-probs of
:func:`core.off_policy.behaviour_logprobs`; this module only binds it to the
field names a micro-batch carries (:mod:`core.fields`) and makes it a
picklable callable for the backend's train step.

Invariants: the loss reads exactly the fields in ``GRPOLoss.input_fields``
(besides the log-probs the backend passes in), so a caller can fetch those
and nothing more. A call returns the micro-batch's *summed* token loss and
its token count; the backend divides the step's sums by the count over every
micro-batch of every DP rank, so the step trains on the token mean over the
global batch and a token weighs the same however the rows are split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from core.fields import (
    ADVANTAGES, GENERATION_LOGPROBS, PREV_LOGPROBS, REFERENCE_LOGPROBS, SAMPLE_MASK, TOKEN_MASK, VERSION_LAG,
)
from core.grpo import clipped_policy_loss, masked_kl_k3
from core.off_policy import behaviour_logprobs, decoupled_policy_loss


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"'{attribute.name}' must be a float: got {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"'{attribute.name}' must be >= 0: got {value}")


@attrs.frozen
class GRPOLoss:
    """``loss_fn(logprobs, micro_batch) -> (summed loss, tokens, metrics)`` for GRPO (DAPO clip bounds).

    ``summed loss`` is the sum over the micro-batch's counted tokens of the per-token loss and ``tokens``
    (an int64 scalar tensor) their number; the backend's train step divides the sums of a step by the
    tokens of the whole global batch (every micro-batch, every DP rank): DAPO's token-level mean.
    The metrics (``policy_loss``, ``kl``, ``clip_fraction``, ...) are this micro-batch's token means.

    Args:
        clip_low: the ratio is clipped below at ``1 - clip_low`` (in [0, 1]).
        clip_high: the ratio is clipped above at ``1 + clip_high``.
        kl_coef: weight of the k3 KL to the reference policy; 0 leaves the
            reference log-probs unread.
        sample_mask: also read ``sample_mask`` (FloatTensor[B]) and count only
            the tokens of rows whose mask is non-zero (e.g. the overlong filter).
        is_cap: None: on-policy GRPO. A number (>= 1): the decoupled off-policy
            objective of async GRPO; also read ``generation_logprobs`` (the
            behaviour policy's) and ``version_lag`` (FloatTensor[B]); the
            proximal policy is ``prev_logprobs``, and the importance weight
            ``exp(prev - behaviour)`` is truncated at ``is_cap``. Rows with lag
            0 were sampled by the proximal weights themselves: their weight is exactly 1.

    Raises:
        TypeError: a coefficient is not a number.
        ValueError: a coefficient is negative (``clip_low > 1`` is rejected on the first call); on a
            call, the token mask times the sample mask holds a value other than 0 or 1.

    Example:
        >>> loss_fn = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)
        >>> loss_fn.input_fields
        ('prev_logprobs', 'advantages', 'token_mask')
    """

    clip_low: float = attrs.field(default=0.2, validator=_non_negative)
    clip_high: float = attrs.field(default=0.2, validator=_non_negative)
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    sample_mask: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    is_cap: float | None = attrs.field(default=None)

    @is_cap.validator
    def _check_is_cap(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"'is_cap' must be a float >= 1 or None: got {type(value).__name__}")
        if not value >= 1 or value == float("inf"):
            raise ValueError(f"'is_cap' must be a finite float >= 1 or None: got {value}")

    @property
    def input_fields(self) -> tuple[str, ...]:
        """The micro-batch fields this loss reads."""
        fields = (PREV_LOGPROBS, ADVANTAGES, TOKEN_MASK)
        if self.sample_mask:
            fields += (SAMPLE_MASK,)
        if self.is_cap is not None:
            fields += (GENERATION_LOGPROBS, VERSION_LAG)
        return fields + (REFERENCE_LOGPROBS,) if self.kl_coef > 0 else fields

    def __call__(
        self, logprobs: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """The micro-batch's summed token loss, its token count and its float metrics (token means).

        Raises:
            KeyError: a field of ``input_fields`` is missing from ``micro_batch``.
            ValueError: the token mask (times the sample mask) holds a value other than 0 or 1.
        """
        missing = [name for name in self.input_fields if name not in micro_batch]
        if missing:
            raise KeyError(f"'micro_batch' must hold {list(self.input_fields)}: missing {missing}")
        mask = micro_batch[TOKEN_MASK]
        if self.sample_mask:
            rows = micro_batch[SAMPLE_MASK]
            mask = mask.to(rows.dtype) * rows.reshape(-1, *([1] * (mask.dim() - 1)))
        tokens = _token_count(mask)
        if self.is_cap is None:
            loss, metrics = clipped_policy_loss(
                logprobs,
                micro_batch[PREV_LOGPROBS],
                micro_batch[ADVANTAGES],
                mask,
                clip_low=self.clip_low,
                clip_high=self.clip_high,
                normalizer=1.0,
            )
        else:
            proximal = micro_batch[PREV_LOGPROBS]
            behaviour = behaviour_logprobs(micro_batch[GENERATION_LOGPROBS], proximal, micro_batch[VERSION_LAG])
            loss, metrics = decoupled_policy_loss(
                logprobs,
                proximal,
                behaviour,
                micro_batch[ADVANTAGES],
                mask,
                clip_low=self.clip_low,
                clip_high=self.clip_high,
                is_cap=self.is_cap,
                normalizer=1.0,
            )
        out = {name: float(value) for name, value in metrics.items()}
        per_token = 1.0 / max(int(tokens), 1)
        if self.kl_coef > 0:
            kl = masked_kl_k3(logprobs, micro_batch[REFERENCE_LOGPROBS], mask, normalizer=1.0)
            loss = loss + self.kl_coef * kl
            out["kl"] = float(kl.detach()) * per_token
        out["policy_loss"] = float(loss.detach()) * per_token
        return loss, tokens, out


def _token_count(mask: torch.Tensor) -> torch.Tensor:
    """The number of counted tokens (an int64 scalar tensor) of a 0/1 token mask.

    Raises:
        ValueError: ``mask`` holds another value (a weight would make the count and the sum disagree).
    """
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)]
        raise ValueError(
            f"'token_mask' (times 'sample_mask') must hold only 0 and 1: got {bad.numel()} other values, "
            f"e.g. {float(bad.flatten()[0])}"
        )
    return (mask != 0).sum()
