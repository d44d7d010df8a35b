"""Jagged <-> padded codec for per-token tensors.

A batch of ``N`` variable-length rows has two layouts:

* padded: a dense ``(N, S, *rest)`` tensor; row ``i`` holds ``lengths[i]`` valid
  tokens followed by padding;
* jagged: a ``torch.jagged`` nested tensor of ``N`` rows, row ``i`` of shape
  ``(lengths[i], *rest)``; no padding is stored.

Invariant: the codec moves the valid tokens of every row bit for bit (same dtype,
same bits, NaN payloads included) for every dtype of
:data:`core.dtypes.CODEC_DTYPES` (bfloat16, bool, uint16/32/64, the float8
types, complex, ...); only padding is dropped or added. A tensor of another
dtype is refused with a ``TypeError``. Dtypes torch has no gather or scatter
kernel for (uint16/32/64, float8) are moved as their same-width integer bit
view (:func:`core.dtypes.to_bits`), so no value is ever converted.

Functions never mutate their inputs and return fresh tensors (``pack_fields``
and ``materialize`` pass fields they do not convert through as the same
objects).

Laws (see ``tests/property/test_codec.py``):
  * ``to_padded(to_jagged(p, L), pad_to_length=S, pad_value=v)`` equals ``p``
    where ``s < L[i]`` and ``v`` elsewhere;
  * ``to_jagged(to_padded(j), jagged_lengths(j))`` has the rows of ``j``;
  * ``repad(p, L, pad_to_length=P)`` equals ``to_padded(to_jagged(p, L),
    pad_to_length=P)`` bit for bit;
  * ``materialize(pack_fields(f, lengths=L, token_fields=T))`` equals ``f`` on
    the valid region of the token fields and is ``f`` for every other field.

Rows may be empty, all rows may be empty, and ``N == 0`` is allowed (torch
builds a jagged tensor with no rows).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from core.checks import check_int_entries
from core.dtypes import check_codec_dtype, from_bits, to_bits
from core.jagged import JaggedParts, from_values_offsets, is_jagged, jagged_parts

Layout = Literal["padded", "jagged"]
RowLengths = tuple[int, ...]
PadValue = float | int | bool
Fields = dict[str, torch.Tensor]


# ---------------------------------------------------------------- inspection


def jagged_lengths(jagged: torch.Tensor) -> RowLengths:
    """Row lengths of a jagged nested tensor.

    Args:
        jagged: a ``torch.jagged`` nested tensor, ragged along dim 1.

    Returns:
        ``lengths`` with ``lengths[i] == jagged[i].shape[0]``.

    Raises:
        TypeError: ``jagged`` is not a ``torch.jagged`` nested tensor.
        ValueError: its ragged dimension is not dim 1.

    Example:
        >>> jagged_lengths(to_jagged(torch.zeros(2, 4), [3, 0]))
        (3, 0)
    """
    return tuple(int(x) for x in _row_lengths(_checked_parts(jagged, "'jagged'")).tolist())


# ---------------------------------------------------------------- tensor codec


def to_jagged(padded: torch.Tensor, lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Drop the padding of a dense batch: row ``i`` becomes ``padded[i, :lengths[i]]``.

    Args:
        padded: ``(N, S, *rest)`` dense tensor of a dtype in
            :data:`core.dtypes.CODEC_DTYPES`.
        lengths: ``N`` valid-token counts, each in ``[0, S]``; a sequence of
            ints or a 1-D integer tensor.

    Returns:
        A ``torch.jagged`` nested tensor of ``N`` rows, row ``i`` of shape
        ``(lengths[i], *rest)`` and the dtype of ``padded``. Its values are a
        copy: ``padded`` is never aliased.

    Raises:
        TypeError: ``padded`` is not a dense tensor, its dtype is not carried,
            or a length is not an int.
        ValueError: ``padded`` is not at least 2-D, ``lengths`` does not have
            ``N`` entries, or a length is outside ``[0, S]``.

    Example:
        >>> j = to_jagged(torch.tensor([[1, 2, 0], [3, 0, 0]]), [2, 1])
        >>> [r.tolist() for r in j.unbind()]
        [[1, 2], [3]]
    """
    return _to_jagged(padded, lengths, "'padded'")


