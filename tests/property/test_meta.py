"""Laws and error paths of ``core.meta.KVBatchMeta`` and ``core.frozen``."""

from __future__ import annotations

import pickle

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.frozen import FrozenDict, freeze, thaw
from core.meta import KVBatchMeta
from core.permutation import inverse_permutation
from tests.property.strategies import concat_operands, meta_and_permutation, metas


@given(metas(), st.data())
def test_slice_concat_round_trip(meta: KVBatchMeta, data: st.DataObject) -> None:
    """Slicing at any k and concatenating the halves gives the original meta."""
    k = data.draw(st.integers(0, len(meta)))
    assert meta.slice(0, k).concat(meta.slice(k, len(meta))) == meta


@given(meta_and_permutation())
def test_subset_inverse_permutation_round_trip(case: tuple[KVBatchMeta, list[int]]) -> None:
    """Subsetting by p then by inverse(p) restores the meta."""
    meta, perm = case
    assert meta.subset(perm).subset(inverse_permutation(perm)) == meta


@given(metas(min_size=1), st.data())
def test_subset_stamp_tags_never_changes_parent(meta: KVBatchMeta, data: st.DataObject) -> None:
    """Stamping tags on a subset leaves the parent meta (and its tags) untouched."""
    before = pickle.dumps(meta)
    idx = data.draw(st.lists(st.integers(0, len(meta) - 1), unique=True, min_size=1))
    child = meta.subset(idx).stamp_tags({"reward": [float(i) for i in range(len(idx))]})
    assert child.tag_column("reward") == tuple(float(i) for i in range(len(idx)))
    assert pickle.dumps(meta) == before


@given(metas(), st.data())
def test_drop_is_complement_of_subset(meta: KVBatchMeta, data: st.DataObject) -> None:
    """drop(I) keeps exactly the rows not in I, in their original order."""
    idx = data.draw(st.lists(st.integers(0, max(len(meta) - 1, 0)), unique=True, max_size=len(meta)))
    kept = [i for i in range(len(meta)) if i not in set(idx)]
    assert meta.drop(idx) == meta.subset(kept)


@given(metas())
def test_meta_pickle_round_trip(meta: KVBatchMeta) -> None:
    """A meta survives pickling (it crosses Ray process boundaries) unchanged."""
    assert pickle.loads(pickle.dumps(meta)) == meta


@given(metas(), metas(partition_id="train"))
def test_concat_fields_are_ordered_intersection(a: KVBatchMeta, b: KVBatchMeta) -> None:
    """concat keeps the fields common to every input, in the first input's order."""
    b = attrs.evolve(b, keys=[f"other-{k}" for k in b.keys], extra_info={})
    a = attrs.evolve(a, extra_info={})
    merged = a.concat(b)
    assert merged.fields == tuple(f for f in a.fields if f in b.fields)
    assert merged.keys == a.keys + b.keys
    both_lengths = a.sequence_lengths is not None and b.sequence_lengths is not None
    assert (merged.sequence_lengths is not None) == both_lengths


@given(metas())
def test_concat_empty_meta_is_left_and_right_identity(meta: KVBatchMeta) -> None:
    """KVBatchMeta() is the neutral element of concat: it keeps every other meta's tags, lengths, fields and extra_info."""
    empty = KVBatchMeta()
    assert empty.concat(meta) == meta
    assert meta.concat(empty) == meta
    assert empty.concat(meta, empty) == meta == meta.concat(empty, empty)
    assert empty.concat(empty) == empty


@given(concat_operands())
def test_concat_is_associative(operands: list[KVBatchMeta]) -> None:
    """(a + b) + c == a + (b + c) == concat of all three at once, empty metas included."""
    a, b, c = operands
    assert a.concat(b).concat(c) == a.concat(b.concat(c)) == a.concat(b, c)


