"""Laws of the trainer's loss function (``shell/loss.py``, ``GRPOLoss``): masked tokens never matter, and
the loss is a sum over tokens with its count, so splitting a batch changes nothing.

A token that the token mask (or the sample mask) drops reaches neither the loss nor its gradient, whatever
its log-probs hold, with the KL term on (``kl_coef > 0``) as without it. The micro-batches of any split of a
batch's rows sum to the whole batch's summed loss, count and gradient (partition law): the backend's token
mean over the global batch does not depend on the split.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.fields import ADVANTAGES, PREV_LOGPROBS, REFERENCE_LOGPROBS, SAMPLE_MASK, TOKEN_MASK
from shell.loss import GRPOLoss


def _loss_and_grad(loss_fn: GRPOLoss, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    leaf = logprobs.clone().requires_grad_(True)
    loss, tokens, _ = loss_fn(leaf, batch)
    loss.backward()
    assert leaf.grad is not None
    assert int(tokens) == int(batch[TOKEN_MASK].sum())
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


@given(
    st.integers(2, 6),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.1]),
    st.booleans(),
)
def test_the_micro_batches_of_a_split_sum_to_the_whole_batchs_loss_count_and_gradient(
    rows: int, cut: int, seed: int, kl_coef: float, sample_mask: bool
) -> None:
    """Split rows ``[0, cut)`` and ``[cut, rows)``: the two summed losses add up to the whole batch's, the token
    counts too, and so do the gradients; the loss over the global batch is sum / count whatever the split."""
    cut = min(cut, rows - 1)
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(rows, 5, generator=g)
    batch = {
        PREV_LOGPROBS: logprobs + 0.3 * torch.randn(rows, 5, generator=g),
        ADVANTAGES: torch.randn(rows, generator=g),
        TOKEN_MASK: torch.rand(rows, 5, generator=g) > 0.3,
        REFERENCE_LOGPROBS: -torch.rand(rows, 5, generator=g),
        SAMPLE_MASK: (torch.rand(rows, generator=g) > 0.3).float(),
    }
    loss_fn = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef, sample_mask=sample_mask)

    def run(a: int, b: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        leaf = logprobs[a:b].clone().requires_grad_(True)
        loss, tokens, metrics = loss_fn(leaf, {name: t[a:b] for name, t in batch.items()})
        loss.backward()
        assert leaf.grad is not None
        assert metrics["policy_loss"] == pytest.approx(float(loss.detach()) / max(int(tokens), 1), rel=1e-6, abs=1e-7)
        return loss.detach(), int(tokens), leaf.grad

    whole, whole_tokens, whole_grad = run(0, rows)
    first, second = run(0, cut), run(cut, rows)
    assert first[1] + second[1] == whole_tokens
    kept = batch[TOKEN_MASK] & (batch[SAMPLE_MASK][:, None] > 0) if sample_mask else batch[TOKEN_MASK]
    assert whole_tokens == int(kept.sum())
    torch.testing.assert_close(first[0] + second[0], whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([first[2], second[2]]), whole_grad, rtol=1e-5, atol=1e-6)


def test_grpo_loss_rejects_a_mask_that_is_not_zero_or_one() -> None:
    """A fractional sample mask would make the token count disagree with the weighted sum: refused by name."""
    batch = {
        PREV_LOGPROBS: torch.zeros(2, 3), ADVANTAGES: torch.ones(2), TOKEN_MASK: torch.ones(2, 3, dtype=torch.bool),
        SAMPLE_MASK: torch.tensor([1.0, 0.5]),
    }
    with pytest.raises(ValueError, match=r"'token_mask' \(times 'sample_mask'\) must hold only 0 and 1: got 3 other values, e.g. 0.5"):
        GRPOLoss(sample_mask=True)(torch.zeros(2, 3), batch)
