"""Laws and error paths of ``core.entropy``: bounds, the uniform and one-hot cases, masking, and a plain-loop reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.entropy import categorical_entropy, mean_token_entropy
from tests.property.strategies import masked_logits, row_entropies, vocab_sizes

NEG_INF = float("-inf")


def _reference(row: list[float]) -> float:
    """-sum p log p over the finite logits, in float64 with math (masked ids dropped)."""
    finite = [z for z in row if z != NEG_INF]
    top = max(finite)
    weights = [math.exp(z - top) for z in finite]
    total = math.fsum(weights)
    return -math.fsum(w / total * math.log(w / total) for w in weights if w > 0)


@given(vocab_sizes, st.floats(-50, 50, width=32))
def test_categorical_entropy_of_uniform_is_log_vocab(vocab: int, level: float) -> None:
    """Equal logits over V ids have entropy log V (whatever their common value)."""
    got = categorical_entropy(torch.full((vocab,), level, dtype=torch.float32)).item()
    assert got == pytest.approx(math.log(vocab), rel=1e-5, abs=1e-6)


@given(vocab_sizes, st.data())
def test_categorical_entropy_of_one_hot_is_zero(vocab: int, data: st.DataObject) -> None:
    """A single finite logit (every other id masked) has entropy exactly +0.0."""
    logits = torch.full((vocab,), NEG_INF)
    logits[data.draw(st.integers(0, vocab - 1))] = data.draw(st.floats(-50, 50, width=32))
    got = categorical_entropy(logits).item()
    assert got == 0.0 and math.copysign(1.0, got) == 1.0


@given(masked_logits())
def test_categorical_entropy_lies_between_zero_and_log_of_finite_ids(logits: torch.Tensor) -> None:
    """Each row's entropy is in [0, log k], k its number of finite logits, and matches a float64 loop."""
    got = categorical_entropy(logits)
    assert got.shape == logits.shape[:1] and got.dtype == logits.dtype
    for row, h in zip(logits.tolist(), got.tolist()):
        k = sum(z != NEG_INF for z in row)
        assert 0.0 <= h <= math.log(k) + 1e-5
        assert h == pytest.approx(_reference(row), rel=1e-4, abs=1e-5)


@given(masked_logits(max_rows=1))
def test_categorical_entropy_of_masked_ids_equals_dropping_them(logits: torch.Tensor) -> None:
    """Masking an id with -inf gives the entropy of the row without that id."""
    row = logits[0]
    dropped = row[row != NEG_INF]
    assert categorical_entropy(row).item() == pytest.approx(categorical_entropy(dropped).item(), rel=1e-5, abs=1e-6)


@given(masked_logits(), st.floats(-20, 20, width=32))
def test_categorical_entropy_is_shift_invariant(logits: torch.Tensor, shift: float) -> None:
    """Adding a constant to every logit leaves the entropy unchanged."""
    assert torch.allclose(categorical_entropy(logits + shift), categorical_entropy(logits), rtol=1e-4, atol=1e-4)


def test_categorical_entropy_keeps_leading_dimensions() -> None:
    """[A, B, V] logits give [A, B] entropies."""
    assert categorical_entropy(torch.zeros(2, 3, 5)).shape == (2, 3)


@pytest.mark.parametrize(
    ("logits", "error", "pattern"),
    [
        (torch.zeros(3, dtype=torch.long), TypeError, "'logits' must be a floating-point tensor: got torch.int64"),
        ([0.0, 1.0], TypeError, "'logits' must be a floating-point tensor: got list"),
        (torch.tensor(1.0), ValueError, "non-empty last .* got shape \\(\\)"),
        (torch.zeros(2, 0), ValueError, "non-empty last .* got shape \\(2, 0\\)"),
        (torch.tensor([0.0, float("nan")]), ValueError, "got NaN or \\+inf"),
        (torch.tensor([0.0, float("inf")]), ValueError, "got NaN or \\+inf"),
        (torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]]), ValueError, "at least one finite value per row"),
    ],
)
def test_categorical_entropy_rejects_bad_logits(logits: object, error: type[Exception], pattern: str) -> None:
    """Non-float, empty, NaN/+inf or fully masked logits are rejected with the field named."""
    with pytest.raises(error, match=pattern):
        categorical_entropy(logits)  # type: ignore[arg-type]


@given(row_entropies(), st.data())
def test_mean_token_entropy_is_independent_of_batching(rows: tuple[list[float], list[int]], data: st.DataObject) -> None:
    """The mean over all rows equals the token-weighted mean of the means of any split into batches."""
    sums, tokens = rows
    whole = mean_token_entropy(sums, tokens)
    assert whole == pytest.approx(math.fsum(sums) / sum(tokens))
    cut = data.draw(st.integers(0, len(sums)))
    parts = [(sums[:cut], tokens[:cut]), (sums[cut:], tokens[cut:])]
    weighted = [(mean_token_entropy(s, t) * sum(t), sum(t)) for s, t in parts if sum(t) > 0]
    assert whole == pytest.approx(math.fsum(w for w, _ in weighted) / sum(n for _, n in weighted))


@pytest.mark.parametrize(
    ("sums", "tokens", "pattern"),
    [
        ([1.0, 2.0], [1], "'row_tokens' must have 2 entries \\(one per row_entropy\\): got 1"),
        ([1.0], [-1], "'row_tokens' must all be >= 0: got \\[-1\\]"),
        ([-0.5], [1], "'row_entropy' must all be finite and >= 0: got \\[-0.5\\]"),
        ([math.nan], [1], "'row_entropy' must all be finite and >= 0"),
        ([0.0, 0.0], [0, 0], "'row_tokens' must sum to at least 1 token: got 0"),
        ([], [], "'row_tokens' must sum to at least 1 token: got 0"),
    ],
)
def test_mean_token_entropy_rejects_bad_rows(sums: list[float], tokens: list[int], pattern: str) -> None:
    """Mismatched lengths, negative counts or sums, and no tokens at all are ValueErrors."""
    with pytest.raises(ValueError, match=pattern):
        mean_token_entropy(sums, tokens)
