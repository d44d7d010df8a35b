"""Shape-faithful column <-> rows codec shared by every store adapter.

A store keeps one value per ``(key, field)``. A TensorDict column of batch size
``N`` is split into ``N`` per-row values plus a small :class:`ColumnSpec`, and
stacked back from rows and that spec. Four column kinds are supported:

* ``dense``: a strided tensor ``(N, *shape)``; row ``i`` is the tensor ``(*shape)``.
* ``jagged``: a ``torch.jagged`` nested tensor ``(N, j, *shape)`` ragged along
  dim 1; row ``i`` is the tensor ``(len_i, *shape)``.
* ``object_array``: a numpy ``dtype=object`` array ``(N, *shape)``; row ``i`` is
  ``arr[i]`` (an element, or an object array of ``shape``).
* ``non_tensor_stack``: a ``tensordict.NonTensorStack`` of batch ``(N, *shape)``;
  row ``i`` is ``stack.tolist()[i]`` (nested lists when ``shape != ()``). A
  stack of zero rows comes back with batch ``(0,)``.

Invariants:
  * round trip: ``stack_column(name, *split_column(name, v, n))`` equals ``v``
    bit for bit: same kind, dtype, shape (``(N,)`` and ``(N, 1)`` stay distinct),
    jagged row lengths and values (for every dtype, bfloat16 and bool included);
  * no aliasing: neither function shares memory or mutable objects with its
    input (tensor rows are detached contiguous copies, object rows deep copies),
    so a store's contents never change when a caller mutates its tensors;
  * a spec never depends on a jagged row's length, so rows of one field put by
    different calls stack together exactly when their specs are equal
    (:func:`common_spec`).

In tensordict 0.15.3, ``td["s"] = np.array([...], dtype=object)`` stores one
batch-wide ``NonTensorData`` that wraps the whole array (``td.get("s")`` is the
``NonTensorData``, ``td["s"]`` the array, and indexing ``td`` does *not* index
the array). :func:`read_columns_of` unwraps it and :func:`build_tensordict` sets
it back the same way, so a reader gets the container kind a writer put.

:func:`columns_equal` is the matching bitwise equality of two columns.

:func:`column_spec` checks a column exactly as :func:`split_column` does but
with whole-column work only: the TransferQueue adapter uses it to send tensor
columns whole, and splits and stacks only object columns.

:func:`to_bit_views` / :func:`from_bit_views` let a TensorDict cross a pickling
transport (Ray) with columns torch cannot unpickle (uint16/32/64, float8) read
as their same-width integer bit view, restored on arrival.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import attrs
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from core.checks import check_int_entries
from core.codec import is_jagged
from core.jagged import jagged_parts
from core.dtypes import BIT_VIEWS, CODEC_DTYPE_NAMES, check_codec_dtype, dtype_from_name, from_bits, to_bits

Kind = Literal["dense", "jagged", "object_array", "non_tensor_stack"]
Shape = tuple[int, ...]
Rows = list[Any]
Tag = dict[str, Any]

KINDS: tuple[str, ...] = get_args(Kind)
TENSOR_KINDS = frozenset({"dense", "jagged"})
OBJECT_DTYPE = "object"



# ---------------------------------------------------------------- spec


def _to_shape(value: Any) -> Shape:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"'shape' must be a sequence of ints: got {type(value).__name__}")
    return check_int_entries("shape", value, minimum=0)


def _check_kind(instance: Any, attribute: Any, value: Any) -> None:
    if value not in KINDS:
        raise ValueError(f"'kind' must be one of {KINDS}: got {value!r}")


@attrs.frozen
class ColumnSpec:
    """How to stack a field's per-row values back into a column.

    Args:
        kind: one of ``"dense"``, ``"jagged"``, ``"object_array"``, ``"non_tensor_stack"``.
        dtype: the torch dtype name (``"bfloat16"``) for tensor kinds, one of
            ``core.dtypes.CODEC_DTYPE_NAMES``; ``"object"`` for the object kinds.
        shape: the dims after the batch dim (``dense``, ``object_array``,
            ``non_tensor_stack``) or after the ragged dim (``jagged``).

    Raises:
        TypeError: ``dtype`` is not a str, or ``shape`` is not a sequence of ints.
        ValueError: unknown ``kind``; ``dtype`` is not a carried dtype name for a
            tensor kind, or not ``"object"`` for an object kind; a negative size.

    Example:
        >>> spec = ColumnSpec("jagged", "bfloat16", (4,))
        >>> ColumnSpec.from_tag(spec.to_tag()) == spec
        True
    """

    kind: Kind = attrs.field(validator=_check_kind)
    dtype: str = attrs.field(validator=attrs.validators.instance_of(str))
    shape: Shape = attrs.field(default=(), converter=_to_shape)

    def __attrs_post_init__(self) -> None:
        if self.kind in TENSOR_KINDS:
            if self.dtype not in CODEC_DTYPE_NAMES:
                raise ValueError(
                    f"'dtype' must name a carried torch dtype for a {self.kind} column (one of "
                    f"{', '.join(CODEC_DTYPE_NAMES)}): got {self.dtype!r}"
                )
        elif self.dtype != OBJECT_DTYPE:
            raise ValueError(f"'dtype' must be {OBJECT_DTYPE!r} for a {self.kind} column: got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of a tensor kind.

        Raises:
            ValueError: the spec is of an object kind.
        """
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"a {self.kind} column has no torch dtype: its 'dtype' is {self.dtype!r}")
        return dtype_from_name(self.dtype)

    def describe(self) -> str:
        """A short human-readable form of the column, e.g. ``"jagged bfloat16 (N, j, 4)"``."""
        dims = ("N", "j", *self.shape) if self.kind == "jagged" else ("N", *self.shape)
        return f"{self.kind} {self.dtype} ({', '.join(map(str, dims))})"

    def to_tag(self) -> Tag:
        """A plain dict of str / list-of-int values (msgpack- and pickle-safe)."""
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_tag(cls, tag: Mapping[str, Any]) -> ColumnSpec:
        """Rebuild a spec from :meth:`to_tag` output.

        Raises:
            TypeError: ``tag`` is not a mapping, or a value has the wrong type.
            KeyError: ``tag`` lacks ``"kind"``, ``"dtype"`` or ``"shape"``.
            ValueError: a value is invalid (see the class docstring).
        """
        if not isinstance(tag, Mapping):
            raise TypeError(f"'tag' must be a mapping with kind, dtype and shape: got {type(tag).__name__}")
        missing = [name for name in ("kind", "dtype", "shape") if name not in tag]
        if missing:
            raise KeyError(f"'tag' must have keys kind, dtype and shape: missing {missing} in {dict(tag)!r}")
        return cls(kind=tag["kind"], dtype=tag["dtype"], shape=tag["shape"])


