"""The data-plane contract (``adapters/store_port.py``), run against every adapter through the ``store`` fixture.

Every test here holds for each entry of ``STORE_FACTORIES``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from adapters.rows import columns_equal
from adapters.store_port import DataPlaneClient, ReservedTagPutClient, TagColumns, TaggedGetClient
from core.codec import jagged_lengths, to_jagged
from core.dtypes import CODEC_DTYPES
from shell.column_io import first_write, read_columns, write_columns
from tests.property.strategies import random_bits


def _ids(n: int, offset: int = 0) -> TensorDict:
    """A one-field batch whose row i holds ``offset + i`` (so rows are recognisable)."""
    return TensorDict({"x": torch.arange(offset, offset + n)}, batch_size=[n])


def _every_kind(n: int, lengths: list[int]) -> TensorDict:
    """A batch with a field for each carried dtype (``core.dtypes.CODEC_DTYPES``) and shape (N,), (N,1), (N,S),
    (N,S,D), jagged, plus object columns; random bits, so floats hold NaN payloads, infinities and -0.0."""
    td = TensorDict(batch_size=[n])
    for i, dtype in enumerate(CODEC_DTYPES):
        name = str(dtype).removeprefix("torch.")
        td[f"{name}_n"] = random_bits((n,), dtype, i)
        td[f"{name}_n1"] = random_bits((n, 1), dtype, i + 100)
        td[f"{name}_ns"] = random_bits((n, 5), dtype, i + 200)
        td[f"{name}_nsd"] = random_bits((n, 5, 3), dtype, i + 300)
        td[f"{name}_jagged"] = to_jagged(random_bits((n, max(lengths)), dtype, i + 400), lengths)
        td[f"{name}_jagged_d"] = to_jagged(random_bits((n, max(lengths), 2), dtype, i + 500), lengths)
    td["objects"] = np.array([{"uid": i, "turns": [i] * i} for i in range(n)], dtype=object)
    td["texts"] = NonTensorStack(*(f"prompt {i}" for i in range(n)))
    return td


def _assert_columns(got: TensorDict, expected: TensorDict, order: list[int]) -> None:
    assert list(got.keys()) == list(expected.keys())
    assert got.batch_size == torch.Size([len(order)])
    for name in expected.keys():
        assert columns_equal(got.get(name), _rows(expected.get(name), order)), name


def _rows(column: Any, order: list[int]) -> Any:
    if isinstance(column, NonTensorData):
        return column.data[order]
    if isinstance(column, NonTensorStack):
        return NonTensorStack(*(column[i] for i in order))
    if column.is_nested:
        rows = column.unbind(0)
        return torch.nested.nested_tensor([rows[i] for i in order], layout=torch.jagged)
    return column[order]


# ---------------------------------------------------------------- round trips


def test_get_round_trips_every_shape_and_dtype(store: DataPlaneClient, partition: str) -> None:
    """Every carried dtype and shape comes back bit-exact in its kind and dtype (NaN payloads too): (N,) and (N,1)
    distinct, jagged incl. empty rows; uint16/32/64 and float8 included."""
    keys = ["a", "b", "c", "d"]
    fields = _every_kind(4, [3, 0, 5, 1])
    assert any(t.isnan().any() for t in (fields[f"{n}_nsd"].float() for n in ("float32", "bfloat16", "float8_e5m2")))
    store.put(keys, partition, fields)
    got = store.get(keys, partition, list(fields.keys()))
    _assert_columns(got, fields, [0, 1, 2, 3])
    for dtype in CODEC_DTYPES:
        name = str(dtype).removeprefix("torch.")
        assert got[f"{name}_ns"].dtype == dtype and got[f"{name}_jagged_d"].dtype == dtype
    assert got["float32_n"].shape == (4,) and got["float32_n1"].shape == (4, 1)
    assert jagged_lengths(got["bfloat16_jagged"]) == (3, 0, 5, 1)
    assert isinstance(got["objects"], np.ndarray) and isinstance(got.get("objects"), NonTensorData)
    assert got["objects"].tolist() == fields["objects"].tolist()
    assert isinstance(got.get("texts"), NonTensorStack) and got.get("texts").tolist() == fields.get("texts").tolist()


TOKEN_LENGTHS = [3, 0, 5, 1]


def _rollout_of_every_dtype(seed: int) -> dict[str, torch.Tensor]:
    """Per-token fields (N, S) and (N, S, 2) of every carried dtype, random bits, 2 columns of forward padding."""
    n, width = len(TOKEN_LENGTHS), max(TOKEN_LENGTHS) + 2
    out = {}
    for i, dtype in enumerate(CODEC_DTYPES):
        name = str(dtype).removeprefix("torch.")
        out[f"{name}_tok"] = random_bits((n, width), dtype, seed + i)
        out[f"{name}_tok_d"] = random_bits((n, width, 2), dtype, seed + 100 + i)
    return out


def _padded_reference(padded: torch.Tensor, width: int) -> torch.Tensor:
    """Row i's first TOKEN_LENGTHS[i] tokens of ``padded``, zero bits after them, ``width`` wide: a per-row loop."""
    out = torch.zeros((padded.shape[0], width, *padded.shape[2:]), dtype=padded.dtype)
    for i, length in enumerate(TOKEN_LENGTHS):
        out[i, :length] = padded[i, :length]
    return out


