"""Laws of a policy rank's write-back (:meth:`shell.policy_worker.PolicyWorker.write_back`), on a MemoryStore.

For any rows and any set ``keep`` of them:
  * partition: the replica leader writes exactly the rows outside ``keep``, once; no other rank writes;
  * what the train call reads back equals a store round trip: the leader's row cache holds every row it computed,
    any other rank's holds the rows of ``keep``, each as the store would return it (trimmed, then zero-padded).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from adapters.memory import MemoryStore
from core.codec import to_jagged, to_padded
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, PREV_LOGPROBS
from shell.column_io import first_write
from shell.policy_worker import PolicyWorker
from shell.row_cache import StepRowCache

PARTITION = "p"
PAD = 6


class _Rank(PolicyWorker):
    """The write-back half of a policy rank, without Ray: a store client, a row cache and whether it leads."""

    is_replica_leader = False  # type: ignore[assignment]

    def __init__(self, client: MemoryStore, leader: bool) -> None:  # noqa: D107 - no backend, no group
        self._client = client
        self._row_cache = StepRowCache()
        self.is_replica_leader = leader  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, PAD), min_size=1, max_size=10), leader=st.booleans(), data=st.data())
def test_write_back_writes_what_is_not_kept_and_keeps_what_the_train_call_reads(
    lengths: list[int], leader: bool, data: st.DataObject
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
    rank = _Rank(store, leader)

    wrote = rank.write_back(meta, {PREV_LOGPROBS: logprobs}, token_fields=[PREV_LOGPROBS], keep=keep)

    sent = [k for k in keys if k not in keep]
    stored = [k for k in keys if PREV_LOGPROBS in store.describe([k], PARTITION).fields]
    assert stored == (sent if leader else [])
    assert wrote == (leader and bool(sent))
    expected = to_padded(to_jagged(logprobs, lengths), pad_to_length=PAD)
    held = keys if leader else [k for k in keys if k in keep]
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
