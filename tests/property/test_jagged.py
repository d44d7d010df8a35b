"""Laws of ``core.jagged``: a jagged tensor's buffers read off its layout are torch's own accessors' answers, and a
tensor built from values and offsets is the one torch's public constructor builds."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.codec import to_jagged, to_padded
from core.jagged import from_values_offsets, is_jagged, jagged_parts
from tests.property.strategies import bit_tensors, jagged_batches, same_bits


@given(bit_tensors())
def test_jagged_parts_are_the_public_accessors(t: torch.Tensor) -> None:
    """``jagged_parts`` is None exactly for non-jagged values; otherwise the very tensors ``values()``, ``offsets()``
    and ``lengths()`` give, ragged along dim 1."""
    parts = jagged_parts(t)
    assert (parts is None) == (not is_jagged(t)) == (not (t.is_nested and t.layout == torch.jagged))
    if parts is not None:
        assert parts.values is t.values() or parts.values.data_ptr() == t.values().data_ptr()
        assert same_bits(parts.values, t.values())
        assert torch.equal(parts.offsets, t.offsets())
        assert (parts.lengths is None) == (t.lengths() is None)
        if parts.lengths is not None:
            assert torch.equal(parts.lengths, t.lengths())
        assert parts.ragged_dim == 1


@given(jagged_batches(bits=True))
def test_from_values_offsets_builds_what_torch_builds(t: torch.Tensor) -> None:
    """Round trip: the tensor built from a jagged tensor's buffers has its rows, bit for bit, and shares its values."""
    parts = jagged_parts(t)
    assert parts is not None
    built = from_values_offsets(parts.values, parts.offsets, parts.lengths)
    reference = torch.nested.nested_tensor_from_jagged(parts.values, parts.offsets, lengths=parts.lengths)
    assert is_jagged(built) and built.dtype == reference.dtype
    rows, expected = built.unbind(), reference.unbind()
    assert len(rows) == len(expected)
    assert all(same_bits(a, b) for a, b in zip(rows, expected))
    assert built.values().data_ptr() == parts.values.data_ptr()


@pytest.mark.parametrize("value", [None, 3, [1, 2], torch.zeros(3), torch.zeros(2, 3)])
def test_jagged_parts_of_a_non_jagged_value_is_none(value: object) -> None:
    """Dense tensors and non-tensors have no jagged buffers."""
    assert jagged_parts(value) is None and not is_jagged(value)


def test_jagged_parts_of_a_strided_nested_tensor_is_none() -> None:
    """A nested tensor of the strided layout is not jagged."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert jagged_parts(strided) is None and not is_jagged(strided)


@given(st.sampled_from(["values", "offsets", "dtype", "values_dim", "offsets_dim"]))
def test_from_values_offsets_rejects_bad_buffers(wrong: str) -> None:
    """Each malformed buffer raises, naming the argument, what it must be and what it got."""
    values, offsets = torch.arange(3), torch.tensor([0, 1, 3])
    expected = {
        "values": (TypeError, r"'values' must be a dense torch.Tensor: got list"),
        "offsets": (TypeError, r"'offsets' must be a dense torch.Tensor: got NoneType"),
        "dtype": (TypeError, r"'offsets' must hold integers \(int64, or int32 as .*\): got torch.float32"),
        "values_dim": (ValueError, r"'values' must be at least 1-D \(total, \*rest\): got shape \(\)"),
        "offsets_dim": (ValueError, r"'offsets' must be 1-D \(N \+ 1,\): got shape \(1, 3\)"),
    }[wrong]
    args = {
        "values": ([0, 1, 2], offsets),
        "offsets": (values, None),
        "dtype": (values, offsets.to(torch.float32)),
        "values_dim": (torch.tensor(1), offsets),
        "offsets_dim": (values, offsets[None]),
    }[wrong]
    with pytest.raises(expected[0], match=expected[1]):
        from_values_offsets(*args)  # type: ignore[arg-type]


def test_from_values_offsets_takes_int32_offsets() -> None:
    """Offsets of int32 (as flash-attention's ``cu_seqlens``) build the same rows as int64 ones."""
    values = torch.arange(6).to(torch.uint16)
    built = from_values_offsets(values, torch.tensor([0, 2, 6], dtype=torch.int32))
    assert [row.view(torch.int16).tolist() for row in built.unbind()] == [[0, 1], [2, 3, 4, 5]]


def test_jagged_buffers_keep_the_autograd_graph() -> None:
    """A jagged tensor in a graph is read through torch's accessors, and one built from values that require grad is
    torch's view of them: padding either keeps the graph, and the gradient reaches the values."""
    values = torch.randn(6, requires_grad=True)
    offsets = torch.tensor([0, 2, 6])
    built = from_values_offsets(values, offsets)
    doubled = torch.nested.nested_tensor_from_jagged(values, offsets) * 2  # an op's output: its buffer is not in the graph
    for jagged, scale in ((built, 1.0), (doubled, 2.0)):
        parts = jagged_parts(jagged)
        assert parts is not None and parts.values.requires_grad
        values.grad = None
        to_padded(jagged).sum().backward()
        assert torch.equal(values.grad, torch.full((6,), scale))
    assert to_jagged(torch.randn(2, 3, requires_grad=True), [2, 1]).requires_grad
