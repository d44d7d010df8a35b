"""Data parity of the two transports: the legacy driver slice equals the data-plane fetch, byte for byte.

For a hypothesis batch (ragged lengths, DP 1..4, with and without packing or
dynamic batching, with and without a train global batch size) the step is
planned by core on both paths (:func:`core.step_plan.stamp_step`, then
:func:`core.step_plan.shard_step` with the policy's ``config.layout``), and
for every rank ``d``::

    LegacyTransport().rank_inputs(StepRows(meta, data), shards, unsorted, FIELDS)[d].data
        == fetch_rank_batch(client, shards[d], FIELDS)        # after first_write

as tensors (layout, dtype, shape, bytes), with the same rows in the same order,
the same ``extra_info`` (pad length, micro-batch spans) and micro-batch plan.
The legacy side plans its own meta (``legacy_meta``, as the legacy rollout's
rows are planned); the data plane's rank input is the shard meta itself. The
fetch runs in-process against ``MemoryStore`` for many examples and against
the session's TransferQueue for a few. Also here: the pure pieces the two
paths share (``stamp_step``, ``micro_batch_spans``, ``PolicyConfig``'s layout,
``slice_rank_batch``) and the ``GRPOLoss`` object (no Ray needed).
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
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES, is_token_field
from core.grpo import clipped_policy_loss
from core.meta import KVBatchMeta
from core.sharding import DynamicBatchingSpec, PackingSpec
from core.step_plan import legacy_meta, micro_batch_spans, shard_step, stamp_step
from core.topology import NamedSharding
from shell.column_io import first_write
from shell.loss import GRPOLoss
from shell.policy import PolicyConfig
from shell.policy_worker import fetch_rank_batch
from shell.rank_input import InlineShard, StoreShard
from shell.step_rows import StepRows
from shell.transport import DataPlaneTransport, LegacyTransport, slice_rank_batch
from tests.property.strategies import policy_batches

pytestmark = pytest.mark.e2e

FIELDS = ["input_ids", "token_mask", "prev_logprobs", "advantages"]
TOKEN_FIELDS = ["input_ids", "token_mask", "prev_logprobs"]
PLAN_KEYS = (MICRO_BATCH_INDICES, "micro_batch_lengths", GLOBAL_FORWARD_PAD_SEQLEN, "train_global_batch_size")
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
    multiple = config.layout.step_pad_multiple
    step = stamp_step(written, multiple=multiple)
    legacy_rows = StepRows(stamp_step(legacy_meta(lengths), multiple=multiple), data)
    plane = DataPlaneTransport(client, lambda: client, partition_id=written.partition_id)
    try:
        for train in (False, True):
            shards, unsorted = shard_step(step, config.layout, train=train)
            legacy_metas, legacy_unsorted = shard_step(legacy_rows.meta, config.layout, train=train)
            assert unsorted == legacy_unsorted
            legacy = LegacyTransport().rank_inputs(legacy_rows, legacy_metas, legacy_unsorted, FIELDS)
            same_meta = LegacyTransport().rank_inputs(StepRows(step, data), shards, unsorted, FIELDS)
            stored = plane.rank_inputs(StepRows(step), shards, unsorted, FIELDS)
            assert len(legacy) == len(same_meta) == len(stored) == len(shards) == dp
            counts, widths = set(), set()
            for rank, (inline, inline_same, store_input, meta) in enumerate(zip(legacy, same_meta, stored, shards)):
                assert isinstance(inline, InlineShard) and store_input == StoreShard(meta)
                fetched = fetch_rank_batch(client, meta, FIELDS)
                assert _canonical(fetched) == _canonical(inline.data), f"rank {rank} (train={train}) differs"
                assert _canonical(fetched) == _canonical(inline_same.data), f"rank {rank} (train={train}, one meta) differs"
                for name in PLAN_KEYS:
                    assert inline.extra_info.get(name) == meta.extra_info.get(name), f"{name} differs on rank {rank}"
                    assert inline_same.extra_info.get(name) == store_input.extra_info.get(name), f"{name} differs on rank {rank}"
                plan = micro_batch_spans(meta.extra_info, len(meta))  # raises unless the spans tile the rank's rows
                assert plan == micro_batch_spans(inline.extra_info, len(inline.data))
                counts.add(len(plan))
                widths.add(fetched["input_ids"].shape[1])
            assert len(counts) == 1 and len(widths) == 1, f"ranks disagree: steps {counts}, widths {widths}"
            steps = n // gbs if train and gbs is not None else 1
            assert counts == {steps}, f"expected {steps} global batch(es) (train={train}, gbs={gbs}): got {counts}"
    finally:
        client.clear(written.keys, written.partition_id)


def _shardable(data: TensorDict, dp: int, gbs: int | None, spec: Spec) -> bool:
    """Whether the core sharding accepts the case (packing can need more rows than there are)."""
    meta = stamp_step(legacy_meta(data["lengths"].tolist()), multiple=1)
    layout = _config(dp, gbs, spec).layout
    try:
        shard_step(meta, layout, train=True)
        shard_step(meta, layout, train=False)
    except ValueError as error:
        if "too few" in str(error):
            return False
        raise
    return True


@settings(max_examples=100, deadline=None)
@given(case=policy_batches())
def test_legacy_rank_inputs_equal_memory_store_fetch(case: tuple[TensorDict, int, int | None, Spec]) -> None:
    """Every rank's legacy rank input is byte-identical to its MemoryStore fetch, with the same plan and pad length."""
    data, dp, gbs, spec = case
    if not _shardable(data, dp, gbs, spec):
        return
    _check_parity(MemoryStore(), data, dp, gbs, spec)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=policy_batches())
