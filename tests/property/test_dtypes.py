"""Laws of ``core.dtypes``: the carried dtypes and their bit views."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings

from core.dtypes import (
    BIT_VIEWS,
    CODEC_DTYPE_NAMES,
    CODEC_DTYPES,
    NATIVE_DTYPES,
    bit_view_dtype,
    check_codec_dtype,
    dtype_from_name,
    from_bits,
    to_bits,
)
from tests.property.strategies import bit_tensors, random_bits, raw_bytes, same_bits


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


@given(bit_tensors())
@settings(max_examples=80)
def test_from_bits_inverts_to_bits(t: torch.Tensor) -> None:
    """from_bits(to_bits(t), t.dtype) is t bit for bit (NaN payloads, holes), and shares t's memory."""
    bits = to_bits(t)
    back = from_bits(bits, t.dtype)
    assert same_bits(back, t)
    assert _values(back).data_ptr() == _values(t).data_ptr()
    if t.is_nested:
        assert torch.equal(back.offsets(), t.offsets())
        assert (back.lengths() is None) == (t.lengths() is None)


@given(bit_tensors())
@settings(max_examples=80)
def test_to_bits_gives_a_native_dtype_of_the_same_width(t: torch.Tensor) -> None:
    """to_bits(t) has a dtype torch fully supports, of t's element size and shape; the same bytes."""
    bits = to_bits(t)
    assert bits.dtype in NATIVE_DTYPES and bits.dtype.itemsize == t.dtype.itemsize
    assert bits.dtype == bit_view_dtype(t.dtype)
    assert torch.equal(raw_bytes(_values(bits)), raw_bytes(_values(t)))
    if t.dtype in NATIVE_DTYPES:
        assert bits is t


@pytest.mark.parametrize("dtype", BIT_VIEWS, ids=str)
def test_bit_view_survives_pickling(dtype: torch.dtype) -> None:
    """The bit view of a dtype torch cannot unpickle pickles, and restores to the original bits."""
    t = random_bits((3, 4), dtype, 7)
    again = from_bits(pickle.loads(pickle.dumps(to_bits(t))), dtype)
    assert same_bits(again, t)


def test_codec_dtypes_are_the_native_ones_and_the_bit_viewed_ones() -> None:
    """CODEC_DTYPES is NATIVE_DTYPES then BIT_VIEWS' keys, no repeats; views are signed ints of the same width."""
    assert CODEC_DTYPES == (*NATIVE_DTYPES, *BIT_VIEWS)
    assert len(set(CODEC_DTYPES)) == len(CODEC_DTYPES)
    for dtype, view in BIT_VIEWS.items():
        assert view in NATIVE_DTYPES and view.is_signed and not view.is_floating_point
        assert view.itemsize == dtype.itemsize
    assert [dtype_from_name(name) for name in CODEC_DTYPE_NAMES] == list(CODEC_DTYPES)
    assert dtype_from_name("float8_e5m2") is torch.float8_e5m2


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int2, torch.complex32, torch.complex128, torch.float8_e8m0fnu, torch.qint8], ids=str)
def test_check_codec_dtype_rejects_dtypes_not_carried(dtype: torch.dtype) -> None:
    """A dtype outside CODEC_DTYPES is a TypeError naming the holder, the dtype and the carried ones."""
    with pytest.raises(TypeError, match=rf"field 'x' must have one of the dtypes the data plane carries \(bool, .*\): got {dtype}"):
        check_codec_dtype(dtype, "field 'x'")
    with pytest.raises(TypeError, match=rf"'dtype' must have one of the dtypes .*got {dtype}"):
        bit_view_dtype(dtype)
    assert check_codec_dtype(torch.uint64, "field 'x'") is torch.uint64


def test_bit_functions_reject_bad_input() -> None:
    """Non-tensors, strided nested tensors, a wrong bit dtype and unknown names raise, naming the argument."""
    with pytest.raises(TypeError, match="'t' must be a torch.Tensor: got list"):
        to_bits([1])  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="'t' must be dense or a torch.jagged nested tensor: got a nested tensor with layout torch.strided"):
        to_bits(strided)
    with pytest.raises(TypeError, match="'bits' must be a torch.Tensor: got int"):
        from_bits(1, torch.uint16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'bits' must have dtype torch.int16 \(the bit view of torch.uint16\): got torch.int32"):
        from_bits(torch.zeros(2, dtype=torch.int32), torch.uint16)
    with pytest.raises(ValueError, match=r"'bits' must have dtype torch.float32 .*got torch.int32"):
        from_bits(torch.zeros(2, dtype=torch.int32), torch.float32)
    with pytest.raises(TypeError, match=r"'dtype' must have one of the dtypes .*got torch.uint4"):
        from_bits(torch.zeros(2, dtype=torch.int8), torch.uint4)
    with pytest.raises(ValueError, match=r"'name' must name a carried dtype \(bool, .*\): got 'torch.uint16'"):
        dtype_from_name("torch.uint16")
    with pytest.raises(TypeError, match="'name' must be a dtype name \\(str\\): got dtype"):
        dtype_from_name(torch.uint16)
