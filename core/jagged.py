"""Jagged nested tensors, read and built without torch-function dispatch.

A ``torch.jagged`` nested tensor is a Python subclass of ``torch.Tensor`` whose every attribute and method
(``.is_nested``, ``.layout``, ``.shape``, ``.dtype``, ``.values()``, ...) goes through its ``__torch_function__``:
tens of microseconds a call, where a dense tensor's attribute costs a fraction of one. The codec, the adapters and
their checks read a few attributes of every column of every batch, so they read a jagged column's buffers here,
once, off the layout's own attributes, and build the columns they return here too.

Invariant: for every value ``t``, :func:`jagged_parts` returns None exactly when :func:`is_jagged` is False, and
otherwise ``JaggedParts(t.values(), t.offsets(), t.lengths(), ragged_dim)`` (the same tensors, no copy);
:func:`from_values_offsets` builds the tensor that ``torch.nested.nested_tensor_from_jagged`` builds from the same
arguments (same rows, dtype and layout), sharing ``values`` and ``offsets``. Autograd sees what it sees through
torch's own accessors: a jagged tensor that requires grad is read through them (its ``values()`` is in the graph,
its layout's buffer is not), and one built from values that require grad is torch's own view of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nested._internal.nested_tensor import NestedTensor as _JaggedTensor

__all__ = ["JaggedParts", "from_values_offsets", "is_jagged", "jagged_parts"]


class JaggedParts(NamedTuple):
    """The buffers of a ``torch.jagged`` nested tensor of ``N`` rows.

    Attributes:
        values: the rows' elements back to back, ``(total, *rest)`` (with holes when ``lengths`` is set).
        offsets: integer ``(N + 1,)`` (int64, or int32 where the caller built it so), row ``i`` starting at
            ``offsets[i]``.
        lengths: int ``(N,)`` row lengths when rows have holes between them, else None (row ``i`` ends where
            row ``i + 1`` starts).
        ragged_dim: the ragged dimension of the nested tensor (1 for a batch of token rows).
    """

    values: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor | None
    ragged_dim: int


def is_jagged(t: Any) -> bool:
    """True when ``t`` is a ``torch.jagged`` nested tensor (any other value: False).

    Example:
        >>> is_jagged(torch.nested.nested_tensor([torch.zeros(2)], layout=torch.jagged)), is_jagged(torch.zeros(2))
        (True, False)
    """
    if isinstance(t, _JaggedTensor):
        return True
    return isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged


def jagged_parts(t: Any) -> JaggedParts | None:
    """The buffers of ``t`` when it is a ``torch.jagged`` nested tensor (see :class:`JaggedParts`), else None.

    Example:
        >>> parts = jagged_parts(torch.nested.nested_tensor_from_jagged(torch.arange(3), torch.tensor([0, 1, 3])))
        >>> parts.values.tolist(), parts.offsets.tolist(), parts.lengths, parts.ragged_dim
        ([0, 1, 2], [0, 1, 3], None, 1)
    """
    if isinstance(t, _JaggedTensor) and not _requires_grad(t):
        return JaggedParts(t._values, t._offsets, t._lengths, t._ragged_idx)
    if isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged:  # in a graph, or named otherwise
        return JaggedParts(t.values(), t.offsets(), t.lengths(), t._ragged_idx)
    return None


def from_values_offsets(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The ``torch.jagged`` nested tensor whose row ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (or
    ``values[offsets[i]:offsets[i] + lengths[i]]``), ragged along dim 1, sharing ``values`` and ``offsets``.

    Raises:
        TypeError: ``values`` or ``offsets`` is not a dense tensor, or ``offsets`` does not hold integers.
        ValueError: ``values`` is 0-d, or ``offsets`` is not 1-D.

    Example:
        >>> [r.tolist() for r in from_values_offsets(torch.arange(3), torch.tensor([0, 1, 3])).unbind()]
        [[0], [1, 2]]
    """
    for arg, tensor in (("values", values), ("offsets", offsets)):
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested:
            raise TypeError(f"'{arg}' must be a dense torch.Tensor: got {type(tensor).__name__}")
    if offsets.dtype == torch.bool or offsets.dtype.is_floating_point or offsets.dtype.is_complex:
        raise TypeError(f"'offsets' must hold integers (int64, or int32 as flash-attention's cu_seqlens): got {offsets.dtype}")
    if values.dim() < 1:
        raise ValueError(f"'values' must be at least 1-D (total, *rest): got shape {tuple(values.shape)}")
    if offsets.dim() != 1:
        raise ValueError(f"'offsets' must be 1-D (N + 1,): got shape {tuple(offsets.shape)}")
    if values.requires_grad:  # torch's own view keeps the graph back to ``values``
        return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)
    return _JaggedTensor(values, offsets, lengths=lengths)


def _requires_grad(t: torch.Tensor) -> bool:
    """``t.requires_grad`` read without torch-function dispatch (a nested tensor's own flag, not its buffer's)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.requires_grad
