"""Laws of ``core.integrity``: the digest equals a plain per-row computation of the documented formula,
depends only on the row, agrees across processes, and every corruption of a row changes its digest."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from core.dtypes import BIT_VIEWS, from_bits, to_bits
from core.codec import to_jagged
from core.integrity import digest_matrix, mismatched_rows, object_row_digests, tensor_row_digests
from tests.property.strategies import digest_columns, digest_dense_rows, digest_object_rows

# The formulas of the module docstring, written out independently of the implementation.
MASK = 2**64 - 1
M1, M2, WEYL = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _header(dtype: torch.dtype, token_shape: tuple[int, ...] | None) -> int:
    shape = "scalar" if token_shape is None else str(tuple(token_shape))
    digest = hashlib.blake2b(f"{dtype}|{shape}".encode(), digest_size=8, person=b"kvrow-v1").digest()
    return int.from_bytes(digest, "little")


def _signed(h: int) -> int:
    return h - 2**64 if h >= 2**63 else h


def _row_bytes(row: torch.Tensor) -> bytes:
    """The row's elements as little-endian bytes, element by element."""
    raw = row.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    size = row.element_size()
    chunks = [raw[i : i + size] for i in range(0, len(raw), size)]
    return b"".join(c if sys.byteorder == "little" else c[::-1] for c in chunks)


