"""Per-row content digests: a 64-bit fingerprint of each row of a column.

Tensor rows are digested by a vectorised multiply/xorshift hash computed over
the whole column at once. Each element's bit pattern ``w`` (an unsigned integer
of the element's own width; elements wider than 8 bytes as several 8-byte
words) at position ``p`` inside its row becomes the term

    z = xs32(M2 * xs32(M1 * (w + p * WEYL)))    (arithmetic mod 2**64,
                                                 xs32(x) = x ^ (x >> 32))

and the row's digest is ``fmix64(sum(z) + H + L * LEN)``: ``H`` is a constant
drawn (by BLAKE2b) from the dtype and the per-token shape, ``L`` the row
length and ``fmix64`` the SplitMix64 finaliser. That is five passes over the
column's words and one segmented sum; the position salts ``p * WEYL`` are
computed once per row layout and shared by the columns that have it. Object
rows (Python values) are digested by a personalised 64-bit BLAKE2b of a
canonical pickle, a slower per-row path.

Invariant: two rows get the same digest when they hold the same dtype, the same
shape and the same bits (object rows: the same canonical value), so equal data
never mismatches. Every step from ``w`` to ``z`` is a bijection of ``w`` for a
fixed position (adding a constant, multiplying by an odd constant, a 32-bit
xorshift) and ``fmix64`` is a bijection, so a row that differs in one element
of up to 8 bytes always gets another digest. Any other difference (a truncated
or padded row, a permutation inside a row, a row replaced by a constant row,
several changed elements) goes unnoticed only if the terms of the differing
elements cancel in the 64-bit sum together with the length and header terms:
probability about 2**-64 per row under the usual heuristic that the mixed
terms behave like independent uniform values. The salt is added before any
nonlinear step, so moving an element (even a zero, or a float's sign bit
alone) changes its term, and the last step of a term is an xorshift, which
does not commute with the sum (a sum of terms linear in ``w`` would be blind
to a swap). The hash is not cryptographic: it detects accidental corruption,
not a forger. Digests depend on nothing but the row (no seeds, no ``hash()``,
bit patterns read as values, not bytes), so they agree across processes and
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

Digests = tuple[int, ...]
DigestMatrix = np.ndarray
"""``(N, F)`` int64: the digest of row ``i`` of column ``j``."""

_PERSON = b"kvrow-v1"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_WEYL = np.uint64(0x9E3779B97F4A7C15)
_LEN = np.uint64(0xD6E8FEB86659FD93)
_LOW = 0 if np.little_endian else 1
"""Index of the low 32-bit half of a uint64 in its uint32 view."""
_WORDS = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.uint16),
    4: (torch.int32, np.uint32),
    8: (torch.int64, np.uint64),
}


# ---------------------------------------------------------------- tensor rows (vectorised)


def _header(dtype: torch.dtype, token_shape: Sequence[int] | None) -> np.uint64:
    """The constant ``H`` of a column: dtype and per-token shape (None: each row is one scalar)."""
    shape = "scalar" if token_shape is None else str(tuple(int(s) for s in token_shape))
    h = hashlib.blake2b(f"{dtype}|{shape}".encode(), digest_size=8, person=_PERSON)
    return np.uint64(int.from_bytes(h.digest(), "little"))


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


def _finish(sums: np.ndarray, header: np.uint64, lengths: np.ndarray) -> np.ndarray:
    h = sums + header
    h += lengths.astype(np.uint64) * _LEN
    return _fmix64(h).view(np.int64)


class _Workspace:
    """Scratch of one digesting call: the term buffer, and the salts ``p * WEYL`` shared by columns of one row layout.

    Reusing memory matters: paging in a fresh megabyte-sized array costs about
    as much as a pass of arithmetic over it.
    """

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint64)
        self._jagged: dict[bytes, np.ndarray] = {}
        self._dense: dict[int, np.ndarray] = {}

    def terms(self, words: np.ndarray, salt: np.ndarray) -> np.ndarray:
        """The terms ``xs32(M2 * xs32(M1 * (w + salt)))`` of ``words`` (``salt`` of the same shape), in the shared buffer."""
        size = words.size
        if self._buffer.size < size:
            self._buffer = np.empty(size, dtype=np.uint64)
        x = self._buffer[:size].reshape(words.shape)
        np.add(words, salt, out=x, dtype=np.uint64)
        x *= _M1
        _xs32(x)
        x *= _M2
        _xs32(x)
        return x

    def dense_salt(self, width: int) -> np.ndarray:
        """``p * WEYL`` for ``p`` in ``0..width-1``."""
        salt = self._dense.get(width)
        if salt is None:
            salt = self._dense[width] = np.arange(width, dtype=np.uint64) * _WEYL
        return salt

    def jagged_salt(self, starts: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
        """``p * WEYL`` of each of ``total`` words, ``p`` counted from the start of its row (rows back to back)."""
        key = starts.tobytes() + counts.tobytes()
        salt = self._jagged.get(key)
        if salt is None:
            # (i - start) * WEYL for word i of a row that starts at word ``start``.
            salt = np.repeat(np.uint64(0) - _WEYL * starts.astype(np.uint64), counts)
            steps = np.arange(total, dtype=np.uint64)
            steps *= _WEYL
            salt += steps
            self._jagged[key] = salt
            if self._buffer.size < total:
                self._buffer = steps  # already paged in: reuse it as the term buffer
        return salt


def _jagged_parts(column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(values, offsets, lengths)`` of a jagged nested tensor, else None.

    Reads the layout's own buffers when present: the public accessors go
    through torch-function dispatch at tens of microseconds a call.
    """
    offsets = getattr(column, "_offsets", None)
    if offsets is not None:
        return column._values, offsets, column._lengths  # type: ignore[attr-defined]
    if column.is_nested:
        if column.layout != torch.jagged:
            raise TypeError(f"'column' must be a dense tensor or a torch.jagged nested tensor: got layout {column.layout}")
        return column.values(), column.offsets(), column.lengths()
    return None


