"""Laws of ``adapters.store_port.TagColumns``: built by name from per-key tags, it is the sequence of those
per-key mappings (a round trip), a column is each key's value of one tag, or the default where it lacks it, and a
put's checks take it exactly as they take the mappings it equals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from adapters.store_port import TagColumns, validate_put

NAMES = ["__digest__.a", "__digest__.b", "__digest__.c"]
_values = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))
_rows = st.lists(st.dictionaries(st.sampled_from(NAMES), _values), max_size=12)


def _by_name(rows: list[dict[str, Any]], names: list[str]) -> tuple[dict[str, list[Any]], dict[str, list[int]]]:
    """The rows' tags of ``names`` as the index sends them: one list per name, and where each name is absent."""
    values = {name: [row.get(name) for row in rows] for name in names}
    absent = {name: [i for i, row in enumerate(rows) if name not in row] for name in names}
    return values, absent


def _picked(rows: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    return [{name: row[name] for name in names if name in row} for row in rows]


@given(_rows, st.lists(st.sampled_from(NAMES), unique=True))
def test_tag_columns_are_the_per_key_mappings_they_were_built_from(rows: list[dict[str, Any]], names: list[str]) -> None:
    """Round trip: per-key tags -> by name -> per-key tags, through iteration, indexing (negative too) and slices;
    a value of None is kept apart from a missing tag."""
    values, absent = _by_name(rows, names)
    tags = TagColumns(values, len(rows), absent=absent)
    expected = _picked(rows, names)
    assert len(tags) == len(rows)
    assert list(tags) == expected and tags == expected and tags == tuple(expected)
    assert [tags[i - len(rows)] for i in range(len(rows))] == expected
    assert tags[1:-1] == tuple(expected[1:-1])


@given(_rows, st.lists(st.sampled_from(NAMES), unique=True))
def test_from_mappings_holds_by_name_what_the_mappings_hold(rows: list[dict[str, Any]], names: list[str]) -> None:
    """``TagColumns.from_mappings(rows, names)`` is the constructor given each name's values and absent keys."""
    values, absent = _by_name(rows, names)
    built = TagColumns.from_mappings(rows, names)
    assert built == TagColumns(values, len(rows), absent=absent) == _picked(rows, names)
    assert all(built.lacking(name) == frozenset(absent[name]) for name in names)


@given(_rows, st.lists(st.sampled_from(NAMES), unique=True), st.sampled_from(NAMES), st.integers())
def test_a_tag_column_is_each_keys_value_or_the_default(
    rows: list[dict[str, Any]], names: list[str], name: str, default: int
) -> None:
    """``column(name, default)`` is ``[mapping.get(name, default) for mapping in tags]``, for every name asked or not."""
    values, absent = _by_name(rows, names)
    tags = TagColumns(values, len(rows), absent=absent)
    assert tags.column(name, default) == [mapping.get(name, default) for mapping in tags]


@given(_rows)
def test_tag_columns_differ_from_other_sequences(rows: list[dict[str, Any]]) -> None:
    """Not equal to a sequence one longer, nor to a string; unhashable, like the dicts it holds."""
    values, absent = _by_name(rows, NAMES)
    tags = TagColumns(values, len(rows), absent=absent)
    assert tags != [*_picked(rows, NAMES), {}]
    assert tags != "" and tags != b""
    with pytest.raises(TypeError):
        hash(tags)


def test_tag_columns_reject_columns_that_are_not_one_per_key() -> None:
    """A column of another length, or an absent list of a tag with no column, raises ValueError naming it."""
    with pytest.raises(ValueError, match=r"tag '__digest__\.a' must have 2 values \(one per key\): got 1"):
        TagColumns({"__digest__.a": [1]}, 2)
    with pytest.raises(ValueError, match=r"'absent' names tags without values: \['__digest__\.b'\]"):
        TagColumns({"__digest__.a": [1, 2]}, 2, absent={"__digest__.b": [0]})
    with pytest.raises(ValueError, match=r"'absent' positions of tag '__digest__\.a' must be in range\(2\): got \[-1, 2\]"):
        TagColumns({"__digest__.a": [1, 2]}, 2, absent={"__digest__.a": [2, 0, -1]})
    tags = TagColumns({"__digest__.a": [1, 2]}, 2)
    with pytest.raises(IndexError, match="key position 2 out of range for 2 keys"):
        tags[2]
    with pytest.raises(IndexError, match="key position -3 out of range for 2 keys"):
        tags[-3]
    with pytest.raises(TypeError):
        tags[1.0]


_ANY_NAMES = [*NAMES, "r", "s"]  # reserved and plain


@given(st.lists(st.dictionaries(st.sampled_from(_ANY_NAMES), _values), min_size=1, max_size=6))
def test_a_put_checks_reserved_tags_by_name_as_it_checks_the_mappings_they_equal(rows: list[dict[str, Any]]) -> None:
    """validate_put accepts a TagColumns when it accepts the per-key mappings it equals, and otherwise raises the
    same error (the first key holding a plain name, and every plain name that key holds)."""
    names = sorted({name for row in rows for name in row} | {"r"})  # a plain name no key may hold
    values, absent = _by_name(rows, names)
    by_name = TagColumns(values, len(rows), absent=absent)
    keys = [f"k{i}" for i in range(len(rows))]
    fields = TensorDict({"x": torch.zeros(len(rows))}, batch_size=[len(rows)])

    def outcome(reserved: Any) -> str:
        try:
            validate_put(keys, "p", fields, reserved_tags=reserved)
        except ValueError as error:
            return str(error)
        return "accepted"

    assert outcome(by_name) == outcome([dict(sorted(row.items())) for row in _picked(rows, names)])
