"""Laws of the ``RayObjectStore`` backend's column frames (:mod:`adapters.tq_object_store`), without Ray.

* Round trip: a framed column unframes to the same dtype, shape and bits, for every torch dtype a store holds.
* Gather: ``gather_rows`` equals picking the rows one by one.
* Assembly: rows spread over any number of stored columns, asked for in any order, come back as the column
  that holds exactly those rows in that order.
* The index (``RowIndex``, the logic of the index actor), under any program of puts and clears: ``locate``
  answers the latest put's column and row of each ``(global index, field)``, or the first missing one; given
  the keys the caller looked up, it never answers another key's row (it reports the first reused one); and
  it counts exactly the columns that still hold a latest row, none once every index is cleared.
* By key: ``locate_keys`` answers the index each key's latest naming put gave it, or the first unknown key;
  with ``sole`` it also refuses the first key whose row holds two wire fields of one field; after
  ``forget_keys`` a forgotten key is unknown while every row stays where ``locate`` finds it.
* Reserved tags by key: ``locate_keys`` with ``tags`` answers each key's reserved tags as the puts naming it merged
  them since its row's last clear, or refuses the first key a put without owners or a forget reached since.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings

from adapters.store_port import TagColumns
from adapters.tq_object_store import (
    RowIndex,
    assemble_column,
    field_schema,
    frame_column,
    gather_rows,
    index_tags,
    unframe,
)
from adapters.tq_row_index import CLEARED_EARLY_LIMIT, ObjectStoreIndex

DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64,
)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaN payloads and all): bytes drawn uniformly, viewed as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _jagged(lengths: list[int], dtype: torch.dtype, seed: int, inner: tuple[int, ...] = ()) -> torch.Tensor:
    values = _random((sum(lengths), *inner), dtype, seed)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_frame_round_trips_every_dtype_bitwise(dtype: torch.dtype) -> None:
    dense = _random((5, 3), dtype, 1)
    values, offsets = unframe(frame_column("x", dense, 5))
    assert offsets is None and values.dtype == dtype and values.shape == dense.shape
    assert torch.equal(_bits(values), _bits(dense))
    jagged = _jagged([2, 0, 4], dtype, 2)
    values, offsets = unframe(frame_column("y", jagged, 3))
    assert values.dtype == dtype and offsets.tolist() == [0, 2, 2, 6]
    assert torch.equal(_bits(values), _bits(jagged.values()))


def test_frame_refuses_a_column_that_is_not_a_tensor_or_has_other_rows() -> None:
    with pytest.raises(TypeError, match=r"field 'x' is a list"):
        frame_column("x", [1, 2], 2)
    with pytest.raises(ValueError, match=r"field 'x' has 3 rows: expected 2"):
        frame_column("x", torch.zeros(3), 2)
    with pytest.raises(ValueError, match=r"field 'y' has 1 rows: expected 2"):
        frame_column("y", _jagged([2], torch.int64, 0), 2)


def test_frame_of_a_jagged_view_starts_at_zero() -> None:
    """A jagged column whose offsets do not start at 0 (a view into a larger buffer) is framed from its rows only."""
    values = torch.arange(10)
    view = torch.nested.nested_tensor_from_jagged(values, torch.tensor([3, 5, 8]))
    framed_values, offsets = unframe(frame_column("x", view, 2))
    assert framed_values.tolist() == [3, 4, 5, 6, 7] and offsets.tolist() == [0, 2, 5]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12), data=st.data())
def test_gather_rows_equals_picking_rows_one_by_one(lengths: list[int], data: st.DataObject) -> None:
    jagged = _jagged(lengths, torch.int32, len(lengths), inner=(2,))
    rows = data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=15))
    values, offsets = gather_rows(jagged.values(), jagged.offsets(), torch.tensor(rows, dtype=torch.int64))
    expected = [jagged.values()[jagged.offsets()[r] : jagged.offsets()[r + 1]] for r in rows]
    assert offsets.diff().tolist() == [len(e) for e in expected]
    assert torch.equal(values, torch.cat(expected) if expected else values.new_empty((0, 2)))
    dense = _random((len(lengths), 3), torch.float32, 3)
    picked, none = gather_rows(dense, None, torch.tensor(rows, dtype=torch.int64))
    assert none is None and torch.equal(_bits(picked), _bits(dense[rows]))


def _runs(columns: list[str]) -> list[list]:
    """``[[column id, count], ...]``: the runs of equal neighbours in ``columns`` (how the index's reply names them)."""
    runs: list[list] = []
    for column in columns:
        if runs and runs[-1][0] == column:
            runs[-1][1] += 1
        else:
            runs.append([column, 1])
    return runs


def _assemble(field: str, where: list[tuple[str, int]], frames: dict) -> torch.Tensor:
    """``assemble_column`` of the rows ``where`` names (``(column id, row)`` each), as the index's reply gives them."""
    return assemble_column(field, _runs([column for column, _row in where]), [row for _column, row in where], frames)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    jagged=st.booleans(),
    data=st.data(),
)
def test_assembly_from_any_split_equals_the_selected_rows(lengths: list[int], jagged: bool, data: st.DataObject) -> None:
    n = len(lengths)
    whole = _jagged(lengths, torch.float16, n) if jagged else _random((n, 2), torch.float16, n)
    rows_of = lambda r: whole[r] if jagged else whole[r]  # noqa: E731
    # the rows are spread over puts: each put stores a subset of rows, in a shuffled order
    order = data.draw(st.permutations(range(n)))
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True))) if n > 1 else []
    puts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
    frames, where = {}, {}
    for i, rows in enumerate(puts):
        part = torch.nested.as_nested_tensor([rows_of(r) for r in rows], layout=torch.jagged) if jagged else whole[list(rows)]
        frames[f"c{i}"] = frame_column("x", part, len(rows))
        where.update({r: (f"c{i}", position) for position, r in enumerate(rows)})
    asked = data.draw(st.lists(st.sampled_from(range(n)), min_size=1, max_size=n, unique=True))
    got = _assemble("x", [where[r] for r in asked], frames)
    if jagged:
        assert got.offsets().diff().tolist() == [lengths[r] for r in asked]
        assert torch.equal(_bits(got.values()), _bits(torch.cat([rows_of(r) for r in asked])))
    else:
        assert torch.equal(_bits(got), _bits(whole[asked]))


