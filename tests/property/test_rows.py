"""Laws and misuse of the column <-> rows codec (``adapters/rows.py``)."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from adapters.rows import (
    column_spec,
    ColumnSpec,
    build_tensordict,
    columns_equal,
    common_spec,
    from_bit_views,
    read_columns_of,
    split_column,
    stack_column,
    to_bit_views,
)
from core.codec import jagged_lengths
from core.dtypes import BIT_VIEWS
from tests.property.strategies import CODEC_DTYPES, dense_columns, jagged_columns, store_batches, store_columns

rows_and_column = st.integers(0, 5).flatmap(lambda n: st.tuples(st.just(n), store_columns(n)))
tensor_rows_and_column = st.integers(0, 5).flatmap(
    lambda n: st.tuples(st.just(n), st.one_of(dense_columns(n), jagged_columns(n)))
)
nonempty_rows_and_column = st.integers(1, 5).flatmap(lambda n: st.tuples(st.just(n), store_columns(n)))
column_specs = st.one_of(
    st.builds(
        ColumnSpec,
        kind=st.sampled_from(["dense", "jagged"]),
        dtype=st.sampled_from([str(d).removeprefix("torch.") for d in CODEC_DTYPES]),
        shape=st.lists(st.integers(0, 4), max_size=3),
    ),
    st.builds(
        ColumnSpec,
        kind=st.sampled_from(["object_array", "non_tensor_stack"]),
        dtype=st.just("object"),
        shape=st.lists(st.integers(0, 4), max_size=3),
    ),
)


def _kind(column: Any) -> str:
    if isinstance(column, torch.Tensor):
        return "jagged" if column.is_nested else "dense"
    return "object_array" if isinstance(column, np.ndarray) else "non_tensor_stack"


def _take(column: Any, order: list[int]) -> Any:
    """Reference selection: rows ``order`` (non-empty) of ``column``, by a plain per-row loop."""
    if isinstance(column, torch.Tensor) and column.is_nested:
        rows = column.unbind(0)
        return torch.nested.nested_tensor([rows[i] for i in order], layout=torch.jagged)
    if isinstance(column, torch.Tensor):
        return torch.stack([column[i] for i in order])
    if isinstance(column, np.ndarray):
        out = np.empty((len(order), *column.shape[1:]), dtype=object)
        for j, i in enumerate(order):
            out[j] = column[i]
        return out
    return NonTensorStack(*(column[i] for i in order))


# ---------------------------------------------------------------- laws


@given(rows_and_column)
def test_split_column_stack_column_round_trip(case: tuple[int, Any]) -> None:
    """stack_column(split_column(v)) equals v bit for bit, in the same kind, for every kind and dtype."""
    n, column = case
    spec, rows = split_column("f", column, n)
    assert spec.kind == _kind(column)
    assert len(rows) == n
    back = stack_column("f", spec, rows)
    assert columns_equal(back, column)
    if spec.kind == "jagged":
        assert jagged_lengths(back) == jagged_lengths(column)


@given(nonempty_rows_and_column, st.data())
def test_stack_column_selects_rows_like_a_loop(case: tuple[int, Any], data: st.DataObject) -> None:
    """Stacking any ordered subset of the rows equals selecting those rows one by one."""
    n, column = case
    order = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n))
    spec, rows = split_column("f", column, n)
    assert columns_equal(stack_column("f", spec, [rows[i] for i in order]), _take(column, order))


@given(tensor_rows_and_column)
def test_split_column_rows_do_not_alias_the_input(case: tuple[int, Any]) -> None:
    """Overwriting the input after a split changes neither the rows nor the column stacked from them."""
    n, column = case
    spec, rows = split_column("f", column, n)
    expected = stack_column("f", spec, rows)
    storage = column.values() if column.is_nested else column
    storage.fill_(1)
    assert columns_equal(stack_column("f", spec, rows), expected)


@given(tensor_rows_and_column)
def test_stack_column_result_does_not_alias_the_rows(case: tuple[int, Any]) -> None:
    """Overwriting a stacked column leaves its rows unchanged."""
    n, column = case
    spec, rows = split_column("f", column, n)
    snapshot = [row.clone() for row in rows]
    out = stack_column("f", spec, rows)
    (out.values() if out.is_nested else out).fill_(1)
    assert all(columns_equal(a, b) for a, b in zip(rows, snapshot))


def test_split_column_object_rows_are_deep_copies() -> None:
    """Mutating an object put in a column after the split does not reach the rows."""
    payload = {"a": [1]}
    column = np.fromiter([payload, None], dtype=object, count=2)
    spec, rows = split_column("o", column, 2)
    payload["a"].append(2)
    assert stack_column("o", spec, rows).tolist() == [{"a": [1]}, None]


@given(column_specs)
def test_column_spec_to_tag_round_trip(spec: ColumnSpec) -> None:
    """ColumnSpec.from_tag(spec.to_tag()) == spec, and the tag holds only str / list-of-int values."""
    tag = spec.to_tag()
    assert ColumnSpec.from_tag(tag) == spec
    assert isinstance(tag["kind"], str) and isinstance(tag["dtype"], str)
    assert all(type(x) is int for x in tag["shape"])


@given(rows_and_column)
def test_build_tensordict_read_columns_of_round_trip(case: tuple[int, Any]) -> None:
    """read_columns_of(build_tensordict(c)) == c, and reads a user's TensorDict the way it was written."""
    n, column = case
    user = TensorDict(batch_size=[n])
    user["f"] = column
    read = read_columns_of(user)["f"]
    assert columns_equal(read, column)
    rebuilt = build_tensordict({"f": read}, n)
    assert type(rebuilt.get("f")) is type(user.get("f"))
    assert columns_equal(read_columns_of(rebuilt)["f"], column)