def _reference_scalar_digest(element: torch.Tensor, header: int) -> int:
    """A scalar row's digest by a plain loop over Python ints: its 64-bit words, salted, mixed and summed."""
    raw = _row_bytes(element)
    total = 0
    for p in range(0, len(raw), 8):
        x = ((int.from_bytes(raw[p : p + 8].ljust(8, b"\0"), "little") + (p // 8) * WEYL) * M1) & MASK
        x ^= x >> 32
        x = (x * M2) & MASK
        x ^= x >> 32
        total = (total + x) & MASK
    h = (total + header) & MASK
    h ^= h >> 30
    h = (h * M1) & MASK
    h ^= h >> 27
    h = (h * M2) & MASK
    h ^= h >> 31
    return _signed(h)


def _reference_row_digest(row: torch.Tensor, header: int) -> int:
    """A token row's digest: XXH3-64 of a copy of its bytes, seeded with the header."""
    return _signed(xxhash.xxh3_64_intdigest(_row_bytes(row), seed=header))


def _reference_digests(column: torch.Tensor) -> tuple[int, ...]:
    if column.is_nested:
        values, offsets, lengths = column.values(), column.offsets().tolist(), column.lengths()
        counts = [b - a for a, b in zip(offsets, offsets[1:])] if lengths is None else lengths.tolist()
        header = _header(values.dtype, tuple(values.shape[1:]))
        return tuple(_reference_row_digest(values[a : a + n], header) for a, n in zip(offsets, counts))
    if column.dim() == 1:
        return tuple(_reference_scalar_digest(row, _header(column.dtype, None)) for row in column)
    header = _header(column.dtype, tuple(column.shape[2:]))
    return tuple(_reference_row_digest(row, header) for row in column)


def _one_row_column(column: torch.Tensor, i: int) -> torch.Tensor:
    if not column.is_nested:
        return column[i : i + 1]
    values, offsets, lengths = column.values(), column.offsets(), column.lengths()
    start = int(offsets[i])
    n = int(offsets[i + 1]) - start if lengths is None else int(lengths[i])
    return torch.nested.nested_tensor_from_jagged(values[start : start + n].clone(), torch.tensor([0, n]))


def _flip_bit(column: torch.Tensor, row: int, index: int, bit: int) -> torch.Tensor:
    """A copy of dense ``column`` with one bit of one element of ``row`` flipped."""
    out = column.clone()
    raw = out[row].reshape(-1).view(torch.uint8)  # a view into ``out``'s storage
    size = column.element_size()
    raw[index * size + bit // 8] ^= 1 << (bit % 8)
    return out


def _jagged(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Rows ``x[i, :lengths[i]]`` as a jagged tensor, by a loop (not ``to_jagged``: complex128 is digested, not carried)."""
    values = torch.cat([x[i, :length] for i, length in enumerate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, *lengths]).cumsum(0))


def _restore(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bits`` read as ``dtype`` again when it is a bit view (see core.dtypes), else ``bits``."""
    return from_bits(bits, dtype) if dtype in BIT_VIEWS else bits


@given(digest_columns())
def test_tensor_row_digests_equals_the_reference_loop(column: torch.Tensor) -> None:
    """The digests equal the docstring formulas computed row by row on copies of each row."""
    assert tensor_row_digests(column) == _reference_digests(column)


@given(digest_columns())
def test_tensor_row_digests_depend_only_on_the_row(column: torch.Tensor) -> None:
    """Each row digests the same alone as inside its column, and digesting leaves the column unchanged."""
    before = column.values().clone() if column.is_nested else column.clone()
    digests = tensor_row_digests(column)
    assert len(digests) == column.shape[0]
    for i in range(column.shape[0]):
        assert tensor_row_digests(_one_row_column(column, i)) == (digests[i],)
    after = column.values() if column.is_nested else column
    assert torch.equal(before.reshape(-1).view(torch.uint8), after.reshape(-1).view(torch.uint8))


@given(digest_dense_rows())
def test_tensor_row_digests_equal_rows_equal_digests(x: torch.Tensor) -> None:
    """A copy digests the same; the jagged form of full rows digests like the dense rows."""
    assert tensor_row_digests(x.clone()) == tensor_row_digests(x)
    assert tensor_row_digests(_jagged(x, [x.shape[1]] * x.shape[0])) == tensor_row_digests(x)


@given(digest_dense_rows(), st.data())
def test_tensor_row_digests_detect_any_single_bit_flip(x: torch.Tensor, data: st.DataObject) -> None:
    """Flipping any one bit of one element changes that row's digest and no other."""
    row = data.draw(st.integers(0, x.shape[0] - 1))
    index = data.draw(st.integers(0, x.shape[1] - 1))
    bit = data.draw(st.integers(0, 8 * x.element_size() - 1))
    assert mismatched_rows(tensor_row_digests(x), tensor_row_digests(_flip_bit(x, row, index, bit))) == (row,)


@given(digest_dense_rows(), st.data())
def test_tensor_row_digests_detect_each_corruption(x: torch.Tensor, data: st.DataObject) -> None:
    """A changed element, truncation, a swap of rows, a permutation within a row or a constant row is detected."""
    base = tensor_row_digests(x)
    row = data.draw(st.integers(0, x.shape[0] - 1))
    lengths = [x.shape[1]] * x.shape[0]
    bits = x[row].reshape(-1).view(torch.uint8)
    corrupted = []
    if x.dtype in BIT_VIEWS:  # no arithmetic kernels (uint16/32/64, float8): change the element's lowest bit
        changed = _flip_bit(x, row, 0, 0)
    else:
        changed = x.clone()
        changed[row, 0] = ~changed[row, 0] if x.dtype == torch.bool else changed[row, 0] + 1
    if not torch.equal(changed[row].reshape(-1).view(torch.uint8), bits):  # e.g. a float too large to move by 1
        corrupted.append(tensor_row_digests(changed))
    short = list(lengths)
    short[row] -= 1
    corrupted.append(tensor_row_digests(_jagged(x, short)))
    xb = to_bits(x) if x.dtype in BIT_VIEWS else x  # moves, copies and swaps of elements on the bit view (uint16/32/64 and float8 lack kernels)
    permuted = xb.clone()
    permuted[row] = xb[row].roll(1)
    if not torch.equal(permuted[row].reshape(-1).view(torch.uint8), bits):
        corrupted.append(tensor_row_digests(_restore(permuted, x.dtype)))
    constant = xb.clone()
    constant[row] = xb[row, 0]
    if not torch.equal(constant[row].reshape(-1).view(torch.uint8), bits):
        corrupted.append(tensor_row_digests(_restore(constant, x.dtype)))
    for digests in corrupted:
        assert mismatched_rows(base, digests) == (row,)
    other = (row + 1) % x.shape[0]
    if not torch.equal(x[row].reshape(-1).view(torch.uint8), x[other].reshape(-1).view(torch.uint8)):
        swapped = xb.clone()
        swapped[[row, other]] = xb[[other, row]]
        assert set(mismatched_rows(base, tensor_row_digests(_restore(swapped, x.dtype)))) == {row, other}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64])
def test_tensor_row_digests_detect_moves_of_zeros_and_sign_bits(dtype: torch.dtype) -> None:
    """Swapping 0 and -0 (a lone sign bit), moving a zero, or zeroing an element changes the digest.

    These values defeat hashes that weight each element by a multiplicative
    position constant (0 * K and 2**63 * K do not depend on K).
    """
    zero = torch.zeros(2, 4, dtype=dtype)
    sign = zero.clone()
    sign[0, 0] = -0.0 if dtype.is_floating_point else torch.iinfo(dtype).min
    swapped = sign.clone()
    swapped[0, 0], swapped[0, 1] = sign[0, 1], sign[0, 0]
    assert mismatched_rows(tensor_row_digests(sign), tensor_row_digests(swapped)) == (0,)
    assert mismatched_rows(tensor_row_digests(zero), tensor_row_digests(sign)) == (0,)
    ones = torch.ones(2, 4, dtype=dtype)
    moved = ones.clone()
    moved[1, 0], moved[1, 3] = 0, 0
    zeroed = moved.clone()
    zeroed[1, 3] = 1
    assert mismatched_rows(tensor_row_digests(ones), tensor_row_digests(zeroed)) == (1,)
    shifted = ones.clone()
    shifted[1, 1], shifted[1, 3] = 0, 0
    assert mismatched_rows(tensor_row_digests(moved), tensor_row_digests(shifted)) == (1,)


@given(st.lists(digest_columns(max_rows=4), min_size=1, max_size=3), digest_object_rows())
def test_digest_matrix_stacks_the_column_digests(columns: list[torch.Tensor], objects: list[Any]) -> None:
    """Column j of the matrix is that column's digests, for tensor and object columns alike."""
    n = columns[0].shape[0]
    same = [c for c in columns if c.shape[0] == n]
    rows = (objects * (n // max(len(objects), 1) + 1))[:n] if objects else [None] * n
    matrix = digest_matrix([*same, rows])
    assert matrix.dtype == np.int64 and matrix.shape == (n, len(same) + 1)
    for j, column in enumerate(same):
        assert tuple(matrix[:, j].tolist()) == tensor_row_digests(column)
    assert tuple(matrix[:, -1].tolist()) == object_row_digests(rows)


def test_digest_matrix_rejects_bad_columns() -> None:
    """Columns of different row counts, or of neither kind, are rejected naming the column."""
    with pytest.raises(ValueError, match=r"'columns\[1\]' must have 2 rows like 'columns\[0\]': got 3"):
        digest_matrix([torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(TypeError, match=r"'columns\[0\]' must be a torch.Tensor or a sequence of row objects: got int"):
        digest_matrix([5])  # type: ignore[list-item]
    assert digest_matrix([]).shape == (0, 0)


def test_digests_are_stable_across_processes() -> None:
    """Tensor and object digests do not depend on the process (hash randomisation, import order)."""
    rows = [{"b": {"x", "y", "z"}, "a": [1, 2]}, "text", frozenset({"p", "q"})]
    column = to_jagged(torch.arange(12, dtype=torch.float32).reshape(3, 4), [4, 1, 3])
    code = (
        "import json, torch; from core.codec import to_jagged; "
        "from core.integrity import object_row_digests, tensor_row_digests; "
        "c = to_jagged(torch.arange(12, dtype=torch.float32).reshape(3, 4), [4, 1, 3]); "
        "print(json.dumps([object_row_digests([{'b': {'x', 'y', 'z'}, 'a': [1, 2]}, 'text', frozenset({'p', 'q'})]), "
        "tensor_row_digests(c)]))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root)
    objects, tensors = json.loads(out.stdout)
    assert tuple(objects) == object_row_digests(rows)
    assert tuple(tensors) == tensor_row_digests(column)
    assert object_row_digests(["a"]) != object_row_digests(["b"])


def test_tensor_row_digests_rejects_non_tensors() -> None:
    """Digesting needs a tensor with a batch dimension, dense or jagged."""
    with pytest.raises(TypeError, match="'column' must be a torch.Tensor: got list"):
        tensor_row_digests([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must have a batch dimension"):
        tensor_row_digests(torch.tensor(1.0))
    with warnings.catch_warnings():  # torch warns that the strided nested layout is a prototype
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="torch.jagged nested tensor: got layout torch.strided"):
        tensor_row_digests(strided)


def test_mismatched_rows_counts_length_differences() -> None:
    """Rows present on one side only count as mismatched."""
    assert mismatched_rows([1, 2], [1, 2, 3]) == (2,)
    assert mismatched_rows([1, 2], [1, 2]) == ()


@given(st.data())
def test_tensor_row_digests_detect_any_changed_route_of_a_jagged_routing(data: st.DataObject) -> None:
    """A jagged int8 ``routed_experts`` column ([tokens, layers, topk] per row): changing one expert id of one real
    token changes that row's digest and no other, so ``verify_integrity`` covers the routing like any field."""
    rows = data.draw(st.integers(1, 4))
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=rows, max_size=rows))
    layers, topk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    padded = torch.randint(0, 8, (rows, max(lengths), layers, topk), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    row = data.draw(st.integers(0, rows - 1))
    token, layer, slot = (data.draw(st.integers(0, n - 1)) for n in (lengths[row], layers, topk))
    changed = padded.clone()
    changed[row, token, layer, slot] = (int(padded[row, token, layer, slot]) + 1) % 8
    before, after = (tensor_row_digests(to_jagged(p, lengths)) for p in (padded, changed))
    assert mismatched_rows(before, after) == (row,)