def _assert_jagged_rows(got: torch.Tensor, padded: torch.Tensor) -> None:
    assert got.dtype == padded.dtype and jagged_lengths(got) == tuple(TOKEN_LENGTHS)
    for i, row in enumerate(got.unbind(0)):
        assert columns_equal(row, padded[i, : TOKEN_LENGTHS[i]].contiguous()), i


def test_first_write_round_trips_every_dtype_through_the_jagged_path(store: DataPlaneClient, partition: str) -> None:
    """first_write of per-token fields of every carried dtype, then read_columns jagged and padded, and a
    write_columns trim of results of every dtype, give each row's tokens back bit for bit (NaN payloads too),
    padded with zero bits; uint16/32/64 and float8 included."""
    keys = ["r0", "r1", "r2", "r3"]
    rollout = _rollout_of_every_dtype(0)
    meta = first_write(store, rollout, keys=keys, partition_id=partition, lengths=TOKEN_LENGTHS, token_fields=list(rollout))
    jagged = read_columns(store, meta, list(rollout), layout="jagged")
    padded = read_columns(store, meta, list(rollout), layout="padded")
    for name, column in rollout.items():
        _assert_jagged_rows(jagged[name], column)
        assert columns_equal(padded[name], _padded_reference(column, max(TOKEN_LENGTHS))), name
    results = {f"{name}_result": value for name, value in _rollout_of_every_dtype(1000).items()}
    meta = write_columns(store, meta, results, token_fields=list(results))
    back = read_columns(store, meta.subset([2, 0]), list(results), layout="jagged")
    for name, column in results.items():
        rows = back[name].unbind(0)
        for row, i in zip(rows, [2, 0]):
            assert columns_equal(row, column[i, : TOKEN_LENGTHS[i]].contiguous()), name


def test_get_round_trips_all_empty_jagged_rows(store: DataPlaneClient, partition: str) -> None:
    """A jagged field whose rows are all empty comes back jagged with empty rows."""
    field = to_jagged(torch.zeros(2, 3, dtype=torch.bfloat16), [0, 0])
    store.put(["a", "b"], partition, TensorDict({"j": field}, batch_size=[2]))
    got = store.get(["b", "a"], partition, ["j"])["j"]
    assert got.dtype == torch.bfloat16 and jagged_lengths(got) == (0, 0)