def test_assembly_refuses_rows_of_different_dtypes() -> None:
    frames = {"a": frame_column("x", torch.zeros(2, dtype=torch.int8), 2), "b": frame_column("x", torch.zeros(2), 2)}
    with pytest.raises(ValueError, match=r"field 'x': its rows were put with different"):
        _assemble("x", [("a", 0), ("b", 1)], frames)


def test_assembly_refuses_runs_that_do_not_cover_the_rows() -> None:
    frames = {"a": frame_column("x", torch.zeros(3), 3)}
    with pytest.raises(ValueError, match=r"field 'x': the runs of columns cover 2 rows: expected 3"):
        assemble_column("x", [["a", 2]], [0, 1, 2], frames)


def test_field_schema_keeps_no_per_row_state() -> None:
    """Dense fields are reported as TransferQueue reports them; jagged ones with the row shape (0, *inner) and no
    per-row shapes."""
    from tensordict import TensorDict
    from transfer_queue.metadata import extract_field_schema

    td = TensorDict(
        {"j": _jagged([2, 3], torch.int64, 0, inner=(4,)), "d": torch.zeros(2, 3), "v": torch.zeros(2)}, batch_size=[2]
    )
    frames = {name: frame_column(name, td.get(name), 2) for name in td.keys()}
    ours, theirs = field_schema(frames), extract_field_schema(td)
    for name in td.keys():
        assert ours[name]["dtype"] == theirs[name]["dtype"]
        assert ours[name]["is_nested"] is False
        assert "per_sample_shapes" not in ours[name]
    for name in ("d", "v"):
        assert tuple(ours[name]["shape"]) == tuple(theirs[name]["shape"])
    assert tuple(ours["j"]["shape"]) == (0, 4)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint64, torch.float8_e4m3fn, torch.bool], ids=str)