def test_empty_meta_holds_nothing() -> None:
    """KVBatchMeta() has no partition and no rows; a meta that holds anything must name a partition."""
    empty = KVBatchMeta()
    assert (empty.partition_id, len(empty), empty.fields, empty.extra_info) == ("", 0, (), {})
    assert empty.is_empty_meta() and not KVBatchMeta("p", []).is_empty_meta()
    for content in ({"keys": ["a"]}, {"fields": ["x"]}, {"sequence_lengths": []}, {"extra_info": {"step": 1}}, {"task_name": "t"}):
        with pytest.raises(ValueError, match=r"'partition_id' must be a non-empty string: got ''; only the empty meta"):
            KVBatchMeta(**content)


def test_meta_is_deeply_immutable() -> None:
    """Tags and extra_info are read-only copies: mutating the inputs never reaches the meta."""
    tags = [{"reward": 1.0}]
    info = {"micro_batch_indices": [[0, 1]]}
    meta = KVBatchMeta("p", ["a"], tags=tags, extra_info=info)
    tags[0]["reward"] = 5.0
    info["micro_batch_indices"][0][1] = 9
    assert meta.tags is not None and meta.tags[0]["reward"] == 1.0
    assert meta.extra_info["micro_batch_indices"] == ((0, 1),)
    with pytest.raises(TypeError):
        meta.tags[0]["reward"] = 2.0  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        meta.keys = ("b",)  # type: ignore[misc]


def test_kvbatchmeta_rejects_length_count_mismatch() -> None:
    """sequence_lengths must have one entry per key."""
    with pytest.raises(ValueError, match=r"'sequence_lengths' must have 2 entries \(one per key\): got 1"):
        KVBatchMeta("p", ["a", "b"], sequence_lengths=[3])


def test_kvbatchmeta_rejects_tag_count_mismatch() -> None:
    """tags must have one entry per key."""
    with pytest.raises(ValueError, match=r"'tags' must have 1 entries \(one per key\): got 2"):
        KVBatchMeta("p", ["a"], tags=[{}, {}])


def test_kvbatchmeta_rejects_duplicate_and_empty_keys() -> None:
    """Keys are unique, non-empty strings."""
    with pytest.raises(ValueError, match=r"'keys' must be unique: 'a' repeats"):
        KVBatchMeta("p", ["a", "a"])
    with pytest.raises(ValueError, match=r"'keys' entries must be non-empty"):
        KVBatchMeta("p", [""])
    with pytest.raises(TypeError, match=r"'keys' entries must be str: got int"):
        KVBatchMeta("p", [1])
    with pytest.raises(TypeError, match=r"not a single string"):
        KVBatchMeta("p", "abc")


def test_kvbatchmeta_rejects_bad_lengths_and_partition() -> None:
    """Lengths are non-negative ints; the partition id is a non-empty string."""
    with pytest.raises(ValueError, match=r"'sequence_lengths' entries must be >= 0: got -1"):
        KVBatchMeta("p", ["a"], sequence_lengths=[-1])
    with pytest.raises(TypeError, match=r"'sequence_lengths' entries must be int: got float"):
        KVBatchMeta("p", ["a"], sequence_lengths=[1.5])
    with pytest.raises(ValueError, match=r"'partition_id' must be a non-empty string"):
        KVBatchMeta("", ["a"])
    with pytest.raises(TypeError, match=r"'tags' entries must be mappings"):
        KVBatchMeta("p", ["a"], tags=[1])
    with pytest.raises(TypeError, match=r"'extra_info' must be a mapping"):
        KVBatchMeta("p", ["a"], extra_info=[1])


def test_kvbatchmeta_accepts_numpy_lengths() -> None:
    """numpy integer lengths are stored as Python ints."""
    meta = KVBatchMeta("p", ["a", "b"], sequence_lengths=np.array([3, 4]))
    assert meta.sequence_lengths == (3, 4)
    assert all(type(x) is int for x in meta.sequence_lengths)


def test_subset_rejects_repeats_and_out_of_range() -> None:
    """subset rejects repeated rows and indices outside the batch."""
    meta = KVBatchMeta("p", ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"'indices' must not repeat rows: row 1 repeats"):
        meta.subset([1, 1])
    with pytest.raises(ValueError, match=r"'indices' entries must be in range\(3\)"):
        meta.subset([3])
    with pytest.raises(ValueError, match=r"must not repeat rows"):
        meta.drop([0, 0])


