"""Laws of the data plane's driver-held columns (:meth:`shell.transport.DataPlaneTransport.write`), on a MemoryStore.

* Small per-row columns (advantages, sample mask) never reach the store; larger ones do.
* Whatever holds them, ``read`` returns the written values bitwise, and every rank input carries its shard's
  rows of the held columns in the shard's key order (the same rows the store would give it).
* The latest write of a field wins per key; ``finish`` and ``abort`` drop what the driver held.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from adapters.memory import MemoryStore
from core.meta import KVBatchMeta
from shell.column_io import first_write
from shell.rank_input import StoreShard
from shell.step_rows import StepRows
from shell.transport import HELD_ROW_BYTES, DataPlaneTransport

PARTITION = "p"


def _rows(store: MemoryStore, n: int) -> StepRows:
    keys = [f"k{i}" for i in range(n)]
    meta = first_write(
        store, {"input_ids": torch.ones(n, 3, dtype=torch.int64)}, keys=keys, partition_id=PARTITION,
        lengths=[3] * n, token_fields=["input_ids"],
    )
    return StepRows(meta)


def _transport(store: MemoryStore) -> DataPlaneTransport:
    return DataPlaneTransport(store, lambda: store, partition_id=PARTITION)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_held_columns_stay_off_the_store_and_reach_each_shard_in_key_order(n: int, data: st.DataObject) -> None:
    store = MemoryStore()
    rows = _rows(store, n)
    transport = _transport(store)
    advantages = torch.randn(n)
    mask = torch.randint(0, 2, (n,)).float()
    rows = transport.write(rows, {"advantages": advantages, "sample_mask": mask})
    assert "advantages" in rows.meta.fields
    assert set(store.describe(rows.meta.keys, PARTITION).fields) == {"input_ids"}  # nothing new was stored
    back = transport.read(rows, ["advantages", "sample_mask", "input_ids"])
    assert torch.equal(back["advantages"], advantages) and torch.equal(back["sample_mask"], mask)
    order = data.draw(st.permutations(range(n)))
    cut = data.draw(st.integers(0, n))
    shards = [rows.meta.subset(order[:cut]), rows.meta.subset(order[cut:])]
    inputs = transport.rank_inputs(rows, shards, list(range(n)), ["input_ids", "advantages"])
    for shard, given_input in zip(shards, inputs):
        assert isinstance(given_input, StoreShard)
        picked = [int(key[1:]) for key in shard.keys]
        if picked:
            assert torch.equal(given_input.columns["advantages"], advantages[picked])
        assert "input_ids" not in given_input.columns and "sample_mask" not in given_input.columns


def test_large_columns_go_to_the_store() -> None:
    store = MemoryStore()
    rows = _rows(store, 4)
    transport = _transport(store)
    wide = torch.randn(4, HELD_ROW_BYTES // 4 + 1)  # one float more than a held row
    rows = transport.write(rows, {"wide": wide, "small": torch.ones(4)})
    assert set(store.describe(rows.meta.keys, PARTITION).fields) == {"input_ids", "wide"}
    assert torch.equal(transport.read(rows, ["wide"])["wide"], wide)


def test_the_latest_write_wins_and_finish_drops_held_columns() -> None:
    store = MemoryStore()
    rows = _rows(store, 4)
    transport = _transport(store)
    transport.admit(rows, {})
    rows = transport.write(rows, {"a": torch.zeros(4)})
    transport.write(rows.subset([1, 3]), {"a": torch.tensor([5.0, 7.0])})
    assert transport.read(rows, ["a"])["a"].tolist() == [0.0, 5.0, 0.0, 7.0]
    transport.finish(rows)
    assert store.list_keys(PARTITION) == ()
    assert transport._held_rows(rows.meta.keys, "a") is None


def test_store_shard_refuses_columns_of_another_row_count() -> None:
    meta = KVBatchMeta(PARTITION, ["a", "b"], sequence_lengths=[1, 1])
    try:
        StoreShard(meta, {"advantages": torch.zeros(3)})
    except ValueError as error:
        assert "'columns['advantages']' must be a tensor with one row per key (2): got (3,)" in str(error)
    else:
        raise AssertionError("a column of 3 rows for 2 keys must be refused")


def test_store_shard_keep_names_keys_of_the_shard_and_rank_inputs_hand_each_shard_its_set() -> None:
    """``keep`` outside the shard's keys is refused; ``rank_inputs`` gives shard r the r-th key set, or none."""
    meta = KVBatchMeta(PARTITION, ["a", "b"], sequence_lengths=[1, 1])
    assert StoreShard(meta, keep=["b"]).keep == frozenset({"b"})
    try:
        StoreShard(meta, keep={"a", "z"})
    except ValueError as error:
        assert "'keep' must name keys of the shard: ['z'] are not in 'meta.keys'" in str(error)
    else:
        raise AssertionError("a kept key outside the shard must be refused")
    store = MemoryStore()
    transport = _transport(store)
    rows = _rows(store, 4)
    shards = (rows.meta.subset([0, 1]), rows.meta.subset([2, 3]))
    kept = (frozenset({"k1"}), frozenset())
    inputs = transport.rank_inputs(rows, shards, [0, 1, 2, 3], ["input_ids"], keep=kept)
    assert [i.keep for i in inputs] == list(kept)  # type: ignore[union-attr]
    assert [i.keep for i in transport.rank_inputs(rows, shards, [0, 1, 2, 3], ["input_ids"])] == [frozenset()] * 2  # type: ignore[union-attr]
    try:
        transport.rank_inputs(rows, shards, [0, 1, 2, 3], ["input_ids"], keep=kept[:1])
    except ValueError as error:
        assert "'keep' must hold one key set per shard (2): got 1" in str(error)
    else:
        raise AssertionError("one key set for two shards must be refused")