def test_assembly_moves_dtypes_torch_cannot_index(dtype: torch.dtype) -> None:
    """Rows of dtypes without torch index kernels gather as bytes: rows from two columns, reordered, bitwise."""
    first = _jagged([2, 1], dtype, 5)
    second = _random((1, 3), dtype, 6)
    second = torch.nested.nested_tensor_from_jagged(second.reshape(-1), torch.tensor([0, 3]))
    frames = {"a": frame_column("x", first, 2), "b": frame_column("x", second, 1)}
    got = _assemble("x", [("b", 0), ("a", 1), ("a", 0)], frames)
    assert got.dtype == dtype and got.offsets().tolist() == [0, 3, 4, 6]
    expected = torch.cat([_bits(second.values()), _bits(first.values()[2:3]), _bits(first.values()[0:2])])
    assert torch.equal(_bits(got.values()), expected)


def test_assembly_of_a_column_with_no_values_and_one_with_some() -> None:
    empty = frame_column("x", _jagged([0], torch.float32, 0, inner=(2,)), 1)
    full = frame_column("x", _jagged([3], torch.float32, 1, inner=(2,)), 1)
    got = _assemble("x", [("e", 0), ("f", 0)], {"e": empty, "f": full})
    assert got.offsets().tolist() == [0, 0, 3] and got.values().shape == (3, 2)


# ---------------------------------------------------------------- the index

INDEXES, FIELDS, KEYS, PARTITIONS = range(6), ("a", "b", "c"), ("k0", "k1", "k2", "k3"), ("p", "q")



def _puts_of(fields: Sequence[str]) -> st.SearchStrategy[tuple]:
    """Puts of some of ``fields`` to rows ``(global index, key)`` of a partition."""
    return st.tuples(
        st.just("put"),
        st.sampled_from(PARTITIONS),
        st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True),
        st.lists(st.tuples(st.sampled_from(INDEXES), st.sampled_from(KEYS)), min_size=1, max_size=6, unique_by=lambda r: r[0]),
        st.booleans(),  # whether the put names its owners (TQ's own put does not)
    )


_put = _puts_of(FIELDS)
_clear = st.tuples(st.just("clear"), st.lists(st.sampled_from(INDEXES), max_size=6, unique=True))
_query = st.tuples(
    st.lists(st.sampled_from(INDEXES), min_size=1, max_size=6, unique=True),
    st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True),
    st.sampled_from(PARTITIONS),
    st.lists(st.sampled_from(KEYS), min_size=6, max_size=6),
    st.booleans(),  # whether the get names its owners
)


def _expected(model: dict, query: tuple) -> dict:
    """What ``locate`` must answer, from a model of the latest put of each (global index, field)."""
    indexes, fields, partition, keys, named = query
    for field in fields:
        for i, index in enumerate(indexes):
            where = model.get((index, field))
            if where is None:
                return {"missing": [field, index]}
            column, row, owner = where
            if named and owner is not None and owner != (partition, keys[i]):
                return {"reused": [field, index, list(owner)]}
    return {"locations": {f: [_runs([model[x, f][0] for x in indexes]), [model[x, f][1] for x in indexes]] for f in fields}}


def _apply(index: RowIndex, n: int, op: tuple) -> None:
    """Run op ``n`` of a program on ``index``: a clear, a forget of keys, or a put whose columns are named after
    ``n`` and the field (with :func:`_digests_of` as its reserved tags when the op says so, a mapping per row for
    even ``n`` and by name, as ``adapters.tq_object_store.index_tags`` sends a ``TagColumns``, for odd ``n``)."""
    if op[0] == "clear":
        index.clear(op[1])
        return
    if op[0] == "forget":
        index.forget_keys(op[1], op[2])
        return
    _, partition, fields, rows, named, *tagged = op
    puts = [(field, f"col{n}{field}", [(f"stored{n}{field}", None)], [i for i, _ in rows]) for field in fields]
    tags = [_digests_of(n, row, fields) for row in range(len(rows))] if tagged and tagged[0] else None
    if tags is not None and n % 2:
        tags = index_tags(TagColumns.from_mappings(tags, list(_digests_of(n, 0, fields))))
    index.register("writer", puts, (partition, [k for _, k in rows]) if named else None, tags)