def test_get_returns_rows_in_request_order(store: DataPlaneClient, partition: str) -> None:
    """Rows come back in the order of the requested keys, not the put order."""
    keys = ["k0", "k1", "k2", "k3", "k4"]
    fields = _every_kind(5, [1, 4, 0, 2, 3])
    store.put(keys, partition, fields)
    order = [3, 0, 4, 1]
    got = store.get([keys[i] for i in order], partition, list(fields.keys()))
    _assert_columns(got, fields, order)


def test_get_selects_only_the_requested_fields(store: DataPlaneClient, partition: str) -> None:
    """A get returns exactly the selected fields, in the selected order."""
    fields = TensorDict({"x": torch.arange(3), "y": torch.ones(3, 2), "z": torch.zeros(3)}, batch_size=[3])
    store.put(["a", "b", "c"], partition, fields)
    got = store.get(["c", "a"], partition, ["z", "x"])
    assert list(got.keys()) == ["z", "x"]
    assert got["x"].tolist() == [2, 0]


def test_put_adds_fields_to_existing_keys(store: DataPlaneClient, partition: str) -> None:
    """A second put of new fields under the same keys keeps the first put's fields."""
    store.put(["a", "b"], partition, TensorDict({"input_ids": to_jagged(torch.ones(2, 4), [4, 1])}, batch_size=[2]))
    store.put(["b", "a"], partition, TensorDict({"logprobs": to_jagged(torch.zeros(2, 4), [1, 4])}, batch_size=[2]))
    got = store.get(["a", "b"], partition, ["input_ids", "logprobs"])
    assert jagged_lengths(got["input_ids"]) == (4, 1)
    assert jagged_lengths(got["logprobs"]) == (4, 1)


def test_put_require_stored_writes_only_under_stored_keys(store: DataPlaneClient, partition: str) -> None:
    """With require_stored a put to stored keys adds its field; one unknown key makes it raise and write nothing."""
    store.put(["a", "b"], partition, TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]))
    store.put(["b", "a"], partition, TensorDict({"y": torch.tensor([20, 10])}, batch_size=[2]), require_stored=True)
    assert store.get(["a", "b"], partition, ["x", "y"])["y"].tolist() == [10, 20]
    with pytest.raises(KeyError, match=rf"1 keys are not stored in partition '{partition}': \['ghost'\]"):
        store.put(["a", "ghost"], partition, TensorDict({"z": torch.tensor([1, 2])}, batch_size=[2]), require_stored=True)
    assert store.list_keys(partition) == ("a", "b")
    assert store.describe(["a", "b"], partition).fields == ("x", "y")
    with pytest.raises(KeyError, match="not stored"):
        store.put(["n"], f"{partition}-empty", TensorDict({"z": torch.tensor([1])}, batch_size=[1]), require_stored=True)
    assert store.list_keys(f"{partition}-empty") == ()


def test_get_stacks_jagged_rows_from_different_puts(store: DataPlaneClient, partition: str) -> None:
    """Jagged rows of one field put by separate calls (different lengths) stack into one column."""
    store.put(["a"], partition, TensorDict({"j": to_jagged(torch.full((1, 5), 1.0), [5])}, batch_size=[1]))
    store.put(["b"], partition, TensorDict({"j": to_jagged(torch.full((1, 2), 2.0), [0])}, batch_size=[1]))
    got = store.get(["b", "a"], partition, ["j"])["j"]
    assert jagged_lengths(got) == (0, 5)
    assert got.unbind(0)[1].tolist() == [1.0] * 5


def test_put_rewrite_replaces_the_field(store: DataPlaneClient, partition: str) -> None:
    """Last write wins for a field under a key, even when the new value has another shape or kind."""
    store.put(["a", "b"], partition, _ids(2))
    store.put(["b"], partition, _ids(1, offset=10))
    assert store.get(["a", "b"], partition, ["x"])["x"].tolist() == [0, 10]
    store.put(["a", "b"], partition, TensorDict({"x": to_jagged(torch.ones(2, 3), [3, 2])}, batch_size=[2]))
    assert jagged_lengths(store.get(["a", "b"], partition, ["x"])["x"]) == (3, 2)