# ---------------------------------------------------------------- examples


def test_split_column_keeps_n_and_n1_distinct() -> None:
    """(N,) and (N, 1) columns get different specs and stack back to their own shapes."""
    flat, _ = split_column("a", torch.zeros(3), 3)
    col, rows = split_column("b", torch.zeros(3, 1), 3)
    assert flat.shape == () and col.shape == (1,)
    assert stack_column("b", col, rows).shape == (3, 1)


def test_split_column_object_array_in_tensordict() -> None:
    """An object array set on a TensorDict comes back as that array from td[name], through the codec."""
    td = TensorDict(batch_size=[2])
    td["s"] = np.array(["x", {"y": 1}], dtype=object)
    spec, rows = split_column("s", td.get("s"), 2)
    out = build_tensordict({"s": stack_column("s", spec, rows)}, 2)
    assert isinstance(out.get("s"), NonTensorData)
    assert isinstance(out["s"], np.ndarray) and out["s"].tolist() == ["x", {"y": 1}]


def test_stack_column_zero_rows() -> None:
    """Stacking no rows gives an empty column of the spec's trailing shape and dtype."""
    assert stack_column("d", ColumnSpec("dense", "int8", (2,)), []).shape == (0, 2)
    empty = stack_column("j", ColumnSpec("jagged", "bool", (3,)), [])
    assert empty.dtype == torch.bool and jagged_lengths(empty) == ()
    assert stack_column("o", ColumnSpec("object_array", "object", ()), []).shape == (0,)


def test_columns_equal_detects_differences() -> None:
    """columns_equal tells apart kind, shape, dtype, one flipped bit, -0.0 vs 0.0, and jagged lengths; NaN equals NaN."""
    x = torch.tensor([1.0, float("nan")])
    assert columns_equal(x, x.clone())
    assert not columns_equal(x, x[:, None])
    assert not columns_equal(x, x.double())
    assert not columns_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    flipped = x.clone()
    flipped.view(torch.int32)[0] ^= 1
    assert not columns_equal(x, flipped)
    j1 = torch.nested.nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged)
    j2 = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)], layout=torch.jagged)
    assert columns_equal(j1, j1.clone()) and not columns_equal(j1, j2)
    assert not columns_equal(j1, torch.ones(2, 2))
    assert not columns_equal(np.array([1, 2], dtype=object), NonTensorStack(1, 2))
    assert not columns_equal(NonTensorStack(1, 2), NonTensorStack(2, 1))