def common_spec(name: str, specs: Mapping[str, ColumnSpec]) -> ColumnSpec:
    """The one spec that rows of field ``name`` share across keys.

    Args:
        name: the field name (for messages).
        specs: key -> the spec its row of ``name`` was stored with (non-empty).

    Returns:
        The common spec.

    Raises:
        ValueError: ``specs`` is empty, or the keys hold ``name`` in different
            kinds, dtypes or shapes (e.g. dense from one put, jagged from
            another), which cannot be stacked into one column.
    """
    groups: dict[ColumnSpec, list[str]] = {}
    for key, spec in specs.items():
        groups.setdefault(spec, []).append(key)
    if not groups:
        raise ValueError(f"field {name!r}: 'specs' must hold at least one key's spec: got none")
    if len(groups) > 1:
        shown = "; ".join(f"{spec.describe()} for keys {keys[:3]}" for spec, keys in groups.items())
        raise ValueError(
            f"field {name!r} is stored with different layouts across the requested keys, "
            f"so it cannot be stacked into one column: {shown}; get these keys in separate calls"
        )
    return next(iter(groups))


# ---------------------------------------------------------------- split


def column_spec(name: str, value: Any, n: int) -> ColumnSpec:
    """The spec of a column of ``n`` rows, checked exactly as :func:`split_column` checks it, without splitting it.

    Whole-column work only (no per-row copies): a store that moves tensor
    columns as they are uses this to validate them.

    Args:
        name: the field name (for messages).
        value: a column as :func:`split_column` takes it.
        n: the batch size.

    Returns:
        The spec :func:`split_column` would return for ``value``.

    Raises:
        TypeError: as :func:`split_column`.
        ValueError: as :func:`split_column`.

    Example:
        >>> column_spec("ids", torch.nested.nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged), 2)
        ColumnSpec(kind='jagged', dtype='float32', shape=())
    """
    field = f"field {name!r}"
    value = _unwrap(field, name, value)
    if isinstance(value, torch.Tensor):
        return _tensor_spec(field, value, n)
    if isinstance(value, np.ndarray):
        return _object_array_spec(field, value, n)
    return _stack_spec(field, value, n)