def test_legacy_rank_inputs_equal_transfer_queue_fetch(
    tq_store_session: TransferQueueStore, case: tuple[TensorDict, int, int | None, Spec]
) -> None:
    """Every rank's legacy rank input is byte-identical to its fetch from the real TransferQueue."""
    data, dp, gbs, spec = case
    if not _shardable(data, dp, gbs, spec):
        return
    client = TransferQueueStore.attach()
    try:
        _check_parity(client, data, dp, gbs, spec)
    finally:
        client.close()


def test_parity_token_fields_are_core_token_fields() -> None:
    """The fields written per-token here are exactly those core calls per-token (which the legacy slice trims)."""
    assert TOKEN_FIELDS == [name for name in FIELDS if is_token_field(name)]


def test_stamp_step_rejects_a_second_pad_length() -> None:
    """The pad length is stamped once per step: a different value is refused; a meta without lengths too."""
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
    assert stamp_step(meta, multiple=8).extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 8
    with pytest.raises(ValueError, match=r"stamped once per step: expected 8, got 4"):
        stamp_step(stamped, multiple=8)
    with pytest.raises(ValueError, match=r"'meta.sequence_lengths' is required to stamp a step's pad length: got None"):
        stamp_step(KVBatchMeta("p", ["a"]), multiple=1)


def test_micro_batch_spans_uses_the_driver_spans_as_they_are() -> None:
    """The spans the driver stamped are the worker's plan, unchanged."""
    assert micro_batch_spans({MICRO_BATCH_INDICES: (((0, 2), (2, 3)),)}, 3) == (((0, 2), (2, 3)),)
    assert micro_batch_spans({MICRO_BATCH_INDICES: (((0, 3),), ((3, 4), (4, 6)))}, 6) == (((0, 3),), ((3, 4), (4, 6)))


def test_micro_batch_spans_rejects_spans_that_do_not_tile() -> None:
    """Spans with a gap, out of order, or not covering the rank's rows are refused."""
    with pytest.raises(ValueError, match=r"'micro_batch_indices' must tile range\(4\) in order"):
        micro_batch_spans({MICRO_BATCH_INDICES: (((0, 2), (3, 4)),)}, 4)
    with pytest.raises(ValueError, match=r"'micro_batch_indices' must tile range\(5\) in order"):
        micro_batch_spans({MICRO_BATCH_INDICES: (((0, 2),), ((2, 4),))}, 5)
    with pytest.raises(ValueError, match=r"'micro_batch_indices' must tile range\(4\) in order"):
        micro_batch_spans({MICRO_BATCH_INDICES: (((2, 4),), ((0, 2),))}, 4)


