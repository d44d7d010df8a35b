"""Laws and error paths of ``core.grpo``: each vectorised function against a plain-Python reference."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.grpo import (
    clipped_policy_loss,
    dapo_keep_mask,
    group_baseline,
    grpo_advantages,
    kl_k3,
    masked_kl_k3,
    masked_mean,
)
from tests.property.strategies import clip_ranges, grouped_rewards, policy_loss_inputs, weighted_policy_loss_inputs

GroupCase = tuple[torch.Tensor, list[int]]
LossCase = dict[str, torch.Tensor]
CLOSE = {"rtol": 1e-9, "atol": 1e-9}


# ---------------------------------------------------------------- plain-Python references


def _members(rewards: list[float], ids: list[int]) -> dict[int, list[float]]:
    groups: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, ids):
        groups[g].append(r)
    return groups


def _reference_baseline(rewards: list[float], ids: list[int], leave_one_out: bool) -> tuple[list[float], list[float]]:
    groups = _members(rewards, ids)
    baseline, std = [], []
    for r, g in zip(rewards, ids):
        values = groups[g]
        n, mean = len(values), math.fsum(values) / len(values)
        if leave_one_out:
            baseline.append((math.fsum(values) - r) / (n - 1) if n > 1 else r)
        else:
            baseline.append(mean)
        std.append(math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0)
    return baseline, std


def _reference_token_losses(case: LossCase, low: float, high: float) -> list[list[float]]:
    lp, prev, mask = case["logprobs"].tolist(), case["prev_logprobs"].tolist(), case["mask"].tolist()
    adv = case["advantages"].tolist()
    weights = case["importance_weights"].tolist() if "importance_weights" in case else None
    out = []
    for b, row in enumerate(lp):
        losses = []
        for t in range(len(row)):
            if not float(mask[b][t]):
                losses.append(0.0)
                continue
            a = adv[b][t] if isinstance(adv[b], list) else adv[b]
            ratio = math.exp(lp[b][t] - prev[b][t])
            clipped = min(max(ratio, 1 - low), 1 + high)
            losses.append(-min(ratio * a, clipped * a) * (1.0 if weights is None else weights[b][t]))
        out.append(losses)
    return out


def _reference_loss(case: LossCase, low: float, high: float, level: str, normalizer: float | None) -> float:
    losses = _reference_token_losses(case, low, high)
    weights = [[float(w) for w in row] for row in case["mask"].tolist()]
    if level == "token":
        total = math.fsum(l * w for lrow, wrow in zip(losses, weights) for l, w in zip(lrow, wrow))
        count = math.fsum(w for row in weights for w in row)
        denominator = normalizer if normalizer is not None else count
        return total / denominator if denominator else 0.0
    means = [
        math.fsum(l * w for l, w in zip(lrow, wrow)) / math.fsum(wrow)
        for lrow, wrow in zip(losses, weights)
        if math.fsum(wrow)
    ]
    denominator = normalizer if normalizer is not None else len(means)
    return math.fsum(means) / denominator if denominator else 0.0


def _single_token(ratio: float, advantage: float) -> LossCase:
    return {
        "logprobs": torch.tensor([[math.log(ratio)]], dtype=torch.float64),
        "prev_logprobs": torch.zeros(1, 1, dtype=torch.float64),
        "advantages": torch.tensor([advantage], dtype=torch.float64),
        "mask": torch.ones(1, 1, dtype=torch.bool),
    }


# ---------------------------------------------------------------- group_baseline / grpo_advantages


@settings(max_examples=40)
@given(grouped_rewards(), st.booleans())
def test_group_baseline_matches_loop_reference(case: GroupCase, leave_one_out: bool) -> None:
    """baseline and std equal a plain per-group loop (mean or leave-one-out mean; unbiased std, 0 for singletons)."""
    rewards, ids = case
    baseline, std = group_baseline(rewards, ids, leave_one_out=leave_one_out)
    ref_baseline, ref_std = _reference_baseline(rewards.tolist(), ids, leave_one_out)
    torch.testing.assert_close(baseline, torch.tensor(ref_baseline, dtype=torch.float64), **CLOSE)
    torch.testing.assert_close(std, torch.tensor(ref_std, dtype=torch.float64), **CLOSE)


@settings(max_examples=40)
@given(grouped_rewards())
def test_group_baseline_accepts_tensor_ids_like_lists(case: GroupCase) -> None:
    """An int64 tensor of ids gives exactly what the same ids as a list give."""
    rewards, ids = case
    for a, b in zip(group_baseline(rewards, torch.tensor(ids)), group_baseline(rewards, ids)):
        assert torch.equal(a, b)


@settings(max_examples=40)
@given(grouped_rewards(), st.booleans())
def test_grpo_advantages_constant_groups_are_exactly_zero(case: GroupCase, leave_one_out: bool) -> None:
    """A group whose rewards are all equal (singletons included) gets std exactly 0 and advantages exactly 0."""
    rewards, ids = case
    baseline, std = group_baseline(rewards, ids, leave_one_out=leave_one_out)
    advantages = grpo_advantages(rewards, baseline, std)
    groups = _members(rewards.tolist(), ids)
    for i, g in enumerate(ids):
        if len(set(groups[g])) == 1:
            assert std[i].item() == 0.0 and advantages[i].item() == 0.0


@settings(max_examples=40)
@given(grouped_rewards())
def test_grpo_advantages_unnormalized_have_zero_group_mean(case: GroupCase) -> None:
    """Without std normalisation (and without leave-one-out) the advantages of each group sum to 0."""
    rewards, ids = case
    advantages = grpo_advantages(rewards, *group_baseline(rewards, ids), normalize_by_std=False)
    per_group: dict[int, list[float]] = defaultdict(list)
    for a, g in zip(advantages.tolist(), ids):
        per_group[g].append(a)
    for values in per_group.values():
        assert abs(math.fsum(values)) <= 1e-9 * len(values) * (1 + max(abs(v) for v in values))


@settings(max_examples=40)
@given(grouped_rewards())
def test_grpo_advantages_leave_one_out_scales_mean_advantage(case: GroupCase) -> None:
    """RLOO identity: r_i - loo_baseline_i == n/(n-1) * (r_i - mean_g) for groups of n > 1."""
    rewards, ids = case
    plain = grpo_advantages(rewards, *group_baseline(rewards, ids), normalize_by_std=False)
    loo = grpo_advantages(rewards, *group_baseline(rewards, ids, leave_one_out=True), normalize_by_std=False)
    sizes = {g: ids.count(g) for g in ids}
    scale = torch.tensor([sizes[g] / (sizes[g] - 1) if sizes[g] > 1 else 0.0 for g in ids], dtype=torch.float64)
    torch.testing.assert_close(loo, plain * scale, **CLOSE)


@settings(max_examples=40)
@given(grouped_rewards(), st.floats(1e-6, 1e-1))
def test_grpo_advantages_normalized_formula(case: GroupCase, epsilon: float) -> None:
    """Normalised advantages are (r - b) / (std + eps); a group's normalised std is std / (std + eps)."""
    rewards, ids = case
    baseline, std = group_baseline(rewards, ids)
    advantages = grpo_advantages(rewards, baseline, std, epsilon=epsilon)
    torch.testing.assert_close(advantages, (rewards - baseline) / (std + epsilon), **CLOSE)
    _, adv_std = group_baseline(advantages, ids)
    torch.testing.assert_close(adv_std, std / (std + epsilon), **CLOSE)