def test_common_spec_returns_the_shared_spec() -> None:
    """Keys holding one spec (jagged rows of any length) share it."""
    spec = ColumnSpec("jagged", "float32", ())
    assert common_spec("ids", {"a": spec, "b": ColumnSpec("jagged", "float32", ())}) is spec


# ---------------------------------------------------------------- misuse


def test_split_column_rejects_wrong_row_count() -> None:
    """A column whose batch dim is not n is rejected, naming the field."""
    with pytest.raises(ValueError, match=r"field 'x' must have 3 rows \(the batch size\): got 2"):
        split_column("x", torch.zeros(2), 3)
    with pytest.raises(ValueError, match=r"field 'o' must have 3 rows"):
        split_column("o", np.empty(2, dtype=object), 3)
    with pytest.raises(ValueError, match=r"field 's' must have 3 rows"):
        split_column("s", NonTensorStack(1, 2), 3)
    with pytest.raises(ValueError, match=r"field 'z' must have a batch dim of 3 rows: got a 0-d tensor"):
        split_column("z", torch.tensor(1.0), 3)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (NonTensorData("hello", batch_size=[2]), r"field 'c' must hold one value per row: got a batch-wide NonTensorData wrapping str"),
        (np.array([1.0, 2.0]), r"field 'c' must be a numpy array of dtype object: got dtype float64"),
        (TensorDict({"a": torch.zeros(2)}, batch_size=[2]), r"field 'c' must be a tensor.*got a nested TensorDict"),
        (torch.zeros(2, 2).to_sparse(), r"field 'c' must be a strided \(dense\) tensor: got layout torch.sparse_coo"),
        ([1, 2], r"field 'c' must be a tensor, jagged tensor, object array or NonTensorStack: got list"),
        (torch.zeros(2, 3, dtype=torch.uint4), r"field 'c' must have one of the dtypes the data plane carries .*: got torch.uint4"),
        (torch.zeros(2, dtype=torch.complex128), r"field 'c' must have one of the dtypes .*: got torch.complex128"),
        (
            torch.nested.nested_tensor_from_jagged(torch.zeros(3, dtype=torch.uint8).view(torch.float8_e8m0fnu), torch.tensor([0, 1, 3])),
            r"field 'c' must have one of the dtypes .*: got torch.float8_e8m0fnu",
        ),
    ],
)
def test_split_column_rejects_unsupported_kinds(value: Any, match: str) -> None:
    """Values that are not one of the four kinds, or tensors of a dtype not carried, raise TypeError naming the field."""
    with pytest.raises(TypeError, match=match):
        split_column("c", value, 2)


def test_split_column_rejects_jagged_not_ragged_along_dim_1() -> None:
    """A jagged tensor ragged along dim 2 is rejected."""
    column = torch.nested.nested_tensor_from_jagged(torch.zeros(2, 5), torch.tensor([0, 2, 5]), jagged_dim=2)
    with pytest.raises(ValueError, match=r"field 'j' must be a jagged tensor ragged along dim 1: got ragged dims \[2\]"):
        split_column("j", column, 2)


