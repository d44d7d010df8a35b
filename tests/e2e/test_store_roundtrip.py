"""Round-trip law of every store adapter: a get returns, bit for bit, the last write of each (key, field).

The reference is a plain model (key -> field -> the column and row it was last
put from) and a per-row loop that stacks the expected column; the store under
test never computes the expectation.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from adapters.rows import columns_equal
from adapters.store_port import DataPlaneClient
from tests.property.strategies import STORE_FIELDS, store_batches, store_keys

Model = dict[str, dict[str, tuple[Any, int]]]


def _layout(column: Any) -> tuple[Any, ...]:
    """What must agree for rows of different puts to stack: kind, dtype and trailing shape (not jagged lengths)."""
    if isinstance(column, NonTensorData):
        return ("object_array", column.data.shape[1:])
    if isinstance(column, NonTensorStack):
        return ("non_tensor_stack", tuple(column.batch_size[1:]))
    if column.is_nested:
        return ("jagged", column.dtype, tuple(column.shape[2:]))
    return ("dense", column.dtype, tuple(column.shape[1:]))


def _row(column: Any, i: int) -> Any:
    if isinstance(column, NonTensorData):
        return column.data[i]
    if isinstance(column, NonTensorStack):
        return column[i]
    return column.unbind(0)[i] if column.is_nested else column[i]


def _expected(sources: list[tuple[Any, int]]) -> Any:
    """The column a loop builds from (column, row) sources of one layout."""
    kind = _layout(sources[0][0])[0]
    rows = [_row(column, i) for column, i in sources]
    if kind == "jagged":
        return torch.nested.nested_tensor(rows, layout=torch.jagged)
    if kind == "dense":
        return torch.stack(rows)
    if kind == "non_tensor_stack":
        return NonTensorStack(*rows)
    out = np.empty((len(rows), *np.shape(sources[0][0].data)[1:]), dtype=object)
    for j, row in enumerate(rows):
        out[j] = row
    return out


def _put(store: DataPlaneClient, partition: str, model: Model, keys: list[str], fields: TensorDict) -> None:
    store.put(keys, partition, fields)
    for i, key in enumerate(keys):
        model.setdefault(key, {}).update({name: (fields.get(name), i) for name in fields.keys()})


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_get_returns_the_last_write_bit_for_bit(store: DataPlaneClient, data: st.DataObject) -> None:
    """After puts over overlapping keys, get(K, f) equals the loop-stacked last writes of f for K (any order);
    it raises KeyError when some key lacks f and ValueError when K's rows of f differ in layout."""
    partition = f"roundtrip-{uuid.uuid4().hex}"
    pool = data.draw(store_keys, label="key pool")
    model: Model = {}
    for _ in range(data.draw(st.integers(1, 3), label="puts")):
        keys, fields = data.draw(store_batches(key_pool=pool), label="put")
        _put(store, partition, model, keys, fields)
    assert sorted(store.list_keys(partition)) == sorted(model)

    request = data.draw(st.permutations(sorted(model)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])))
    for name in STORE_FIELDS:
        lacking = [key for key in request if name not in model[key]]
        if lacking:
            event("a key lacks the field: KeyError")
            with pytest.raises(KeyError, match=f"field '{name}' is missing"):
                store.get(request, partition, [name])
            continue
        sources = [model[key][name] for key in request]
        if len({_layout(column) for column, _ in sources}) > 1:
            event("rows differ in layout: ValueError")
            with pytest.raises(ValueError, match=f"field '{name}' is stored with different layouts"):
                store.get(request, partition, [name])
            continue
        event(f"read back a {_layout(sources[0][0])[0]} column")
        got = store.get(request, partition, [name])
        assert got.batch_size == torch.Size([len(request)])
        assert columns_equal(got.get(name), _expected(sources)), name

    store.clear(list(model), partition)
    assert store.list_keys(partition) == ()