def repad(padded: torch.Tensor, lengths: Sequence[int] | torch.Tensor, *, pad_to_length: int) -> torch.Tensor:
    """``to_padded(to_jagged(padded, lengths), pad_to_length=pad_to_length)``, computed on the dense batch.

    Row ``i`` keeps ``padded[i, :lengths[i]]`` and is zero past it, ``pad_to_length``
    wide: the rows as a store round trip of the per-token field gives them back,
    with no jagged tensor built in between (one mask over the batch, where the
    two calls build and read a nested tensor).

    Args:
        padded: ``(N, S, *rest)`` dense tensor of a dtype in
            :data:`core.dtypes.CODEC_DTYPES`.
        lengths: ``N`` valid-token counts, each in ``[0, S]``.
        pad_to_length: the width of the result, at least the longest row.

    Returns:
        A fresh ``(N, pad_to_length, *rest)`` tensor of ``padded``'s dtype.

    Raises:
        TypeError, ValueError: as :func:`to_jagged`, and as :func:`to_padded`
            for a ``pad_to_length`` shorter than the longest row.

    Example:
        >>> repad(torch.tensor([[1, 2, 9], [3, 9, 9]]), [2, 1], pad_to_length=4).tolist()
        [[1, 2, 0, 0], [3, 0, 0, 0]]
    """
    lens = _checked_lengths(padded, lengths, "'padded'")
    if not isinstance(pad_to_length, int) or isinstance(pad_to_length, bool):
        raise TypeError(f"'pad_to_length' must be an int: got {type(pad_to_length).__name__}")
    longest = int(lens.max()) if lens.numel() else 0
    if pad_to_length < longest:
        raise ValueError(f"'pad_to_length' must be at least the longest row ({longest}) of 'padded': got {pad_to_length}")
    n, width = padded.shape[0], min(padded.shape[1], pad_to_length)
    bits = to_bits(padded)
    out = torch.zeros((n, pad_to_length, *padded.shape[2:]), dtype=bits.dtype, device=padded.device)
    mask = (torch.arange(width, device=padded.device) < lens[:, None]).reshape(n, width, *[1] * (padded.dim() - 2))
    out[:, :width] = torch.where(mask, bits[:, :width], out[:, :width])
    return from_bits(out, padded.dtype)


def to_padded(
    jagged: torch.Tensor,
    *,
    pad_value: PadValue = 0,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
) -> torch.Tensor:
    """Pad a jagged batch into a dense ``(N, L, *rest)`` tensor.

    ``L`` is the longest row rounded up to ``pad_to_multiple``, or exactly
    ``pad_to_length`` when given. Jagged tensors with holes (built with explicit
    ``lengths``) are supported.

    Args:
        jagged: a ``torch.jagged`` nested tensor, ragged along dim 1.
        pad_value: fill for positions past each row's end. It must be exactly
            representable in an integer or bool dtype, and within the range of
            a floating dtype (floats round as torch does; inf and NaN only where
            the dtype has them).
        pad_to_multiple: round ``L`` up to a multiple of this (>= 1).
        pad_to_length: the exact width ``L``; a multiple of ``pad_to_multiple``
            and at least the longest row.

    Returns:
        A fresh dense tensor with ``out[i, :len_i] == jagged[i]`` and
        ``out[i, len_i:] == pad_value``, in the dtype of ``jagged``.

    Raises:
        TypeError: ``jagged`` is not a ``torch.jagged`` nested tensor, its
            dtype is not carried, or an option has the wrong type.
        ValueError: the ragged dim is not 1; ``pad_to_multiple < 1``;
            ``pad_to_length`` is shorter than the longest row or not a multiple
            of ``pad_to_multiple``; ``pad_value`` does not fit the dtype.

    Example:
        >>> j = to_jagged(torch.tensor([[1, 2, 0], [3, 0, 0]]), [2, 1])
        >>> to_padded(j, pad_value=-1, pad_to_multiple=4).tolist()
        [[1, 2, -1, -1], [3, -1, -1, -1]]
    """
    _check_width_options(pad_to_multiple, pad_to_length)
    return _to_padded(jagged, pad_value, pad_to_multiple, pad_to_length, "'jagged'", "'pad_value'")


