"""Policy parity on real worker groups (Ray + megatron on CPU, gloo): one ``Policy`` over both transports.

One group per layout (DP=2, TP=2 x DP=1, PP=2 x DP=1) is shared by this
module's tests; a policy on each transport drives the same group, and ``reset`` rebuilds
every rank's backend (seed weights, fresh optimizer) before each path trains.
Per layout and batching mode (none, packing, dynamic batching):

* log-probs and reference log-probs are bitwise equal on both paths and come
  back in caller key order (the data plane stores them by key);
* one train call (two optimizer steps) gives the same losses, grad norms and
  per-micro-batch metrics on both paths;
* exactly one write per (key, field), counted by a recording client inside
  every worker; the same micro-batch count and forward length on every DP rank;
* with ``keep_for_train``, the log-prob call is sharded as the train call: no
  row is written back, the train call reads nothing from the store, and it is
  unchanged;
* a worker that raises mid-step leaves none of the step's keys in the store.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from adapters.store_port import DataPlaneClient
from adapters.transfer_queue import TransferQueueStore
from core.fields import PREV_LOGPROBS, REFERENCE_LOGPROBS
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from core.sharding import DynamicBatchingSpec, PackingSpec
from core.step_plan import legacy_meta, shard_step
from core.topology import NamedSharding
from shell.bench.policy import MeteredGroup
from shell.column_io import first_write
from shell.loss import GRPOLoss
from shell.policy import Policy, PolicyConfig, build_group
from shell.policy_worker import PolicyWorker
from shell.worker_group import GPUShortageError
from shell.step_rows import StepRows
from shell.transport import DataPlaneTransport, LegacyTransport
from shell.worker import on_all_ranks
from shell.worker_group import WorkerError, WorkerGroup

pytestmark = pytest.mark.e2e

MODEL = TinyGPTConfig(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=64)
LAYOUTS: dict[str, dict[str, int]] = {
    "dp2": {"data_parallel": 2},
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
}
N_ROWS = 16
GBS = 8
TOKEN_FIELDS = ["input_ids", "token_mask"]
LOSS = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)


class RecordingClient:
    """A store client that logs every put's and every get's ``(keys, fields)`` and forwards every call."""

    def __init__(self, inner: DataPlaneClient) -> None:
        self.inner = inner
        self.puts: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self.gets: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

    def put(self, keys: Sequence[str], partition_id: str, fields: TensorDict, **kwargs: Any) -> KVBatchMeta:
        self.puts.append((tuple(keys), tuple(fields.keys())))
        return self.inner.put(keys, partition_id, fields, **kwargs)

    def get(self, keys: Sequence[str], partition_id: str, fields: Sequence[str], **kwargs: Any) -> TensorDict:
        self.gets.append((tuple(keys), tuple(fields)))
        return self.inner.get(keys, partition_id, fields, **kwargs)

    def get_with_tags(self, keys: Sequence[str], partition_id: str, fields: Sequence[str], **kwargs: Any) -> Any:
        self.gets.append((tuple(keys), tuple(fields)))
        return self.inner.get_with_tags(keys, partition_id, fields, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def recording_transfer_queue() -> RecordingClient:
    """The workers' client factory: TransferQueue, recorded."""
    return RecordingClient(TransferQueueStore.attach())