def _dense_digests(column: torch.Tensor, work: _Workspace) -> np.ndarray:
    n = column.shape[0]
    words, per_element = _words(column)
    if column.dim() == 1:
        header, lengths, width = _header(column.dtype, None), np.zeros(n, dtype=np.int64), per_element
    else:
        header = _header(column.dtype, column.shape[2:])
        lengths = np.full(n, column.shape[1], dtype=np.int64)
        width = math.prod(column.shape[1:]) * per_element
    if n == 0 or width == 0:
        return _finish(np.zeros(n, dtype=np.uint64), header, lengths)
    x = work.terms(words.reshape(n, width), work.dense_salt(width))
    return _finish(x.sum(axis=1, dtype=np.uint64), header, lengths)


def _jagged_digests(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None, work: _Workspace) -> np.ndarray:
    off = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    n = off.shape[0] - 1
    rows = np.diff(off) if lengths is None else lengths.detach().cpu().numpy().astype(np.int64, copy=False)
    header = _header(values.dtype, values.shape[1:])
    words, per_element = _words(values)
    per_token = math.prod(values.shape[1:]) * per_element
    starts, counts = off[:-1] * per_token, rows * per_token
    total = int(counts.sum())
    if total == 0:
        return _finish(np.zeros(n, dtype=np.uint64), header, rows)
    packed = np.cumsum(counts) - counts  # where each row starts once the rows are back to back
    if lengths is not None or int(off[0]) != 0 or int(off[-1]) * per_token != words.shape[0]:
        # Holes between or around the rows: gather their words back to back first.
        words = words[np.arange(total, dtype=np.int64) + np.repeat(starts - packed, counts)]
    x = work.terms(words, work.jagged_salt(packed, counts, total))
    sums = np.zeros(n, dtype=np.uint64)
    filled = counts > 0
    sums[filled] = np.add.reduceat(x, packed[filled], dtype=np.uint64)
    return _finish(sums, header, rows)


def _tensor_digests(column: torch.Tensor, work: _Workspace) -> np.ndarray:
    if not isinstance(column, torch.Tensor):
        raise TypeError(f"'column' must be a torch.Tensor: got {type(column).__name__}")
    parts = _jagged_parts(column)
    if parts is not None:
        return _jagged_digests(*parts, work)
    if column.dim() == 0:
        raise TypeError("'column' must have a batch dimension: got a 0-d tensor")
    return _dense_digests(column, work)


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
    return tuple(_tensor_digests(column, _Workspace()).tolist())


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

    Column ``j`` is a tensor (digested as :func:`tensor_row_digests` does, the
    position salts shared by columns with the same row layout) or a sequence
    of per-row Python objects (as :func:`object_row_digests`).

    Raises:
        TypeError: a column is neither a tensor nor a sequence (or is a tensor
            :func:`tensor_row_digests` rejects).
        ValueError: the columns have different numbers of rows.

    Example:
        >>> digest_matrix([torch.zeros(2, 3), ["a", "b"]]).shape
        (2, 2)
    """
    work = _Workspace()
    out = []
    for j, column in enumerate(columns):
        if isinstance(column, torch.Tensor):
            digests = _tensor_digests(column, work)
        elif isinstance(column, Sequence) and not isinstance(column, (str, bytes)):
            digests = np.array(object_row_digests(column), dtype=np.int64).reshape(-1)
        else:
            raise TypeError(
                f"'columns[{j}]' must be a torch.Tensor or a sequence of row objects: got {type(column).__name__}"
            )
        if out and digests.shape[0] != out[0].shape[0]:
            raise ValueError(f"'columns[{j}]' must have {out[0].shape[0]} rows like 'columns[0]': got {digests.shape[0]}")
        out.append(digests)
    if not out:
        return np.zeros((0, 0), dtype=np.int64)
    return np.stack(out, axis=1)


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
