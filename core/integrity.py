"""Per-row content digests: a 64-bit fingerprint of each row of a column.

Invariant: two rows get the same digest when they hold the same dtype, the same
shape and the same bytes (for object rows: the same canonical value), and with
overwhelming probability (a keyed 64-bit BLAKE2b) a different digest otherwise:
a changed element, a truncated or padded row, a permutation inside a row, or a
row replaced by a constant row all change it. Digests depend on nothing but the
row, so they agree across processes and machines.

Digesting never mutates its input.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

Digests = tuple[int, ...]
_PERSON = b"kvrow-v1"


def _hasher(header: bytes) -> Any:
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(header)
    return h


def _finish(h: Any) -> int:
    return int.from_bytes(h.digest(), "little", signed=True)


def _header(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    return f"{dtype}|{tuple(int(s) for s in shape)}|".encode()


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_row_digests(column: torch.Tensor) -> Digests:
    """Digests of the rows of a dense ``(N, ...)`` tensor or a jagged nested tensor.

    Args:
        column: a strided tensor with a batch dimension, or a ``torch.jagged``
            nested tensor (ragged along dim 1).

    Returns:
        ``N`` signed 64-bit ints, one per row.

    Raises:
        TypeError: ``column`` is not a tensor, or is a 0-d tensor.
    """
    if not isinstance(column, torch.Tensor):
        raise TypeError(f"'column' must be a torch.Tensor: got {type(column).__name__}")
    if column.is_nested:
        return _jagged_digests(column)
    if column.dim() == 0:
        raise TypeError("'column' must have a batch dimension: got a 0-d tensor")
    n = column.shape[0]
    row_shape = tuple(column.shape[1:])
    header = _header(column.dtype, row_shape)
    data = column.detach().contiguous().reshape(n, -1)
    if data.shape[1] == 0:
        return tuple(_finish(_hasher(header)) for _ in range(n))
    raw = data.view(torch.uint8).numpy()
    out = []
    for i in range(n):
        h = _hasher(header)
        h.update(memoryview(raw[i]))
        out.append(_finish(h))
    return tuple(out)


def _jagged_digests(column: torch.Tensor) -> Digests:
    values = column.values()
    offsets = column.offsets().tolist()
    lengths = column.lengths()
    starts = offsets[:-1]
    ends = offsets[1:] if lengths is None else [s + int(n) for s, n in zip(starts, lengths.tolist())]
    inner = tuple(values.shape[1:])
    per_token = int(np.prod(inner, dtype=np.int64)) * values.element_size() if inner else values.element_size()
    raw = _as_bytes(values)
    out = []
    for start, end in zip(starts, ends):
        h = _hasher(_header(values.dtype, (end - start, *inner)))
        h.update(raw[start * per_token : end * per_token])
        out.append(_finish(h))
    return tuple(out)


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ("map", sorted(((repr(k), _canonical(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, (set, frozenset)):
        return ("set", sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canonical(v) for v in value])
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tobytes() if value.dtype != object else [_canonical(v) for v in value.ravel()])
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), bytes(_as_bytes(value)))
    return value


def object_row_digests(rows: Sequence[Any]) -> Digests:
    """Digests of per-row Python objects, via a canonical form (sets and dicts sorted).

    Canonicalisation makes the digest independent of hash randomisation, so
    a set written by one process digests the same when read in another.
    """
    out = []
    for row in rows:
        h = _hasher(b"object|")
        h.update(pickle.dumps(_canonical(row), protocol=4))
        out.append(_finish(h))
    return tuple(out)


def mismatched_rows(expected: Sequence[int], actual: Sequence[int]) -> tuple[int, ...]:
    """Positions where two digest sequences differ (a length difference counts every extra position).

    Example:
        >>> mismatched_rows([1, 2, 3], [1, 5, 3])
        (1,)
    """
    n = max(len(expected), len(actual))
    return tuple(
        i for i in range(n) if i >= len(expected) or i >= len(actual) or int(expected[i]) != int(actual[i])
    )
