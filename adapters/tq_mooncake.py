"""Mooncake, TransferQueue's key/value storage backend: the rows it cannot store as they are, and its set-up.

Mooncake (:data:`MOONCAKE`) rejects zero-byte values, so on this backend a
jagged tensor column travels with one zero token appended to every row
(:func:`pad_jagged_rows` / :func:`unpad_jagged_rows`) and a column whose rows
hold no bytes at all travels as its row lengths (:func:`zero_byte_placeholder`
/ :func:`from_zero_byte_placeholder`). Before TQ starts Mooncake,
:func:`prepare_mooncake` checks the package and puts ``mooncake_master`` on
``PATH``; a process that attaches lends Mooncake no memory
(:func:`attach_lending_no_memory`), so objects live in the owner's segment and
outlive workers.

Invariant: each encoding has an exact inverse, ``unpad_jagged_rows(pad_jagged_rows(c)) == c``
and ``from_zero_byte_placeholder(zero_byte_placeholder(c)) == c`` bit for bit
(rows back to back), and every stored value holds at least one byte.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig

from adapters.rows import TENSOR_KINDS, ColumnSpec

MOONCAKE = "MooncakeStore"
"""The storage backend that rejects zero-byte values: its stores pad jagged rows on the wire."""


# ---------------------------------------------------------------- padded rows (pure)


def pad_jagged_rows(column: torch.Tensor) -> torch.Tensor:
    """A contiguous jagged copy of ``column`` with one zero element (token) appended to every row.

    A backend that rejects zero-byte values (:data:`MOONCAKE`) can then store
    empty rows; :func:`unpad_jagged_rows` is the inverse. Holes between the
    input's rows are dropped.

    Example:
        >>> col = torch.nested.nested_tensor_from_jagged(torch.tensor([5, 6, 7]), torch.tensor([0, 2, 2, 3]))
        >>> pad_jagged_rows(col).values().tolist(), pad_jagged_rows(col).offsets().tolist()
        ([5, 6, 0, 0, 7, 0], [0, 3, 4, 6])
    """
    values, lens = _back_to_back(column)
    padded = _row_offsets(lens + 1)
    out = _with_zero_tokens(values, int(padded[-1]), padded[1:].numpy() - 1)
    return torch.nested.nested_tensor_from_jagged(out, padded)


def _back_to_back(column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, lengths)`` of a jagged column with its rows back to back from token 0 (as is when they already are)."""
    values, offsets, lengths = column.values(), column.offsets(), column.lengths()
    lens = offsets.diff() if lengths is None else lengths.to(torch.int64)
    if lengths is not None or int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
        values = torch.cat([values[a : a + n] for a, n in zip(offsets[:-1].tolist(), lens.tolist())])
    return values, lens


def _row_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets (``N + 1``, from 0) of rows of ``lengths`` laid back to back."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return offsets


def _with_zero_tokens(values: torch.Tensor, size: int, zeros: np.ndarray) -> torch.Tensor:
    """``size`` tokens: zero ones at positions ``zeros``, the tokens of ``values`` in order elsewhere."""
    if not values.numel():
        return values.new_zeros((size, *values.shape[1:]))
    tokens = _token_bytes(values)
    out = np.zeros((size, *tokens.shape[1:]), dtype=tokens.dtype)
    out[_token_mask(size, zeros)] = tokens
    return _from_token_bytes(out, values)


def _without_tokens(values: torch.Tensor, drop: np.ndarray) -> torch.Tensor:
    """The tokens of ``values`` except those at positions ``drop``, in order."""
    if not values.numel():
        return values.new_zeros((values.shape[0] - len(drop), *values.shape[1:]))
    tokens = _token_bytes(values)
    return _from_token_bytes(tokens[_token_mask(tokens.shape[0], drop)], values)


_TOKEN_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _token_bytes(values: torch.Tensor) -> np.ndarray:
    """``values`` (tokens along dim 0, non-empty) as a numpy view with one entry per token:
    ``(tokens,)`` unsigned words when a token is 1, 2, 4 or 8 bytes, else ``(tokens, bytes)`` uint8."""
    raw = values.contiguous().reshape(values.shape[0], -1).view(torch.uint8).numpy()
    word = _TOKEN_WORDS.get(raw.shape[1])
    return raw.view(word).reshape(-1) if word is not None else raw