# ---------------------------------------------------------------- field dicts


def pack_fields(
    fields: Mapping[str, torch.Tensor],
    *,
    lengths: Sequence[int],
    token_fields: Collection[str],
) -> Fields:
    """Make the per-token fields of a batch jagged; keep the other fields as they are.

    Args:
        fields: name -> tensor, every tensor with ``len(lengths)`` rows (dim 0).
        lengths: valid-token count of each row.
        token_fields: names of the per-token fields. A dense token field is
            ``(N, S, ...)`` with ``S >= max(lengths)``; columns past a row's
            length (e.g. sequence-parallel padding) are dropped. A token field
            that is already jagged must have exactly ``lengths`` and is passed
            through.

    Returns:
        A new dict, in the order of ``fields``: token fields jagged, every other
        field the very tensor it was given.

    Raises:
        TypeError: ``fields`` is not a mapping of str -> tensor, ``token_fields``
            is a single string, or a length is not an int.
        ValueError: a name in ``token_fields`` is not in ``fields``; a field does
            not have ``len(lengths)`` rows; a length is negative; a dense token
            field is not 2-D or narrower than ``max(lengths)``; a jagged token
            field has other row lengths.

    Example:
        >>> f = {"input_ids": torch.tensor([[5, 6, 0], [7, 0, 0]]), "reward": torch.tensor([1.0, 0.0])}
        >>> packed = pack_fields(f, lengths=[2, 1], token_fields=["input_ids"])
        >>> jagged_lengths(packed["input_ids"]), packed["reward"] is f["reward"]
        ((2, 1), True)
    """
    _check_fields(fields)
    names = _token_names(token_fields, fields)
    lens = _lengths_tuple(lengths)
    n = len(lens)
    longest = max(lens, default=0)
    out: Fields = {}
    for name, field in fields.items():
        arg = f"'fields[{name!r}]'"
        _check_rows(field, n, arg)
        if name not in names:
            out[name] = field
        elif is_jagged(field):
            got = jagged_lengths(field)
            if got != lens:
                row = next(i for i, (a, b) in enumerate(zip(got, lens)) if a != b)
                raise ValueError(
                    f"{arg} is jagged with row lengths other than 'lengths': "
                    f"row {row} has {got[row]}, expected {lens[row]}"
                )
            out[name] = field
        else:
            if field.dim() < 2:
                raise ValueError(
                    f"{arg} is listed in 'token_fields', so it must be at least 2-D (N, S, ...): "
                    f"got shape {tuple(field.shape)}; leave per-row fields out of 'token_fields'"
                )
            if field.shape[1] < longest:
                raise ValueError(
                    f"{arg} must be at least {longest} wide (the longest of 'lengths'): "
                    f"got shape {tuple(field.shape)}"
                )
            out[name] = _to_jagged(field, lens, arg)
    return out