def _digests_of(n: int, row: int, fields: Sequence[str]) -> dict[str, int]:
    """The reserved tags that put ``n`` of a program gives its row ``row``: a digest per field, unique to the put."""
    return {f"__digest__.{field}": n * 100 + row for field in fields}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_put, _clear), max_size=12), st.lists(_query, min_size=1, max_size=4))
def test_the_index_answers_the_latest_put_never_another_keys_row_and_counts_live_columns(
    program: list[tuple], queries: list[tuple]
) -> None:
    index, model = RowIndex(), {}
    for n, op in enumerate(program):
        _apply(index, n, op)
        if op[0] == "clear":
            model = {at: where for at, where in model.items() if at[0] not in op[1]}
            continue
        _, partition, fields, rows, named = op
        for field in fields:
            for row, (i, key) in enumerate(rows):
                model[i, field] = (f"col{n}{field}", row, (partition, key) if named else None)
    for query in queries:
        indexes, fields, partition, keys, named = query
        found = index.locate(indexes, fields, (partition, keys[: len(indexes)]) if named else None)
        want = _expected(model, (indexes, fields, partition, keys[: len(indexes)], named))
        if "locations" in want:
            assert found["locations"] == want["locations"]
            assert set(found["columns"]) == {c for f in fields for c, _count in want["locations"][f][0]}
        else:
            assert found == want
    assert index.stats()["columns"] == len({column for column, _, _ in model.values()})
    index.clear(list(INDEXES))
    assert index.stats() == {"columns": 0, "rows": 0}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(_put, _clear), max_size=12),
    st.sampled_from(PARTITIONS),
    st.lists(st.tuples(st.sampled_from(INDEXES), st.sampled_from(KEYS)), min_size=1, max_size=6, unique_by=lambda r: r[0]),
)
def test_an_owned_clear_drops_only_rows_that_no_other_key_holds(
    program: list[tuple], partition: str, cleared: list[tuple[int, str]]
) -> None:
    """``clear_owned`` drops the rows at each index that its key still holds there (the latest put there named
    it) or that no known key holds (the latest put there named none, or the key moved elsewhere since), and keeps,
    untouched, every row that a put has given another key, and every other index's rows; and no cleared key is
    answered by key after it."""
    index, model = RowIndex(), {}
    owner: dict[int, tuple[str, str] | None] = {}  # global index -> the key its latest put named (None: none)
    for n, op in enumerate(program):
        _apply(index, n, op)
        if op[0] == "clear":
            model = {at: where for at, where in model.items() if at[0] not in op[1]}
            owner.update(dict.fromkeys(op[1]))
            continue
        _, put_partition, fields, rows, named = op
        for row, (i, key) in enumerate(rows):
            if named:  # the key's earlier index is now of no known key (see the by-key law below)
                owner.update({j: None for j, o in owner.items() if o == (put_partition, key)})
            owner[i] = (put_partition, key) if named else None
            model.update({(i, field): (f"col{n}{field}", row) for field in fields})
    index.clear_owned(partition, [k for _, k in cleared], [i for i, _ in cleared])
    dropped = {i for i, k in cleared if owner.get(i) in (None, (partition, k))}
    kept = {at: where for at, where in model.items() if at[0] not in dropped}
    for (i, field), (column, row) in kept.items():
        assert index.locate([i], [field])["locations"][field] == [[[column, 1]], [row]]
    assert all("missing" in index.locate([i], [field]) for i in dropped for field in FIELDS)
    assert index.stats()["columns"] == len({column for column, _ in kept.values()})
    for _, key in cleared:  # TQ holds a cleared key no more: the index answers it by key nowhere
        assert index.locate_keys(partition, [key], FIELDS[:1]) == {"unknown": key}


