"""Laws and error paths of ``core.off_policy``: the decoupled loss against ``clipped_policy_loss`` and a plain loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.grpo import clipped_policy_loss
from core.off_policy import behaviour_logprobs, decoupled_policy_loss, truncated_importance_weights
from tests.property.strategies import clip_ranges, decoupled_loss_inputs, importance_caps, version_lags

LossCase = dict[str, torch.Tensor]
levels = st.sampled_from(["token", "sequence"])


def _on_policy(case: LossCase) -> LossCase:
    return {**case, "behaviour_logprobs": case["proximal_logprobs"].clone()}


def _clipped_args(case: LossCase) -> dict[str, torch.Tensor]:
    """The arguments of ``clipped_policy_loss`` for a decoupled case (proximal as ``prev_logprobs``)."""
    return {
        "logprobs": case["logprobs"],
        "prev_logprobs": case["proximal_logprobs"],
        "advantages": case["advantages"],
        "mask": case["mask"],
    }


def _grad(loss: torch.Tensor, wrt: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, wrt)[0]


def _poison_masked(case: LossCase) -> LossCase:
    """``case`` with -inf / NaN written at every masked-out token of every log-prob input."""
    masked = case["mask"].to(torch.float64) == 0
    return {
        **case,
        "logprobs": case["logprobs"].masked_fill(masked, -math.inf),
        "proximal_logprobs": case["proximal_logprobs"].masked_fill(masked, math.nan),
        "behaviour_logprobs": case["behaviour_logprobs"].masked_fill(masked, -math.inf),
    }


# ---------------------------------------------------------------- plain-Python reference


def _reference_weight(prox: float, behav: float, cap: float) -> float:
    return min(math.exp(prox - behav), cap)


def _reference_loss(case: LossCase, low: float, high: float, cap: float, level: str) -> float:
    lp, prox, behav = (case[k].tolist() for k in ("logprobs", "proximal_logprobs", "behaviour_logprobs"))
    mask, adv = case["mask"].tolist(), case["advantages"].tolist()
    totals, counts = [], []
    for b, row in enumerate(lp):
        total = count = 0.0
        for t in range(len(row)):
            m = float(mask[b][t])
            if not m:
                continue
            a = adv[b][t] if isinstance(adv[b], list) else adv[b]
            ratio = math.exp(lp[b][t] - prox[b][t])
            clipped = min(max(ratio, 1 - low), 1 + high)
            total += -min(ratio * a, clipped * a) * _reference_weight(prox[b][t], behav[b][t], cap) * m
            count += m
        totals.append(total)
        counts.append(count)
    if level == "token":
        return math.fsum(totals) / math.fsum(counts) if math.fsum(counts) else 0.0
    means = [t / c for t, c in zip(totals, counts) if c]
    return math.fsum(means) / len(means) if means else 0.0


# ---------------------------------------------------------------- truncated_importance_weights


@settings(max_examples=40)
@given(decoupled_loss_inputs(), importance_caps)
def test_truncated_importance_weights_lie_in_zero_to_cap_and_equal_the_ratio_below_it(case: LossCase, cap: float) -> None:
    """Every weight is in [0, is_cap]; selected weights equal exp(prox - behav) where that is <= is_cap, else is_cap; masked ones are 0."""
    prox, behav, mask = case["proximal_logprobs"], case["behaviour_logprobs"], case["mask"]
    w = truncated_importance_weights(prox, behav, mask, is_cap=cap)
    ratio = torch.exp(prox - behav)
    selected = mask.to(torch.float64) != 0
    assert ((w >= 0) & (w <= cap)).all()
    below = selected & (ratio <= cap)
    assert torch.equal(w[below], ratio[below])
    assert (w[selected & (ratio > cap)] == cap).all()
    assert (w[~selected] == 0).all()


@settings(max_examples=30)
@given(decoupled_loss_inputs(), importance_caps)
def test_truncated_importance_weights_ignore_masked_values(case: LossCase, cap: float) -> None:
    """-inf / NaN at masked positions of either log-prob input leave every weight unchanged."""
    poisoned = _poison_masked(case)
    args = ("proximal_logprobs", "behaviour_logprobs", "mask")
    clean = truncated_importance_weights(*(case[k] for k in args), is_cap=cap)
    assert torch.equal(truncated_importance_weights(*(poisoned[k] for k in args), is_cap=cap), clean)


@settings(max_examples=30)
@given(decoupled_loss_inputs(), importance_caps)
def test_truncated_importance_weights_are_detached(case: LossCase, cap: float) -> None:
    """The weights carry no autograd history, even from inputs that require grad."""
    prox = case["proximal_logprobs"].clone().requires_grad_(True)
    behav = case["behaviour_logprobs"].clone().requires_grad_(True)
    w = truncated_importance_weights(prox, behav, case["mask"], is_cap=cap)
    assert not w.requires_grad and w.grad_fn is None


def test_truncated_importance_weights_worked_example() -> None:
    """Ratios 1, 4 and 0.25 with cap 2 give 1, 2 and 0.25; a masked -inf gives 0."""
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3]], dtype=torch.float64))
    behav = torch.log(torch.tensor([[0.5, 0.05, 0.4, 0.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_importance_weights(prox, behav, mask, is_cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 0.25, 0.0], rel=1e-12)
    assert w.dtype == torch.float64


def test_truncated_importance_weights_rejects_a_bad_cap() -> None:
    """is_cap must be a finite real number >= 1."""
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"'is_cap' must be finite and in \[1.0, inf\): got 0.5"):
        truncated_importance_weights(lp, lp, mask, is_cap=0.5)
    with pytest.raises(ValueError, match=r"'is_cap' must be finite and in \[1.0, inf\): got inf"):
        truncated_importance_weights(lp, lp, mask, is_cap=math.inf)
    with pytest.raises(TypeError, match=r"'is_cap' must be a real number: got str"):
        truncated_importance_weights(lp, lp, mask, is_cap="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"truncated_importance_weights\(\) missing 1 required keyword-only argument: 'is_cap'"):
        truncated_importance_weights(lp, lp, mask)  # type: ignore[call-arg]


def test_truncated_importance_weights_rejects_bad_tensors() -> None:
    """Both log-prob inputs must be floating [B, S] of one shape; the mask must match them."""
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'proximal_logprobs' must be 2-D of shape \[B, S\]: got shape \(6,\)"):
        truncated_importance_weights(torch.zeros(6), torch.zeros(6), torch.ones(6), is_cap=2.0)
    with pytest.raises(ValueError, match=r"'behaviour_logprobs' must have shape \(2, 3\) \(same as 'proximal_logprobs'\): got \(3, 2\)"):
        truncated_importance_weights(lp, lp.T, torch.ones(2, 3), is_cap=2.0)
    with pytest.raises(TypeError, match=r"'behaviour_logprobs' must have a floating dtype: got torch.int64"):
        truncated_importance_weights(lp, torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), is_cap=2.0)
    with pytest.raises(TypeError, match=r"'mask' must be bool or floating: got torch.int64; pass mask.bool\(\)"):
        truncated_importance_weights(lp, lp, torch.ones(2, 3, dtype=torch.int64), is_cap=2.0)


# ---------------------------------------------------------------- behaviour_logprobs


@settings(max_examples=40)
@given(decoupled_loss_inputs(), st.data())
def test_behaviour_logprobs_takes_generation_rows_exactly_where_the_lag_is_positive(case: LossCase, data: st.DataObject) -> None:
    """Row b is bitwise the generation row when version_lag[b] > 0 and the proximal row when it is 0."""
    gen, prox = case["behaviour_logprobs"], case["proximal_logprobs"]
    lag = data.draw(version_lags(gen.shape[0]))
    out = behaviour_logprobs(gen, prox, lag)
    for b, row_lag in enumerate(lag.tolist()):
        assert torch.equal(out[b], gen[b] if row_lag > 0 else prox[b])


@settings(max_examples=30)
@given(decoupled_loss_inputs(), st.integers(1, 5), st.sampled_from([torch.int64, torch.int32, torch.float32]))
def test_behaviour_logprobs_zero_lag_is_proximal_and_positive_lag_is_generation(
    case: LossCase, lag: int, dtype: torch.dtype
) -> None:
    """All-zero lags return the proximal log-probs exactly; all-positive lags the generation log-probs exactly."""
    gen, prox = case["behaviour_logprobs"], case["proximal_logprobs"]
    rows = gen.shape[0]
    assert torch.equal(behaviour_logprobs(gen, prox, torch.zeros(rows, dtype=dtype)), prox)
    assert torch.equal(behaviour_logprobs(gen, prox, torch.full((rows,), lag, dtype=dtype)), gen)


def test_behaviour_logprobs_accepts_a_sequence_of_ints() -> None:
    """A list of int lags gives what the same lags as a tensor give; a lag-0 row gets importance weight exactly 1."""
    gen, prox = torch.full((3, 2), -1.0, dtype=torch.float64), torch.full((3, 2), -2.0, dtype=torch.float64)
    out = behaviour_logprobs(gen, prox, [0, 2, 0])
    assert torch.equal(out, behaviour_logprobs(gen, prox, torch.tensor([0, 2, 0])))
    w = truncated_importance_weights(prox, out, torch.ones(3, 2), is_cap=4.0)
    assert w[[0, 2]].eq(1.0).all() and w[1].eq(math.exp(-1.0)).all()


def test_behaviour_logprobs_rejects_bad_lags() -> None:
    """version_lag must be [B], non-negative (NaN rejected), and integer or floating."""
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'version_lag' entries must be >= 0: got -1 at index 1"):
        behaviour_logprobs(lp, lp, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match=r"'version_lag' entries must be >= 0: got nan at index 0"):
        behaviour_logprobs(lp, lp, torch.tensor([math.nan, 1.0]))
    with pytest.raises(ValueError, match=r"'version_lag' entries must be >= 0: got -2 at index 0"):
        behaviour_logprobs(lp, lp, [-2, 0])
    with pytest.raises(ValueError, match=r"'version_lag' must have shape \(2,\) \(one lag per row\): got \(2, 1\)"):
        behaviour_logprobs(lp, lp, torch.zeros(2, 1))
    with pytest.raises(TypeError, match=r"'version_lag' must have an integer or floating dtype: got torch.bool; pass version_lag.long\(\)"):
        behaviour_logprobs(lp, lp, torch.tensor([True, False]))
    with pytest.raises(TypeError, match=r"'version_lag' must be a tensor or a sequence of ints: got int"):
        behaviour_logprobs(lp, lp, 1)  # type: ignore[arg-type]


def test_behaviour_logprobs_rejects_bad_logprobs() -> None:
    """Both log-prob inputs must be floating [B, S] of one shape."""
    with pytest.raises(ValueError, match=r"'generation_logprobs' must have shape \(2, 3\) \(same as 'proximal_logprobs'\): got \(2, 4\)"):
        behaviour_logprobs(torch.zeros(2, 4), torch.zeros(2, 3), [0, 0])
    with pytest.raises(TypeError, match=r"'generation_logprobs' must have a floating dtype: got torch.int64"):
        behaviour_logprobs(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), [0, 0])


# ---------------------------------------------------------------- decoupled_policy_loss


@settings(max_examples=40)
@given(decoupled_loss_inputs(), clip_ranges, importance_caps, levels)
def test_decoupled_policy_loss_on_policy_is_clipped_policy_loss_bitwise(
    case: LossCase, clips: tuple[float, float], cap: float, level: str
) -> None:
    """With behaviour == proximal, loss, gradient and shared metrics equal clipped_policy_loss's bitwise, for any is_cap >= 1."""
    case = _on_policy(case)
    low, high = clips
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = case["logprobs"].clone().requires_grad_(True)
    loss_a, m_a = decoupled_policy_loss(**{**case, "logprobs": lp_a}, clip_low=low, clip_high=high, is_cap=cap, level=level)  # type: ignore[arg-type]
    loss_b, m_b = clipped_policy_loss(**{**_clipped_args(case), "logprobs": lp_b}, clip_low=low, clip_high=high, level=level)  # type: ignore[arg-type]
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(_grad(loss_a, lp_a), _grad(loss_b, lp_b))
    assert all(torch.equal(m_a[k], m_b[k]) for k in m_b)
    any_token = bool((case["mask"].to(torch.float64) != 0).any())
    assert m_a["is_weight_mean"].item() == (1.0 if any_token else 0.0)
    assert m_a["is_truncated_frac"].item() == 0.0 and m_a["behaviour_kl"].item() == 0.0


