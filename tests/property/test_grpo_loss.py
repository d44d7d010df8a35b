"""Laws of the trainer's loss function (``shell/loss.py``, ``GRPOLoss``): masked tokens never matter.

A token that the token mask (or the sample mask) drops reaches neither the loss nor its gradient, whatever
its log-probs hold, with the KL term on (``kl_coef > 0``) as without it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.fields import ADVANTAGES, PREV_LOGPROBS, REFERENCE_LOGPROBS, TOKEN_MASK
from shell.loss import GRPOLoss


def _loss_and_grad(loss_fn: GRPOLoss, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    leaf = logprobs.clone().requires_grad_(True)
    loss, _ = loss_fn(leaf, batch)
    loss.backward()
    assert leaf.grad is not None
    return float(loss.detach()), leaf.grad


@given(
    st.lists(st.floats(-3.0, 0.0), min_size=6, max_size=6),
    st.lists(st.floats(-3.0, 0.0), min_size=6, max_size=6),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 100.0, -1e4]),
    st.sampled_from([0.05, 1.0]),
)
def test_a_masked_tokens_reference_logprob_reaches_neither_the_loss_nor_the_gradient(
    logprobs: list[float], reference: list[float], junk: float, kl_coef: float
) -> None:
    """With the KL term on, a masked token whose reference log-prob (and log-prob) is junk (NaN, inf, huge) gives
    the loss and the gradient of the same batch with a benign value there; the masked token's gradient is 0."""
    current = torch.tensor([logprobs[:3], logprobs[3:]], dtype=torch.float32)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    batch = {
        PREV_LOGPROBS: current.detach().clone(),
        ADVANTAGES: torch.tensor([1.0, -0.5]),
        TOKEN_MASK: mask,
        REFERENCE_LOGPROBS: torch.tensor([reference[:3], reference[3:]], dtype=torch.float32),
    }
    loss_fn = GRPOLoss(kl_coef=kl_coef)
    benign_loss, benign_grad = _loss_and_grad(loss_fn, current, batch)
    poisoned = dict(batch, **{REFERENCE_LOGPROBS: batch[REFERENCE_LOGPROBS].masked_fill(~mask, junk)})
    junk_logprobs = current.masked_fill(~mask, -50.0)
    loss, grad = _loss_and_grad(loss_fn, junk_logprobs, poisoned)
    assert loss == pytest.approx(benign_loss, rel=1e-6, abs=1e-7)
    assert torch.isfinite(grad).all() and torch.all(grad[~mask] == 0)
    torch.testing.assert_close(grad, benign_grad)
