"""The dtypes the data plane carries, and the bit view each travels as where torch falls short.

:data:`CODEC_DTYPES` lists every dtype that the jagged codec
(:mod:`core.codec`), the column codec (``adapters.rows``) and every store
move bit for bit. Any other dtype is refused with a ``TypeError`` naming the
field: sub-byte and quantized dtypes, ``complex32`` and ``float8_e8m0fnu``
(too few kernels: no zero to pad with, in the latter), and ``complex128``
(torch 2.13 crashes with a segmentation fault concatenating complex128 rows
that are only 8-byte aligned, which is how TransferQueue's storage hands rows
back; there is no 16-byte integer to view them as).

torch lacks a few kernels and its pickling for some of these dtypes:
``masked_select`` / ``masked_scatter_`` for ``uint16``/``uint32``/``uint64``,
``masked_scatter_`` for the float8 types, and unpickling (so Ray's transport)
for all of them. Those dtypes travel as a *bit view*: the same bytes read as
the signed integer dtype of the same width (:func:`bit_view_dtype`), restored
to the true dtype on arrival (:func:`from_bits`). A bit view copies nothing
and changes no bit; the true dtype is recorded beside it by whoever sends it.

Invariant (``tests/property/test_dtypes.py``): for every tensor ``t`` of a
dtype in :data:`CODEC_DTYPES`, dense or ``torch.jagged`` (holes included),
``from_bits(to_bits(t), t.dtype)`` has ``t``'s dtype, shape, row lengths and
bits, and ``to_bits(t)`` has a dtype torch fully supports
(:data:`NATIVE_DTYPES`), of the same element size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core.frozen import FrozenDict
from core.jagged import from_values_offsets, is_jagged, jagged_parts

NATIVE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)
"""The carried dtypes torch fully supports: they travel as they are."""

BIT_VIEWS: Mapping[torch.dtype, torch.dtype] = FrozenDict(
    {
        torch.uint16: torch.int16,
        torch.uint32: torch.int32,
        torch.uint64: torch.int64,
        torch.float8_e4m3fn: torch.int8,
        torch.float8_e4m3fnuz: torch.int8,
        torch.float8_e5m2: torch.int8,
        torch.float8_e5m2fnuz: torch.int8,
    }
)
"""The carried dtypes torch falls short on, each mapped to the signed integer dtype of its width."""

CODEC_DTYPES: tuple[torch.dtype, ...] = (*NATIVE_DTYPES, *BIT_VIEWS)
"""Every dtype the codec and every store round-trip bit for bit (NaN payloads and -0.0 included)."""

_BY_NAME: Mapping[str, torch.dtype] = FrozenDict({str(d).removeprefix("torch."): d for d in CODEC_DTYPES})

CODEC_DTYPE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
"""The names of :data:`CODEC_DTYPES` without the ``torch.`` prefix (``"bfloat16"``), as column specs record them."""


def check_codec_dtype(dtype: Any, arg: str) -> torch.dtype:
    """``dtype`` itself when it is in :data:`CODEC_DTYPES`.

    Args:
        dtype: the dtype to check.
        arg: what holds it, for the message (e.g. ``"field 'ids'"``).

    Raises:
        TypeError: ``dtype`` is not a carried torch dtype; the message lists them.
    """
    if dtype in CODEC_DTYPES:
        return dtype
    raise TypeError(
        f"{arg} must have one of the dtypes the data plane carries ({', '.join(CODEC_DTYPE_NAMES)}): got {dtype}; "
        f"convert it first, e.g. t.to(torch.float32)"
    )


def dtype_from_name(name: Any) -> torch.dtype:
    """The carried dtype named ``name`` (``"uint16"``, no ``torch.`` prefix).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` names no dtype of :data:`CODEC_DTYPES`.
    """
    if not isinstance(name, str):
        raise TypeError(f"'name' must be a dtype name (str): got {type(name).__name__}")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"'name' must name a carried dtype ({', '.join(CODEC_DTYPE_NAMES)}): got {name!r}") from None


def bit_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as: the same-width signed integer for :data:`BIT_VIEWS`, else itself.

    Raises:
        TypeError: ``dtype`` is not in :data:`CODEC_DTYPES`.

    Example:
        >>> bit_view_dtype(torch.uint16), bit_view_dtype(torch.bfloat16)
        (torch.int16, torch.bfloat16)
    """
    check_codec_dtype(dtype, "'dtype'")
    return BIT_VIEWS.get(dtype, dtype)


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` read as :func:`bit_view_dtype` of its dtype: a view (no copy), or ``t`` itself when no view is needed.

    Args:
        t: a dense tensor or a ``torch.jagged`` nested tensor (its offsets and
            lengths are kept, so holes between rows stay).

    Raises:
        TypeError: ``t`` is not a tensor, is a nested tensor of another
            layout, or its dtype is not in :data:`CODEC_DTYPES`.

    Example:
        >>> to_bits(torch.tensor([65535], dtype=torch.uint16)).tolist()
        [-1]
    """
    _check_tensor(t, "'t'")
    target = bit_view_dtype(t.dtype)
    return t if target == t.dtype else _view(t, target)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`to_bits`: ``bits`` read as ``dtype`` (a view; ``bits`` itself when no view is needed).

    Args:
        bits: what :func:`to_bits` gave for a tensor of ``dtype`` (dense or jagged).
        dtype: the true dtype, in :data:`CODEC_DTYPES`.

    Raises:
        TypeError: ``bits`` is not a tensor, or ``dtype`` is not carried.
        ValueError: ``bits`` does not have ``bit_view_dtype(dtype)``.

    Example:
        >>> from_bits(torch.tensor([-1], dtype=torch.int16), torch.uint16).tolist()
        [65535]
    """
    _check_tensor(bits, "'bits'")
    wire = bit_view_dtype(dtype)
    if bits.dtype != wire:
        raise ValueError(f"'bits' must have dtype {wire} (the bit view of {dtype}): got {bits.dtype}")
    return bits if wire == dtype else _view(bits, dtype)


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    parts = jagged_parts(t)
    if parts is None:
        return t.view(dtype)
    # A jagged tensor has no dtype view of its own: view its values, keep offsets and lengths.
    return from_values_offsets(parts.values.view(dtype), parts.offsets, parts.lengths)


def _check_tensor(t: Any, arg: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor: got {type(t).__name__}")
    if not is_jagged(t) and t.is_nested:
        raise TypeError(f"{arg} must be dense or a torch.jagged nested tensor: got a nested tensor with layout {t.layout}")