def split_column(name: str, value: Any, n: int) -> tuple[ColumnSpec, Rows]:
    """Split a column of ``n`` rows into its spec and ``n`` independent row values.

    Args:
        name: the field name (for messages).
        value: a dense tensor ``(n, ...)``, a ``torch.jagged`` nested tensor of
            ``n`` rows ragged along dim 1, a numpy ``dtype=object`` array of
            ``n`` rows (bare or inside a ``NonTensorData``), or a
            ``NonTensorStack`` of batch ``(n, ...)``.
        n: the batch size.

    Returns:
        ``(spec, rows)``; rows share no memory or mutable objects with ``value``
        (tensors are detached contiguous copies, objects deep copies).

    Raises:
        TypeError: ``value`` is of another kind (a nested TensorDict, a strided
            nested tensor, a sparse tensor, a batch-wide ``NonTensorData`` that is
            not an object array, a numpy array of a non-object dtype, ...), or a
            tensor of a dtype not in ``core.dtypes.CODEC_DTYPES``.
        ValueError: ``value`` does not have ``n`` rows, or a jagged tensor is
            ragged along a dim other than 1.

    Example:
        >>> spec, rows = split_column("reward", torch.tensor([1.0, 2.0]), 2)
        >>> spec, [r.item() for r in rows]
        (ColumnSpec(kind='dense', dtype='float32', shape=()), [1.0, 2.0])
    """
    field = f"field {name!r}"
    value = _unwrap(field, name, value)
    if isinstance(value, torch.Tensor):
        spec = _tensor_spec(field, value, n)
        return spec, [_copy_tensor(row) for row in value.detach().unbind(0)]
    if isinstance(value, np.ndarray):
        spec = _object_array_spec(field, value, n)
        return spec, [copy.deepcopy(value[i]) for i in range(n)]
    return _stack_spec(field, value, n), copy.deepcopy(value.tolist())


def _unwrap(field: str, name: str, value: Any) -> Any:
    """The column a value holds (a ``NonTensorData`` object array unwrapped); TypeError for unsupported kinds."""
    if isinstance(value, NonTensorData):
        data = value.data
        if not isinstance(data, np.ndarray):
            raise TypeError(
                f"{field} must hold one value per row: got a batch-wide NonTensorData wrapping "
                f"{type(data).__name__}; store per-row objects as a NonTensorStack, e.g. "
                f"td[{name!r}] = NonTensorStack(*values), or as np.array(values, dtype=object)"
            )
        value = data
    if isinstance(value, (torch.Tensor, np.ndarray, NonTensorStack)):
        return value
    if isinstance(value, TensorDictBase):
        raise TypeError(
            f"{field} must be a tensor, jagged tensor, object array or NonTensorStack: got a nested "
            f"{type(value).__name__}; flatten it first, e.g. fields.flatten_keys('.')"
        )
    raise TypeError(
        f"{field} must be a tensor, jagged tensor, object array or NonTensorStack: got {type(value).__name__}"
    )


