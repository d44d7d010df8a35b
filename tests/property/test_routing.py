"""Laws and error paths of ``core.routing`` (R3 router replay): the routing codec, its checks, replay padding and
the disagreement and mismatch metrics, against plain loops where a reference helps."""

from __future__ import annotations

import doctest
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import core.routing
from core.routing import (
    NO_ROUTE,
    LogprobMismatch,
    RoutingDisagreement,
    check_routing,
    decode_routing,
    encode_routing,
    logprob_mismatch,
    pad_routing_for_replay,
    routing_bytes,
    routing_disagreement,
    routing_dtype,
)
from tests.property.strategies import expert_counts, mismatch_inputs, routing_cases

Case = dict[str, Any]


def _real(case: Case) -> torch.Tensor:
    """[B, S] bool: the real positions of a routing case."""
    width = case["routed"].shape[1]
    return torch.arange(width) < torch.tensor(case["lengths"], dtype=torch.int64).reshape(-1, 1)


def _check(case: Case, routed: torch.Tensor | None = None) -> None:
    check_routing(
        case["routed"] if routed is None else routed,
        case["lengths"],
        num_layers=case["num_layers"],
        topk=case["topk"],
        num_experts=case["num_experts"],
    )


def _first_real(case: Case) -> tuple[int, int] | None:
    """The first real (row, token) of a case, or None when it has no real token."""
    for row, length in enumerate(case["lengths"]):
        if length:
            return row, length - 1
    return None


# ---------------------------------------------------------------- dtype and codec


@given(expert_counts)
def test_routing_dtype_is_the_narrowest_that_holds_every_id(num_experts: int) -> None:
    """routing_dtype(E) holds -1 and E - 1, and the next narrower signed dtype does not hold E - 1."""
    dtype = routing_dtype(num_experts)
    ladder = [torch.int8, torch.int16, torch.int32]
    assert torch.iinfo(dtype).min <= NO_ROUTE and num_experts - 1 <= torch.iinfo(dtype).max
    narrower = ladder[: ladder.index(dtype)]
    assert all(num_experts - 1 > torch.iinfo(d).max for d in narrower)


def test_routing_dtype_boundaries() -> None:
    """int8 holds ids up to 127 (128 experts), int16 up to 32767, int32 up to 2**31 - 1."""
    assert [routing_dtype(e) for e in (1, 128, 129, 32768, 32769, 2**31)] == [
        torch.int8, torch.int8, torch.int16, torch.int16, torch.int32, torch.int32,
    ]


@pytest.mark.parametrize(
    ("num_experts", "error", "message"),
    [
        (0, ValueError, r"'num_experts' must be >= 1: got 0"),
        (-3, ValueError, r"'num_experts' must be >= 1: got -3"),
        (2**31 + 1, ValueError, r"'num_experts' must be <= 2147483648 \(its ids must fit int32\): got 2147483649"),
        (True, TypeError, r"'num_experts' must be an int: got bool"),
        (8.0, TypeError, r"'num_experts' must be an int: got float"),
    ],
)
def test_routing_dtype_rejects_bad_counts(num_experts: Any, error: type, message: str) -> None:
    """An expert count below 1, past int32 or not an int is rejected naming 'num_experts'."""
    with pytest.raises(error, match=message):
        routing_dtype(num_experts)


@given(expert_counts, st.data())
def test_encode_routing_round_trips_every_id(num_experts: int, data: st.DataObject) -> None:
    """decode(encode(x, E)) == x (int64) for -1, 0, E - 1 and random ids; encode stores routing_dtype(E)."""
    drawn = data.draw(st.lists(st.integers(NO_ROUTE, num_experts - 1), max_size=20))
    ids = torch.tensor([NO_ROUTE, 0, num_experts - 1, *drawn], dtype=torch.int64)
    encoded = encode_routing(ids, num_experts)
    assert encoded.dtype == routing_dtype(num_experts)
    decoded = decode_routing(encoded)
    assert decoded.dtype == torch.int64 and torch.equal(decoded, ids)