def test_partitions_are_independent(store: DataPlaneClient, partition: str) -> None:
    """The same key in two partitions holds two values; clearing one leaves the other."""
    other = f"{partition}-other"
    store.put(["k"], partition, _ids(1, offset=1))
    store.put(["k"], other, _ids(1, offset=2))
    assert store.get(["k"], partition, ["x"])["x"].tolist() == [1]
    assert store.get(["k"], other, ["x"])["x"].tolist() == [2]
    store.clear(["k"], partition)
    assert store.get(["k"], other, ["x"])["x"].tolist() == [2]
    assert store.list_keys(partition) == ()
    store.clear(["k"], other)


def test_put_returns_the_receipt_of_this_put(store: DataPlaneClient, partition: str) -> None:
    """The receipt names the partition, keys, the fields this put wrote, and its tags and lengths."""
    store.put(["a", "b"], partition, _ids(2))
    fields = TensorDict({"y": torch.ones(2), "z": torch.zeros(2)}, batch_size=[2])
    receipt = store.put(["a", "b"], partition, fields, tags=[{"r": 1}, {}], sequence_lengths=[3, 4])
    assert receipt.partition_id == partition and receipt.keys == ("a", "b")
    assert receipt.fields == ("y", "z")
    assert receipt.tags == ({"r": 1}, {}) and receipt.sequence_lengths == (3, 4)


def test_put_merges_tags_and_keeps_lengths(store: DataPlaneClient, partition: str) -> None:
    """Tags merge across puts (new values win); lengths are kept unless a put gives new ones."""
    store.put(["a", "b"], partition, _ids(2), tags=[{"uid": 0, "r": 0.0}, {"uid": 1}], sequence_lengths=[3, 4])
    store.put(["a", "b"], partition, TensorDict({"y": torch.ones(2)}, batch_size=[2]), tags=[{"r": 1.0}, {"adv": -1.0}])
    meta = store.describe(["b", "a"], partition)  # type: ignore[attr-defined]
    assert meta.tags == ({"uid": 1, "adv": -1.0}, {"uid": 0, "r": 1.0})
    assert meta.sequence_lengths == (4, 3)
    assert meta.fields == ("x", "y")
    store.put(["a"], partition, _ids(1), sequence_lengths=[7])
    assert store.describe(["a", "b"], partition).sequence_lengths == (7, 4)  # type: ignore[attr-defined]


def test_get_with_tags_returns_the_columns_and_the_named_tags(store: DataPlaneClient, partition: str) -> None:
    """get_with_tags gives what get gives and, per key in request order, the named tags that key holds."""
    assert isinstance(store, TaggedGetClient)
    batch = _every_kind(3, [3, 0, 2])
    store.put(["a", "b", "c"], partition, batch, tags=[{"uid": 0, "d": 5}, {"uid": 1}, {"uid": 2, "d": -7}])
    store.put(["b"], partition, _ids(1), tags=[{"d": 9}])  # tags merged across puts count
    columns, tags = store.get_with_tags(["c", "b", "a"], partition, list(batch.keys()), ["d", "missing"])
    _assert_columns(columns, batch, [2, 1, 0])
    assert tags == ({"d": -7}, {"d": 9}, {"d": 5})
    assert store.get_with_tags(["b"], partition, ["x"], [])[1] == ({},)
    with pytest.raises(TypeError, match=r"'tag_names' must be a sequence of tag names, not a single string"):
        store.get_with_tags(["b"], partition, ["x"], "d")
    with pytest.raises(KeyError, match=r"1 keys are not stored in partition .*\['zz'\]"):
        store.get_with_tags(["b", "zz"], partition, ["x"], ["d"])
    with pytest.raises(KeyError, match=r"field 'x' is missing in partition .* for 2 keys: \['a', 'c'\]"):
        store.get_with_tags(["a", "b", "c"], partition, ["x"], ["d"])


