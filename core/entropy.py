"""Policy entropy: the uncertainty of a sampling distribution, in nats, and its mean over generated tokens.

The rollout engine draws each response token from ``softmax(logits / temperature)``
over the tokenizer's ids (ids past the tokenizer get logit ``-inf``). The
entropy of that distribution, averaged over a step's generated tokens, is the
step's ``entropy`` metric: it falls toward 0 as the policy collapses onto one
answer per prompt, which the reward alone cannot show.

Invariants:
  * ``categorical_entropy`` of a row lies in ``[0, log k]``, ``k`` the number
    of its finite logits: ``log k`` when they are all equal, 0 when only one
    is finite (up to float rounding at the upper end; never below 0);
  * ids with logit ``-inf`` contribute nothing: masking an id is the same as
    removing it from the row;
  * adding a constant to a row's logits leaves its entropy unchanged;
  * ``mean_token_entropy`` is the summed entropy of all tokens over their count,
    so splitting the rows into batches does not change it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["categorical_entropy", "mean_token_entropy"]


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits)`` along the last dimension.

    Args:
        logits: FloatTensor[..., V]; ``-inf`` marks ids that cannot be drawn.
            Apply the temperature first (``logits / temperature``).

    Returns:
        FloatTensor[...] (the input's dtype), each entry in ``[0, log k]``.

    Raises:
        TypeError: ``logits`` is not a floating-point tensor.
        ValueError: ``logits`` has no last dimension or an empty one, holds NaN
            or ``+inf``, or a row has no finite logit.

    Example:
        >>> abs(categorical_entropy(torch.zeros(4)).item() - math.log(4)) < 1e-6
        True
        >>> categorical_entropy(torch.tensor([0.0, -math.inf])).item()
        0.0
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"'logits' must be a floating-point tensor: got {got}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"'logits' must have a non-empty last (vocabulary) dimension: got shape {tuple(logits.shape)}")
    if bool(torch.isnan(logits).any() | torch.isposinf(logits).any()):
        raise ValueError("'logits' must hold finite values or -inf (a masked id): got NaN or +inf")
    if bool(torch.isneginf(logits).all(dim=-1).any()):
        raise ValueError("'logits' must have at least one finite value per row: got a row that is all -inf")
    logp = torch.log_softmax(logits, dim=-1)  # <= 0 everywhere: logsumexp >= max
    terms = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp.exp() * logp)  # 0 * log 0 = 0
    return 0.0 - terms.sum(dim=-1)  # 0.0 - x, not -x: a zero entropy is +0.0


def mean_token_entropy(row_entropy: Sequence[float], row_tokens: Sequence[int]) -> float:
    """The mean entropy per generated token: ``sum(row_entropy) / sum(row_tokens)``.

    Args:
        row_entropy: per row, the summed entropy (nats) of its generated tokens.
        row_tokens: per row, how many tokens it generated.

    Raises:
        ValueError: the sequences differ in length, a count is negative, a sum is
            negative or not finite, or there are no tokens at all.

    Example:
        >>> mean_token_entropy([1.0, 0.5], [2, 1])
        0.5
    """
    sums, counts = [float(x) for x in row_entropy], [int(n) for n in row_tokens]
    if len(sums) != len(counts):
        raise ValueError(f"'row_tokens' must have {len(sums)} entries (one per row_entropy): got {len(counts)}")
    bad_counts = [n for n in counts if n < 0]
    if bad_counts:
        raise ValueError(f"'row_tokens' must all be >= 0: got {bad_counts[:5]}")
    bad_sums = [x for x in sums if not (math.isfinite(x) and x >= 0.0)]
    if bad_sums:
        raise ValueError(f"'row_entropy' must all be finite and >= 0: got {bad_sums[:5]}")
    total = sum(counts)
    if total == 0:
        raise ValueError("'row_tokens' must sum to at least 1 token: got 0")
    return math.fsum(sums) / total