@settings(max_examples=40)
@given(grouped_rewards(), st.booleans(), st.data())
def test_group_statistics_are_permutation_equivariant(case: GroupCase, leave_one_out: bool, data: st.DataObject) -> None:
    """Permuting rows permutes baseline, std, advantages and the DAPO mask the same way."""
    rewards, ids = case
    perm = data.draw(st.permutations(list(range(len(ids)))))
    index = torch.tensor(perm, dtype=torch.int64)
    baseline, std = group_baseline(rewards, ids, leave_one_out=leave_one_out)
    p_baseline, p_std = group_baseline(rewards[index], [ids[i] for i in perm], leave_one_out=leave_one_out)
    torch.testing.assert_close(p_baseline, baseline[index], **CLOSE)
    torch.testing.assert_close(p_std, std[index], **CLOSE)
    torch.testing.assert_close(
        grpo_advantages(rewards[index], p_baseline, p_std), grpo_advantages(rewards, baseline, std)[index], **CLOSE
    )
    assert torch.equal(dapo_keep_mask(rewards[index], [ids[i] for i in perm]), dapo_keep_mask(rewards, ids)[index])


@settings(max_examples=40)
@given(grouped_rewards())
def test_group_functions_do_not_mutate_inputs(case: GroupCase) -> None:
    """group_baseline, grpo_advantages and dapo_keep_mask leave their input tensors unchanged."""
    rewards, ids = case
    ids_tensor = torch.tensor(ids)
    before, before_ids = rewards.clone(), ids_tensor.clone()
    baseline, std = group_baseline(rewards, ids_tensor, leave_one_out=True)
    b0, s0 = baseline.clone(), std.clone()
    grpo_advantages(rewards, baseline, std)
    dapo_keep_mask(rewards, ids_tensor)
    assert torch.equal(rewards, before) and torch.equal(ids_tensor, before_ids)
    assert torch.equal(baseline, b0) and torch.equal(std, s0)


