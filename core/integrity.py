"""Per-row content digests: a 64-bit fingerprint of each row of a column.

A tensor row is a run of elements: a row of a jagged nested tensor, or row
``i`` of a dense ``(N, S, ...)`` tensor. Its digest is XXH3-64 (the
``xxhash`` library) of the row's bytes, the elements' bit patterns in
little-endian order, seeded with a constant ``H`` drawn (by BLAKE2b) from the
dtype and the per-token shape. One call per row reads the row in place: no
copy, no gather, holes between jagged rows skipped.

A row of a 1-D ``(N,)`` column is a single element, where a call per row would
cost more than the hashing, so those columns are digested at once by a
vectorised bijection. Each element's bit pattern, as one or two 64-bit words
``w`` at positions ``p``, becomes the term

    z = xs32(M2 * xs32(M1 * (w + p * WEYL)))    (arithmetic mod 2**64,
                                                 xs32(x) = x ^ (x >> 32))

and the row's digest is ``fmix64(sum(z) + H)``, ``fmix64`` being the SplitMix64
finaliser.

Invariant: two rows get the same digest when they hold the same dtype, the same
shape and the same bits (object rows: the same canonical value), so equal data
never mismatches. A changed element, a truncated or padded row, a permutation
inside a row, a row replaced by a constant row, or rows swapped between keys
change the bytes (or their count) that a row's digest reads, and XXH3-64
yields the same digest for two different inputs with probability about
2**-64 (its published collision and avalanche test results); a scalar row's
digest is a bijection of a 64-bit element, so any change of one is detected
for certain. The hash is not cryptographic: it detects accidental corruption,
not a forger. Digests depend on nothing but the row (no per-process seeds, no
``hash()``, bytes in one fixed order), so they agree across processes and
machines.

Digesting never mutates its input.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from core.jagged import jagged_parts

Digests = tuple[int, ...]
DigestMatrix = np.ndarray
"""``(N, F)`` int64: the digest of row ``i`` of column ``j``."""

_PERSON = b"kvrow-v1"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_WEYL = np.uint64(0x9E3779B97F4A7C15)
_LOW = 0 if np.little_endian else 1
"""Index of the low 32-bit half of a uint64 in its uint32 view."""
_WORDS = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.uint16),
    4: (torch.int32, np.uint32),
    8: (torch.int64, np.uint64),
}


# ---------------------------------------------------------------- tensor rows


def _header(dtype: torch.dtype, token_shape: Sequence[int] | None) -> int:
    """The constant ``H`` of a column: dtype and per-token shape (None: each row is one scalar)."""
    shape = "scalar" if token_shape is None else str(tuple(int(s) for s in token_shape))
    h = hashlib.blake2b(f"{dtype}|{shape}".encode(), digest_size=8, person=_PERSON)
    return int.from_bytes(h.digest(), "little")


def _words(values: torch.Tensor) -> tuple[np.ndarray, int]:
    """The bit patterns of ``values`` as flat unsigned words, and the words per element (1, or 2 for 16-byte dtypes)."""
    t = values.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    size = t.element_size()
    per_element = 1
    if size > 8:
        per_element = size // 8
        t = t.view(torch.int64).reshape(-1)
        size = 8
    torch_word, numpy_word = _WORDS[size]
    return t.view(torch_word).numpy().view(numpy_word), per_element


def _little_endian_bytes(values: torch.Tensor) -> memoryview:
    """The elements' bit patterns as little-endian bytes (a view of ``values`` on little-endian machines)."""
    words, _ = _words(values)
    if not np.little_endian and words.itemsize > 1:
        words = words.byteswap()  # a copy: the input is never changed
    return memoryview(words.view(np.uint8))


def _row_digests(data: memoryview, starts: Sequence[int], ends: Sequence[int], header: int) -> list[int]:
    """XXH3-64 of ``data[start:end]`` for each row, seeded with ``header``, as unsigned ints.

    The one loop in Python per row: a slice of a memoryview (no copy) and one call.
    """
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[a:b], header) for a, b in zip(starts, ends)]


def _xs32(x: np.ndarray) -> None:
    """``x ^= x >> 32`` in place, as ``low half ^= high half`` on the uint32 view (one pass, no temporary)."""
    halves = x.view(np.uint32).reshape(-1, 2)
    halves[:, _LOW] ^= halves[:, 1 - _LOW]