@settings(max_examples=30)
@given(decoupled_loss_inputs(), clip_ranges, importance_caps, levels, st.one_of(st.none(), st.floats(0.5, 50.0)))
def test_decoupled_policy_loss_is_clipped_policy_loss_with_truncated_weights(
    case: LossCase, clips: tuple[float, float], cap: float, level: str, normalizer: float | None
) -> None:
    """The loss and gradient are exactly clipped_policy_loss's with importance_weights=truncated_importance_weights(...)."""
    low, high = clips
    options = {"clip_low": low, "clip_high": high, "level": level, "normalizer": normalizer}
    w = truncated_importance_weights(case["proximal_logprobs"], case["behaviour_logprobs"], case["mask"], is_cap=cap)
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = case["logprobs"].clone().requires_grad_(True)
    loss_a, m_a = decoupled_policy_loss(**{**case, "logprobs": lp_a}, is_cap=cap, **options)  # type: ignore[arg-type]
    loss_b, m_b = clipped_policy_loss(**{**_clipped_args(case), "logprobs": lp_b}, importance_weights=w, **options)  # type: ignore[arg-type]
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(_grad(loss_a, lp_a), _grad(loss_b, lp_b))
    assert all(torch.equal(m_a[k], m_b[k]) for k in m_b)


@settings(max_examples=30)
@given(decoupled_loss_inputs(), clip_ranges, importance_caps, levels)
def test_decoupled_policy_loss_matches_loop_reference(
    case: LossCase, clips: tuple[float, float], cap: float, level: str
) -> None:
    """The loss equals a naive per-token loop: clipped surrogate against proximal times min(exp(prox - behav), cap)."""
    low, high = clips
    loss, _ = decoupled_policy_loss(**case, clip_low=low, clip_high=high, is_cap=cap, level=level)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(_reference_loss(case, low, high, cap, level), rel=1e-9, abs=1e-9)