def test_group_baseline_concrete_and_empty() -> None:
    """A worked example (including a singleton under leave-one-out), and an empty batch gives empty outputs."""
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    baseline, std = group_baseline(rewards, [7, 7, -2, 7], leave_one_out=True)
    assert baseline.tolist() == [0.5, 1.0, 3.0, 0.5]
    assert std[2].item() == 0.0 and std[0].item() == pytest.approx(math.sqrt(1 / 3))
    empty_b, empty_s = group_baseline(torch.zeros(0), [])
    assert empty_b.shape == (0,) and empty_s.shape == (0,)


def test_group_baseline_rejects_bad_rewards() -> None:
    """rewards must be a 1-D floating tensor."""
    with pytest.raises(TypeError, match=r"'rewards' must be a torch.Tensor: got list"):
        group_baseline([1.0, 2.0], [0, 0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'rewards' must have a floating dtype: got torch.int64; pass rewards.float\(\)"):
        group_baseline(torch.tensor([1, 2]), [0, 0])
    with pytest.raises(ValueError, match=r"'rewards' must be 1-D of shape \[N\] \(one reward per row\): got shape \(2, 1\)"):
        group_baseline(torch.zeros(2, 1), [0, 0])


def test_group_baseline_rejects_bad_group_ids() -> None:
    """group_ids must be integers, one per reward."""
    rewards = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'group_ids' must have shape \(3,\) \(one id per reward\): got \(2,\)"):
        group_baseline(rewards, [0, 1])
    with pytest.raises(TypeError, match=r"'group_ids' must have an integer dtype: got torch.float32; pass group_ids.long\(\)"):
        group_baseline(rewards, torch.zeros(3))
    with pytest.raises(TypeError, match=r"'group_ids' entries must be int: got float at index 1"):
        group_baseline(rewards, [0, 1.5, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"'group_ids' must be an integer tensor or a sequence of ints: got str"):
        group_baseline(rewards, "abc")  # type: ignore[arg-type]


def test_grpo_advantages_rejects_bad_arguments() -> None:
    """baseline and std must match rewards' shape; epsilon must be a positive finite number."""
    r = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'baseline' must have shape \(3,\) \(same as 'rewards'\): got \(2,\)"):
        grpo_advantages(r, torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"'std' must have shape \(3,\) \(same as 'rewards'\): got \(3, 1\)"):
        grpo_advantages(r, torch.zeros(3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"'epsilon' must be finite and in \(0.0, inf\): got 0.0"):
        grpo_advantages(r, r, r, epsilon=0.0)
    with pytest.raises(TypeError, match=r"'epsilon' must be a real number: got str"):
        grpo_advantages(r, r, r, epsilon="1e-6")  # type: ignore[arg-type]


# ---------------------------------------------------------------- dapo_keep_mask


@settings(max_examples=40)
@given(grouped_rewards())
def test_dapo_keep_mask_keeps_exactly_non_constant_groups(case: GroupCase) -> None:
    """At eps=0 a row is kept iff its group's rewards are not all equal."""
    rewards, ids = case
    groups = _members(rewards.tolist(), ids)
    expected = [len(set(groups[g])) > 1 for g in ids]
    assert dapo_keep_mask(rewards, ids).tolist() == expected


@settings(max_examples=40)
@given(grouped_rewards(), st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_dapo_keep_mask_is_monotone_in_eps(case: GroupCase, eps_a: float, eps_b: float) -> None:
    """A larger eps keeps a subset of the rows a smaller eps keeps, and whole groups at a time."""
    rewards, ids = case
    small, large = sorted((eps_a, eps_b))
    keep_small, keep_large = dapo_keep_mask(rewards, ids, eps=small), dapo_keep_mask(rewards, ids, eps=large)
    assert not (keep_large & ~keep_small).any()
    verdict: dict[int, bool] = {}
    for kept, g in zip(keep_large.tolist(), ids):
        assert verdict.setdefault(g, kept) == kept


def test_dapo_keep_mask_threshold_example() -> None:
    """eps drops a varying group whose std is below it: std([0, 1]) ~ 0.707, std([0, 4]) ~ 2.83."""
    rewards = torch.tensor([0.0, 1.0, 0.0, 4.0, 2.0, 2.0])
    assert dapo_keep_mask(rewards, [0, 0, 1, 1, 2, 2], eps=1.0).tolist() == [False, False, True, True, False, False]


def test_dapo_keep_mask_rejects_bad_arguments() -> None:
    """eps must be a non-negative number; group ids must match rewards."""
    with pytest.raises(ValueError, match=r"'eps' must be finite and in \[0.0, inf\): got -0.1"):
        dapo_keep_mask(torch.zeros(2), [0, 0], eps=-0.1)
    with pytest.raises(ValueError, match=r"'group_ids' must have shape \(2,\) \(one id per reward\): got \(3,\)"):
        dapo_keep_mask(torch.zeros(2), [0, 0, 1])


# ---------------------------------------------------------------- clipped_policy_loss


@settings(max_examples=30)
@given(policy_loss_inputs(), clip_ranges, st.sampled_from(["token", "sequence"]))
def test_clipped_policy_loss_matches_loop_reference(case: LossCase, clips: tuple[float, float], level: str) -> None:
    """The loss equals a naive per-token loop at token and sequence level."""
    low, high = clips
    loss, _ = clipped_policy_loss(**case, clip_low=low, clip_high=high, level=level)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(_reference_loss(case, low, high, level, None), rel=1e-9, abs=1e-9)


@settings(max_examples=30)
@given(policy_loss_inputs(), st.sampled_from(["token", "sequence"]), st.floats(0.5, 50.0))
def test_clipped_policy_loss_normalizer_replaces_count(case: LossCase, level: str, normalizer: float) -> None:
    """With a normalizer, the loss is the masked sum (of tokens or per-sequence means) divided by it."""
    loss, _ = clipped_policy_loss(**case, level=level, normalizer=normalizer)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(_reference_loss(case, 0.2, 0.2, level, normalizer), rel=1e-9, abs=1e-9)


@settings(max_examples=30)
@given(policy_loss_inputs(max_batch=6), st.sampled_from(["token", "sequence"]), st.data())
def test_clipped_policy_loss_global_normalisation_adds_up(case: LossCase, level: str, data: st.DataObject) -> None:
    """Split into micro-batches, each normalised by the global count, the losses add up to the full-batch loss."""
    batch = case["logprobs"].shape[0]
    cut = data.draw(st.integers(0, batch))
    weights = case["mask"].to(torch.float64)
    count = weights.sum().item() if level == "token" else float((weights.sum(-1) != 0).sum().item())
    full, _ = clipped_policy_loss(**case, level=level)  # type: ignore[arg-type]
    parts = [
        clipped_policy_loss(**{k: v[rows] for k, v in case.items()}, level=level, normalizer=count or 1.0)[0]  # type: ignore[arg-type]
        for rows in (slice(0, cut), slice(cut, batch))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-9, abs=1e-12)


@settings(max_examples=40)
@given(clip_ranges, st.floats(-3.0, 3.0), st.floats(0.0, 1.0))
def test_clipped_policy_loss_inside_clip_range_is_unclipped(clips: tuple[float, float], advantage: float, where: float) -> None:
    """For ratio in [1 - low, 1 + high] the per-token loss is -ratio * A and no token counts as clipped."""
    low, high = clips
    ratio = (1 - low) + where * (low + high)
    loss, metrics = clipped_policy_loss(**_single_token(ratio, advantage), clip_low=low, clip_high=high)
    assert loss.item() == pytest.approx(-ratio * advantage, rel=1e-9, abs=1e-12)
    if 1e-6 < where < 1 - 1e-6:  # exp(log(ratio)) may round across a bound it sits on
        assert metrics["clip_fraction"].item() == 0.0


@settings(max_examples=40)
@given(clip_ranges, st.floats(0.01, 3.0), st.floats(1e-3, 2.0), st.booleans(), st.booleans())
def test_clipped_policy_loss_outside_clip_range_is_pessimistic(
    clips: tuple[float, float], magnitude: float, overshoot: float, above: bool, positive: bool
) -> None:
    """Outside the range the loss is the larger (pessimistic) of the clipped and unclipped terms."""
    low, high = clips
    ratio = (1 + high) * (1 + overshoot) if above else (1 - low) * math.exp(-overshoot)
    advantage = magnitude if positive else -magnitude
    loss, metrics = clipped_policy_loss(**_single_token(ratio, advantage), clip_low=low, clip_high=high)
    bound = 1 + high if above else 1 - low
    clipped_wins = above == positive  # clip caps the gain: above with A > 0, below with A < 0
    expected = -bound * advantage if clipped_wins else -ratio * advantage
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert loss.item() >= max(-ratio * advantage, -bound * advantage) - 1e-12
    assert metrics["clip_fraction"].item() == (1.0 if clipped_wins and bound > 0 else 0.0)
    side = "clip_fraction_high" if above else "clip_fraction_low"
    assert metrics[side].item() == (1.0 if clipped_wins else 0.0)


@settings(max_examples=30)
@given(policy_loss_inputs(), clip_ranges)
def test_clipped_policy_loss_gradient_vanishes_on_clipped_and_masked_tokens(case: LossCase, clips: tuple[float, float]) -> None:
    """d loss / d logprobs is 0 on masked tokens and where the clipped term is active, non-zero elsewhere (A != 0)."""
    low, high = clips
    logprobs = case["logprobs"].clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(**{**case, "logprobs": logprobs}, clip_low=low, clip_high=high)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = torch.exp(case["logprobs"] - case["prev_logprobs"])
    adv = case["advantages"] if case["advantages"].dim() == 2 else case["advantages"].unsqueeze(-1).expand_as(ratio)
    clipped = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0))
    masked = case["mask"].to(torch.float64) == 0
    assert (grad[clipped | masked] == 0).all()
    live = ~clipped & ~masked & (adv != 0)
    assert (grad[live] != 0).all()


@settings(max_examples=30)
@given(policy_loss_inputs(), st.sampled_from(["token", "sequence"]))
def test_clipped_policy_loss_ignores_masked_values(case: LossCase, level: str) -> None:
    """Putting -inf / NaN at masked positions changes neither the loss, the metrics nor the gradient."""
    masked = case["mask"].to(torch.float64) == 0
    poisoned = {
        "logprobs": case["logprobs"].masked_fill(masked, -math.inf),
        "prev_logprobs": case["prev_logprobs"].masked_fill(masked, math.nan),
    }
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = poisoned["logprobs"].clone().requires_grad_(True)
    loss_a, metrics_a = clipped_policy_loss(**{**case, "logprobs": lp_a}, level=level)  # type: ignore[arg-type]
    loss_b, metrics_b = clipped_policy_loss(**{**case, **poisoned, "logprobs": lp_b}, level=level)  # type: ignore[arg-type]
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)
    assert torch.equal(torch.autograd.grad(loss_a, lp_a)[0], torch.autograd.grad(loss_b, lp_b)[0])


@settings(max_examples=40)
@given(policy_loss_inputs())
def test_clipped_policy_loss_does_not_mutate_inputs(case: LossCase) -> None:
    """The loss leaves every input tensor unchanged."""
    before = {k: v.clone() for k, v in case.items()}
    clipped_policy_loss(**case)
    assert all(torch.equal(case[k], before[k]) for k in case)


@settings(max_examples=30)
@given(weighted_policy_loss_inputs(), clip_ranges, st.sampled_from(["token", "sequence"]))
def test_clipped_policy_loss_importance_weights_match_loop_reference(
    case: LossCase, clips: tuple[float, float], level: str
) -> None:
    """With importance_weights, each token's loss is multiplied by its weight before the reduction."""
    low, high = clips
    loss, _ = clipped_policy_loss(**case, clip_low=low, clip_high=high, level=level)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(_reference_loss(case, low, high, level, None), rel=1e-9, abs=1e-9)


@settings(max_examples=30)
@given(policy_loss_inputs(), clip_ranges, st.sampled_from(["token", "sequence"]))
def test_clipped_policy_loss_unit_importance_weights_change_nothing(
    case: LossCase, clips: tuple[float, float], level: str
) -> None:
    """All-ones importance weights give bitwise the loss, gradient and metrics of no weights."""
    low, high = clips
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = case["logprobs"].clone().requires_grad_(True)
    ones = torch.ones_like(case["logprobs"])
    loss_a, m_a = clipped_policy_loss(**{**case, "logprobs": lp_a}, clip_low=low, clip_high=high, level=level)  # type: ignore[arg-type]
    loss_b, m_b = clipped_policy_loss(
        **{**case, "logprobs": lp_b}, clip_low=low, clip_high=high, level=level, importance_weights=ones  # type: ignore[arg-type]
    )
    assert torch.equal(loss_a, loss_b)
    assert m_a.keys() == m_b.keys() and all(torch.equal(m_a[k], m_b[k]) for k in m_a)
    assert torch.equal(torch.autograd.grad(loss_a, lp_a)[0], torch.autograd.grad(loss_b, lp_b)[0])


@settings(max_examples=30)
@given(weighted_policy_loss_inputs(), st.sampled_from(["token", "sequence"]))
def test_clipped_policy_loss_importance_weights_are_constants_ignored_where_masked(case: LossCase, level: str) -> None:
    """No gradient flows into the weights, and -inf / NaN weights at masked positions change neither loss nor gradient."""
    masked = case["mask"].to(torch.float64) == 0
    weights = case["importance_weights"].clone().requires_grad_(True)
    poisoned = case["importance_weights"].masked_fill(masked, math.nan)
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = case["logprobs"].clone().requires_grad_(True)
    loss_a, _ = clipped_policy_loss(**{**case, "logprobs": lp_a, "importance_weights": weights}, level=level)  # type: ignore[arg-type]
    loss_b, _ = clipped_policy_loss(**{**case, "logprobs": lp_b, "importance_weights": poisoned}, level=level)  # type: ignore[arg-type]
    assert torch.equal(loss_a, loss_b)
    grad_a, grad_weights = torch.autograd.grad(loss_a, [lp_a, weights], allow_unused=True)
    assert grad_weights is None
    assert torch.equal(grad_a, torch.autograd.grad(loss_b, lp_b)[0])


def test_clipped_policy_loss_rejects_bad_importance_weights() -> None:
    """importance_weights must be floating, of the logprobs' shape, finite and >= 0 where the mask selects."""
    lp, adv, mask = torch.zeros(2, 3), torch.ones(2), torch.tensor([[True, True, False], [True, True, True]])
    with pytest.raises(TypeError, match=r"'importance_weights' must have a floating dtype: got torch.int64; pass importance_weights.float\(\)"):
        clipped_policy_loss(lp, lp, adv, mask, importance_weights=torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"'importance_weights' must have shape \(2, 3\) \(same as 'logprobs'\): got \(2,\)"):
        clipped_policy_loss(lp, lp, adv, mask, importance_weights=torch.ones(2))
    bad = torch.ones(2, 3)
    bad[0, 2] = math.inf  # masked: ignored
    bad[1, 1] = math.nan
    with pytest.raises(ValueError, match=r"'importance_weights' must be finite and >= 0 where 'mask' is non-zero: got nan at \[1, 1\]"):
        clipped_policy_loss(lp, lp, adv, mask, importance_weights=bad)
    with pytest.raises(ValueError, match=r"'importance_weights' must be finite and >= 0 where 'mask' is non-zero: got -0.5 at \[0, 1\]"):
        clipped_policy_loss(lp, lp, adv, mask, importance_weights=torch.tensor([[1.0, -0.5, 1.0], [1.0, 1.0, 1.0]]))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clipped_policy_loss_all_zero_mask_is_zero(level: str) -> None:
    """An all-zero mask gives loss 0 (not NaN), zero metrics and a zero, finite gradient."""
    logprobs = torch.full((2, 3), -math.inf).requires_grad_(True)
    loss, metrics = clipped_policy_loss(
        logprobs, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool), level=level  # type: ignore[arg-type]
    )
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    assert torch.equal(torch.autograd.grad(loss, logprobs)[0], torch.zeros(2, 3))


def test_clipped_policy_loss_metrics_are_token_fractions() -> None:
    """clip_fraction counts masked tokens where the clipped term is active; ratio_mean and token_count are local."""
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 0.5, 2.0]]))
    loss, m = clipped_policy_loss(
        logprobs, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.tensor([[True, True, True, False]])
    )
    assert m["clip_fraction"].item() == pytest.approx(2 / 3)
    assert m["clip_fraction_high"].item() == pytest.approx(1 / 3)
    assert m["clip_fraction_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["token_count"].item() == 3.0
    assert loss.item() == pytest.approx(-(1.2 + 1.0 - 0.8) / 3)
    assert not any(v.requires_grad for v in m.values())


def test_clipped_policy_loss_rejects_bad_shapes() -> None:
    """logprobs must be [B, S]; prev_logprobs and mask must match it; advantages must be [B] or [B, S]."""
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'logprobs' must be 2-D of shape \[B, S\]: got shape \(6,\)"):
        clipped_policy_loss(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"'prev_logprobs' must have shape \(2, 3\) \(same as 'logprobs'\): got \(2, 4\)"):
        clipped_policy_loss(lp, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match=r"'advantages' must have shape \(2,\) \(one per sequence\) or \(2, 3\) \(one per token\): got \(3,\)"):
        clipped_policy_loss(lp, lp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"'mask' must have shape \(2, 3\) \(same as the values it masks\): got \(3, 2\)"):
        clipped_policy_loss(lp, lp, torch.zeros(2), mask.T)


def test_clipped_policy_loss_rejects_bad_dtypes() -> None:
    """An integer mask is rejected with the corrected call; log-probs must be floating."""
    lp = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"'mask' must be bool or floating: got torch.int64; pass mask.bool\(\)"):
        clipped_policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"'prev_logprobs' must have a floating dtype: got torch.int64"):
        clipped_policy_loss(lp, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2), torch.ones(2, 3))