def _fmix64(h: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser (a bijection of uint64), in place."""
    h ^= h >> np.uint64(30)
    h *= _M1
    h ^= h >> np.uint64(27)
    h *= _M2
    h ^= h >> np.uint64(31)
    return h


def _scalar_digests(column: torch.Tensor) -> np.ndarray:
    """Digests of a 1-D column, one element per row, by the vectorised bijection of the module docstring."""
    words, per_element = _words(column)
    x = words.reshape(column.shape[0], per_element).astype(np.uint64)
    x += np.arange(per_element, dtype=np.uint64) * _WEYL
    x *= _M1
    _xs32(x)
    x *= _M2
    _xs32(x)
    h = x.sum(axis=1, dtype=np.uint64)
    h += np.uint64(_header(column.dtype, None))
    return _fmix64(h).view(np.int64)


def _jagged_parts(column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(values, offsets, lengths)`` of a jagged nested tensor, else None.

    Reads the layout's own buffers (:func:`core.jagged.jagged_parts`): the
    public accessors go through torch-function dispatch at tens of
    microseconds a call.
    """
    parts = jagged_parts(column)
    if parts is not None:
        return parts.values, parts.offsets, parts.lengths
    if column.is_nested:
        raise TypeError(f"'column' must be a dense tensor or a torch.jagged nested tensor: got layout {column.layout}")
    return None


def _jagged_digests(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None) -> list[int]:
    off = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    token_bytes = math.prod(values.shape[1:]) * values.element_size()
    if token_bytes != 1:
        off = off * token_bytes
    if lengths is None:  # rows end where the next begins
        bounds = off.tolist()
        starts, ends = bounds, bounds[1:]
    else:  # holes between rows
        starts = off[:-1].tolist()
        ends = (off[:-1] + lengths.detach().cpu().numpy().astype(np.int64, copy=False) * token_bytes).tolist()
    return _row_digests(_little_endian_bytes(values), starts, ends, _header(values.dtype, values.shape[1:]))


def _dense_digests(column: torch.Tensor) -> list[int]:
    n = column.shape[0]
    row_bytes = math.prod(column.shape[1:]) * column.element_size()
    starts = range(0, n * row_bytes, row_bytes) if row_bytes else [0] * n
    ends = range(row_bytes, (n + 1) * row_bytes, row_bytes) if row_bytes else [0] * n
    return _row_digests(_little_endian_bytes(column), starts, ends, _header(column.dtype, column.shape[2:]))


def _tensor_digests(column: torch.Tensor) -> np.ndarray | list[int]:
    """A column's digests: int64 for a 1-D column, unsigned Python ints for the others (one per row)."""
    if not isinstance(column, torch.Tensor):
        raise TypeError(f"'column' must be a torch.Tensor: got {type(column).__name__}")
    parts = _jagged_parts(column)
    if parts is not None:
        return _jagged_digests(*parts)
    if column.dim() == 0:
        raise TypeError("'column' must have a batch dimension: got a 0-d tensor")
    if column.dim() == 1:
        return _scalar_digests(column)
    return _dense_digests(column)


def _signed(digests: np.ndarray | list[int]) -> np.ndarray:
    """:func:`_tensor_digests`' answer as int64."""
    if isinstance(digests, np.ndarray):
        return digests
    return np.array(digests, dtype=np.uint64).view(np.int64)


def tensor_row_digests(column: torch.Tensor) -> Digests:
    """Digests of the rows of a dense ``(N, ...)`` tensor or a jagged nested tensor.

    A jagged column whose rows all have length ``S`` digests like the dense
    ``(N, S, ...)`` column of the same rows.

    Args:
        column: a strided tensor with a batch dimension, or a ``torch.jagged``
            nested tensor (ragged along dim 1, holes between rows allowed).

    Returns:
        ``N`` signed 64-bit ints, one per row.

    Raises:
        TypeError: ``column`` is not a tensor, is a 0-d tensor, or is a nested
            tensor of another layout than ``torch.jagged``.
    """
    return tuple(_signed(_tensor_digests(column)).tolist())


# ---------------------------------------------------------------- object rows (per row)


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
        flat = value.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return value


def object_row_digests(rows: Sequence[Any]) -> Digests:
    """Digests of per-row Python objects, via a canonical form (sets and dicts sorted).

    Canonicalisation makes the digest independent of hash randomisation, so
    a set written by one process digests the same when read in another.
    """
    out = []
    for row in rows:
        h = hashlib.blake2b(b"object|", digest_size=8, person=_PERSON)
        h.update(pickle.dumps(_canonical(row), protocol=4))
        out.append(int.from_bytes(h.digest(), "little", signed=True))
    return tuple(out)


# ---------------------------------------------------------------- many columns, comparison


def digest_matrix(columns: Sequence[torch.Tensor | Sequence[Any]]) -> DigestMatrix:
    """The digests of ``F`` columns of ``N`` rows each, as one ``(N, F)`` int64 array.

    Column ``j`` is a tensor (digested as :func:`tensor_row_digests` does) or a
    sequence of per-row Python objects (as :func:`object_row_digests`).

    Raises:
        TypeError: a column is neither a tensor nor a sequence (or is a tensor
            :func:`tensor_row_digests` rejects).
        ValueError: the columns have different numbers of rows.

    Example:
        >>> digest_matrix([torch.zeros(2, 3), ["a", "b"]]).shape
        (2, 2)
    """
    digests: list[np.ndarray | list[int]] = []
    for j, column in enumerate(columns):
        if isinstance(column, torch.Tensor):
            column_digests = _tensor_digests(column)
        elif isinstance(column, Sequence) and not isinstance(column, (str, bytes)):
            column_digests = np.array(object_row_digests(column), dtype=np.int64).reshape(-1)
        else:
            raise TypeError(
                f"'columns[{j}]' must be a torch.Tensor or a sequence of row objects: got {type(column).__name__}"
            )
        if digests and len(column_digests) != len(digests[0]):
            raise ValueError(f"'columns[{j}]' must have {len(digests[0])} rows like 'columns[0]': got {len(column_digests)}")
        digests.append(column_digests)
    if not digests:
        return np.zeros((0, 0), dtype=np.int64)
    out = np.empty((len(digests[0]), len(digests)), dtype=np.uint64)
    for j, column_digests in enumerate(digests):  # unsigned ints straight in, int64 arrays as their bits
        out[:, j] = column_digests.view(np.uint64) if isinstance(column_digests, np.ndarray) else column_digests
    return out.view(np.int64)


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