def test_describe_lists_only_fields_every_key_holds(store: DataPlaneClient, partition: str) -> None:
    """describe's fields are those all requested keys hold; lengths are None unless every key has one."""
    store.put(["a", "b"], partition, _ids(2), sequence_lengths=[1, 2])
    store.put(["c"], partition, TensorDict({"x": torch.zeros(1), "y": torch.zeros(1)}, batch_size=[1]))
    assert store.describe(["a", "c"], partition).fields == ("x",)  # type: ignore[attr-defined]
    assert store.describe(["a", "c"], partition).sequence_lengths is None  # type: ignore[attr-defined]
    assert store.describe(["c"], partition).fields == ("x", "y")  # type: ignore[attr-defined]
    with pytest.raises(KeyError, match=r"1 keys are not stored in partition .*\['zz'\]"):
        store.describe(["a", "zz"], partition)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"'keys' must name at least one row: got none"):
        store.describe([], partition)  # type: ignore[attr-defined]


def test_list_keys_in_first_put_order(store: DataPlaneClient, partition: str) -> None:
    """list_keys gives stored keys in first-put order (a rewrite keeps a key's place); unknown partition: ()."""
    assert store.list_keys(partition) == ()
    store.put(["b", "a"], partition, _ids(2))
    store.put(["c", "b"], partition, _ids(2))
    assert store.list_keys(partition) == ("b", "a", "c")