@settings(max_examples=30)
@given(decoupled_loss_inputs(), importance_caps)
def test_decoupled_policy_loss_metrics_match_loop_reference(case: LossCase, cap: float) -> None:
    """is_weight_mean, is_truncated_frac and behaviour_kl are masked token means of w, [ratio > cap] and k3(behav, prox)."""
    _, m = decoupled_policy_loss(**case, is_cap=cap)  # type: ignore[arg-type]
    prox, behav, mask = (case[k].flatten().tolist() for k in ("proximal_logprobs", "behaviour_logprobs", "mask"))
    rows = [(p, b, float(w)) for p, b, w in zip(prox, behav, mask) if float(w)]
    count = math.fsum(w for _, _, w in rows)

    def mean(values: list[float]) -> float:
        return math.fsum(v * w for v, (_, _, w) in zip(values, rows)) / count if count else 0.0

    assert m["is_weight_mean"].item() == pytest.approx(mean([_reference_weight(p, b, cap) for p, b, _ in rows]), rel=1e-9, abs=1e-12)
    assert m["is_truncated_frac"].item() == pytest.approx(mean([float(math.exp(p - b) > cap) for p, b, _ in rows]), abs=1e-12)
    kl = [math.exp(p - b) - (p - b) - 1 for p, b, _ in rows]
    assert m["behaviour_kl"].item() == pytest.approx(mean(kl), rel=1e-9, abs=1e-12)
    assert not any(v.requires_grad for v in m.values())