def _from_token_bytes(tokens: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_token_bytes`: tokens of ``like``'s dtype and per-token shape."""
    if tokens.shape[0] == 0:
        return torch.empty((0, *like.shape[1:]), dtype=like.dtype)
    raw = np.ascontiguousarray(tokens).view(np.uint8).reshape(tokens.shape[0], -1)
    return torch.from_numpy(raw).view(like.dtype).reshape(tokens.shape[0], *like.shape[1:])


def _token_mask(size: int, holes: np.ndarray) -> np.ndarray:
    """A boolean mask of ``size`` tokens, False at ``holes``."""
    mask = np.ones(size, dtype=bool)
    mask[holes] = False
    return mask


def zero_byte_rows(spec: ColumnSpec) -> bool:
    """Whether every row of a tensor column with ``spec`` holds zero bytes (a zero in its per-row shape)."""
    return spec.kind in TENSOR_KINDS and 0 in spec.shape


def zero_byte_placeholder(spec: ColumnSpec, column: torch.Tensor) -> torch.Tensor:
    """What a key/value backend stores for a column of zero-byte rows: each row's length as ``(N,)`` int64.

    The spec (dtype, shape) and these lengths determine the column, so
    :func:`from_zero_byte_placeholder` rebuilds it bit for bit.
    """
    if spec.kind == "jagged":
        offsets, lengths = column.offsets(), column.lengths()
        return (offsets.diff() if lengths is None else lengths).to(torch.int64)
    return torch.full((column.shape[0],), spec.shape[0], dtype=torch.int64)


def from_zero_byte_placeholder(name: str, spec: ColumnSpec, value: Any, n: int) -> torch.Tensor:
    """Inverse of :func:`zero_byte_placeholder` from what TQ returned (dense ``(N,)`` or rows of one element).

    Raises:
        RuntimeError: TQ returned another number of rows, or not an int64 tensor.
    """
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        raise RuntimeError(f"TransferQueue returned field {name!r} as {type(value).__name__}: expected int64 row lengths")
    lengths = value.values() if value.is_nested else value.reshape(-1)
    if lengths.shape[0] != n:
        raise RuntimeError(f"TransferQueue returned {lengths.shape[0]} rows of field {name!r}: expected {n}")
    if spec.kind == "dense":
        return torch.empty((n, *spec.shape), dtype=spec.torch_dtype)
    offsets = _row_offsets(lengths)
    values = torch.empty((int(offsets[-1]), *spec.shape), dtype=spec.torch_dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def unpad_jagged_rows(name: str, column: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_jagged_rows`: a contiguous jagged tensor without each row's last element.

    Raises:
        RuntimeError: a row is empty, so it cannot have been padded (names the field).
    """
    values, lens = _back_to_back(column)
    if bool((lens < 1).any()):
        raise RuntimeError(f"TransferQueue returned an empty row of field {name!r}, which was stored padded")
    out = _without_tokens(values, _row_offsets(lens)[1:].numpy() - 1)  # each row's last token
    return torch.nested.nested_tensor_from_jagged(out, _row_offsets(lens - 1))


# ---------------------------------------------------------------- set-up


def prepare_mooncake(conf: DictConfig) -> None:
    """Check that Mooncake can run before anything starts, and put ``mooncake_master`` on ``PATH``.

    TQ starts the master by name; pip installs it inside the ``mooncake``
    package (and into the environment's ``bin``, which is not on ``PATH`` when
    Python is run by its full path), so that directory is appended to
    ``PATH`` when the name is not found.

    Raises:
        RuntimeError: the ``mooncake`` package is missing or cannot load, or
            TQ is to start the master and no ``mooncake_master`` exists.
    """
    hint = (
        "install it with pip install mooncake-transfer-engine (GPU machines) or "
        "mooncake-transfer-engine-non-cuda (CPU only); it needs the system libraries libibverbs1 and libnuma1"
    )
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"backend {MOONCAKE!r} needs the 'mooncake' package: {hint}")
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        raise RuntimeError(f"backend {MOONCAKE!r}: the 'mooncake' package is installed but cannot load ({e}): {hint}") from e
    if not conf.backend[MOONCAKE].auto_init or shutil.which("mooncake_master"):
        return
    for folder in list(spec.submodule_search_locations):
        if os.access(os.path.join(folder, "mooncake_master"), os.X_OK):
            os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH", ""), folder) if p)
            return
    raise RuntimeError(f"backend {MOONCAKE!r}: no 'mooncake_master' executable on PATH or in the mooncake package: {hint}")


def attach_lending_no_memory(conf: DictConfig) -> None:
    """Create this process's TQ client for a Mooncake system with no memory of its own (once per process).

    Objects then live in the owner's segment and outlive this process. Does
    nothing when the process already has a TQ client.
    """
    if tq.interface._TQ_CLIENT is None:
        conf.backend[MOONCAKE].global_segment_size = 0
        tq.interface._maybe_create_tq_client(conf)
