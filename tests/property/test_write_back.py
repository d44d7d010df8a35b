"""Laws of a policy rank's write-back (:meth:`shell.policy_worker.PolicyWorker.write_back`), on a MemoryStore.

For any rows and any set ``keep`` of them:
  * partition: the replica leader writes exactly the rows outside ``keep``, once; no other rank writes;
  * what the train call reads back equals a store round trip: the leader's row cache holds every row it computed,
    another rank's holds the rows of ``keep`` when it reads for itself (``fetch_policy="independent"``) and none
    when its leader reads for it, each as the store would return it (trimmed, then zero-padded).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from adapters.memory import MemoryStore
from core.codec import to_jagged, to_padded
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, PREV_LOGPROBS
from shell.column_io import first_write, write_columns
from shell.policy_worker import PolicyWorker, PolicyWorkerConfig
from shell.row_cache import StepRowCache

PARTITION = "p"
PAD = 6


class _Rank(PolicyWorker):
    """The write-back half of a policy rank, without Ray: a store client, a row cache and whether it leads."""

    is_replica_leader = False  # type: ignore[assignment]

    def __init__(self, client: MemoryStore, leader: bool, fetch_policy: str = "auto") -> None:
        self.config = PolicyWorkerConfig(fetch_policy=fetch_policy)  # type: ignore[arg-type]
        self._client = client
        self._row_cache = StepRowCache()
        self.is_replica_leader = leader  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, PAD), min_size=1, max_size=10),
    leader=st.booleans(),
    fetch_policy=st.sampled_from(["auto", "independent", "leader_broadcast"]),
    data=st.data(),
)
def test_write_back_writes_what_is_not_kept_and_keeps_what_the_train_call_reads(
    lengths: list[int], leader: bool, fetch_policy: str, data: st.DataObject
) -> None:
    n = len(lengths)
    keys = [f"k{i}" for i in range(n)]
    keep = frozenset(data.draw(st.sets(st.sampled_from(keys))))
    store = MemoryStore()
    meta = first_write(
        store, {"input_ids": torch.ones(n, PAD, dtype=torch.int64)}, keys=keys, partition_id=PARTITION,
        lengths=lengths, token_fields=["input_ids"],
    ).with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: PAD})
    logprobs = torch.randn(n, PAD, generator=torch.Generator().manual_seed(n))
    rank = _Rank(store, leader, fetch_policy)

    wrote = rank.write_back(meta, {PREV_LOGPROBS: logprobs}, token_fields=[PREV_LOGPROBS], keep=keep)

    sent = [k for k in keys if k not in keep]
    stored = [k for k in keys if PREV_LOGPROBS in store.describe([k], PARTITION).fields]
    assert stored == (sent if leader else [])
    assert wrote == (leader and bool(sent))
    expected = to_padded(to_jagged(logprobs, lengths), pad_to_length=PAD)
    reads_for_itself = leader or fetch_policy == "independent"
    held = keys if leader else [k for k in keys if k in keep and reads_for_itself]
    hits, _ = rank._row_cache.split(keys, [PREV_LOGPROBS], PAD)
    assert [keys[i] for i in hits] == held
    if held:
        rows = torch.tensor([keys.index(k) for k in held])
        assert torch.equal(rank._row_cache.gather(held, [PREV_LOGPROBS], PAD)[PREV_LOGPROBS], expected[rows])


def test_write_back_refuses_to_keep_rows_without_the_step_pad_length() -> None:
    """Rows kept off the store must be kept as the train call reads them: that needs the step's pad length."""
    store = MemoryStore()
    meta = first_write(
        store, {"input_ids": torch.ones(2, 3, dtype=torch.int64)}, keys=["a", "b"], partition_id=PARTITION,
        lengths=[3, 2], token_fields=["input_ids"],
    )
    with pytest.raises(ValueError, match=r"'keep' needs 'meta' stamped with 'global_forward_pad_seqlen'"):
        _Rank(store, True).write_back(meta, {PREV_LOGPROBS: torch.zeros(2, 3)}, token_fields=[PREV_LOGPROBS], keep={"a"})
    assert PREV_LOGPROBS not in store.describe(["a", "b"], PARTITION).fields


class _CountingStore(MemoryStore):
    """A MemoryStore that logs each get's keys and fields."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

    def get(self, keys, partition_id, fields=None, **kwargs):  # type: ignore[no-untyped-def]
        self.gets.append((tuple(keys), tuple(fields or ())))
        return super().get(keys, partition_id, fields, **kwargs)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, PAD), min_size=2, max_size=10), data=st.data())
def test_a_rank_reads_each_row_and_field_from_its_cache_when_held_and_the_rest_in_one_get_per_miss_pattern(
    lengths: list[int], data: st.DataObject
) -> None:
    """A train shard of rows this rank kept (log-probs in no store) and rows another rank computed, read with a
    stored field the cache never held: each (row, field) comes from the cache when held, else from the store, one
    get per pattern of missed rows, each value as a store round trip gives it."""
    n = len(lengths)
    keys = [f"k{i}" for i in range(n)]
    m = data.draw(st.integers(1, n - 1))  # this rank computes keys[:m]; another rank keys[m:]
    keep = sorted(data.draw(st.sets(st.sampled_from(keys[:m]))))
    store = _CountingStore()
    ids = torch.arange(n * PAD, dtype=torch.int64).reshape(n, PAD)
    meta = first_write(
        store, {"input_ids": ids, "extra": torch.arange(n, dtype=torch.float32)}, keys=keys, partition_id=PARTITION,
        lengths=lengths, token_fields=["input_ids"],
    ).with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: PAD})
    logprobs = torch.randn(n, PAD, generator=torch.Generator().manual_seed(n))
    rank = _Rank(store, True)
    mine = meta.subset(range(m))
    rank._read_rows(mine, ["input_ids"], "padded")  # the log-prob call's fetch, then its write-back
    rank.write_back(mine, {PREV_LOGPROBS: logprobs[:m]}, token_fields=[PREV_LOGPROBS], keep=frozenset(keep))
    write_columns(store, meta.subset(range(m, n)), {PREV_LOGPROBS: logprobs[m:]}, token_fields=[PREV_LOGPROBS])
    store.gets.clear()
    rows = [keys.index(k) for k in keep] + list(range(m, n))  # the train shard: kept rows and the other rank's
    shard = meta.subset(rows)

    batch = rank._read_rows(shard, ["input_ids", "extra", PREV_LOGPROBS], "padded")

    index = torch.tensor(rows)
    assert torch.equal(batch["input_ids"], to_padded(to_jagged(ids, lengths), pad_to_length=PAD)[index])
    assert torch.equal(batch["extra"], torch.arange(n, dtype=torch.float32)[index])
    assert torch.equal(batch[PREV_LOGPROBS], to_padded(to_jagged(logprobs, lengths), pad_to_length=PAD)[index])
    others = tuple(keys[m:])
    expected = [(others, ("input_ids", PREV_LOGPROBS)), (shard.keys, ("extra",))] if keep else [(shard.keys, ("input_ids", "extra", PREV_LOGPROBS))]
    assert sorted(store.gets) == sorted(expected)
