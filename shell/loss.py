"""``GRPOLoss``: the GRPO loss as a picklable ``loss_fn`` for a policy backend's train step.

The math is :func:`core.grpo.clipped_policy_loss` (plus ``kl_coef`` times the
masked k3 KL to the reference policy); this module only binds it to the
field names a micro-batch carries (:mod:`core.fields`) and makes it a
picklable callable for the backend's train step.

Invariant: the loss reads exactly the fields in ``GRPOLoss.input_fields``
(besides the log-probs the backend passes in), so a caller can fetch those
and nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from core.fields import ADVANTAGES, PREV_LOGPROBS, REFERENCE_LOGPROBS, SAMPLE_MASK, TOKEN_MASK
from core.grpo import clipped_policy_loss, kl_k3, masked_mean


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"'{attribute.name}' must be a float: got {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"'{attribute.name}' must be >= 0: got {value}")


@attrs.frozen
class GRPOLoss:
    """``loss_fn(logprobs, micro_batch) -> (loss, metrics)`` for GRPO (token-level mean, DAPO clip bounds).

    Args:
        clip_low: the ratio is clipped below at ``1 - clip_low`` (in [0, 1]).
        clip_high: the ratio is clipped above at ``1 + clip_high``.
        kl_coef: weight of the k3 KL to the reference policy; 0 leaves the
            reference log-probs unread.
        sample_mask: also read ``sample_mask`` (FloatTensor[B]) and count only
            the tokens of rows whose mask is non-zero (e.g. the overlong filter).

    Raises:
        TypeError: a coefficient is not a number.
        ValueError: a coefficient is negative (``clip_low > 1`` is rejected on the first call).

    Example:
        >>> loss_fn = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)
        >>> loss_fn.input_fields
        ('prev_logprobs', 'advantages', 'token_mask')
    """

    clip_low: float = attrs.field(default=0.2, validator=_non_negative)
    clip_high: float = attrs.field(default=0.2, validator=_non_negative)
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    sample_mask: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def input_fields(self) -> tuple[str, ...]:
        """The micro-batch fields this loss reads."""
        fields = (PREV_LOGPROBS, ADVANTAGES, TOKEN_MASK)
        if self.sample_mask:
            fields += (SAMPLE_MASK,)
        return fields + (REFERENCE_LOGPROBS,) if self.kl_coef > 0 else fields

    def __call__(self, logprobs: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss and its float metrics.

        Raises:
            KeyError: a field of ``input_fields`` is missing from ``micro_batch``.
        """
        missing = [name for name in self.input_fields if name not in micro_batch]
        if missing:
            raise KeyError(f"'micro_batch' must hold {list(self.input_fields)}: missing {missing}")
        mask = micro_batch[TOKEN_MASK]
        if self.sample_mask:
            rows = micro_batch[SAMPLE_MASK]
            mask = mask.to(rows.dtype) * rows.reshape(-1, *([1] * (mask.dim() - 1)))
        loss, metrics = clipped_policy_loss(
            logprobs,
            micro_batch[PREV_LOGPROBS],
            micro_batch[ADVANTAGES],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        out = {name: float(value) for name, value in metrics.items()}
        if self.kl_coef > 0:
            kl = masked_mean(kl_k3(logprobs, micro_batch[REFERENCE_LOGPROBS]), mask)
            loss = loss + self.kl_coef * kl
            out["kl"] = float(kl.detach())
        out["policy_loss"] = float(loss.detach())
        return loss, out