@settings(max_examples=30)
@given(decoupled_loss_inputs(), importance_caps, levels)
def test_decoupled_policy_loss_ignores_masked_values(case: LossCase, cap: float, level: str) -> None:
    """-inf / NaN at masked positions of any log-prob input change neither the loss, the metrics nor the gradient."""
    poisoned = _poison_masked(case)
    lp_a = case["logprobs"].clone().requires_grad_(True)
    lp_b = poisoned["logprobs"].clone().requires_grad_(True)
    loss_a, m_a = decoupled_policy_loss(**{**case, "logprobs": lp_a}, is_cap=cap, level=level)  # type: ignore[arg-type]
    loss_b, m_b = decoupled_policy_loss(**{**poisoned, "logprobs": lp_b}, is_cap=cap, level=level)  # type: ignore[arg-type]
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(m_a[k], m_b[k]) for k in m_a)
    assert torch.equal(_grad(loss_a, lp_a), _grad(loss_b, lp_b))


@settings(max_examples=30)
@given(decoupled_loss_inputs(), importance_caps)
def test_decoupled_policy_loss_sends_no_gradient_through_the_weight(case: LossCase, cap: float) -> None:
    """No gradient reaches behaviour; proximal's gradient is clipped_policy_loss's w.r.t. prev_logprobs at fixed weights."""
    prox = case["proximal_logprobs"].clone().requires_grad_(True)
    behav = case["behaviour_logprobs"].clone().requires_grad_(True)
    lp = case["logprobs"].clone().requires_grad_(True)
    loss, _ = decoupled_policy_loss(lp, prox, behav, case["advantages"], case["mask"], is_cap=cap)
    grad_prox, grad_behav = torch.autograd.grad(loss, [prox, behav], allow_unused=True)
    assert grad_behav is None
    w = truncated_importance_weights(case["proximal_logprobs"], case["behaviour_logprobs"], case["mask"], is_cap=cap)
    prev = case["proximal_logprobs"].clone().requires_grad_(True)
    reference, _ = clipped_policy_loss(case["logprobs"], prev, case["advantages"], case["mask"], importance_weights=w)
    assert torch.equal(grad_prox, _grad(reference, prev))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_policy_loss_all_zero_mask_is_zero(level: str) -> None:
    """An all-zero mask gives loss 0, zero metrics and a zero gradient, whatever the inputs hold."""
    logprobs = torch.full((2, 3), -math.inf).requires_grad_(True)
    loss, metrics = decoupled_policy_loss(
        logprobs, torch.full((2, 3), math.nan), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool), level=level  # type: ignore[arg-type]
    )
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    assert torch.equal(_grad(loss, logprobs), torch.zeros(2, 3))