def test_grpo_loss_matches_core_and_pickles() -> None:
    """GRPOLoss is core's clipped loss (plus kl_coef * k3 KL) summed over its tokens, with their count, and survives
    pickling."""
    g = torch.Generator().manual_seed(0)
    lp, prev, ref = (torch.randn(3, 5, generator=g) for _ in range(3))
    batch = {"prev_logprobs": prev, "advantages": torch.randn(3, generator=g), "token_mask": torch.rand(3, 5, generator=g) > 0.5,
             "reference_policy_logprobs": ref}
    loss_fn = pickle.loads(pickle.dumps(GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)))
    loss, tokens, metrics = loss_fn(lp, batch)
    expected, _ = clipped_policy_loss(lp, prev, batch["advantages"], batch["token_mask"], clip_low=0.2, clip_high=0.28)
    assert int(tokens) == int(batch["token_mask"].sum()) and "kl" not in metrics
    assert float(loss / tokens) == pytest.approx(float(expected), rel=1e-6)  # the summed loss over its tokens
    assert metrics["policy_loss"] == pytest.approx(float(expected), rel=1e-6)
    with_kl, tokens, metrics = GRPOLoss(kl_coef=0.5)(lp, batch)
    mean = clipped_policy_loss(lp, prev, batch["advantages"], batch["token_mask"])[0].item() + 0.5 * metrics["kl"]
    assert metrics["kl"] > 0 and (with_kl / tokens).item() == pytest.approx(mean, rel=1e-6)
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
    assert PolicyConfig(sharding=NamedSharding({"tensor_parallel": 2})).layout.step_pad_multiple == 2
    assert PolicyConfig(sharding=dp2, packing=PackingSpec(8, sequence_length_pad_multiple=4)).layout.step_pad_multiple == 4
    assert PolicyConfig(sharding=dp2, pad_multiple=3).layout.step_pad_multiple == 3
    assert PolicyConfig(sharding=dp2, train_global_batch_size=4).layout.train_global_batch_size == 4


def test_legacy_meta_and_slice_rank_batch_reject_missing_fields() -> None:
    """A legacy meta has one synthetic key per length; a slice needs every field a call reads and pads token fields."""
    data = TensorDict({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 9]]), "advantages": torch.tensor([1.0, 2.0])}, batch_size=[2])
    meta = legacy_meta([3, 1])
    assert meta.keys == ("row0", "row1") and meta.sequence_lengths == (3, 1)
    with pytest.raises(KeyError, match=r"missing \['token_mask'\]"):
        slice_rank_batch(data, [1, 0], [3, 1], fields=["input_ids", "token_mask"], pad_to=4)
    batch = slice_rank_batch(data, [1, 0], [3, 1], fields=["input_ids", "advantages"], pad_to=4)
    assert batch["input_ids"].tolist() == [[8, 0, 0, 0], [5, 6, 7, 0]]  # per-token: trimmed to each length, then padded
    assert batch["advantages"].tolist() == [2.0, 1.0] and batch["lengths"].tolist() == [1, 3]


def test_legacy_transport_rank_inputs_need_the_batch() -> None:
    """The legacy transport slices the driver's batch: rows that live in a store have none to slice."""
    meta = stamp_step(legacy_meta([2, 1]), multiple=1)
    shards, unsorted = shard_step(meta, _config(1, None, None).layout, train=False)
    with pytest.raises(ValueError, match=r"these rows live in partition 'legacy': the driver holds no batch"):
        LegacyTransport().rank_inputs(StepRows(meta), shards, unsorted, ["input_ids"])


def test_fetch_rank_batch_requires_sequence_lengths() -> None:
    """A meta without lengths cannot be fetched as a rank batch."""
    store = MemoryStore()
    meta = store.put(["a"], "p", TensorDict({"x": torch.zeros(1, 2)}, batch_size=[1]))
    with pytest.raises(ValueError, match=r"'meta.sequence_lengths' is required to fetch a rank batch"):
        fetch_rank_batch(store, meta, ["x"])