def _check_rows(field: str, got: int, n: int) -> None:
    if got != n:
        raise ValueError(f"{field} must have {n} rows (the batch size): got {got}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_spec(field: str, value: torch.Tensor, n: int) -> ColumnSpec:
    # Each attribute of a jagged tensor costs a __torch_function__ call: read its buffers instead.
    parts = jagged_parts(value)
    if parts is not None:
        if parts.ragged_dim != 1:
            raise ValueError(f"{field} must be a jagged tensor ragged along dim 1: got ragged dims {[parts.ragged_dim]}")
        _check_rows(field, parts.offsets.shape[0] - 1, n)
        return ColumnSpec("jagged", _dtype_name(check_codec_dtype(parts.values.dtype, field)), tuple(parts.values.shape[1:]))
    if value.is_nested:  # before its shape, which a strided nested tensor does not have
        raise TypeError(
            f"{field} must be dense or a torch.jagged nested tensor: got a nested tensor with layout "
            f"{value.layout}; rebuild it with torch.nested.nested_tensor(rows, layout=torch.jagged)"
        )
    shape, layout = value.shape, value.layout
    if layout != torch.strided:
        raise TypeError(f"{field} must be a strided (dense) tensor: got layout {layout}; call .to_dense()")
    if len(shape) == 0:
        raise ValueError(f"{field} must have a batch dim of {n} rows: got a 0-d tensor")
    _check_rows(field, shape[0], n)
    return ColumnSpec("dense", _dtype_name(check_codec_dtype(value.dtype, field)), tuple(shape[1:]))


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _object_array_spec(field: str, value: np.ndarray, n: int) -> ColumnSpec:
    if value.dtype != object:
        raise TypeError(
            f"{field} must be a numpy array of dtype object: got dtype {value.dtype}; "
            f"convert it, e.g. np.asarray(values, dtype=object), or pass numbers as a torch tensor"
        )
    if value.ndim == 0:
        raise ValueError(f"{field} must have a batch dim of {n} rows: got a 0-d object array")
    _check_rows(field, value.shape[0], n)
    return ColumnSpec("object_array", OBJECT_DTYPE, value.shape[1:])


def _stack_spec(field: str, value: NonTensorStack, n: int) -> ColumnSpec:
    if len(value.batch_size) == 0:
        raise ValueError(f"{field} must have a batch dim of {n} rows: got a NonTensorStack of batch size []")
    _check_rows(field, value.batch_size[0], n)
    return ColumnSpec("non_tensor_stack", OBJECT_DTYPE, tuple(value.batch_size[1:]))


# ---------------------------------------------------------------- stack


def stack_column(name: str, spec: ColumnSpec, rows: Sequence[Any]) -> Any:
    """Stack per-row values back into a column of the kind ``spec`` names.

    Args:
        name: the field name (for messages).
        spec: the column's spec (see :func:`split_column`, :func:`common_spec`).
        rows: one value per row, as :func:`split_column` returned them.

    Returns:
        A fresh column of ``len(rows)`` rows: a dense tensor, a ``torch.jagged``
        nested tensor, a numpy object array, or a ``NonTensorStack``. It shares no
        memory or mutable objects with ``rows``.

    Raises:
        TypeError: ``spec`` is not a ``ColumnSpec``, ``rows`` is not a sequence,
            or a tensor row is not a dense tensor.
        ValueError: a row does not fit ``spec`` (dtype, shape or nesting).

    Example:
        >>> spec = ColumnSpec("jagged", "int64", ())
        >>> j = stack_column("ids", spec, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64)])
        >>> [r.tolist() for r in j.unbind()]
        [[1, 2], []]
    """
    field = f"field {name!r}"
    if not isinstance(spec, ColumnSpec):
        raise TypeError(f"'spec' of {field} must be a ColumnSpec: got {type(spec).__name__}")
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"'rows' of {field} must be a sequence of row values: got {type(rows).__name__}")
    if spec.kind == "dense":
        return _stack_dense(field, spec, rows)
    if spec.kind == "jagged":
        return _stack_jagged(field, spec, rows)
    if spec.kind == "object_array":
        return _stack_object_array(field, spec, rows)
    return _stack_objects(field, spec.shape, copy.deepcopy(list(rows)))


def _check_tensor_row(field: str, spec: ColumnSpec, i: int, row: Any) -> None:
    if not isinstance(row, torch.Tensor) or row.is_nested or row.layout != torch.strided:
        got = type(row).__name__ if not isinstance(row, torch.Tensor) else f"layout {row.layout}"
        raise TypeError(f"row {i} of {field} must be a dense tensor ({spec.describe()}): got {got}")
    if row.dtype != spec.torch_dtype:
        raise ValueError(f"row {i} of {field} must have dtype {spec.dtype}: got {_dtype_name(row.dtype)}")
    if spec.kind == "jagged":
        fits = row.dim() == 1 + len(spec.shape) and tuple(row.shape[1:]) == spec.shape
        want = f"(len, {', '.join(map(str, spec.shape))})" if spec.shape else "(len,)"
    else:
        fits = tuple(row.shape) == spec.shape
        want = str(spec.shape)
    if not fits:
        raise ValueError(f"row {i} of {field} must have shape {want}: got {tuple(row.shape)}")