def _by_key_cases(put: st.SearchStrategy[tuple], fields: Sequence[str], max_fields: int) -> Any:
    """``@given`` of a program of puts and clears, a partition, some keys and up to ``max_fields`` of ``fields``."""
    return given(
        st.lists(st.one_of(put, _clear), max_size=12),
        st.sampled_from(PARTITIONS),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
        st.lists(st.sampled_from(fields), min_size=1, max_size=max_fields, unique=True),
    )


@settings(max_examples=300, deadline=None)
@_by_key_cases(_put, FIELDS, 3)
def test_the_index_locates_by_key_only_where_the_latest_put_there_named_that_key(
    program: list[tuple], partition: str, keys: list[str], fields: list[str]
) -> None:
    """``locate_keys`` reports for each key the index whose latest put named that key (no clear or unnamed put
    there since, and no later put of the key elsewhere), or the first key that has none; and answers ``locate`` of
    the reported indexes, with the keys as owners."""
    index = RowIndex()
    owner: dict[int, tuple[str, str] | None] = {}  # global index -> the key its latest put named
    for n, op in enumerate(program):
        _apply(index, n, op)
        if op[0] == "clear":
            owner.update(dict.fromkeys(op[1]))
            continue
        _, put_partition, _fields, rows, named = op
        for i, k in rows:  # a key is at one index: a later put of it elsewhere moves it (TQ moves a key only
            if named:      # after a clear, which a racing put may beat to the index)
                owner.update({j: None for j, o in owner.items() if o == (put_partition, k)})
            owner[i] = (put_partition, k) if named else None
    found = index.locate_keys(partition, keys, fields)
    at = {k: i for i, o in owner.items() if o is not None and o[0] == partition for k in [o[1]]}
    if "unknown" in found:
        assert found["unknown"] not in at
        return
    reported = found.pop("indexes")
    assert reported == [at[k] for k in keys]
    assert found == index.locate(reported, fields, (partition, keys))


WIRES = ("a@jagged.int64.", "a@dense.float16.3", "b@jagged.int64.")
_wire_put = _puts_of(WIRES)