def test_split_column_rejects_a_strided_nested_tensor() -> None:
    """A nested tensor of the strided layout raises TypeError naming the field and the layout to rebuild it with."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)
        column = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match=r"field 's' must be dense or a torch.jagged nested tensor: got a nested tensor with layout torch.strided; rebuild it with"):
        split_column("s", column, 2)


def test_stack_column_rejects_rows_that_do_not_fit() -> None:
    """Rows of another dtype, shape or type than the spec raise, naming row and field."""
    dense = ColumnSpec("dense", "float32", (2,))
    with pytest.raises(ValueError, match=r"row 1 of field 'x' must have dtype float32: got int64"):
        stack_column("x", dense, [torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"row 0 of field 'x' must have shape \(2,\): got \(3,\)"):
        stack_column("x", dense, [torch.zeros(3)])
    with pytest.raises(ValueError, match=r"row 0 of field 'j' must have shape \(len, 2\): got \(3,\)"):
        stack_column("j", ColumnSpec("jagged", "float32", (2,)), [torch.zeros(3)])
    with pytest.raises(TypeError, match=r"row 0 of field 'x' must be a dense tensor \(dense float32 \(N, 2\)\): got list"):
        stack_column("x", dense, [[0.0, 0.0]])
    with pytest.raises(ValueError, match=r"row 0 of field 'o' must be an object array of shape \(2,\): got list"):
        stack_column("o", ColumnSpec("object_array", "object", (2,)), [[1, 2]])
    with pytest.raises(ValueError, match=r"row 0 of field 's' must be a list of 2 .*: got a list of 1"):
        stack_column("s", ColumnSpec("non_tensor_stack", "object", (2,)), [["a"]])


def test_stack_column_rejects_bad_arguments() -> None:
    """A non-spec or a non-sequence of rows raises TypeError."""
    with pytest.raises(TypeError, match=r"'spec' of field 'x' must be a ColumnSpec: got dict"):
        stack_column("x", {"kind": "dense"}, [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'rows' of field 'x' must be a sequence of row values: got str"):
        stack_column("x", ColumnSpec("dense", "float32"), "ab")


def test_column_spec_rejects_invalid_values() -> None:
    """Unknown kinds, dtypes that do not fit the kind, and bad shapes are rejected on construction."""
    with pytest.raises(ValueError, match=r"'kind' must be one of"):
        ColumnSpec("ragged", "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'dtype' must name a carried torch dtype for a dense column \(one of bool, .*\): got 'float'"):
        ColumnSpec("dense", "float")
    with pytest.raises(ValueError, match=r"'dtype' must name a carried torch dtype for a jagged column .*got 'complex128'"):
        ColumnSpec("jagged", "complex128")
    with pytest.raises(ValueError, match=r"'dtype' must be 'object' for a object_array column: got 'int64'"):
        ColumnSpec("object_array", "int64")
    with pytest.raises(ValueError, match=r"'shape' entries must be >= 0: got -1 at index 0"):
        ColumnSpec("dense", "float32", (-1,))
    with pytest.raises(TypeError, match=r"'shape' entries must be int: got float at index 1"):
        ColumnSpec("dense", "float32", (1, 2.0))
    with pytest.raises(TypeError, match=r"'shape' must be a sequence of ints: got str"):
        ColumnSpec("dense", "float32", "12")
    with pytest.raises(ValueError, match=r"a object_array column has no torch dtype"):
        _ = ColumnSpec("object_array", "object").torch_dtype


def test_column_spec_from_tag_rejects_bad_tags() -> None:
    """A tag that is not a mapping or lacks a key is rejected, naming what is missing."""
    with pytest.raises(TypeError, match=r"'tag' must be a mapping with kind, dtype and shape: got list"):
        ColumnSpec.from_tag(["dense"])  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"missing \['shape'\]"):
        ColumnSpec.from_tag({"kind": "dense", "dtype": "float32"})


def test_common_spec_rejects_mixed_layouts() -> None:
    """A field stored dense for some keys and jagged for others cannot be stacked."""
    specs = {"a": ColumnSpec("dense", "int64", (4,)), "b": ColumnSpec("jagged", "int64", ())}
    with pytest.raises(ValueError, match=r"field 'ids' is stored with different layouts.*dense int64 \(N, 4\) for keys \['a'\].*jagged int64 \(N, j\) for keys \['b'\]"):
        common_spec("ids", specs)
    with pytest.raises(ValueError, match=r"field 'ids': 'specs' must hold at least one key's spec"):
        common_spec("ids", {})


def test_build_tensordict_rejects_wrong_row_count() -> None:
    """A column that does not have n rows, or a non-str name, is rejected."""
    with pytest.raises(ValueError, match=r"column 'x' must have 3 rows \(the batch size\): got 2"):
        build_tensordict({"x": torch.zeros(2)}, 3)
    with pytest.raises(TypeError, match=r"'columns' keys must be str: got int"):
        build_tensordict({1: torch.zeros(2)}, 2)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"'columns' must be a mapping of name -> column: got list"):
        build_tensordict([torch.zeros(2)], 2)  # type: ignore[arg-type]


def test_read_columns_of_rejects_non_tensordict() -> None:
    """Only TensorDicts can be read."""
    with pytest.raises(TypeError, match=r"'td' must be a TensorDict: got dict"):
        read_columns_of({"x": torch.zeros(2)})  # type: ignore[arg-type]


@given(rows_and_column)
def test_column_spec_equals_split_column_spec(case: tuple[int, Any]) -> None:
    """column_spec gives the spec split_column would, without splitting into rows."""
    n, column = case
    assert column_spec("f", column, n) == split_column("f", column, n)[0]


def test_column_spec_rejects_wrong_row_count() -> None:
    """A column whose first dimension is not the batch size raises, naming the field."""
    with pytest.raises(ValueError, match="'f'"):
        column_spec("f", torch.zeros(3, 2), 4)


# ---------------------------------------------------------------- transport bit views


@given(store_batches())
@settings(max_examples=40)
def test_from_bit_views_inverts_to_bit_views_across_pickling(batch: tuple[list[str], TensorDict]) -> None:
    """A batch sent as to_bit_views gives, pickled and restored with from_bit_views, every column bit for bit;
    exactly the uint16/32/64 and float8 columns travel viewed, as signed integers of their width."""
    _, td = batch
    wire, dtypes = to_bit_views(td)
    viewed = {name for name, value in read_columns_of(td).items() if isinstance(value, torch.Tensor) and value.dtype in BIT_VIEWS}
    assert set(dtypes) == viewed
    for name in viewed:
        assert wire.get(name).dtype == BIT_VIEWS[td.get(name).dtype]
    back = from_bit_views(*pickle.loads(pickle.dumps((wire, dtypes))))
    assert list(back.keys()) == list(td.keys())
    for name in td.keys():
        assert columns_equal(back.get(name), td.get(name)), name


def test_to_bit_views_without_views_returns_the_batch_itself() -> None:
    """A batch with no column to view is sent as it is; from_bit_views with no views returns it as it is."""
    td = TensorDict({"x": torch.zeros(2, dtype=torch.bfloat16)}, batch_size=[2])
    assert to_bit_views(td) == (td, {})
    assert from_bit_views(td, {}) is td


def test_bit_views_reject_bad_input() -> None:
    """A dtype not carried, a non-mapping, an unknown column and a wrong bit dtype raise, naming what is wrong."""
    with pytest.raises(TypeError, match=r"field 'c' must have one of the dtypes the data plane carries .*got torch.complex128"):
        to_bit_views(TensorDict({"c": torch.zeros(2, dtype=torch.complex128)}, batch_size=[2]))
    td = TensorDict({"x": torch.zeros(2, dtype=torch.int16)}, batch_size=[2])
    with pytest.raises(TypeError, match=r"'dtypes' must be a mapping of column name -> dtype name: got list"):
        from_bit_views(td, ["x"])  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"'dtypes' names column 'y', which the TensorDict lacks \(have \['x'\]\)"):
        from_bit_views(td, {"y": "uint16"})
    with pytest.raises(ValueError, match=r"'bits' must have dtype torch.int32 \(the bit view of torch.uint32\): got torch.int16"):
        from_bit_views(td, {"x": "uint32"})