def _stack_dense(field: str, spec: ColumnSpec, rows: Sequence[Any]) -> torch.Tensor:
    for i, row in enumerate(rows):
        _check_tensor_row(field, spec, i, row)
    if not rows:
        return torch.empty((0, *spec.shape), dtype=spec.torch_dtype)
    return torch.stack(list(rows))


def _stack_jagged(field: str, spec: ColumnSpec, rows: Sequence[Any]) -> torch.Tensor:
    for i, row in enumerate(rows):
        _check_tensor_row(field, spec, i, row)
    if rows:
        values = torch.cat(list(rows))
        device = values.device
    else:
        values = torch.empty((0, *spec.shape), dtype=spec.torch_dtype)
        device = values.device
    lengths = torch.tensor([0, *(row.shape[0] for row in rows)], dtype=torch.int64, device=device)
    return torch.nested.nested_tensor_from_jagged(values, lengths.cumsum(0))


def _stack_object_array(field: str, spec: ColumnSpec, rows: Sequence[Any]) -> np.ndarray:
    if not spec.shape:
        return np.fromiter((copy.deepcopy(row) for row in rows), dtype=object, count=len(rows))
    out = np.empty((len(rows), *spec.shape), dtype=object)
    for i, row in enumerate(rows):
        if not isinstance(row, np.ndarray) or row.dtype != object or row.shape != spec.shape:
            got = f"shape {row.shape}, dtype {row.dtype}" if isinstance(row, np.ndarray) else type(row).__name__
            raise ValueError(f"row {i} of {field} must be an object array of shape {spec.shape}: got {got}")
        out[i] = copy.deepcopy(row)
    return out


def _stack_objects(field: str, shape: Shape, rows: list[Any]) -> NonTensorStack:
    if not shape:
        return NonTensorStack(*rows)
    inner = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != shape[0]:
            got = f"a list of {len(row)}" if isinstance(row, list) else type(row).__name__
            raise ValueError(f"row {i} of {field} must be a list of {shape[0]} (NonTensorStack dims {shape}): got {got}")
        inner.append(_stack_objects(field, shape[1:], row))
    return NonTensorStack(*inner)


# ---------------------------------------------------------------- equality


