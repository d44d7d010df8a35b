"""Laws of the jagged <-> padded codec (``core.codec``).

The vectorised codec is checked against a plain per-row loop, and round trips
are checked bit for bit (dtype, shape and the raw bits of every element).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.codec import is_jagged, jagged_lengths, materialize, pack_fields, repad, to_jagged, to_padded
from core.fields import ROUTED_EXPERTS, TOKEN_FIELDS
from core.routing import NO_ROUTE
from tests.property.strategies import (
    codec_dtypes,
    codec_row_lengths,
    field_batches,
    jagged_batches,
    pad_values_for,
    padded_batches,
    random_tensor,
    routing_cases,
    same_bits,
)


def _rows(jagged: torch.Tensor) -> list[torch.Tensor]:
    """Rows of a jagged tensor, read by torch's own ``unbind``."""
    return list(jagged.unbind())


def _loop_padded(
    rows: list[torch.Tensor], width: int, pad: bool | int | float, rest: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Reference padding: one row at a time."""
    out = torch.full((len(rows), width, *rest), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


def _valid_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1)


def _jagged(rows: list[list[int]]) -> torch.Tensor:
    lengths = [len(r) for r in rows]
    width = max(lengths, default=0)
    padded = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    return to_jagged(padded, lengths)


# ---------------------------------------------------------------- to_jagged


@given(padded_batches())
@settings(max_examples=60)
def test_to_jagged_matches_loop_reference(batch: tuple[torch.Tensor, list[int]]) -> None:
    """Row i of to_jagged(p, L) is exactly p[i, :L[i]], in p's dtype, and p is unchanged."""
    padded, lengths = batch
    before = padded.clone()
    jagged = to_jagged(padded, lengths)
    assert is_jagged(jagged)
    assert jagged.shape[0] == len(lengths) and jagged.dtype == padded.dtype
    assert jagged_lengths(jagged) == tuple(lengths)
    rows = _rows(jagged)
    assert len(rows) == len(lengths)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        assert same_bits(row, padded[i, :length])
    assert same_bits(padded, before)


@given(padded_batches())
@settings(max_examples=30)
def test_to_jagged_accepts_lengths_tensor(batch: tuple[torch.Tensor, list[int]]) -> None:
    """A 1-D integer tensor of lengths gives the same jagged tensor as a list."""
    padded, lengths = batch
    from_list = to_jagged(padded, lengths)
    from_tensor = to_jagged(padded, torch.tensor(lengths, dtype=torch.int32))
    assert same_bits(from_list.values(), from_tensor.values())
    assert same_bits(from_list.offsets(), from_tensor.offsets())


def test_to_jagged_copies_values() -> None:
    """The jagged values never alias the padded input."""
    padded = torch.arange(6.0).reshape(2, 3)
    jagged = to_jagged(padded, [3, 3])
    jagged.values().fill_(-1.0)
    assert torch.equal(padded, torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int64])
def test_to_jagged_handles_no_rows_and_empty_rows(dtype: torch.dtype) -> None:
    """N == 0 and all-empty rows are valid batches and round-trip."""
    for shape, lengths in [((0, 4), []), ((0, 0, 2), []), ((3, 4), [0, 0, 0]), ((2, 0), [0, 0])]:
        padded = random_tensor(shape, dtype, 0)
        jagged = to_jagged(padded, lengths)
        assert jagged.shape[0] == shape[0] and jagged_lengths(jagged) == tuple(lengths)
        back = to_padded(jagged, pad_to_length=shape[1])
        assert same_bits(back, torch.zeros(shape, dtype=dtype))