class RecordingPolicyWorker(PolicyWorker):
    """A PolicyWorker that hands its client's write log and read log back (and empties them)."""

    @on_all_ranks
    def take_write_log(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        log = list(self.client.puts)  # type: ignore[attr-defined]
        self.client.puts.clear()  # type: ignore[attr-defined]
        return log

    @on_all_ranks
    def take_read_log(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        log = list(self.client.gets)  # type: ignore[attr-defined]
        self.client.gets.clear()  # type: ignore[attr-defined]
        return log


def _config(layout: str, mode: str) -> PolicyConfig:
    sharding = NamedSharding(LAYOUTS[layout])
    tp = sharding.axis_size("tensor_parallel")
    return PolicyConfig(
        sharding=sharding,
        model=MODEL,
        seed=3,
        train_global_batch_size=GBS,
        packing=PackingSpec(max_tokens_per_microbatch=48, sequence_length_pad_multiple=tp) if mode == "packing" else None,
        dynamic_batching=DynamicBatchingSpec(max_tokens_per_microbatch=48) if mode == "dynamic" else None,
        timeout_s=180.0,
    )


def _batch(seed: int) -> TensorDict:
    """A ragged GRPO batch: ids (junk past each row's end), mask of response tokens, advantages, lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 21, (N_ROWS,), generator=g)
    width = int(lengths.max()) + 3
    positions = torch.arange(width)[None, :]
    prompt = torch.randint(1, 4, (N_ROWS, 1), generator=g)
    return TensorDict(
        {
            "input_ids": torch.randint(0, MODEL.vocab_size, (N_ROWS, width), generator=g),
            "token_mask": (positions >= prompt) & (positions < lengths[:, None]),
            "advantages": torch.randn(N_ROWS, generator=g),
            "lengths": lengths,
        },
        batch_size=[N_ROWS],
    )


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def group(request: pytest.FixtureRequest, ray_cluster: None, tq_store_session: TransferQueueStore) -> Iterator[WorkerGroup]:
    """A 2-rank policy group per layout, with recording TransferQueue clients, shared by this module."""
    with build_group(_config(request.param, "none"), worker_cls=RecordingPolicyWorker, client_factory=recording_transfer_queue) as wg:
        yield wg


@pytest.fixture
def client(tq_store_session: TransferQueueStore) -> Iterator[DataPlaneClient]:
    """The driver's TransferQueue client."""
    store = TransferQueueStore.attach()
    try:
        yield store
    finally:
        store.close()


def _layout(group: WorkerGroup) -> str:
    return next(name for name, sizes in LAYOUTS.items() if NamedSharding(sizes) == group.sharding)


def _write(client: DataPlaneClient, data: TensorDict) -> KVBatchMeta:
    return first_write(
        client,
        {name: data[name] for name in ("input_ids", "token_mask", "advantages")},
        keys=[f"row-{uuid.uuid4().hex[:8]}" for _ in range(N_ROWS)],
        partition_id=f"policy-{uuid.uuid4().hex}",
        lengths=data["lengths"].tolist(),
        token_fields=TOKEN_FIELDS,
    )


def _logged_counts(group: WorkerGroup, take: Any) -> Counter[tuple[str, str]]:
    """How often each ``(key, field)`` is in the logs that ``take`` (a ``RecordingPolicyWorker`` method) hands back
    from every rank."""
    counts: Counter[tuple[str, str]] = Counter()
    for log in group.call(take):
        for keys, fields in log:
            counts.update((k, f) for k in keys for f in fields)
    return counts


def _write_counts(group: WorkerGroup) -> Counter[tuple[str, str]]:
    return _logged_counts(group, RecordingPolicyWorker.take_write_log)


def _read_counts(group: WorkerGroup) -> Counter[tuple[str, str]]:
    return _logged_counts(group, RecordingPolicyWorker.take_read_log)


def _plane(group: WorkerGroup, client: DataPlaneClient, config: PolicyConfig, meta: KVBatchMeta) -> tuple[Policy, StepRows]:
    """A data-plane policy over ``meta``'s partition, and the step's rows (prepared, and owned by the transport)."""
    transport = DataPlaneTransport(client, recording_transfer_queue, partition_id=meta.partition_id)
    policy = Policy(config, transport, group=group)
    rows = policy.prepare(StepRows(meta))
    transport.admit(rows, {})
    return policy, rows


def _legacy(group: WorkerGroup, config: PolicyConfig, data: TensorDict) -> tuple[Policy, StepRows]:
    """A legacy policy and the in-memory batch's rows (prepared)."""
    policy = Policy(config, LegacyTransport(), group=group)
    return policy, policy.prepare(StepRows(legacy_meta(data["lengths"].tolist()), data))


BOTH = [PREV_LOGPROBS, REFERENCE_LOGPROBS]


@pytest.mark.parametrize("mode", ["none", "packing", "dynamic"])
def test_policy_gives_bitwise_equal_logprobs_and_train_steps_on_both_transports(
    group: WorkerGroup, client: DataPlaneClient, mode: str
) -> None:
    """Both transports give bitwise-equal (reference) log-probs in caller order, and equal losses, grad norms and metrics."""
    config = _config(_layout(group), mode)
    data = _batch(seed=len(mode))
    legacy, legacy_rows = _legacy(group, config, data)
    group.call(PolicyWorker.reset)
    plane, rows = _plane(group, client, config, _write(client, data))
    try:
        group.call(RecordingPolicyWorker.take_write_log)  # drop the set-up's log
        rows = plane.logprobs(rows, reference=True)
        counts = _write_counts(group)
        stored = plane.transport.read(rows, BOTH)
        legacy_rows = legacy.logprobs(legacy_rows, reference=True)
        expected = legacy.transport.read(legacy_rows, BOTH)
        for name in BOTH:
            assert torch.equal(stored[name], expected[name])
        assert stored[PREV_LOGPROBS].abs().sum() > 0
        assert set(counts.values()) == {1}, "every (key, field) is written exactly once, by the replica leader"
        assert set(counts) == {(k, f) for k in rows.meta.keys for f in BOTH}

        group.call(PolicyWorker.reset)
        legacy_result = legacy.train(legacy_rows, LOSS)
        group.call(PolicyWorker.reset)
        plane_result = plane.train(rows, LOSS)
    finally:
        plane.transport.finish(rows)
    assert plane_result.loss == legacy_result.loss and len(plane_result.loss) == N_ROWS // GBS
    assert plane_result.grad_norm == legacy_result.grad_norm
    assert plane_result.micro_batch_metrics == legacy_result.micro_batch_metrics
    assert plane_result.micro_batches == legacy_result.micro_batches
    assert len(set(plane_result.micro_batches)) == 1, "every DP rank runs the same micro-batch count per step"
    assert len(set(plane_result.forward_seq_lengths)) == 1, "every DP rank forwards at the same length"
    assert not set(rows.meta.keys) & set(client.list_keys(rows.meta.partition_id))


def test_policy_logprobs_with_reference_keeps_the_policy_logprobs_on_both_transports(
    group: WorkerGroup, client: DataPlaneClient
) -> None:
    """Asking for the reference too changes no ``prev_logprobs`` bit, on either transport; one write per (key, field)."""
    config = _config(_layout(group), "packing")
    data = _batch(seed=11)
    group.call(PolicyWorker.reset)
    legacy, legacy_rows = _legacy(group, config, data)
    alone = legacy.transport.read(legacy.logprobs(legacy_rows), [PREV_LOGPROBS])
    both = legacy.transport.read(legacy.logprobs(legacy_rows, reference=True), BOTH)
    plane, rows = _plane(group, client, config, _write(client, data))
    try:
        group.call(RecordingPolicyWorker.take_write_log)
        rows = plane.logprobs(rows, reference=True)
        counts = _write_counts(group)
        stored = plane.transport.read(rows, BOTH)
    finally:
        plane.transport.finish(rows)
    assert torch.equal(both[PREV_LOGPROBS], alone[PREV_LOGPROBS])
    for name in BOTH:
        assert torch.equal(stored[name], both[name])
    assert set(counts.values()) == {1}
    assert set(counts) == {(k, f) for k in rows.meta.keys for f in BOTH}


@pytest.mark.parametrize("mode", ["none", "packing"])
def test_policy_keeps_for_train_every_row_each_rank_trains_on_and_neither_writes_back_nor_reads_again(
    group: WorkerGroup, client: DataPlaneClient, mode: str
) -> None:
    """With keep_for_train, the log-prob call is sharded as the train call: every rank reads the rows it trains on
    once, in the log-prob call, writes no log-probs back, and its train call reads nothing from the store (at DP=2 a
    log-prob call on its own, sharded as one global batch, would put some rows on another rank than the train call
    does); the train call still equals the legacy path's bitwise."""
    config = _config(_layout(group), mode)
    data = _batch(seed=21 + len(mode))
    legacy, legacy_rows = _legacy(group, config, data)
    group.call(PolicyWorker.reset)
    legacy_result = legacy.train(legacy.logprobs(legacy_rows, reference=True, keep_for_train=True), LOSS)
    group.call(PolicyWorker.reset)
    plane, rows = _plane(group, client, config, _write(client, data))
    try:
        group.call(RecordingPolicyWorker.take_write_log)
        group.call(RecordingPolicyWorker.take_read_log)
        rows = plane.logprobs(rows, reference=True, prefetch=LOSS.input_fields, keep_for_train=True)
        written, read = _write_counts(group), _read_counts(group)
        plane_result = plane.train(rows, LOSS)
        written_in_train, read_in_train = _write_counts(group), _read_counts(group)
    finally:
        plane.transport.finish(rows)
    forward, _ = shard_step(rows.meta, config.layout, train=False)
    train, _ = shard_step(rows.meta, config.layout, train=True)
    moved = {key for f, t in zip(forward, train) for key in f.keys if key not in t.keys}
    assert bool(moved) == (config.layout.dp_size > 1)  # the shardings differ at DP=2: this call uses the train one
    assert not written and not written_in_train
    assert {key for key, _field in read} == set(rows.meta.keys)  # every row read once a replica, in the log-prob call
    assert not read_in_train
    assert plane_result.loss == legacy_result.loss
    assert plane_result.grad_norm == legacy_result.grad_norm
    assert plane_result.micro_batch_metrics == legacy_result.micro_batch_metrics
    assert not set(rows.meta.keys) & set(client.list_keys(rows.meta.partition_id))


def test_each_call_reports_its_slowest_ranks_model_seconds_within_its_wall_time(
    group: WorkerGroup, client: DataPlaneClient
) -> None:
    """Every rank's log-prob and train result holds ``compute_s`` (else the meter raises ``KeyError``), and a call's
    slowest rank's (what ``shell.bench policy`` reports as its model time, and ``Policy.model_seconds`` holds) is
    positive and below the call's wall time, on both transports."""
    config = _config(_layout(group), "none")
    data = _batch(seed=31)
    metered = MeteredGroup(group)
    legacy = Policy(config, LegacyTransport(), group=metered)  # type: ignore[arg-type]
    legacy_rows = legacy.prepare(StepRows(legacy_meta(data["lengths"].tolist()), data))
    plane, rows = _plane(group, client, config, _write(client, data))
    plane = Policy(config, plane.transport, group=metered)  # type: ignore[arg-type]
    try:
        for policy, call, calls in (
            (legacy, lambda: legacy.logprobs(legacy_rows, reference=True), {"logprobs"}),
            (legacy, lambda: legacy.train(legacy.logprobs(legacy_rows, reference=True), LOSS), {"logprobs", "train"}),
            (plane, lambda: plane.logprobs(rows, reference=True), {"logprobs"}),
            (plane, lambda: plane.train(plane.logprobs(rows, reference=True), LOSS), {"logprobs", "train"}),
        ):
            group.call(PolicyWorker.reset)
            metered.take()
            start = time.perf_counter()
            call()
            wall = time.perf_counter() - start
            model = metered.take_compute()
            assert 0.0 < model < wall, (model, wall)
            assert set(policy.model_seconds) == calls
            assert math.isclose(sum(policy.model_seconds.values()), model, rel_tol=1e-9)
    finally:
        plane.transport.finish(rows)
    group.call(RecordingPolicyWorker.take_write_log)


class MissingFieldLoss(GRPOLoss):
    """A GRPO loss that asks for a field nobody wrote: every worker raises while fetching."""

    @property
    def input_fields(self) -> tuple[str, ...]:
        return (*super().input_fields, "never_written")


def test_policy_clears_step_keys_when_a_worker_raises(group: WorkerGroup, client: DataPlaneClient) -> None:
    """A worker failing mid-step raises WorkerError at the caller and leaves none of the step's keys stored."""
    plane, rows = _plane(group, client, _config(_layout(group), "none"), _write(client, _batch(seed=11)))
    rows = plane.logprobs(rows)
    with pytest.raises(WorkerError, match=r"never_written"):
        plane.train(rows, MissingFieldLoss())
    assert not set(rows.meta.keys) & set(client.list_keys(rows.meta.partition_id))
    group.call(RecordingPolicyWorker.take_write_log)


def test_policy_rejects_an_unprepared_step(group: WorkerGroup, client: DataPlaneClient) -> None:
    """Rows without the step's pad length are refused before any work (and their keys are kept)."""
    meta = _write(client, _batch(seed=12))
    transport = DataPlaneTransport(client, recording_transfer_queue, partition_id=meta.partition_id)
    plane = Policy(_config(_layout(group), "none"), transport, group=group)
    transport.admit(StepRows(meta), {})
    try:
        with pytest.raises(ValueError, match=r"call rows = policy.prepare\(rows\) first"):
            plane.logprobs(StepRows(meta))
        assert set(meta.keys) <= set(client.list_keys(meta.partition_id))
    finally:
        transport.finish(StepRows(meta))
    assert not set(meta.keys) & set(client.list_keys(meta.partition_id))


def test_build_group_refuses_cuda_ranks_without_a_gpu_each(ray_cluster: None) -> None:
    """``device="cuda"`` on a cluster with fewer GPUs than ranks fails at once, naming both counts (Ray would
    otherwise wait for GPUs that never come, up to the group's setup timeout); the ranks' config carries the device."""
    import time

    import ray

    config = PolicyConfig(sharding=NamedSharding({"data_parallel": 2}), model=MODEL, device="cuda")
    assert config.worker_config().device == "cuda" and config.num_gpus_per_worker == 1.0
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if gpus >= 2:
        pytest.skip(f"this Ray cluster has {gpus:g} GPUs: the refusal needs fewer than 2")
    start = time.monotonic()
    with pytest.raises(
        ValueError, match=rf"^'device' is 'cuda': the policy's 2 ranks need 2 GPUs \(1 each\), the Ray cluster has {gpus:g};"
    ) as raised:
        build_group(config)
    assert isinstance(raised.value.__cause__, GPUShortageError)
    assert time.monotonic() - start < 5.0
    with pytest.raises(ValueError, match=r"'device' must be in"):
        PolicyConfig(sharding=NamedSharding({"data_parallel": 2}), device="tpu")