@pytest.mark.parametrize("num_experts", [1, 2, 127, 128, 129, 300])
def test_encode_routing_round_trips_the_whole_id_range(num_experts: int) -> None:
    """Every id in [-1, E) survives encode then decode, shape kept, input untouched."""
    ids = torch.arange(NO_ROUTE, num_experts).reshape(1, -1, 1)
    before = ids.clone()
    assert torch.equal(decode_routing(encode_routing(ids, num_experts)), ids)
    assert torch.equal(ids, before)


def test_encode_routing_rejects_bad_input() -> None:
    """An id outside [-1, E) names its index; a float or bool tensor is a TypeError."""
    with pytest.raises(ValueError, match=r"'indices' must hold expert ids in \[-1, 8\) \(-1: no route\): got 8 at index \(0, 1\)"):
        encode_routing(torch.tensor([[0, 8]]), 8)
    with pytest.raises(ValueError, match=r"got -2 at index \(0,\)"):
        encode_routing(torch.tensor([-2]), 8)
    with pytest.raises(TypeError, match=r"'indices' must have an integer dtype \(expert ids\): got torch.float32"):
        encode_routing(torch.tensor([1.0]), 8)
    with pytest.raises(TypeError, match=r"'indices' must be a dense integer tensor: got list"):
        encode_routing([1, 2], 8)  # type: ignore[arg-type]


def test_decode_routing_rejects_bad_input() -> None:
    """decode_routing takes integer ids >= -1 only."""
    with pytest.raises(ValueError, match=r"'routed' must hold expert ids >= -1 \(-1: no route\): got -5 at index \(1,\)"):
        decode_routing(torch.tensor([0, -5], dtype=torch.int8))
    with pytest.raises(TypeError, match=r"'routed' must have an integer dtype"):
        decode_routing(torch.tensor([True]))


@given(st.integers(0, 500), st.integers(1, 6), st.integers(1, 4), expert_counts)
def test_routing_bytes_is_the_encoded_tensors_size(tokens: int, layers: int, topk: int, num_experts: int) -> None:
    """routing_bytes equals the bytes of the encoded [tokens, layers, topk] tensor."""
    encoded = encode_routing(torch.zeros(tokens, layers, topk, dtype=torch.int64), num_experts)
    assert routing_bytes(tokens, layers, topk, num_experts) == encoded.numel() * encoded.element_size()


def test_routing_bytes_rejects_bad_sizes() -> None:
    """Negative tokens or a zero size name the argument."""
    with pytest.raises(ValueError, match=r"'num_tokens' must be >= 0: got -1"):
        routing_bytes(-1, 2, 2, 8)
    with pytest.raises(ValueError, match=r"'topk' must be >= 1: got 0"):
        routing_bytes(1, 2, 0, 8)


# ---------------------------------------------------------------- check_routing


@pytest.mark.parametrize("num_experts", [127, 128, 129, 32_767, 32_768, 32_769])
def test_check_routing_and_encode_accept_ids_at_each_dtype_boundary(num_experts: int) -> None:
    """At the expert counts where routing_dtype changes (a dtype that holds E - 1 but not E), an encoded routing
    holding the top id E - 1 passes check_routing, and encoding it again is the identity: the range checks compare
    with E exactly instead of wrapping it into the narrow dtype (128 as int8 is -128)."""
    ids = torch.tensor([[[[0, num_experts - 1]], [[num_experts - 1, 1]], [[NO_ROUTE, NO_ROUTE]]]])  # 3 tokens, top-2
    encoded = encode_routing(ids, num_experts)
    check_routing(encoded, [2], num_layers=1, topk=2, num_experts=num_experts)  # the third token is padding
    assert torch.equal(encode_routing(encoded, num_experts), encoded)
    assert torch.equal(decode_routing(encoded), ids)
    with pytest.raises(ValueError, match=rf"expected expert ids in \[0, {num_experts - 1}\), got {num_experts - 1}"):
        check_routing(encoded, [2], num_layers=1, topk=2, num_experts=num_experts - 1)  # one expert fewer: E - 1 is out


