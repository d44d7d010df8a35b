"""Data parity of the two policy paths: the legacy driver slice equals the data-plane fetch, byte for byte.

For a hypothesis batch (ragged lengths, DP 1..4, with and without packing or
dynamic batching, with and without a train global batch size) the legacy path
(``shell.policy.legacy_shards``) and the data-plane path (``first_write``,
``stamp_step``, ``shard_step``, then ``shell.policy_worker.fetch_rank_batch``
per rank) must give every rank the same rows in the same order, the same
tensors (layout, dtype, shape, bytes) and the same micro-batch plan and pad
length. The fetch runs in-process against ``MemoryStore`` for many examples
and against the session's TransferQueue for a few. Also here: the
``GRPOLoss`` object and the worker's micro-batch plan (no Ray needed).
"""

from __future__ import annotations

import pickle
import uuid
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from tensordict import TensorDict

from adapters.memory import MemoryStore
from adapters.store_port import DataPlaneClient
from adapters.transfer_queue import TransferQueueStore
from core.codec import is_jagged
from core.grpo import clipped_policy_loss
from core.sharding import DynamicBatchingSpec, PackingSpec
from core.topology import NamedSharding
from shell.column_io import GLOBAL_FORWARD_PAD_SEQLEN, first_write
from shell.loss import GRPOLoss
from shell.policy import PolicyConfig, legacy_meta, legacy_shards, shard_step, slice_rank_batch, stamp_step
from shell.policy_worker import fetch_rank_batch, micro_batch_plan
from tests.property.strategies import policy_batches

pytestmark = pytest.mark.e2e

FIELDS = ["input_ids", "token_mask", "prev_logprobs", "advantages"]
TOKEN_FIELDS = ["input_ids", "token_mask", "prev_logprobs"]
PLAN_KEYS = ("micro_batch_indices", "micro_batch_lengths", GLOBAL_FORWARD_PAD_SEQLEN, "train_global_batch_size")
Spec = PackingSpec | DynamicBatchingSpec | None


def _config(dp: int, gbs: int | None, spec: Spec) -> PolicyConfig:
    return PolicyConfig(
        sharding=NamedSharding({"data_parallel": dp}),
        train_global_batch_size=gbs,
        packing=spec if isinstance(spec, PackingSpec) else None,
        dynamic_batching=spec if isinstance(spec, DynamicBatchingSpec) else None,
    )