def test_clipped_policy_loss_rejects_bad_options() -> None:
    """Clip ranges, level and normalizer are range-checked; normalizer=0 shows the corrected call."""
    lp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"'clip_low' must be finite and in \[0.0, 1.0\]: got 1.5"):
        clipped_policy_loss(lp, lp, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match=r"'clip_high' must be finite and in \[0.0, inf\): got -0.1"):
        clipped_policy_loss(lp, lp, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match=r"'level' must be one of \['token', 'sequence'\]: got 'batch'"):
        clipped_policy_loss(lp, lp, adv, mask, level="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'normalizer' .* got 0; .* pass normalizer=max\(count, 1\)"):
        clipped_policy_loss(lp, lp, adv, mask, normalizer=0)
    with pytest.raises(ValueError, match=r"'normalizer' must be finite and in \(0.0, inf\): got nan"):
        clipped_policy_loss(lp, lp, adv, mask, normalizer=math.nan)
    with pytest.raises(TypeError, match=r"'normalizer' must be a real number: got Tensor"):
        clipped_policy_loss(lp, lp, adv, mask, normalizer=torch.tensor(4.0))  # type: ignore[arg-type]


# ---------------------------------------------------------------- kl_k3 / masked_mean


@settings(max_examples=40)
@given(policy_loss_inputs())
def test_kl_k3_is_non_negative_and_matches_formula(case: LossCase) -> None:
    """k3 = exp(d) - d - 1 with d = ref - lp is >= 0 everywhere, and 0 exactly where lp == ref."""
    lp, ref = case["logprobs"], case["prev_logprobs"]
    kl = kl_k3(lp, ref)
    d = ref - lp
    assert (kl >= 0).all()
    torch.testing.assert_close(kl, torch.exp(d) - d - 1, rtol=1e-9, atol=1e-12)
    assert torch.equal(kl_k3(lp, lp), torch.zeros_like(lp))