@given(routing_cases())
def test_check_routing_accepts_valid_routings_whatever_the_padding(case: Case) -> None:
    """Distinct in-range experts on every real token pass, padding holding -1, 0 or junk; so does a 3-D row."""
    _check(case)
    spot = _first_real(case)
    if spot is not None:
        row = case["routed"][spot[0], : case["lengths"][spot[0]]]
        check_routing(row, None, num_layers=case["num_layers"], topk=case["topk"], num_experts=case["num_experts"])


@given(routing_cases(), st.data())
def test_check_routing_names_row_token_layer_of_each_fault(case: Case, data: st.DataObject) -> None:
    """An out-of-range id, a -1 or a repeated expert at one real (row, token, layer) is named with both values."""
    spot = _first_real(case)
    if spot is None:
        return
    row, token = spot
    layer = data.draw(st.integers(0, case["num_layers"] - 1))
    experts, topk = case["num_experts"], case["topk"]
    faults = [
        (experts, rf"routed_experts row {row} token {token} layer {layer}: expected expert ids in \[0, {experts}\), got {experts}"),
        (NO_ROUTE, rf"routed_experts row {row} token {token} layer {layer}: expected a route in each of the {topk} "
                   rf"top-k slots \(ids in \[0, {experts}\)\), got -1 \(no route\) in slot 0"),
    ]
    if topk >= 2:
        faults.append(("repeat", rf"routed_experts row {row} token {token} layer {layer}: expected {topk} distinct experts"))
    value, message = data.draw(st.sampled_from(faults))
    routed = case["routed"].clone()
    routed[row, token, layer, 0] = routed[row, token, layer, 1] if value == "repeat" else value
    with pytest.raises(ValueError, match=message):
        _check(case, routed)


def test_check_routing_rejects_bad_shapes_dtypes_and_lengths() -> None:
    """Shape, dtype, lengths and sizes are checked, each error naming its argument with expected and got."""
    routed = torch.tensor([[[[0, 1]], [[2, 3]]]])  # [1, 2, 1, 2]
    sizes = {"num_layers": 1, "topk": 2, "num_experts": 4}
    with pytest.raises(ValueError, match=r"'routed_experts' must have shape \[B, S, 2, 2\] \(\[B, S, num_layers, topk\]\): got \(1, 2, 1, 2\)"):
        check_routing(routed, [2], num_layers=2, topk=2, num_experts=4)
    with pytest.raises(TypeError, match=r"'routed_experts' must have an integer dtype \(expert ids\): got torch.float32"):
        check_routing(routed.float(), [2], **sizes)
    with pytest.raises(ValueError, match=r"'lengths' must have 1 entries \(one per row of 'routed_experts'\): got 2"):
        check_routing(routed, [2, 1], **sizes)
    with pytest.raises(ValueError, match=r"'lengths' entries must be <= 2 \(the width S of 'routed_experts'\): got 3 at index 0"):
        check_routing(routed, [3], **sizes)
    with pytest.raises(ValueError, match=r"'lengths' must be None for a 3-D 'routed_experts'"):
        check_routing(routed[0], [2], **sizes)
    with pytest.raises(ValueError, match=r"'topk' must be in \[1, num_experts \(4\)\]: got 5"):
        check_routing(routed, [2], num_layers=1, topk=5, num_experts=4)
    with pytest.raises(ValueError, match=r"'prompt_routes' must be \[B, S, layers, topk\] or \[T, layers, topk\]: got shape \(2, 2\)"):
        check_routing(routed[0, :, 0], None, field="prompt_routes", **sizes)


# ---------------------------------------------------------------- pad_routing_for_replay


@given(routing_cases())
def test_pad_routing_for_replay_keeps_real_tokens_and_routes_padding(case: Case) -> None:
    """Real positions are unchanged bitwise; every padding position is 0..topk-1; the result has no -1 and every
    position is a valid route; the input is untouched."""
    routed = case["routed"]
    before = routed.clone()
    out = pad_routing_for_replay(routed, case["lengths"])
    real = _real(case)
    assert out.dtype == routed.dtype and out.shape == routed.shape
    assert torch.equal(out[real], routed[real])
    assert torch.equal(out[~real], torch.arange(case["topk"], dtype=routed.dtype).expand_as(routed[~real]))
    assert not bool((out == NO_ROUTE).any())
    _check({**case, "lengths": None}, out)  # every position, padding included, is a valid route
    assert torch.equal(routed, before)


