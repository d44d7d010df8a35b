"""Laws of ``core.integrity``: digests are stable, and every corruption of a row changes its digest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.codec import to_jagged
from core.integrity import mismatched_rows, object_row_digests, tensor_row_digests

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool, torch.float16]


@st.composite
def dense_rows(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n, width = draw(st.integers(2, 6)), draw(st.integers(2, 9))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, width), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, width, generator=g).to(dtype)
    return torch.randint(0, 100, (n, width), generator=g).to(dtype)


@given(dense_rows())
def test_tensor_row_digests_equal_rows_equal_digests(x: torch.Tensor) -> None:
    """Digesting a copy gives the same digests; the jagged form of full rows digests like the dense rows."""
    assert tensor_row_digests(x.clone()) == tensor_row_digests(x)
    assert tensor_row_digests(to_jagged(x, [x.shape[1]] * x.shape[0])) == tensor_row_digests(x)


@given(dense_rows(), st.data())
def test_tensor_row_digests_detect_each_corruption(x: torch.Tensor, data: st.DataObject) -> None:
    """A changed element, truncation, a swap of rows, a permutation within a row or a constant row is detected."""
    base = tensor_row_digests(x)
    row = data.draw(st.integers(0, x.shape[0] - 1))
    lengths = [x.shape[1]] * x.shape[0]
    corrupted = []
    changed = x.clone()
    changed[row, 0] = ~changed[row, 0] if x.dtype == torch.bool else changed[row, 0] + 1
    corrupted.append(tensor_row_digests(changed))
    short = list(lengths)
    short[row] -= 1
    corrupted.append(tensor_row_digests(to_jagged(x, short)))
    if not torch.equal(x[row], x[row].roll(1)):
        permuted = x.clone()
        permuted[row] = x[row].roll(1)
        corrupted.append(tensor_row_digests(permuted))
    if not torch.equal(x[row], torch.full_like(x[row], x[row, 0].item())):
        constant = x.clone()
        constant[row] = x[row, 0]
        corrupted.append(tensor_row_digests(constant))
    for digests in corrupted:
        assert mismatched_rows(base, digests) == (row,)
    other = (row + 1) % x.shape[0]
    if not torch.equal(x[row], x[other]):
        swapped = x.clone()
        swapped[[row, other]] = x[[other, row]]
        assert set(mismatched_rows(base, tensor_row_digests(swapped))) == {row, other}


def test_object_row_digests_are_stable_across_processes() -> None:
    """Object digests do not depend on hash randomisation (sets and dicts are canonicalised)."""
    rows = [{"b": {"x", "y", "z"}, "a": [1, 2]}, "text", frozenset({"p", "q"})]
    code = (
        "import json; from core.integrity import object_row_digests; "
        "print(json.dumps(object_row_digests([{'b': {'x', 'y', 'z'}, 'a': [1, 2]}, 'text', frozenset({'p', 'q'})])))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root)
    assert tuple(json.loads(out.stdout)) == object_row_digests(rows)
    assert object_row_digests(["a"]) != object_row_digests(["b"])


def test_tensor_row_digests_rejects_non_tensors() -> None:
    """Digesting needs a tensor with a batch dimension."""
    with pytest.raises(TypeError, match="'column' must be a torch.Tensor: got list"):
        tensor_row_digests([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must have a batch dimension"):
        tensor_row_digests(torch.tensor(1.0))


def test_mismatched_rows_counts_length_differences() -> None:
    """Rows present on one side only count as mismatched."""
    assert mismatched_rows([1, 2], [1, 2, 3]) == (2,)
    assert mismatched_rows([1, 2], [1, 2]) == ()