def materialize(
    fields: Mapping[str, torch.Tensor],
    *,
    layout: Layout = "padded",
    pad_values: Mapping[str, PadValue] | None = None,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
) -> Fields:
    """Give a batch of fields the layout a consumer asked for.

    Args:
        fields: name -> tensor; jagged tensors are the token fields.
        layout: ``"padded"`` pads every jagged field with :func:`to_padded`;
            ``"jagged"`` returns the fields as they are.
        pad_values: pad value per field name (default 0); names of absent or
            dense fields are ignored, so one table can serve every batch.
        pad_to_multiple: round each padded width up to a multiple of this.
        pad_to_length: the exact width of every padded token field (dense
            fields are never resized).

    Returns:
        A new dict, in the order of ``fields``; dense fields (and, for
        ``"jagged"``, every field) are the very tensors given.

    Raises:
        TypeError: ``fields`` is not a mapping of str -> tensor, or
            ``pad_values`` is not a mapping.
        ValueError: ``layout`` is unknown, or a field cannot be padded as asked
            (see :func:`to_padded`); the message names the field.

    Example:
        >>> f = pack_fields({"ids": torch.tensor([[5, 6], [7, 0]])}, lengths=[2, 1], token_fields=["ids"])
        >>> materialize(f, pad_values={"ids": -1}, pad_to_length=3)["ids"].tolist()
        [[5, 6, -1], [7, -1, -1]]
    """
    valid = get_args(Layout)
    if layout not in valid:
        raise ValueError(f"'layout' must be one of {valid}: got {layout!r}")
    _check_fields(fields)
    if pad_values is None:
        pad_values = {}
    if not isinstance(pad_values, Mapping):
        raise TypeError(f"'pad_values' must be a mapping of field name -> pad value: got {type(pad_values).__name__}")
    _check_width_options(pad_to_multiple, pad_to_length)
    if layout == "jagged":
        return dict(fields)
    return {
        name: (
            _to_padded(
                field,
                pad_values.get(name, 0),
                pad_to_multiple,
                pad_to_length,
                f"'fields[{name!r}]'",
                f"'pad_values[{name!r}]'",
            )
            if is_jagged(field)
            else field
        )
        for name, field in fields.items()
    }


# ---------------------------------------------------------------- helpers


def _to_jagged(padded: Any, lengths: Any, arg: str) -> torch.Tensor:
    lens = _checked_lengths(padded, lengths, arg)
    width = padded.shape[1]
    mask = torch.arange(width, device=padded.device) < lens[:, None]
    # Gather the bit view: uint16/32/64 and float8 have no masked_select kernel.
    bits = to_bits(padded)
    # masked_select is the fastest gather for (N, S) rows; boolean indexing for trailing dims.
    values = torch.masked_select(bits, mask) if bits.dim() == 2 else bits[mask]
    offsets = torch.cat((lens.new_zeros(1), lens.cumsum(0)))
    return from_values_offsets(from_bits(values, padded.dtype), offsets)


def _checked_lengths(padded: Any, lengths: Any, arg: str) -> torch.Tensor:
    """``lengths`` as an int64 tensor, after checking ``padded`` (a dense ``(N, S, ...)`` tensor of a carried dtype)
    and that every length is in ``[0, S]``."""
    if not isinstance(padded, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor: got {type(padded).__name__}")
    if padded.is_nested:
        raise TypeError(f"{arg} must be a dense (N, S, ...) tensor: got a nested tensor, which has no padding to drop")
    if padded.dim() < 2:
        raise ValueError(f"{arg} must be at least 2-D (N, S, ...): got shape {tuple(padded.shape)}")
    check_codec_dtype(padded.dtype, arg)
    n, width = padded.shape[0], padded.shape[1]
    lens = _lengths_tensor(lengths, n, padded.device, arg)
    bad = (lens < 0) | (lens > width)
    if n and bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"'lengths' must be in [0, {width}] (the width S of {arg}): "
            f"row {row} has length {int(lens[row])}, S is {width}"
        )
    return lens