def test_concat_rejects_conflicts() -> None:
    """concat needs one partition, unique keys, agreeing extra_info and task names."""
    a = KVBatchMeta("p", ["a"], extra_info={"step": 1})
    with pytest.raises(ValueError, match=r"'partition_id' must match to concat: expected 'p', got 'q'"):
        a.concat(KVBatchMeta("q", ["b"]))
    with pytest.raises(ValueError, match=r"'keys' must be unique"):
        a.concat(KVBatchMeta("p", ["a"]))
    with pytest.raises(ValueError, match=r"'extra_info\['step'\]' conflicts"):
        a.concat(KVBatchMeta("p", ["b"], extra_info={"step": 2}))
    with pytest.raises(ValueError, match=r"'task_name' must match"):
        a.concat(KVBatchMeta("p", ["b"], task_name="x"))
    with pytest.raises(TypeError, match=r"concat arguments must be KVBatchMeta"):
        a.concat(["b"])  # type: ignore[arg-type]


def test_stamp_tags_stores_scalars_and_validates_length() -> None:
    """stamp_tags stores 0-d numpy values as Python scalars and checks column length."""
    meta = KVBatchMeta("p", ["a", "b"]).stamp_tags({"reward": np.array([0.5, 1.0])})
    assert meta.tag_column("reward") == (0.5, 1.0)
    assert type(meta.tag_column("reward")[0]) is float
    with pytest.raises(ValueError, match=r"'columns\['adv'\]' must have 2 entries \(one per key\): got 3"):
        meta.stamp_tags({"adv": [1, 2, 3]})
    with pytest.raises(KeyError, match=r"tag 'adv' is missing for 2 keys"):
        meta.tag_column("adv")
    with pytest.raises(KeyError, match=r"this meta has no tags"):
        KVBatchMeta("p", ["a"]).tag_column("reward")


def test_with_fields_and_extra_info_return_new_metas() -> None:
    """with_fields adds names once (ordered union); with_extra_info overrides keys."""
    meta = KVBatchMeta("p", ["a"], fields=["x"], extra_info={"s": 1})
    grown = meta.with_fields(["y", "x", "y"]).with_extra_info(s=2, t=3)
    assert grown.fields == ("x", "y") and meta.fields == ("x",)
    assert grown.extra_info == {"s": 2, "t": 3} and meta.extra_info == {"s": 1}
    with pytest.raises(TypeError, match=r"not a single string"):
        meta.with_fields("y")


def test_inverse_permutation_rejects_non_permutations() -> None:
    """inverse_permutation rejects repeats, out-of-range entries and non-ints."""
    with pytest.raises(ValueError, match=r"entry 1 repeats"):
        inverse_permutation([1, 1])
    with pytest.raises(ValueError, match=r"entry 2 at index 1 is out of range"):
        inverse_permutation([0, 2])
    with pytest.raises(TypeError, match=r"got float at index 0"):
        inverse_permutation([0.0])


@given(st.integers(0, 64).flatmap(lambda n: st.permutations(list(range(n)))))
def test_inverse_permutation_is_involution(perm: list[int]) -> None:
    """inverse(p)[p[i]] == i and inverse(inverse(p)) == p."""
    inv = inverse_permutation(perm)
    assert all(inv[p] == i for i, p in enumerate(perm))
    assert inverse_permutation(inv) == tuple(perm)


def test_freeze_thaw_round_trip() -> None:
    """freeze makes deep read-only copies; thaw restores plain containers."""
    value = {"a": [1, {"b": {2, 3}}], "c": np.arange(3)}
    frozen = freeze(value)
    assert isinstance(frozen, FrozenDict)
    assert frozen["c"].flags.writeable is False
    thawed = thaw(frozen)
    assert thawed["a"] == [1, {"b": {2, 3}}]
    assert np.array_equal(thawed["c"], value["c"])
    assert hash(FrozenDict({"x": 1})) == hash(FrozenDict({"x": 1}))
    with pytest.raises(AttributeError, match="immutable"):
        frozen.x = 1