def test_to_jagged_rejects_bad_input() -> None:
    """Wrong types, ranks, counts and out-of-range lengths raise with the argument named."""
    padded = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="'padded' must be a torch.Tensor: got list"):
        to_jagged([[0, 0]], [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'padded' must be a dense .* got a nested tensor"):
        to_jagged(to_jagged(padded, [1, 2]), [1, 2])
    with pytest.raises(ValueError, match=r"'padded' must be at least 2-D \(N, S, \.\.\.\): got shape \(3,\)"):
        to_jagged(torch.zeros(3), [1, 1, 1])
    with pytest.raises(ValueError, match=r"'lengths' must have 2 entries \(one per row of 'padded'\): got 3"):
        to_jagged(padded, [1, 1, 1])
    with pytest.raises(ValueError, match=r"'lengths' must be in \[0, 3\].*row 1 has length 4, S is 3"):
        to_jagged(padded, [1, 4])
    with pytest.raises(ValueError, match=r"row 0 has length -1, S is 3"):
        to_jagged(padded, torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="'lengths' entries must be int: got bool at index 1"):
        to_jagged(padded, [1, True])
    with pytest.raises(TypeError, match="'lengths' entries must be int: got float at index 0"):
        to_jagged(padded, [1.0, 2])
    with pytest.raises(TypeError, match="'lengths' must hold integers: got dtype torch.float32"):
        to_jagged(padded, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"'lengths' must be a 1-D tensor .*got shape \(2, 1\)"):
        to_jagged(padded, torch.tensor([[1], [2]]))
    with pytest.raises(TypeError, match="'lengths' must be a sequence of ints: got int"):
        to_jagged(padded, 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------- to_padded


@given(jagged_batches(), st.integers(1, 5), st.data())
@settings(max_examples=60)
def test_to_padded_matches_loop_reference(jagged: torch.Tensor, multiple: int, data: st.DataObject) -> None:
    """to_padded equals a per-row loop fill, holes included, width = longest row rounded up."""
    pad = data.draw(pad_values_for(jagged.dtype))
    rows = _rows(jagged)
    longest = max((r.shape[0] for r in rows), default=0)
    width = -(-longest // multiple) * multiple
    out = to_padded(jagged, pad_value=pad, pad_to_multiple=multiple)
    assert same_bits(out, _loop_padded(rows, width, pad, tuple(jagged.values().shape[1:]), jagged.dtype))


@given(padded_batches(), st.data())
@settings(max_examples=60)
def test_to_padded_inverts_to_jagged(batch: tuple[torch.Tensor, list[int]], data: st.DataObject) -> None:
    """to_padded(to_jagged(p, L), pad_to_length=S) is p on the valid region and pad_value elsewhere."""
    padded, lengths = batch
    pad = data.draw(pad_values_for(padded.dtype))
    out = to_padded(to_jagged(padded, lengths), pad_value=pad, pad_to_length=padded.shape[1])
    mask = _valid_mask(lengths, padded.shape[1]).reshape(*padded.shape[:2], *[1] * (padded.dim() - 2))
    expected = torch.where(mask, padded, torch.full_like(padded, pad))
    assert same_bits(out, expected)


@given(padded_batches(bits=True), st.data())
@settings(max_examples=80)
def test_repad_is_the_round_trip_through_jagged(batch: tuple[torch.Tensor, list[int]], data: st.DataObject) -> None:
    """repad(p, L, pad_to_length=P) is to_padded(to_jagged(p, L), pad_to_length=P) bit for bit, P narrower or wider
    than p (any bit pattern, every carried dtype)."""
    padded, lengths = batch
    width = data.draw(st.integers(max(lengths, default=0), padded.shape[1] + 3))
    expected = to_padded(to_jagged(padded, lengths), pad_to_length=width)
    got = repad(padded, lengths, pad_to_length=width)
    assert same_bits(got, expected)
    assert got.data_ptr() != padded.data_ptr() or padded.numel() == 0


def test_repad_refuses_what_the_round_trip_refuses() -> None:
    """A row longer than the batch, a pad length shorter than the longest row, and a nested input are refused, each
    error naming the bound and the value."""
    with pytest.raises(ValueError, match=r"'lengths' must be in \[0, 3\].*row 1 has length 4"):
        repad(torch.zeros(2, 3), [1, 4], pad_to_length=5)
    with pytest.raises(ValueError, match=r"'pad_to_length' must be at least the longest row \(3\).*got 2"):
        repad(torch.zeros(2, 3), [1, 3], pad_to_length=2)
    with pytest.raises(TypeError, match="dense"):
        repad(to_jagged(torch.zeros(2, 3), [1, 2]), [1, 2], pad_to_length=3)
    with pytest.raises(TypeError, match="'pad_to_length' must be an int: got float"):
        repad(torch.zeros(2, 3), [1, 2], pad_to_length=3.0)


@given(jagged_batches(), st.integers(1, 4))
@settings(max_examples=60)
def test_to_jagged_inverts_to_padded(jagged: torch.Tensor, multiple: int) -> None:
    """to_jagged(to_padded(j), jagged_lengths(j)) has exactly the rows of j."""
    back = to_jagged(to_padded(jagged, pad_to_multiple=multiple), jagged_lengths(jagged))
    rows, back_rows = _rows(jagged), _rows(back)
    assert len(rows) == len(back_rows)
    assert all(same_bits(a, b) for a, b in zip(rows, back_rows))


@given(padded_batches(bits=True), jagged_batches(bits=True))
@settings(max_examples=40)
def test_codec_moves_any_bit_pattern(batch: tuple[torch.Tensor, list[int]], jagged: torch.Tensor) -> None:
    """Any bits (NaN payloads, inf, -0.0, every carried dtype incl. uint64 and float8) survive both directions."""
    padded, lengths = batch
    rows = _rows(to_jagged(padded, lengths))
    assert all(same_bits(row, padded[i, :length]) for i, (row, length) in enumerate(zip(rows, lengths)))
    out = to_padded(jagged)
    assert all(same_bits(out[i, : row.shape[0]], row) for i, row in enumerate(_rows(jagged)))


def test_codec_refuses_dtypes_it_does_not_carry() -> None:
    """A dtype outside core.dtypes.CODEC_DTYPES is a TypeError naming the argument, never a torch kernel error."""
    with pytest.raises(TypeError, match=r"'padded' must have one of the dtypes the data plane carries .*got torch.uint4"):
        to_jagged(torch.zeros(2, 3, dtype=torch.uint4), [1, 2])
    with pytest.raises(TypeError, match=r"'jagged' must have one of the dtypes .*got torch.float8_e8m0fnu"):
        values = torch.zeros(3, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        to_padded(torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 1, 3])))
    with pytest.raises(TypeError, match=r"'fields\['x'\]' must have one of the dtypes .*got torch.int4"):
        pack_fields({"x": torch.zeros(2, 3, dtype=torch.int4)}, lengths=[1, 2], token_fields=["x"])


@given(routing_cases())
@settings(max_examples=60)
def test_routed_experts_round_trip_padded_jagged_padded_with_pad_minus_one(case: dict[str, Any]) -> None:
    """A [rows, tokens, layers, topk] int8 routing: jagged rows are its real tokens, and padding them back with
    -1 gives it on the real tokens and -1 (no route) everywhere else, dtype and shape kept."""
    routed, lengths = case["routed"], case["lengths"]
    jagged = to_jagged(routed, lengths)
    assert all(same_bits(row, routed[i, : lengths[i]]) for i, row in enumerate(_rows(jagged)))
    back = to_padded(jagged, pad_value=NO_ROUTE, pad_to_length=routed.shape[1])
    real = _valid_mask(lengths, routed.shape[1])[:, :, None, None]
    assert same_bits(back, torch.where(real, routed, torch.full_like(routed, NO_ROUTE)))
    packed = pack_fields({ROUTED_EXPERTS: routed}, lengths=lengths, token_fields=TOKEN_FIELDS & {ROUTED_EXPERTS})
    again = materialize(packed, pad_values={ROUTED_EXPERTS: NO_ROUTE}, pad_to_length=routed.shape[1])[ROUTED_EXPERTS]
    assert same_bits(again, back)


@given(codec_row_lengths(), st.integers(1, 8), st.integers(0, 8))
@settings(max_examples=50)
def test_to_padded_width_is_rounded_longest_or_pad_to_length(lengths: list[int], multiple: int, extra: int) -> None:
    """Width is the longest row rounded up to pad_to_multiple, or exactly pad_to_length."""
    jagged = to_jagged(torch.zeros(len(lengths), max(lengths, default=0), dtype=torch.int8), lengths)
    longest = max(lengths, default=0)
    assert to_padded(jagged, pad_to_multiple=multiple).shape[1] == -(-longest // multiple) * multiple
    exact = (-(-longest // multiple) + extra) * multiple
    assert to_padded(jagged, pad_to_multiple=multiple, pad_to_length=exact).shape[1] == exact


def test_to_padded_rejects_bad_input() -> None:
    """Dense inputs, wrong ragged dims, short or misaligned widths and unrepresentable pads raise."""
    jagged = _jagged([[1, 2, 3], [4]])
    with pytest.raises(TypeError, match=r"'jagged' must be a torch.jagged nested tensor: got a dense tensor .*to_jagged\(padded, lengths\)"):
        to_padded(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="'jagged' must be a torch.jagged nested tensor: got list"):
        to_padded([[1]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'jagged' must be ragged along dim 1 .*got ragged dims \[2\]"):
        to_padded(to_jagged(torch.zeros(2, 3, 4), [1, 2]).transpose(1, 2))
    with pytest.raises(ValueError, match=r"'pad_to_length' must be at least the longest row \(3\) of 'jagged': got 2"):
        to_padded(jagged, pad_to_length=2)
    with pytest.raises(ValueError, match=r"'pad_to_length' must be a multiple of 'pad_to_multiple' \(4\): got 6"):
        to_padded(jagged, pad_to_multiple=4, pad_to_length=6)
    with pytest.raises(ValueError, match="'pad_to_length' must be >= 0: got -1"):
        to_padded(jagged, pad_to_length=-1)
    with pytest.raises(ValueError, match="'pad_to_multiple' must be >= 1: got 0"):
        to_padded(jagged, pad_to_multiple=0)
    with pytest.raises(TypeError, match="'pad_to_multiple' must be an int: got float"):
        to_padded(jagged, pad_to_multiple=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'pad_to_length' must be an int or None: got str"):
        to_padded(jagged, pad_to_length="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'pad_value' must be a whole number for a torch.int64 field: got 0.5"):
        to_padded(jagged, pad_value=0.5)
    with pytest.raises(ValueError, match=r"'pad_value' must be in \[0, 255\] for a torch.uint8 field: got 256"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.uint8), [1]), pad_value=256)
    with pytest.raises(ValueError, match="'pad_value' must be 0/1 or False/True for a bool field: got 2"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.bool), [1]), pad_value=2)
    with pytest.raises(TypeError, match="'pad_value' must be a bool, int or float: got str"):
        to_padded(jagged, pad_value="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'pad_value' must be in \[-448.0, 448.0\] for a torch.float8_e4m3fn field: got 1000.0"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.float8_e4m3fn), [1]), pad_value=1000.0)
    with pytest.raises(ValueError, match=r"'pad_value' must be finite or NaN for a torch.float8_e4m3fnuz field \(it has no infinity\): got inf"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.float8_e4m3fnuz), [1]), pad_value=float("inf"))
    with pytest.raises(ValueError, match=r"'pad_value' must be in \[-65504.0, 65504.0\] for a torch.float16 field: got 100000.0"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.float16), [1]), pad_value=1e5)
    inf_pad = to_padded(to_jagged(torch.zeros(2, 2, dtype=torch.float8_e5m2), [1, 0]), pad_value=float("-inf"), pad_to_length=2)
    assert inf_pad.float()[0].tolist() == [0.0, float("-inf")]
    with pytest.raises(ValueError, match=r"'pad_value' must be in \[0, 65535\] for a torch.uint16 field: got -1"):
        to_padded(to_jagged(torch.zeros(1, 2, dtype=torch.uint16), [1]), pad_value=-1)