@settings(max_examples=40)
@given(st.floats(-1e-6, 1e-6, allow_subnormal=False))
def test_kl_k3_never_negative_from_rounding(delta: float) -> None:
    """For tiny differences in float32, where exp(d) - d - 1 can round negative, k3 stays >= 0."""
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float32)
    assert (kl_k3(lp, lp + delta) >= 0).all()


def test_kl_k3_rejects_bad_arguments() -> None:
    """Shapes must match and both inputs must be floating."""
    with pytest.raises(ValueError, match=r"'ref_logprobs' must have shape \(2, 3\) \(same as 'logprobs'\): got \(2,\)"):
        kl_k3(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(TypeError, match=r"'logprobs' must have a floating dtype: got torch.int64"):
        kl_k3(torch.zeros(2, dtype=torch.int64), torch.zeros(2))


@settings(max_examples=40)
@given(policy_loss_inputs(), st.one_of(st.none(), st.floats(0.5, 20.0)))
def test_masked_mean_matches_loop_reference(case: LossCase, normalizer: float | None) -> None:
    """masked_mean is sum(v * m) / (normalizer or sum(m)), and 0 when nothing is selected."""
    values, mask = case["logprobs"], case["mask"]
    pairs = [(v, float(m)) for v, m in zip(values.flatten().tolist(), mask.flatten().tolist())]
    total, count = math.fsum(v * m for v, m in pairs), math.fsum(m for _, m in pairs)
    denominator = normalizer if normalizer is not None else count
    expected = total / denominator if denominator else 0.0
    assert masked_mean(values, mask, normalizer=normalizer).item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    rows = masked_mean(values, mask, dim=-1)
    for b in range(values.shape[0]):
        assert rows[b].item() == pytest.approx(masked_mean(values[b], mask[b]).item(), rel=1e-12, abs=1e-12)


def test_masked_mean_empty_selection_is_zero() -> None:
    """An all-zero mask gives 0, and a NaN at a masked position is ignored."""
    assert masked_mean(torch.tensor([math.nan, 1.0]), torch.tensor([False, False])).item() == 0.0
    assert masked_mean(torch.tensor([math.nan, 1.0]), torch.tensor([0.0, 2.0])).item() == 1.0


def test_masked_mean_rejects_bad_arguments() -> None:
    """mask must match values' shape; normalizer must be positive."""
    with pytest.raises(ValueError, match=r"'mask' must have shape \(3,\) \(same as the values it masks\): got \(2,\)"):
        masked_mean(torch.zeros(3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"'normalizer' must be finite and in \(0.0, inf\): got -2"):
        masked_mean(torch.zeros(3), torch.ones(3), normalizer=-2)
    with pytest.raises(TypeError, match=r"'values' must be a torch.Tensor: got list"):
        masked_mean([1.0], torch.ones(1))  # type: ignore[arg-type]


@given(
    st.lists(st.floats(-3.0, 0.0), min_size=4, max_size=4),
    st.lists(st.floats(-3.0, 0.0), min_size=4, max_size=4),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 100.0]),
)
def test_masked_kl_k3_is_the_masked_mean_of_k3_and_masked_tokens_never_reach_its_gradient(
    logprobs: list[float], reference: list[float], junk: float
) -> None:
    """Value: masked_mean(kl_k3(...), mask), bit for bit; gradient: finite, 0 at masked tokens, whatever they hold."""
    mask = torch.tensor([True, False, True, False])
    current = torch.tensor(logprobs, requires_grad=True)
    ref = torch.tensor(reference).masked_fill(~mask, junk)
    value = masked_kl_k3(current, ref, mask)
    value.backward()
    assert current.grad is not None
    assert torch.isfinite(current.grad).all() and torch.all(current.grad[~mask] == 0)
    plain = masked_mean(kl_k3(torch.tensor(logprobs), ref), mask)
    assert torch.equal(value.detach(), plain)