def test_decoupled_policy_loss_worked_example() -> None:
    """A stale token with prox/behav ratio e (> cap 2) counts twice; an on-policy one once."""
    lp = torch.zeros(1, 2, dtype=torch.float64)
    behav = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)
    loss, m = decoupled_policy_loss(lp, lp, behav, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), is_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    assert m["is_weight_mean"].item() == pytest.approx(1.5)
    assert m["is_truncated_frac"].item() == 0.5
    assert m["behaviour_kl"].item() == pytest.approx((math.e - 2) / 2)


def test_decoupled_policy_loss_rejects_bad_arguments() -> None:
    """Shapes are checked against 'logprobs' and named; is_cap and the clip options are range-checked."""
    lp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"'logprobs' must be 2-D of shape \[B, S\]: got shape \(6,\)"):
        decoupled_policy_loss(torch.zeros(6), lp, lp, adv, mask)
    with pytest.raises(ValueError, match=r"'proximal_logprobs' must have shape \(2, 3\) \(same as 'logprobs'\): got \(2, 4\)"):
        decoupled_policy_loss(lp, torch.zeros(2, 4), lp, adv, mask)
    with pytest.raises(ValueError, match=r"'behaviour_logprobs' must have shape \(2, 3\) \(same as 'logprobs'\): got \(3,\)"):
        decoupled_policy_loss(lp, lp, torch.zeros(3), adv, mask)
    with pytest.raises(ValueError, match=r"'is_cap' must be finite and in \[1.0, inf\): got 0.9"):
        decoupled_policy_loss(lp, lp, lp, adv, mask, is_cap=0.9)
    with pytest.raises(ValueError, match=r"'clip_low' must be finite and in \[0.0, 1.0\]: got 1.5"):
        decoupled_policy_loss(lp, lp, lp, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match=r"'advantages' must have shape \(2,\) \(one per sequence\) or \(2, 3\) \(one per token\): got \(3,\)"):
        decoupled_policy_loss(lp, lp, lp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"'importance_weights' must be finite and >= 0 where 'mask' is non-zero: got nan at \[0, 0\]"):
        decoupled_policy_loss(lp, torch.full((2, 3), -math.inf), torch.full((2, 3), -math.inf), adv, mask)