# ---------------------------------------------------------------- helpers


def test_is_jagged_only_for_jagged_layout() -> None:
    """is_jagged is True for torch.jagged nested tensors and False for anything else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert is_jagged(_jagged([[1], []]))
    assert not is_jagged(torch.zeros(2, 3))
    assert not is_jagged(strided)
    assert not is_jagged([[1]])
    with pytest.raises(TypeError, match="'jagged' must be a torch.jagged nested tensor: got layout torch.strided"):
        jagged_lengths(strided)


def test_jagged_lengths_reads_rows_with_holes() -> None:
    """jagged_lengths returns explicit lengths when the jagged tensor has holes."""
    holes = torch.nested.nested_tensor_from_jagged(torch.arange(9), torch.tensor([0, 4, 6, 9]), lengths=torch.tensor([2, 0, 3]))
    assert jagged_lengths(holes) == (2, 0, 3)
    assert jagged_lengths(_jagged([[1, 2], [], [3]])) == (2, 0, 1)
    with pytest.raises(TypeError, match=r"'jagged' must be a torch.jagged nested tensor: got a dense tensor of shape \(2, 3\)"):
        jagged_lengths(torch.zeros(2, 3))


# ---------------------------------------------------------------- pack_fields / materialize


@given(field_batches(), st.integers(1, 4))
@settings(max_examples=60)
def test_materialize_inverts_pack_fields(batch: tuple, multiple: int) -> None:
    """materialize(pack_fields(f)) is f on the valid region of token fields (pad elsewhere); dense fields are f's own."""
    fields, lengths, token_fields, pad_values = batch
    before = {name: t.clone() for name, t in fields.items()}
    packed = pack_fields(fields, lengths=lengths, token_fields=token_fields)
    out = materialize(packed, pad_values=pad_values, pad_to_multiple=multiple)
    width = -(-max(lengths, default=0) // multiple) * multiple
    assert list(out) == list(fields)
    for name, field in fields.items():
        if name in token_fields:
            assert is_jagged(packed[name]) and jagged_lengths(packed[name]) == tuple(lengths)
            rows = [field[i, :length] for i, length in enumerate(lengths)]
            assert same_bits(out[name], _loop_padded(rows, width, pad_values.get(name, 0), tuple(field.shape[2:]), field.dtype))
        else:
            assert packed[name] is field and out[name] is field
        assert same_bits(field, before[name])


@given(field_batches(), st.integers(0, 3))
@settings(max_examples=30)
def test_materialize_pad_to_length_resizes_only_token_fields(batch: tuple, extra: int) -> None:
    """pad_to_length sets the width of every token field and leaves dense fields alone."""
    fields, lengths, token_fields, _ = batch
    length = max(lengths, default=0) + extra
    out = materialize(pack_fields(fields, lengths=lengths, token_fields=token_fields), pad_to_length=length)
    for name, field in fields.items():
        if name in token_fields:
            assert out[name].shape == (len(lengths), length, *field.shape[2:])
        else:
            assert out[name] is field


@given(field_batches())
@settings(max_examples=20)
def test_materialize_jagged_layout_returns_fields_as_they_are(batch: tuple) -> None:
    """layout='jagged' returns every field object unchanged, in a new dict."""
    fields, lengths, token_fields, _ = batch
    packed = pack_fields(fields, lengths=lengths, token_fields=token_fields)
    out = materialize(packed, layout="jagged", pad_to_length=10**6)
    assert out is not packed and list(out) == list(packed)
    assert all(out[name] is packed[name] for name in packed)


@given(codec_row_lengths(), codec_dtypes)
@settings(max_examples=30)
def test_pack_fields_passes_matching_jagged_token_field_through(lengths: list[int], dtype: torch.dtype) -> None:
    """A token field that is already jagged with the same lengths is returned as is."""
    jagged = to_jagged(random_tensor((len(lengths), max(lengths, default=0), 2), dtype, 1), lengths)
    packed = pack_fields({"logprobs": jagged}, lengths=lengths, token_fields={"logprobs"})
    assert packed["logprobs"] is jagged


def test_pack_fields_trims_sequence_parallel_padding() -> None:
    """A token field wider than the longest row is trimmed to each row's length."""
    wide = torch.arange(12.0).reshape(2, 6)
    packed = pack_fields({"logprobs": wide}, lengths=[3, 1], token_fields=["logprobs"])
    assert [r.tolist() for r in packed["logprobs"].unbind()] == [[0.0, 1.0, 2.0], [6.0]]


def test_pack_fields_rejects_bad_input() -> None:
    """Missing names, wrong batch sizes, narrow or 1-D token fields and mismatched jagged lengths raise."""
    ids = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"'token_fields' must be a collection of names, not a single string: got 'ids'; wrap it, e\.g\. token_fields=\['ids'\]"):
        pack_fields({"ids": ids}, lengths=[1, 2], token_fields="ids")
    with pytest.raises(ValueError, match=r"'token_fields' names 'mask', which is not in 'fields' \(have \['ids'\]\)"):
        pack_fields({"ids": ids}, lengths=[1, 2], token_fields=["ids", "mask"])
    with pytest.raises(ValueError, match=r"'fields\['reward'\]' must have 2 rows \(one per entry of 'lengths'\): got 3"):
        pack_fields({"ids": ids, "reward": torch.zeros(3)}, lengths=[1, 2], token_fields=["ids"])
    with pytest.raises(ValueError, match=r"'fields\['ids'\]' must have 3 rows .*got 2"):
        pack_fields({"ids": ids}, lengths=[1, 2, 0], token_fields=["ids"])
    with pytest.raises(ValueError, match=r"'fields\['step'\]' must have a batch dim of 2 rows: got a 0-d tensor"):
        pack_fields({"ids": ids, "step": torch.tensor(3)}, lengths=[1, 2], token_fields=["ids"])
    with pytest.raises(ValueError, match=r"'fields\['reward'\]' is listed in 'token_fields', so it must be at least 2-D"):
        pack_fields({"reward": torch.zeros(2)}, lengths=[1, 2], token_fields=["reward"])
    with pytest.raises(ValueError, match=r"'fields\['ids'\]' must be at least 5 wide \(the longest of 'lengths'\): got shape \(2, 4\)"):
        pack_fields({"ids": ids}, lengths=[5, 2], token_fields=["ids"])
    with pytest.raises(ValueError, match=r"'fields\['ids'\]' is jagged with row lengths other than 'lengths': row 1 has 2, expected 3"):
        pack_fields({"ids": to_jagged(ids, [1, 2])}, lengths=[1, 3], token_fields=["ids"])
    with pytest.raises(ValueError, match="'lengths' entries must be >= 0: got -2 at index 0"):
        pack_fields({"ids": ids}, lengths=[-2, 1], token_fields=["ids"])
    with pytest.raises(TypeError, match=r"'fields\['ids'\]' must be a torch.Tensor: got list"):
        pack_fields({"ids": [[1]]}, lengths=[1], token_fields=["ids"])  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'fields' must be a mapping of name -> tensor: got list"):
        pack_fields([ids], lengths=[1, 2], token_fields=[])  # type: ignore[arg-type]


def test_materialize_rejects_bad_input() -> None:
    """Unknown layouts, bad pad tables and too-short widths raise, naming the field."""
    packed = pack_fields({"ids": torch.zeros(2, 4, dtype=torch.int64)}, lengths=[4, 2], token_fields=["ids"])
    with pytest.raises(ValueError, match=r"'layout' must be one of \('padded', 'jagged'\): got 'dense'"):
        materialize(packed, layout="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'pad_to_length' must be at least the longest row \(4\) of 'fields\['ids'\]': got 3"):
        materialize(packed, pad_to_length=3)
    with pytest.raises(ValueError, match=r"'pad_values\['ids'\]' must be a whole number for a torch.int64 field: got 1.5"):
        materialize(packed, pad_values={"ids": 1.5})
    with pytest.raises(TypeError, match="'pad_values' must be a mapping of field name -> pad value: got list"):
        materialize(packed, pad_values=[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'fields\['ids'\]' must be a torch.Tensor: got int"):
        materialize({"ids": 3})  # type: ignore[dict-item]