def test_pad_routing_for_replay_rejects_bad_input() -> None:
    """A non-integer tensor or lengths that do not fit name the argument."""
    with pytest.raises(TypeError, match=r"'routed' must have an integer dtype"):
        pad_routing_for_replay(torch.zeros(1, 1, 1, 1), [1])
    with pytest.raises(ValueError, match=r"'lengths' must have 1 entries \(one per row of 'routed'\): got 0"):
        pad_routing_for_replay(torch.zeros(1, 1, 1, 1, dtype=torch.int8), [])


# ---------------------------------------------------------------- routing_disagreement


def _reference_disagreement(a: torch.Tensor, b: torch.Tensor, lengths: list[int]) -> tuple[int, int, int, int]:
    """(tokens, decisions, differing tokens, differing decisions) by a plain loop over sets."""
    tokens = decisions = diff_tokens = diff_decisions = 0
    for row, length in enumerate(lengths):
        for t in range(length):
            tokens += 1
            token_differs = False
            for layer in range(a.shape[2]):
                decisions += 1
                if sorted(a[row, t, layer].tolist()) != sorted(b[row, t, layer].tolist()):
                    diff_decisions += 1
                    token_differs = True
            diff_tokens += token_differs
    return tokens, decisions, diff_tokens, diff_decisions


@given(routing_cases(), routing_cases(), st.data())
def test_routing_disagreement_matches_a_loop_and_bounds_its_shares(case: Case, other: Case, data: st.DataObject) -> None:
    """Counts equal a per-(token, layer) set comparison; decision_share <= token_share <= layers * decision_share."""
    a = case["routed"]
    mix = torch.tensor(data.draw(st.lists(st.booleans(), min_size=a[..., 0].numel(), max_size=a[..., 0].numel())))
    b = a.clone().reshape(-1, a.shape[-1])
    if b.shape[0]:
        junk = torch.randint(0, case["num_experts"], b.shape, generator=torch.Generator().manual_seed(0)).to(b.dtype)
        b = torch.where(mix.reshape(-1, 1), b, junk)
    b = b.reshape(a.shape)
    got = routing_disagreement(a, b, case["lengths"])
    assert (got.tokens, got.decisions, got.differing_tokens, got.differing_decisions) == _reference_disagreement(a, b, case["lengths"])
    layers = a.shape[2]
    assert got.decision_share <= got.token_share + 1e-12
    assert got.token_share <= layers * got.decision_share + 1e-12
    assert 0.0 <= got.decision_share <= 1.0 and 0.0 <= got.token_share <= 1.0


@given(routing_cases(), st.data())
def test_routing_disagreement_of_a_routing_with_itself_is_zero_in_any_slot_order(case: Case, data: st.DataObject) -> None:
    """Identical routings, and routings whose top-k slots are permuted per (token, layer), disagree nowhere."""
    a = case["routed"]
    keys = torch.rand(a.shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1))))
    permuted = a.gather(-1, keys.argsort(dim=-1))
    for b in (a, permuted):
        got = routing_disagreement(a, b, case["lengths"])
        assert (got.token_share, got.decision_share, got.differing_tokens, got.differing_decisions) == (0.0, 0.0, 0, 0)
        assert got.tokens == sum(case["lengths"]) and got.decisions == got.tokens * case["num_layers"]


@given(routing_cases())
def test_routing_disagreement_never_reads_padding(case: Case) -> None:
    """Changing only padding positions changes no count."""
    a = case["routed"]
    b = torch.where(_real(case)[:, :, None, None], a, torch.full_like(a, 7))
    assert routing_disagreement(a, b, case["lengths"]) == routing_disagreement(a, a, case["lengths"])