def _canonical(td: TensorDict) -> dict[str, tuple[Any, ...]]:
    """Each field as (layout, dtype, shape, bytes): equal iff the tensors are byte-identical."""
    out = {}
    for name, t in td.items():
        assert not is_jagged(t), f"field {name!r} must be padded in a rank batch"
        out[name] = (str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def _check_parity(client: DataPlaneClient, data: TensorDict, dp: int, gbs: int | None, spec: Spec) -> None:
    config = _config(dp, gbs, spec)
    n = data.batch_size[0]
    keys = [f"k{i}" for i in range(n)]
    lengths = data["lengths"].tolist()
    written = first_write(
        client,
        {name: data[name] for name in FIELDS},
        keys=keys,
        partition_id=f"parity-{uuid.uuid4().hex}",
        lengths=lengths,
        token_fields=TOKEN_FIELDS,
    )
    step = stamp_step(written, multiple=config.step_pad_multiple)
    try:
        for train in (False, True):
            legacy, legacy_unsorted = legacy_shards(data, config, fields=FIELDS, train=train)
            metas, unsorted = shard_step(step, config, train=train)
            assert unsorted == legacy_unsorted
            counts, widths = set(), set()
            for rank, (shard, meta) in enumerate(zip(legacy, metas)):
                fetched = fetch_rank_batch(client, meta, FIELDS)
                assert _canonical(fetched) == _canonical(shard.data), f"rank {rank} (train={train}) differs"
                for name in PLAN_KEYS:
                    assert shard.extra_info.get(name) == meta.extra_info.get(name), f"{name} differs on rank {rank}"
                counts.add(len(micro_batch_plan(meta.extra_info, len(meta), rows_per_step=None if gbs is None or not train else gbs // dp)))
                widths.add(fetched["input_ids"].shape[1])
            assert len(counts) == 1 and len(widths) == 1, f"ranks disagree: steps {counts}, widths {widths}"
    finally:
        client.clear(written.keys, written.partition_id)


def _shardable(data: TensorDict, dp: int, gbs: int | None, spec: Spec) -> bool:
    """Whether the core sharding accepts the case (packing can need more rows than there are)."""
    meta = stamp_step(legacy_meta(data), multiple=1)
    try:
        shard_step(meta, _config(dp, gbs, spec), train=True)
        shard_step(meta, _config(dp, gbs, spec), train=False)
    except ValueError as error:
        if "too few" in str(error):
            return False
        raise
    return True


@settings(max_examples=100, deadline=None)
@given(case=policy_batches())
def test_legacy_shards_equal_memory_store_fetch(case: tuple[TensorDict, int, int | None, Spec]) -> None:
    """Every rank's legacy batch is byte-identical to its MemoryStore fetch, with the same plan and pad length."""
    data, dp, gbs, spec = case
    if not _shardable(data, dp, gbs, spec):
        return
    _check_parity(MemoryStore(), data, dp, gbs, spec)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=policy_batches())
def test_legacy_shards_equal_transfer_queue_fetch(
    tq_store_session: TransferQueueStore, case: tuple[TensorDict, int, int | None, Spec]
) -> None:
    """Every rank's legacy batch is byte-identical to its fetch from the real TransferQueue."""
    data, dp, gbs, spec = case
    if not _shardable(data, dp, gbs, spec):
        return
    client = TransferQueueStore.attach()
    try:
        _check_parity(client, data, dp, gbs, spec)
    finally:
        client.close()


def test_stamp_step_rejects_a_second_pad_length() -> None:
    """The pad length is stamped once per step: a different value is refused."""
    meta = first_write(
        MemoryStore(),
        {"input_ids": torch.zeros(2, 4, dtype=torch.long)},
        keys=["a", "b"],
        partition_id="p",
        lengths=[4, 2],
        token_fields=["input_ids"],
    )
    stamped = stamp_step(meta, multiple=1)
    assert stamped.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4
    assert stamp_step(stamped, multiple=1) == stamped
    with pytest.raises(ValueError, match=r"stamped once per step: expected 8, got 4"):
        stamp_step(stamped, multiple=8)


def test_micro_batch_plan_uses_driver_spans_or_one_per_step() -> None:
    """The driver's spans are used as they are; without them, one micro-batch per global batch."""
    assert micro_batch_plan({"micro_batch_indices": (((0, 2), (2, 3)),)}, 3) == (((0, 2), (2, 3)),)
    assert micro_batch_plan({}, 6, rows_per_step=3) == (((0, 3),), ((3, 6),))
    assert micro_batch_plan({}, 6) == (((0, 6),),)


def test_micro_batch_plan_rejects_spans_that_do_not_tile() -> None:
    """Spans with a gap, or not covering the rows, are refused."""
    with pytest.raises(ValueError, match=r"'micro_batch_indices' must tile range\(4\) in order"):
        micro_batch_plan({"micro_batch_indices": (((0, 2), (3, 4)),)}, 4)
    with pytest.raises(ValueError, match=r"'rows_per_step' must be >= 1 and divide the rank's 5 rows: got 2"):
        micro_batch_plan({}, 5, rows_per_step=2)


def test_grpo_loss_matches_core_and_pickles() -> None:
    """GRPOLoss is core's clipped loss (plus kl_coef * k3 KL), and survives pickling."""
    g = torch.Generator().manual_seed(0)
    lp, prev, ref = (torch.randn(3, 5, generator=g) for _ in range(3))
    batch = {"prev_logprobs": prev, "advantages": torch.randn(3, generator=g), "token_mask": torch.rand(3, 5, generator=g) > 0.5,
             "reference_policy_logprobs": ref}
    loss_fn = pickle.loads(pickle.dumps(GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)))
    loss, metrics = loss_fn(lp, batch)
    expected, _ = clipped_policy_loss(lp, prev, batch["advantages"], batch["token_mask"], clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss, expected) and "kl" not in metrics
    with_kl, metrics = GRPOLoss(kl_coef=0.5)(lp, batch)
    assert metrics["kl"] > 0 and with_kl.item() == pytest.approx(clipped_policy_loss(lp, prev, batch["advantages"], batch["token_mask"])[0].item() + 0.5 * metrics["kl"])
    assert GRPOLoss(kl_coef=0.5).input_fields[-1] == "reference_policy_logprobs"


def test_grpo_loss_rejects_missing_fields_and_negative_coefficients() -> None:
    """A micro-batch without the loss's fields, or a negative coefficient, is refused by name."""
    with pytest.raises(KeyError, match=r"missing \['advantages', 'token_mask'\]"):
        GRPOLoss()(torch.zeros(1, 2), {"prev_logprobs": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match=r"'kl_coef' must be >= 0: got -1"):
        GRPOLoss(kl_coef=-1)


def test_policy_config_rejects_both_specs_and_uneven_global_batch() -> None:
    """Packing and dynamic batching are exclusive; the global batch splits evenly over DP."""
    dp2 = NamedSharding({"data_parallel": 2})
    with pytest.raises(ValueError, match=r"'packing' and 'dynamic_batching' are mutually exclusive"):
        PolicyConfig(sharding=dp2, packing=PackingSpec(8), dynamic_batching=DynamicBatchingSpec(8))
    with pytest.raises(ValueError, match=r"'train_global_batch_size' must be a positive multiple of the DP size 2: got 3"):
        PolicyConfig(sharding=dp2, train_global_batch_size=3)
    assert PolicyConfig(sharding=NamedSharding({"tensor_parallel": 2})).step_pad_multiple == 2


def test_legacy_meta_and_slice_reject_missing_fields() -> None:
    """An in-memory batch needs 'lengths', and every field a call reads."""
    data = TensorDict({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, batch_size=[2])
    with pytest.raises(KeyError, match=r"'data' must hold 'lengths'"):
        legacy_meta(data)
    data.set("lengths", torch.tensor([3, 1]))
    assert legacy_meta(data).sequence_lengths == (3, 1)
    with pytest.raises(KeyError, match=r"missing \['token_mask'\]"):
        slice_rank_batch(data, [1, 0], fields=["input_ids", "token_mask"], token_fields=["input_ids"], pad_to=4)
    batch = slice_rank_batch(data, [1, 0], fields=["input_ids"], token_fields=["input_ids"], pad_to=4)
    assert batch["input_ids"].shape == (2, 4) and batch["lengths"].tolist() == [1, 3]


def test_fetch_rank_batch_requires_sequence_lengths() -> None:
    """A meta without lengths cannot be fetched as a rank batch."""
    store = MemoryStore()
    meta = store.put(["a"], "p", TensorDict({"x": torch.zeros(1, 2)}, batch_size=[1]))
    with pytest.raises(ValueError, match=r"'meta.sequence_lengths' is required to fetch a rank batch"):
        fetch_rank_batch(store, meta, ["x"])