@settings(max_examples=300, deadline=None)
@_by_key_cases(_wire_put, WIRES, 2)
def test_a_sole_locate_by_key_refuses_rows_that_hold_two_wire_fields_of_one_field(
    program: list[tuple], partition: str, keys: list[str], fields: list[str]
) -> None:
    """``locate_keys(..., sole=True)`` answers what ``locate_keys`` answers, except that it reports the first key
    whose row a put naming its owners gave a second wire field of one user field (a rewrite in another kind, dtype
    or shape; since that row's last clear): only the key's tags say which of the two is current."""
    index = RowIndex()
    held: dict[int, set[str]] = {}  # global index -> wire fields it holds
    shadowed: set[int] = set()
    for n, op in enumerate(program):
        _apply(index, n, op)
        if op[0] == "clear":
            for i in op[1]:
                held.pop(i, None)
                shadowed.discard(i)
            continue
        _, _partition, put_fields, rows, named = op
        for field in put_fields:
            for i, _key in rows:
                there = held.setdefault(i, set())
                if named and field not in there and any(f.split("@")[0] == field.split("@")[0] for f in there):
                    shadowed.add(i)
                there.add(field)
    plain = index.locate_keys(partition, keys, fields)
    sole = index.locate_keys(partition, keys, fields, sole=True)
    first_unknown = keys.index(plain["unknown"]) if "unknown" in plain else len(keys)
    reached = keys[:first_unknown]
    at = {}
    for key in reached:  # the indexes of the keys before the first unknown one (all known to the index)
        at[key] = index.locate_keys(partition, [key], fields[:1])["indexes"][0] if fields else None
    blocked = [key for key in reached if at[key] in shadowed]
    if blocked:
        assert sole == {"shadowed": blocked[0]}
    else:
        assert sole == plain


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(_put, _clear), max_size=10),
    st.sampled_from(PARTITIONS),
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    st.lists(st.sampled_from(INDEXES), min_size=1, max_size=6, unique=True),
)
def test_a_forgotten_key_is_unknown_by_key_and_its_rows_stay_by_index(
    program: list[tuple], partition: str, forgotten: list[str], indexes: list[int]
) -> None:
    """After ``forget_keys``, ``locate_keys`` reports a forgotten key unknown (alone or first among others), while
    ``locate`` by global index answers what it answered before, and other keys are answered as before."""
    index = RowIndex()
    for n, op in enumerate(program):
        _apply(index, n, op)
    before = index.locate(indexes, FIELDS)
    others = [key for key in KEYS if key not in forgotten]
    answered = {key: index.locate_keys(partition, [key], FIELDS[:1]) for key in others}
    index.forget_keys(partition, forgotten)
    assert index.locate(indexes, FIELDS) == before
    for key in forgotten:
        assert index.locate_keys(partition, [key, *others], FIELDS[:1]) == {"unknown": key}
    assert {key: index.locate_keys(partition, [key], FIELDS[:1]) for key in others} == answered


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(_put, _clear), max_size=10),
    st.sampled_from(PARTITIONS),
    st.lists(  # a put's rows: one index per key, as TQ's lookup gives them
        st.tuples(st.sampled_from(INDEXES), st.sampled_from(KEYS)),
        min_size=1, max_size=6, unique_by=(lambda r: r[0], lambda r: r[1]),
    ),
    st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True),
    st.data(),
)
def test_a_put_that_reaches_the_index_after_an_owned_clear_of_its_keys_is_not_answered_by_key(
    program: list[tuple], partition: str, rows: list[tuple[int, str]], fields: list[str], data: st.DataObject
) -> None:
    """A put of keys at the indexes its lookup gave them, whose register reaches the index after an owned clear of
    some of those keys at those indexes (the clear raced it), is not answered by key for those keys: ``locate_keys``
    reports each unknown, while ``locate`` by global index answers the put's rows, and the put's other keys are
    answered by key. The key's next put there is answered by key again."""
    index = RowIndex()
    for n, op in enumerate(program):
        _apply(index, n, op)
    raced = data.draw(st.lists(st.sampled_from(rows), min_size=1, unique=True))
    index.clear_owned(partition, [k for _, k in raced], [i for i, _ in raced])
    late = ("put", partition, fields, rows, True)
    _apply(index, len(program), late)
    for i, key in rows:
        found = index.locate_keys(partition, [key], fields)
        if (i, key) in raced:
            assert found == {"unknown": key}
        else:
            assert found["indexes"] == [i]
        assert index.locate([i], fields, (partition, [key]))["locations"] == {
            field: [[[f"col{len(program)}{field}", 1]], [rows.index((i, key))]] for field in fields
        }
    _apply(index, len(program) + 1, late)  # the keys' next put at the same indexes
    assert index.locate_keys(partition, [k for _, k in rows], fields)["indexes"] == [i for i, _ in rows]


def test_the_index_remembers_only_the_latest_cleared_keys() -> None:
    """An owned clear remembers at most ``CLEARED_EARLY_LIMIT`` keys: a put racing a clear older than that is
    answered by key (the bound keeps the index's memory flat over a long run)."""
    index = RowIndex()
    index.clear_owned("p", ["old"], [0])
    index.clear_owned("p", [f"k{n}" for n in range(CLEARED_EARLY_LIMIT)], list(range(1, CLEARED_EARLY_LIMIT + 1)))
    for key, at in (("old", 0), ("k0", 1)):
        index.register("writer", [("a", f"col-{key}", [("stored", None)], [at])], ("p", [key]))
    assert index.locate_keys("p", ["old"], ["a"])["indexes"] == [0]
    assert index.locate_keys("p", ["k0"], ["a"]) == {"unknown": "k0"}