def test_routing_disagreement_rejects_bad_input() -> None:
    """Shapes must agree; RoutingDisagreement rejects counts that contradict each other."""
    a = torch.zeros(1, 2, 1, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"'replayed' must have shape \(1, 2, 1, 2\) \(same as 'recorded'\)"):
        routing_disagreement(a, torch.zeros(1, 2, 1, 1, dtype=torch.int8), [2])
    with pytest.raises(TypeError, match=r"'replayed' must have an integer dtype"):
        routing_disagreement(a, a.float(), [2])
    with pytest.raises(ValueError, match=r"'differing_decisions' must be >= differing_tokens \(2; .*\): got 1"):
        RoutingDisagreement(tokens=3, decisions=6, differing_tokens=2, differing_decisions=1)
    with pytest.raises(ValueError, match=r"'differing_tokens' must be <= tokens \(1\): got 2"):
        RoutingDisagreement(tokens=1, decisions=6, differing_tokens=2, differing_decisions=2)
    with pytest.raises(ValueError, match=r"'tokens' must be >= 0: got -1"):
        RoutingDisagreement(tokens=-1, decisions=0, differing_tokens=0, differing_decisions=0)
    assert RoutingDisagreement(0, 0, 0, 0).token_share == 0.0


# ---------------------------------------------------------------- logprob_mismatch


def _reference_mismatch(case: dict[str, torch.Tensor]) -> tuple[float, float]:
    abs_sum = k3_sum = weight = 0.0
    for t, r, w in zip(case["train_logprobs"].flatten().tolist(), case["rollout_logprobs"].flatten().tolist(),
                       case["mask"].to(torch.float64).flatten().tolist()):
        if w:
            d = t - r
            abs_sum += abs(d) * w
            k3_sum += (math.exp(d) - 1 - d) * w
            weight += w
    return (abs_sum / weight, k3_sum / weight) if weight else (0.0, 0.0)


@given(mismatch_inputs())
@settings(max_examples=60)
def test_logprob_mismatch_matches_a_loop_and_k3_is_non_negative(case: dict[str, torch.Tensor]) -> None:
    """Both means equal a plain loop over the masked tokens; k3 >= 0; the absolute gap is symmetric."""
    got = logprob_mismatch(**case)
    want_abs, want_k3 = _reference_mismatch(case)
    assert got.mean_abs_diff == pytest.approx(want_abs, rel=1e-9, abs=1e-12)
    assert got.k3_kl == pytest.approx(want_k3, rel=1e-9, abs=1e-12)
    assert got.k3_kl >= 0.0
    swapped = logprob_mismatch(case["rollout_logprobs"], case["train_logprobs"], case["mask"])
    assert swapped.mean_abs_diff == got.mean_abs_diff and swapped.tokens == got.tokens


@given(mismatch_inputs())
def test_logprob_mismatch_is_zero_for_equal_logprobs_and_ignores_masked_tokens(case: dict[str, torch.Tensor]) -> None:
    """Equal log-probs give 0 and 0; -inf or NaN at masked-out tokens change nothing."""
    train, mask = case["train_logprobs"], case["mask"]
    assert logprob_mismatch(train, train.clone(), mask) == LogprobMismatch(0.0, 0.0, int((mask != 0).sum()))
    masked = mask.to(torch.float64) == 0
    poisoned = logprob_mismatch(train.masked_fill(masked, -math.inf), case["rollout_logprobs"].masked_fill(masked, math.nan), mask)
    assert poisoned == logprob_mismatch(**case)


def test_logprob_mismatch_rejects_bad_input() -> None:
    """Shapes must agree and log-probs be floating."""
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'rollout_logprobs' must have shape \(2, 3\) \(same as 'train_logprobs'\)"):
        logprob_mismatch(lp, torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"'train_logprobs'"):
        logprob_mismatch(lp.long(), lp, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"'mask' must be bool or floating"):
        logprob_mismatch(lp, lp, torch.ones(2, 3, dtype=torch.int64))


# ---------------------------------------------------------------- docs


def test_routing_docstring_examples_hold() -> None:
    """Every example in core.routing's docstrings runs and prints what it shows."""
    result = doctest.testmod(core.routing, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