def columns_equal(a: Any, b: Any) -> bool:
    """Whether two columns are identical: same kind, dtype, shape and bits.

    Tensors compare by raw bytes, so NaN equals NaN and ``-0.0`` differs from
    ``0.0``; jagged tensors compare row lengths and each row's bytes (holes are
    ignored); object arrays and ``NonTensorStack`` compare shape and ``==`` of
    their elements. A ``NonTensorData`` compares as the value it wraps.

    Example:
        >>> columns_equal(torch.zeros(2), torch.zeros(2, 1))
        False
    """
    a, b = (v.data if isinstance(v, NonTensorData) else v for v in (a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if is_jagged(a) or is_jagged(b):
            if not (is_jagged(a) and is_jagged(b)) or a.dtype != b.dtype or a.dim() != b.dim():
                return False
            rows_a, rows_b = a.unbind(0), b.unbind(0)
            return len(rows_a) == len(rows_b) and all(map(_same_bits, rows_a, rows_b))
        return not (a.is_nested or b.is_nested) and _same_bits(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    if isinstance(a, NonTensorStack) and isinstance(b, NonTensorStack):
        return a.batch_size == b.batch_size and a.tolist() == b.tolist()
    return False


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


# ---------------------------------------------------------------- TensorDicts


def read_columns_of(td: TensorDict) -> dict[str, Any]:
    """The top-level columns of ``td`` as a writer put them.

    A batch-wide ``NonTensorData`` wrapping a numpy array (how tensordict
    stores ``td[name] = np.array(..., dtype=object)``) is unwrapped to the array;
    everything else (tensors, jagged tensors, ``NonTensorStack``, other
    ``NonTensorData``, nested TensorDicts) is returned as stored, for
    :func:`split_column` to split or reject.

    Raises:
        TypeError: ``td`` is not a TensorDict.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"'td' must be a TensorDict: got {type(td).__name__}")
    out: dict[str, Any] = {}
    for name in td.keys():
        value = td.get(name)
        if isinstance(value, NonTensorData) and isinstance(value.data, np.ndarray):
            value = value.data
        out[name] = value
    return out


def build_tensordict(columns: Mapping[str, Any], n: int) -> TensorDict:
    """A TensorDict of batch size ``[n]`` holding ``columns`` as :func:`read_columns_of` reads them.

    Numpy object arrays are set as tensordict sets them from ``td[name] = arr``
    (one batch-wide ``NonTensorData``), so ``td[name]`` gives the array back.

    Raises:
        TypeError: ``columns`` is not a mapping, or a name is not a str.
        ValueError: a column does not have ``n`` rows.
    """
    if not isinstance(columns, Mapping):
        raise TypeError(f"'columns' must be a mapping of name -> column: got {type(columns).__name__}")
    td = TensorDict(batch_size=[n])
    for name, value in columns.items():
        if not isinstance(name, str):
            raise TypeError(f"'columns' keys must be str: got {type(name).__name__}")
        rows = _row_count(value)
        if rows != n:
            raise ValueError(f"column {name!r} must have {n} rows (the batch size): got {rows}")
        if isinstance(value, np.ndarray):
            td.set(name, NonTensorData(value, batch_size=[n]))
        else:
            td.set(name, value)
    return td


def _row_count(value: Any) -> int | None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.shape[0] if value.ndim else None
    if isinstance(value, TensorDictBase):
        return value.batch_size[0] if len(value.batch_size) else None
    return len(value) if isinstance(value, Sequence) else None


# ---------------------------------------------------------------- transport bit views


def to_bit_views(td: TensorDict) -> tuple[TensorDict, dict[str, str]]:
    """``td`` with every tensor column that torch cannot pickle read as its same-width integer bit view.

    torch 2.13 pickles but cannot unpickle tensors of ``uint16``/``uint32``/
    ``uint64`` and the float8 types (Ray reports it as an opaque
    ``RaySystemError``); their bit views (:func:`core.dtypes.to_bits`)
    travel. No data is copied; other columns are the very objects of ``td``.

    Args:
        td: a TensorDict of batch size ``[n]`` (what a store puts or returns).

    Returns:
        ``(wire, dtypes)``: the TensorDict to send and ``{name: true dtype
        name}`` of the viewed columns, for :func:`from_bit_views` on arrival.

    Raises:
        TypeError: ``td`` is not a TensorDict, or a tensor column has a dtype
            not in ``core.dtypes.CODEC_DTYPES`` (naming the field).
    """
    columns = read_columns_of(td)
    dtypes: dict[str, str] = {}
    for name, value in columns.items():
        if isinstance(value, torch.Tensor) and value.dtype in BIT_VIEWS:
            dtypes[name] = _dtype_name(value.dtype)
            columns[name] = to_bits(value)
        elif isinstance(value, torch.Tensor):
            check_codec_dtype(value.dtype, f"field {name!r}")
    return (build_tensordict(columns, td.batch_size[0]) if dtypes else td), dtypes


def from_bit_views(td: TensorDict, dtypes: Mapping[str, str]) -> TensorDict:
    """Undo :func:`to_bit_views`: each column named in ``dtypes`` read as its true dtype again (no copy).

    Raises:
        TypeError: ``td`` is not a TensorDict, or ``dtypes`` is not a mapping.
        KeyError: ``dtypes`` names a column ``td`` lacks.
        ValueError: a named column does not hold the bit view of its dtype, or
            a dtype name is not carried.
    """
    if not isinstance(dtypes, Mapping):
        raise TypeError(f"'dtypes' must be a mapping of column name -> dtype name: got {type(dtypes).__name__}")
    if not dtypes:
        return td
    columns = read_columns_of(td)
    for name, dtype in dtypes.items():
        if name not in columns:
            raise KeyError(f"'dtypes' names column {name!r}, which the TensorDict lacks (have {sorted(columns)})")
        columns[name] = from_bits(columns[name], dtype_from_name(dtype))
    return build_tensordict(columns, td.batch_size[0])