def test_a_register_of_one_field_twice_or_of_an_old_column_id_counts_columns_as_its_columns_come() -> None:
    """Columns are recorded in a put's order, each with its rows, so a put that names one field twice keeps the
    later column's rows and releases the earlier column, and a column id that an earlier column of the put released
    holds its new rows (puts of other shapes than the adapter's, which take the per-column path)."""
    index = RowIndex()
    index.register("writer", [("f", "c1", [("s1", None)], [0]), ("f", "c2", [("s2", None)], [0])])
    assert index.stats() == {"columns": 1, "rows": 1}
    assert index.locate([0], ["f"])["locations"] == {"f": [[["c2", 1]], [0]]}
    index.register("writer", [("g", "c", [("s3", None)], [1])])
    index.register("writer", [("g", "x", [("s4", None)], [1]), ("h", "c", [("s5", None)], [1])])
    found = index.locate([1], ["g", "h"])
    assert found["locations"] == {"g": [[["x", 1]], [0]], "h": [[["c", 1]], [0]]}
    assert found["columns"] == {"x": [("s4", None), "writer"], "c": [("s5", None), "writer"]}
    assert index.stats() == {"columns": 3, "rows": 2}


@pytest.mark.parametrize(
    ("puts", "owners", "tags", "message"),
    [
        ([("a@x", "c1", [("s", None)], [0, 1])], ("p", ["k0"]), None, "'owners' names 1 keys for the 2 rows"),
        ([("a@x", "c1", [("s", None)], [0, 1])], ("p", ["k0", "k1"]), [{}], "'tags' holds 1 rows' tags for the 2"),
        (
            [("a@x", "c1", [("s", None)], [0, 1])],
            ("p", ["k0", "k1"]),
            {"values": {"__digest__.a": [1, 2, 3]}, "absent": {}},
            "'tags' holds 3 values of '__digest__.a' for the 2 rows",
        ),
        ([("a@x", "c1", [("s", None), ("t", None)], [0, 1])], None, None, "field 'a@x' must hold one stored entry: got 2"),
    ],
)
def test_the_index_refuses_a_register_of_other_rows_than_its_columns_and_records_nothing(
    puts: list[tuple], owners: Any, tags: Any, message: str
) -> None:
    index = RowIndex()
    index.register("writer", [("a@x", "c0", [("s0", None)], [0, 1])], ("p", ["k0", "k1"]), [{"__digest__.a": 7}] * 2)
    before = (index.stats(), index.locate_keys("p", ["k0", "k1"], ["a@x"], tags=["__digest__.a"]))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        index.register("writer", puts, owners, tags)
    assert (index.stats(), index.locate_keys("p", ["k0", "k1"], ["a@x"], tags=["__digest__.a"])) == before
    with pytest.raises(ValueError, match="'owners' names 1 keys for 2 global indexes"):
        index.locate([0, 1], ["a@x"], ("p", ["k0"]))


_tagged_put = st.tuples(_put, st.booleans()).map(lambda p: (*p[0], p[1]))  # the last: whether it sends digests
_forget = st.tuples(
    st.just("forget"), st.sampled_from(PARTITIONS), st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True)
)