def _to_padded(
    jagged: Any,
    pad_value: Any,
    pad_to_multiple: int,
    pad_to_length: int | None,
    arg: str,
    pad_arg: str,
) -> torch.Tensor:
    parts = _checked_parts(jagged, arg)
    values, offsets, explicit = parts.values, parts.offsets, parts.lengths
    check_codec_dtype(values.dtype, arg)
    fill = _pad_fill(pad_value, values.dtype, pad_arg)
    lens = _row_lengths(parts)
    n = lens.shape[0]
    longest = int(lens.max()) if n else 0
    if pad_to_length is None:
        width = -(-longest // pad_to_multiple) * pad_to_multiple
    elif pad_to_length < longest:
        raise ValueError(
            f"'pad_to_length' must be at least the longest row ({longest}) of {arg}: got {pad_to_length}"
        )
    else:
        width = pad_to_length
    out = torch.full((n, width, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    positions = torch.arange(width, device=values.device)
    mask = positions < lens[:, None]
    # Gather and scatter the bit views (out_bits is a view of out): uint16/32/64 and float8
    # have no index_select / masked_scatter_ kernels.
    out_bits, values = to_bits(out), to_bits(values)
    if explicit is None:
        # Rows lie back to back in values[offsets[0]:offsets[-1]].
        start = int(offsets[0])
        rows = values.narrow(0, start, int(offsets[-1]) - start)
    else:
        # Holes between rows: gather each row's tokens in order.
        rows = values.index_select(0, (offsets[:-1, None] + positions)[mask])
    if out.dim() == 2:
        out_bits.masked_scatter_(mask, rows)
    else:
        out_bits[mask] = rows
    return out


def _checked_parts(t: Any, arg: str) -> JaggedParts:
    """The buffers of ``t``, a ``torch.jagged`` nested tensor ragged along dim 1 (the token dim)."""
    parts = jagged_parts(t)
    if parts is None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.jagged nested tensor: got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(
                f"{arg} must be a torch.jagged nested tensor: got layout {t.layout}; "
                f"rebuild it with torch.nested.nested_tensor(rows, layout=torch.jagged)"
            )
        raise TypeError(
            f"{arg} must be a torch.jagged nested tensor: got a dense tensor of shape "
            f"{tuple(t.shape)}; make it jagged with to_jagged(padded, lengths)"
        )
    if parts.ragged_dim != 1:
        raise ValueError(f"{arg} must be ragged along dim 1 (the token dim): got ragged dims {[parts.ragged_dim]}")
    return parts


def _row_lengths(parts: JaggedParts) -> torch.Tensor:
    return parts.lengths.to(torch.int64) if parts.lengths is not None else parts.offsets.diff()


def _lengths_tuple(lengths: Any) -> RowLengths:
    if isinstance(lengths, torch.Tensor):
        _check_lengths_tensor(lengths)
        lengths = lengths.tolist()
    return check_int_entries("lengths", lengths, minimum=0)


def _lengths_tensor(lengths: Any, n: int, device: torch.device, arg: str) -> torch.Tensor:
    # Only types and the count are checked here; the caller checks 0 <= length <= S.
    if isinstance(lengths, torch.Tensor):
        _check_lengths_tensor(lengths)
        if lengths.shape[0] != n:
            raise ValueError(f"'lengths' must have {n} entries (one per row of {arg}): got {lengths.shape[0]}")
        return lengths.to(device=device, dtype=torch.int64)
    entries = check_int_entries("lengths", lengths)
    if len(entries) != n:
        raise ValueError(f"'lengths' must have {n} entries (one per row of {arg}): got {len(entries)}")
    return torch.tensor(entries, dtype=torch.int64, device=device)


def _check_lengths_tensor(lengths: torch.Tensor) -> None:
    if lengths.is_nested or lengths.dim() != 1:
        raise ValueError(f"'lengths' must be a 1-D tensor (one entry per row): got shape {tuple(lengths.shape)}")
    dtype = lengths.dtype
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"'lengths' must hold integers: got dtype {dtype}")


def _pad_fill(pad_value: Any, dtype: torch.dtype, pad_arg: str) -> PadValue:
    if not isinstance(pad_value, (bool, int, float)):
        raise TypeError(f"{pad_arg} must be a bool, int or float: got {type(pad_value).__name__}")
    if dtype.is_floating_point or dtype.is_complex:
        value = float(pad_value)
        info = torch.finfo(dtype)
        if math.isinf(value) and not _has_infinity(dtype):
            raise ValueError(f"{pad_arg} must be finite or NaN for a {dtype} field (it has no infinity): got {pad_value!r}")
        if math.isfinite(value) and not info.min <= value <= info.max:
            raise ValueError(f"{pad_arg} must be in [{info.min}, {info.max}] for a {dtype} field: got {pad_value!r}")
        return value
    if dtype == torch.bool:
        if pad_value not in (0, 1):
            raise ValueError(f"{pad_arg} must be 0/1 or False/True for a bool field: got {pad_value!r}")
        return bool(pad_value)
    if isinstance(pad_value, float) and not pad_value.is_integer():
        raise ValueError(f"{pad_arg} must be a whole number for a {dtype} field: got {pad_value!r}")
    info = torch.iinfo(dtype)
    if not info.min <= pad_value <= info.max:
        raise ValueError(f"{pad_arg} must be in [{info.min}, {info.max}] for a {dtype} field: got {pad_value!r}")
    return int(pad_value)


def _has_infinity(dtype: torch.dtype) -> bool:
    # float8_e4m3fn and the fnuz types have no infinity; read it off the dtype rather than list them.
    return bool(torch.tensor(math.inf).to(dtype).to(torch.float32).isinf())


def _check_width_options(pad_to_multiple: Any, pad_to_length: Any) -> None:
    if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, int):
        raise TypeError(f"'pad_to_multiple' must be an int: got {type(pad_to_multiple).__name__}")
    if pad_to_multiple < 1:
        raise ValueError(f"'pad_to_multiple' must be >= 1: got {pad_to_multiple}")
    if pad_to_length is None:
        return
    if isinstance(pad_to_length, bool) or not isinstance(pad_to_length, int):
        raise TypeError(f"'pad_to_length' must be an int or None: got {type(pad_to_length).__name__}")
    if pad_to_length < 0:
        raise ValueError(f"'pad_to_length' must be >= 0: got {pad_to_length}")
    if pad_to_length % pad_to_multiple:
        raise ValueError(
            f"'pad_to_length' must be a multiple of 'pad_to_multiple' ({pad_to_multiple}): got {pad_to_length}"
        )


def _check_fields(fields: Any) -> None:
    if not isinstance(fields, Mapping):
        raise TypeError(f"'fields' must be a mapping of name -> tensor: got {type(fields).__name__}")
    for name, field in fields.items():
        if not isinstance(name, str):
            raise TypeError(f"'fields' keys must be str: got {type(name).__name__}")
        if not isinstance(field, torch.Tensor):
            raise TypeError(f"'fields[{name!r}]' must be a torch.Tensor: got {type(field).__name__}")
        if not is_jagged(field) and field.is_nested:
            raise TypeError(
                f"'fields[{name!r}]' must be dense or torch.jagged: got a nested tensor with layout "
                f"{field.layout}; rebuild it with torch.nested.nested_tensor(rows, layout=torch.jagged)"
            )


def _token_names(token_fields: Any, fields: Mapping[str, torch.Tensor]) -> frozenset[str]:
    if isinstance(token_fields, str):
        raise TypeError(
            f"'token_fields' must be a collection of names, not a single string: got {token_fields!r}; "
            f"wrap it, e.g. token_fields=[{token_fields!r}]"
        )
    try:
        names = frozenset(token_fields)
    except TypeError:
        raise TypeError(f"'token_fields' must be a collection of names: got {type(token_fields).__name__}") from None
    for name in sorted(names, key=str):
        if name not in fields:
            raise ValueError(f"'token_fields' names {name!r}, which is not in 'fields' (have {sorted(fields)})")
    return names


def _check_rows(field: torch.Tensor, n: int, arg: str) -> None:
    if field.dim() == 0:
        raise ValueError(f"{arg} must have a batch dim of {n} rows: got a 0-d tensor")
    if field.shape[0] != n:
        raise ValueError(f"{arg} must have {n} rows (one per entry of 'lengths'): got {field.shape[0]}")