def test_list_keys_rejects_a_non_str_partition(store: DataPlaneClient) -> None:
    """A partition id that is not a str is a TypeError."""
    with pytest.raises(TypeError, match=r"'partition_id' must be a str: got int"):
        store.list_keys(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- clears


def test_clear_is_exact(store: DataPlaneClient, partition: str) -> None:
    """clear(K) removes exactly K: 'k1' leaves 'k11', '6@a' leaves '16@a'."""
    keys = ["k1", "k11", "6@a", "16@a"]
    store.put(keys, partition, _ids(4))
    store.clear(["k1", "6@a"], partition)
    assert store.list_keys(partition) == ("k11", "16@a")
    assert store.get(["16@a", "k11"], partition, ["x"])["x"].tolist() == [3, 1]


def test_get_after_clear_raises_key_error(store: DataPlaneClient, partition: str) -> None:
    """A cleared key is unknown to get, alone or with live keys."""
    store.put(["a", "b"], partition, _ids(2))
    store.clear(["a"], partition)
    with pytest.raises(KeyError, match=r"1 keys are not stored in partition .*\['a'\]"):
        store.get(["a"], partition, ["x"])
    with pytest.raises(KeyError, match=r"\['a'\]"):
        store.get(["b", "a"], partition, ["x"])


def test_clear_then_put_stores_the_key_afresh(store: DataPlaneClient, partition: str) -> None:
    """A key put again after a clear holds only the new fields, tags and lengths."""
    store.put(["a"], partition, TensorDict({"x": torch.ones(1), "y": torch.ones(1)}, batch_size=[1]), tags=[{"r": 1}])
    store.clear(["a"], partition)
    store.put(["a"], partition, _ids(1))
    with pytest.raises(KeyError, match=r"field 'y' is missing"):
        store.get(["a"], partition, ["y"])
    assert store.describe(["a"], partition).tags == ({},)  # type: ignore[attr-defined]


def test_clear_unknown_keys_raises_and_removes_nothing(store: DataPlaneClient, partition: str) -> None:
    """Clearing keys that are not stored raises KeyError naming them, and clears none of the others."""
    store.put(["a", "b"], partition, _ids(2))
    with pytest.raises(KeyError, match=r"1 keys are not stored in partition .*\['zz'\]"):
        store.clear(["a", "zz"], partition)
    assert store.list_keys(partition) == ("a", "b")
    with pytest.raises(KeyError, match=r"\['a'\]"):
        store.clear(["a"], f"{partition}-other")


def test_clear_rejects_duplicate_keys(store: DataPlaneClient, partition: str) -> None:
    """Repeated keys in a clear are a ValueError and remove nothing."""
    store.put(["a"], partition, _ids(1))
    with pytest.raises(ValueError, match=r"'keys' must be unique: 'a' repeats"):
        store.clear(["a", "a"], partition)
    assert store.list_keys(partition) == ("a",)


def test_clear_of_no_keys_does_nothing(store: DataPlaneClient, partition: str) -> None:
    """clear([]) is a no-op."""
    store.put(["a"], partition, _ids(1))
    store.clear([], partition)
    assert store.list_keys(partition) == ("a",)


# ---------------------------------------------------------------- failing loudly


def test_get_unknown_keys_raises_key_error(store: DataPlaneClient, partition: str) -> None:
    """Keys never put raise KeyError, alone or mixed with stored keys; the message names only the unknown ones."""
    with pytest.raises(KeyError, match=r"2 keys are not stored in partition .*\['x', 'y'\]"):
        store.get(["x", "y"], partition, ["x"])
    store.put(["a"], partition, _ids(1))
    with pytest.raises(KeyError, match=r"1 keys are not stored in partition .*\['a1'\]"):
        store.get(["a", "a1"], partition, ["x"])


def test_get_missing_field_raises_key_error_naming_field_and_keys(store: DataPlaneClient, partition: str) -> None:
    """A selected field that some keys lack raises KeyError naming the field and those keys."""
    store.put(["a", "b", "c"], partition, _ids(3))
    store.put(["b"], partition, TensorDict({"y": torch.ones(1)}, batch_size=[1]))
    with pytest.raises(KeyError, match=r"field 'y' is missing in partition .* for 2 keys: \['c', 'a'\]"):
        store.get(["c", "b", "a"], partition, ["x", "y"])


def test_get_mixed_layouts_raises_value_error(store: DataPlaneClient, partition: str) -> None:
    """A field put dense for some keys and jagged for others cannot be read in one get."""
    store.put(["a"], partition, TensorDict({"ids": torch.ones(1, 3)}, batch_size=[1]))
    store.put(["b"], partition, TensorDict({"ids": to_jagged(torch.ones(1, 3), [2])}, batch_size=[1]))
    with pytest.raises(ValueError, match=r"field 'ids' is stored with different layouts"):
        store.get(["a", "b"], partition, ["ids"])
    assert store.get(["b"], partition, ["ids"])["ids"].is_nested


def test_get_rejects_bad_arguments(store: DataPlaneClient, partition: str) -> None:
    """A single-string field selection, no fields, no keys and repeated keys are rejected before I/O."""
    store.put(["a"], partition, _ids(1))
    with pytest.raises(TypeError, match=r"'fields' must be a sequence of strings, not a single string"):
        store.get(["a"], partition, "x")
    with pytest.raises(ValueError, match=r"'select_fields' must name at least one field"):
        store.get(["a"], partition, [])
    with pytest.raises(ValueError, match=r"'keys' must name at least one row"):
        store.get([], partition, ["x"])
    with pytest.raises(ValueError, match=r"'keys' must be unique: 'a' repeats"):
        store.get(["a", "a"], partition, ["x"])


@pytest.mark.parametrize(
    ("keys", "fields", "kwargs", "error", "match"),
    [
        (["a", "a"], _ids(2), {}, ValueError, r"'keys' must be unique: 'a' repeats"),
        (["a", "new"], _ids(3), {}, ValueError, r"'fields' batch size must equal the key count 2: got 3"),
        (["a", "new"], _ids(2), {"tags": [{}]}, ValueError, r"'tags' must have 2 entries \(one per key\): got 1"),
        (["a", "new"], _ids(2), {"sequence_lengths": [1, 2, 3]}, ValueError, r"'sequence_lengths' must have 2 entries"),
        (
            ["a", "new"],
            _ids(2),
            {"tags": [{}, {"uid": 1, "__digest__.x": 5}]},
            ValueError,
            r"tag names starting with '__digest__\.' are reserved for integrity digests: got \['__digest__\.x'\] at index 1",
        ),
        (["a", "new"], {"x": torch.zeros(2)}, {}, TypeError, r"'fields' must be a TensorDict"),
        (
            ["a", "new"],
            TensorDict({"y": torch.zeros(2), "bad": NonTensorData("batch-wide", batch_size=[2])}, batch_size=[2]),
            {},
            TypeError,
            r"field 'bad' must hold one value per row",
        ),
    ],
    ids=[
        "duplicate-keys",
        "batch-mismatch",
        "tags-not-1to1",
        "lengths-not-1to1",
        "reserved-tag",
        "not-a-tensordict",
        "unsupported-column",
    ],
)
def test_put_rejected_writes_nothing(
    store: DataPlaneClient,
    partition: str,
    keys: list[str],
    fields: Any,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    """A rejected put raises and leaves the partition as it was: no new keys, old data and tags unchanged."""
    store.put(["a"], partition, _ids(1, offset=7), tags=[{"r": 1}])
    with pytest.raises(error, match=match):
        store.put(keys, partition, fields, **kwargs)
    assert store.list_keys(partition) == ("a",)
    got = store.get(["a"], partition, ["x"])
    assert list(got.keys()) == ["x"] and got["x"].tolist() == [7]
    assert store.describe(["a"], partition).tags == ({"r": 1},)  # type: ignore[attr-defined]


def test_put_with_reserved_tags_by_name_writes_what_a_mapping_per_key_writes(store: DataPlaneClient, partition: str) -> None:
    """Reserved tags given by name (a TagColumns, as MeteredClient gives its digests) are written as the same
    tags given a mapping per key would be, a key that lacks one included; a non-reserved name writes nothing."""
    assert isinstance(store, ReservedTagPutClient)
    by_name = TagColumns({"__digest__.x": [11, None], "__digest__.y": [5, 6]}, 2, absent={"__digest__.x": [1]})
    store.put_with_reserved_tags(["a", "b"], partition, _ids(2), reserved_tags=by_name, tags=[{"r": 1}, {}])
    expected = ({"r": 1, "__digest__.x": 11, "__digest__.y": 5}, {"__digest__.y": 6})
    assert store.describe(["a", "b"], partition).tags == expected  # type: ignore[attr-defined]
    _, tags = store.get_with_tags(["b", "a"], partition, ["x"], ["__digest__.x", "__digest__.y"])  # type: ignore[attr-defined]
    assert tags == ({"__digest__.y": 6}, {"__digest__.x": 11, "__digest__.y": 5})
    bad = TagColumns({"__digest__.x": [1, 2], "r": [None, 3]}, 2, absent={"r": [0]})
    with pytest.raises(ValueError, match=r"'reserved_tags' names must start with '__digest__\.': got \['r'\] at index 1"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=bad)
    with pytest.raises(ValueError, match=r"'reserved_tags' must have 2 entries \(one per key\): got 3"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=TagColumns({}, 3))
    assert store.list_keys(partition) == ("a", "b")
    assert store.describe(["a", "b"], partition).tags == expected  # type: ignore[attr-defined]


def test_put_with_reserved_tags_writes_them_and_rejects_others(store: DataPlaneClient, partition: str) -> None:
    """put_with_reserved_tags merges reserved tags into the stored tags (the receipt keeps the user tags); a
    non-reserved or unmatched one writes nothing."""
    assert isinstance(store, ReservedTagPutClient)
    reserved = [{"__digest__.x": 11}, {"__digest__.x": -2}]
    receipt = store.put_with_reserved_tags(["a", "b"], partition, _ids(2), reserved_tags=reserved, tags=[{"r": 1}, {}])
    assert receipt.tags == ({"r": 1}, {})
    reserved[0]["__digest__.x"] = 99  # the store holds what was passed, not the caller's mapping
    assert store.describe(["b", "a"], partition).tags == ({"__digest__.x": -2}, {"r": 1, "__digest__.x": 11})  # type: ignore[attr-defined]
    _, tags = store.get_with_tags(["a", "b"], partition, ["x"], ["__digest__.x"])  # type: ignore[attr-defined]
    assert tags == ({"__digest__.x": 11}, {"__digest__.x": -2})
    with pytest.raises(ValueError, match=r"'reserved_tags' names must start with '__digest__\.': got \['r'\] at index 0"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=[{"r": 2}, {}])
    with pytest.raises(ValueError, match=r"'reserved_tags' names must start with '__digest__\.': got \['r'\] at index 1"):
        store.put_with_reserved_tags(  # every key's names are checked, not just the first key's
            ["a", "new"], partition, _ids(2, 5), reserved_tags=[{"__digest__.x": 1}, {"__digest__.x": 1, "r": 2}]
        )
    with pytest.raises(TypeError, match=r"'reserved_tags' entries must be mappings: got list at index 1"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=[{}, ["__digest__.x"]])
    with pytest.raises(ValueError, match=r"'reserved_tags' must have 2 entries \(one per key\): got 1"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=[{}])
    with pytest.raises(ValueError, match=r"tag names starting with '__digest__\.' are reserved .* at index 0"):
        store.put_with_reserved_tags(["a", "new"], partition, _ids(2, 5), reserved_tags=[{}, {}], tags=[{"__digest__.x": 0}, {}])
    assert store.list_keys(partition) == ("a", "b")
    assert store.get(["a"], partition, ["x"])["x"].tolist() == [0]
    assert store.describe(["a"], partition).tags == ({"r": 1, "__digest__.x": 11},)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- aliasing and lifecycle


def test_put_does_not_alias_the_input(store: DataPlaneClient, partition: str) -> None:
    """Mutating the put's tensors and objects afterwards does not change what get returns."""
    fields = _every_kind(3, [2, 0, 3])
    expected = _every_kind(3, [2, 0, 3])
    store.put(["a", "b", "c"], partition, fields)
    for name in fields.keys():
        value = fields.get(name)
        if isinstance(value, torch.Tensor):
            (value.values() if value.is_nested else value).fill_(1)
    fields["objects"][0]["turns"].append(99)
    got = store.get(["a", "b", "c"], partition, list(expected.keys()))
    _assert_columns(got, expected, [0, 1, 2])
    assert got["objects"][0] == {"uid": 0, "turns": []}


def test_get_result_does_not_alias_the_store(store: DataPlaneClient, partition: str) -> None:
    """Mutating a get's result does not change what the next get returns."""
    fields = _every_kind(2, [1, 2])
    store.put(["a", "b"], partition, fields)
    first = store.get(["a", "b"], partition, list(fields.keys()))
    for name in first.keys():
        value = first.get(name)
        if isinstance(value, torch.Tensor):
            (value.values() if value.is_nested else value).fill_(1)
    first["objects"][1]["turns"].append(99)
    _assert_columns(store.get(["a", "b"], partition, list(fields.keys())), fields, [0, 1])


def test_store_implements_the_port(store: DataPlaneClient) -> None:
    """Every adapter is a DataPlaneClient."""
    assert isinstance(store, DataPlaneClient)


def test_close_is_idempotent_and_later_calls_raise(store: DataPlaneClient, partition: str) -> None:
    """close() twice is fine; any other call after close raises RuntimeError."""
    store.put(["a"], partition, _ids(1))
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match=r"is closed"):
        store.get(["a"], partition, ["x"])
    with pytest.raises(RuntimeError, match=r"is closed"):
        store.put(["b"], partition, _ids(1))
    with pytest.raises(RuntimeError, match=r"is closed"):
        store.clear(["a"], partition)
    with pytest.raises(RuntimeError, match=r"is closed"):
        store.list_keys(partition)