@settings(max_examples=300, deadline=None)
@example(  # a clear drops the tags: a later put without digests leaves the key none
    [("put", "p", ["a", "b"], [(0, "k0")], True, True), ("clear", [0]), ("put", "p", ["a"], [(0, "k0")], True, False)],
    "p", ["k0"], ["a"],
)
@example(  # the index given to another key drops the tags of the one before
    [("put", "p", ["a"], [(0, "k0")], True, True), ("put", "p", ["a"], [(0, "k1")], True, False)], "p", ["k1"], ["a"],
)
@example(  # a put without owners leaves the tags unknown until a clear, though a later put names the key again
    [("put", "p", ["a", "b"], [(0, "k0")], True, True), ("put", "p", ["a"], [(0, "k1")], False, False),
     ("put", "p", ["a"], [(0, "k0")], True, True)],
    "p", ["k0"], ["b"],
)
@_by_key_cases(st.one_of(_tagged_put, _forget), FIELDS, 3)
def test_the_index_answers_each_keys_reserved_tags_as_its_puts_merged_them_since_its_rows_clear(
    program: list[tuple], partition: str, keys: list[str], fields: list[str]
) -> None:
    """``locate_keys(..., tags=names)`` answers, per key, the reserved tags of ``names`` that the puts naming that
    key merged (new values win) since its row's last clear or change of key; or the first key whose row a put
    without owners, or a forget (a failed put), reached since that clear; otherwise what ``locate_keys`` answers."""
    index = RowIndex()
    owner: dict[int, tuple[str, str] | None] = {}
    tags: dict[int, dict[str, int]] = {}
    untagged: set[int] = set()
    for n, op in enumerate(program):
        _apply(index, n, op)
        if op[0] == "clear":
            for i in op[1]:
                owner.pop(i, None)
                tags.pop(i, None)
                untagged.discard(i)
        elif op[0] == "forget":
            for i, o in owner.items():
                if o is not None and o[0] == op[1] and o[1] in op[2]:
                    owner[i] = None
                    untagged.add(i)
        else:
            _, put_partition, put_fields, rows, named, tagged = op
            for row, (i, k) in enumerate(rows):
                new = (put_partition, k) if named else None
                if named:  # the key leaves any other index
                    owner.update({j: None for j, o in owner.items() if o == new and j != i})
                if owner.get(i) != new:
                    tags.pop(i, None)
                owner[i] = new
                if not named:
                    untagged.add(i)
                elif tagged:
                    tags.setdefault(i, {}).update(_digests_of(n, row, put_fields))
    names = [f"__digest__.{field}" for field in fields]
    found = index.locate_keys(partition, keys, fields, tags=names)
    at = {o[1]: i for i, o in owner.items() if o is not None and o[0] == partition}
    for key in keys:
        if key not in at:
            assert found == {"unknown": key}
            return
        if at[key] in untagged:
            assert found == {"untagged": key}
            return
    plain = index.locate_keys(partition, keys, fields)
    if "locations" not in plain:
        assert found == plain
        return
    reply = found.pop("tags")
    assert set(reply) == {"values", "absent"} and list(reply["values"]) == names
    expected = [{name: tags[at[k]][name] for name in names if name in tags.get(at[k], {})} for k in keys]
    assert TagColumns(reply["values"], len(keys), absent=reply["absent"]) == expected
    assert found == plain


@pytest.mark.parametrize("by_name", [False, True], ids=["a-mapping-per-row", "by-name"])
def test_the_index_answers_reserved_tags_of_any_value_none_and_arrays_included(by_name: bool) -> None:
    """A reserved tag's value is answered as put, whatever it is: None is told from a missing tag, and an array
    value (which has no truth value) is carried, not compared."""
    index, array = RowIndex(), np.array([1, 2])
    rows = [{"__digest__.x": None, "__digest__.y": array}, {"__digest__.y": 3}]
    tags: Any = rows
    if by_name:
        tags = index_tags(TagColumns.from_mappings(rows, ["__digest__.x", "__digest__.y"]))
    index.register("writer", [("x@dense.int64.", "c0", [("ref", None)], [5, 6])], ("p", ["a", "b"]), tags)
    reply = index.locate_keys("p", ["a", "b"], ["x@dense.int64."], tags=["__digest__.x", "__digest__.y"])["tags"]
    answered = TagColumns(reply["values"], 2, absent=reply["absent"])
    assert answered[0]["__digest__.x"] is None and answered[0]["__digest__.y"] is array
    assert answered[1] == {"__digest__.y": 3}


def test_the_index_actor_serves_each_public_method_of_row_index_from_a_row_index_it_holds() -> None:
    """The actor's remote methods are exactly ``RowIndex``'s public ones, with their signatures; and the actor is not
    a ``RowIndex``, so the per-row helpers a put or a clear calls are ``RowIndex``'s own functions, not the methods
    Ray's tracing hook wraps on an actor's class."""
    served = ObjectStoreIndex.__ray_metadata__.modified_class
    public = sorted(name for name, value in vars(RowIndex).items() if inspect.isfunction(value) and not name.startswith("_"))
    assert sorted(name for name in dir(served) if not name.startswith("_")) == public
    assert all(inspect.signature(getattr(served, name)) == inspect.signature(getattr(RowIndex, name)) for name in public)
    assert not issubclass(served, RowIndex)
