"""The driver side of a megatron policy: ``Policy`` (legacy, bulk data through the driver) and ``DataPlanePolicy``.

Both shard a step with the same core functions and call the same worker
compute (``shell.policy_worker``), so they differ only in how rows reach a
rank:

* :class:`Policy` takes an in-memory batch (a TensorDict with jagged or padded
  token fields and ``lengths``), builds a :class:`~core.meta.KVBatchMeta` with
  synthetic keys and the lengths, shards it with
  :func:`core.sharding.shard_meta_for_dp`, slices and pads each rank's rows on
  the driver (:func:`slice_rank_batch`, to :func:`core.sharding.global_pad_length`)
  and ships them; results come back through the driver and are put back in
  caller order with ``unsorted``.
* :class:`DataPlanePolicy` ships only metas; workers fetch their rows from the
  store and write results back. ``prepare_step`` stamps the step's one
  ``global_forward_pad_seqlen``; ``finish_step`` clears the step's keys, also
  when a worker fails mid-step (the error still reaches the caller).

Invariant: for the same batch and config, the rank batch a worker computes on
is byte-identical on both paths (``tests/e2e/test_policy_parity_data.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from adapters.rows import build_tensordict
from adapters.store_port import DataPlaneClient
from core.codec import is_jagged, to_jagged, to_padded
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from core.sharding import DynamicBatchingSpec, PackingSpec, global_pad_length, shard_meta_for_dp, shard_row_indices
from core.topology import NamedSharding
from shell.column_io import GLOBAL_FORWARD_PAD_SEQLEN, read_columns, write_columns
from shell.loss import PREV_LOGPROBS, REFERENCE_LOGPROBS, TOKEN_MASK
from shell.metering import column_bytes
from shell.policy_worker import (
    INPUT_IDS,
    LENGTHS,
    TRAIN_GLOBAL_BATCH_SIZE,
    ClientFactory,
    FetchPolicy,
    PolicyWorker,
    PolicyWorkerConfig,
    RankShard,
)
from shell.worker_group import WorkerGroup

DEFAULT_TOKEN_FIELDS: tuple[str, ...] = (INPUT_IDS, TOKEN_MASK, PREV_LOGPROBS, REFERENCE_LOGPROBS)
LEGACY_PARTITION = "legacy"


def _optional(cls: type) -> Any:
    return attrs.validators.optional(attrs.validators.instance_of(cls))


@attrs.frozen
class PolicyConfig:
    """Layout, batching and model settings shared by :class:`Policy` and :class:`DataPlanePolicy`.

    Args:
        sharding: the DP / TP / PP layout (CP must be 1 for the megatron backend).
        model: the tiny GPT's shape.
        seed: initial weights (the same on every rank).
        train_global_batch_size: rows per optimizer step (None: one step per ``train`` call).
        packing: sequence packing into micro-batches (exclusive with ``dynamic_batching``).
        dynamic_batching: length-sorted padded micro-batches.
        pad_multiple: the step's pad length is a multiple of this (None: the
            packing pad multiple, else the TP size).
        token_fields: fields that are per-token (dense ``[N, S]`` or jagged).
        learning_rate: Adam's step size.
        num_cpus_per_worker: Ray CPUs per rank.
        timeout_s: how long a call may take.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: both packing and dynamic batching; the global batch size
            is not a multiple of the DP size.
    """

    sharding: NamedSharding = attrs.field(validator=attrs.validators.instance_of(NamedSharding))
    model: TinyGPTConfig = attrs.field(factory=TinyGPTConfig, validator=attrs.validators.instance_of(TinyGPTConfig))
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    train_global_batch_size: int | None = attrs.field(default=None, validator=_optional(int))
    packing: PackingSpec | None = attrs.field(default=None, validator=_optional(PackingSpec))
    dynamic_batching: DynamicBatchingSpec | None = attrs.field(default=None, validator=_optional(DynamicBatchingSpec))
    pad_multiple: int | None = attrs.field(default=None, validator=_optional(int))
    token_fields: tuple[str, ...] = attrs.field(default=DEFAULT_TOKEN_FIELDS, converter=tuple)
    learning_rate: float = 1e-3
    num_cpus_per_worker: float = 0.25
    timeout_s: float = 600.0

    def __attrs_post_init__(self) -> None:
        if self.packing is not None and self.dynamic_batching is not None:
            raise ValueError("'packing' and 'dynamic_batching' are mutually exclusive: got both; pass one")
        gbs, dp = self.train_global_batch_size, self.dp_size
        if gbs is not None and (gbs < 1 or gbs % dp):
            raise ValueError(f"'train_global_batch_size' must be a positive multiple of the DP size {dp}: got {gbs}")

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks."""
        return self.sharding.axis_size("data_parallel")

    @property
    def step_pad_multiple(self) -> int:
        """The multiple the step's pad length is rounded up to."""
        if self.pad_multiple is not None:
            return self.pad_multiple
        if self.packing is not None:
            return self.packing.sequence_length_pad_multiple
        return self.sharding.axis_size("tensor_parallel")

    def worker_config(self) -> PolicyWorkerConfig:
        """The settings every worker builds its backend from."""
        return PolicyWorkerConfig(model=self.model, seed=self.seed, learning_rate=self.learning_rate)


@attrs.frozen
class TrainResult:
    """One ``train`` call's outcome, the same fields on both paths.

    Attributes:
        loss: per optimizer step, the mean over DP ranks of each replica's mean micro-batch loss.
        grad_norm: per optimizer step, the norm of the DP-averaged gradient.
        micro_batch_metrics: per DP rank, per step, one metrics dict per micro-batch.
        micro_batches: per DP rank, the micro-batch count of each step.
        forward_seq_lengths: per DP rank, the sequence length it forwarded at.
    """

    loss: tuple[float, ...]
    grad_norm: tuple[float, ...]
    micro_batch_metrics: tuple[Any, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    forward_seq_lengths: tuple[int, ...]


# ---------------------------------------------------------------- split / merge (pure)


def stamp_step(meta: KVBatchMeta, *, multiple: int) -> KVBatchMeta:
    """``meta`` with the step's ``global_forward_pad_seqlen`` (its longest row rounded up to ``multiple``).

    Idempotent: a meta already stamped with the same value is returned as is.

    Raises:
        ValueError: ``meta`` has no sequence lengths, or is stamped with another value.
    """
    if meta.sequence_lengths is None:
        raise ValueError("'meta.sequence_lengths' is required to stamp a step's pad length: got None")
    pad = global_pad_length(meta.sequence_lengths, multiple=multiple)
    got = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
    if got is not None and got != pad:
        raise ValueError(
            f"'extra_info[{GLOBAL_FORWARD_PAD_SEQLEN!r}]' is stamped once per step: expected {pad}, got {got}"
        )
    return meta.with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: pad})


def shard_step(meta: KVBatchMeta, config: PolicyConfig, *, train: bool) -> tuple[tuple[KVBatchMeta, ...], tuple[int, ...]]:
    """Split a stamped step meta over the DP ranks (train: in global batches of ``train_global_batch_size``)."""
    if train and config.train_global_batch_size is not None:
        meta = meta.with_extra_info(**{TRAIN_GLOBAL_BATCH_SIZE: config.train_global_batch_size})
    return shard_meta_for_dp(
        meta,
        dp_world=config.dp_size,
        batch_size=config.train_global_batch_size if train else None,
        packing=config.packing,
        dynamic_batching=config.dynamic_batching,
    )


def legacy_meta(data: TensorDict) -> KVBatchMeta:
    """A meta of synthetic keys ``row<i>`` and ``data["lengths"]``, for sharding an in-memory batch.

    Raises:
        TypeError: ``data`` is not a TensorDict.
        KeyError: ``data`` has no ``lengths``.
    """
    if not isinstance(data, TensorDict):
        raise TypeError(f"'data' must be a TensorDict with batch_size [N]: got {type(data).__name__}")
    if LENGTHS not in data.keys():
        raise KeyError(f"'data' must hold {LENGTHS!r} (LongTensor[N], valid tokens per row): got {sorted(data.keys())}")
    lengths = [int(x) for x in data[LENGTHS].tolist()]
    return KVBatchMeta(LEGACY_PARTITION, [f"row{i}" for i in range(len(lengths))], sequence_lengths=lengths)


def slice_rank_batch(
    data: TensorDict,
    rows: Sequence[int],
    *,
    fields: Sequence[str],
    token_fields: Sequence[str],
    pad_to: int,
) -> TensorDict:
    """Rows ``rows`` of ``data`` as a rank batch: ``fields`` (token fields trimmed to each row's length, then
    padded with 0 to ``pad_to``) plus ``lengths`` (LongTensor).

    This is the legacy half of the parity: it must equal :func:`shell.policy_worker.fetch_rank_batch`
    of the same rows after ``first_write``.

    Raises:
        KeyError: a field is missing from ``data``.
        ValueError: a row is longer than ``pad_to``.
    """
    missing = [name for name in fields if name not in data.keys()]
    if missing:
        raise KeyError(f"'data' must hold {list(fields)}: missing {missing}")
    index = torch.tensor(list(rows), dtype=torch.long)
    lengths = [int(x) for x in data[LENGTHS][index].tolist()]
    columns: dict[str, Any] = {}
    for name in fields:
        value = data[name]
        if is_jagged(value) or name in token_fields:
            dense = to_padded(value) if is_jagged(value) else value
            columns[name] = to_padded(to_jagged(dense[index], lengths), pad_to_length=pad_to)
        else:
            columns[name] = value[index]
    columns[LENGTHS] = torch.tensor(lengths, dtype=torch.long)
    return build_tensordict(columns, len(lengths))


def legacy_shards(
    data: TensorDict, config: PolicyConfig, *, fields: Sequence[str], train: bool
) -> tuple[tuple[RankShard, ...], tuple[int, ...]]:
    """The per-rank shards of an in-memory batch (as the data plane would fetch them), and ``unsorted``."""
    meta = stamp_step(legacy_meta(data), multiple=config.step_pad_multiple)
    shards, unsorted = shard_step(meta, config, train=train)
    rows = shard_row_indices(shards, unsorted)
    pad = meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]
    out = tuple(
        RankShard(
            slice_rank_batch(data, r, fields=fields, token_fields=config.token_fields, pad_to=pad),
            shard.extra_info,
        )
        for r, shard in zip(rows, shards)
    )
    return out, unsorted


def merge_train(results: Sequence[Mapping[str, Any]]) -> TrainResult:
    """One result per DP rank (the replica leaders') -> :class:`TrainResult`.

    Raises:
        ValueError: ranks ran different numbers of steps.
    """
    counts = {len(r["loss"]) for r in results}
    if len(counts) != 1:
        raise ValueError(f"every DP rank must run the same number of steps: got {[len(r['loss']) for r in results]}")
    (steps,) = counts
    return TrainResult(
        loss=tuple(sum(r["loss"][s] for r in results) / len(results) for s in range(steps)),
        grad_norm=tuple(results[0]["grad_norm"]),
        micro_batch_metrics=tuple(tuple(r["metrics"]) for r in results),
        micro_batches=tuple(tuple(r["micro_batches"]) for r in results),
        forward_seq_lengths=tuple(int(r["forward_seq_length"]) for r in results),
    )


def tensor_bytes(value: Any) -> int:
    """Payload bytes of a tensor, or of every column of a TensorDict / mapping (0 for anything else).

    Each column is counted by :func:`shell.metering.column_bytes`, as the store's meter counts it.
    """
    if isinstance(value, (TensorDict, Mapping)):
        return sum(column_bytes(v) for v in value.values())
    return column_bytes(value)


def _shard_bytes(shards: Sequence[RankShard]) -> int:
    return sum(tensor_bytes(shard.data) for shard in shards)


def _train_fields(loss_fn: Any) -> list[str]:
    return [INPUT_IDS, *getattr(loss_fn, "input_fields", ())]


# ---------------------------------------------------------------- execute


def build_group(
    config: PolicyConfig, *, worker_cls: type[PolicyWorker] = PolicyWorker, client_factory: ClientFactory | None = None
) -> WorkerGroup:
    """Start one ``worker_cls`` actor per rank of ``config.sharding`` and build every backend.

    Raises:
        RuntimeError: Ray is not initialised.
        WorkerError: a rank failed to start or to build its backend.
    """
    group = WorkerGroup(
        worker_cls,
        config.sharding,
        init_args=(config.worker_config(), client_factory),
        backend="gloo",
        num_cpus_per_worker=config.num_cpus_per_worker,
        timeout_s=config.timeout_s,
        pg_timeout_s=config.timeout_s,
    )
    try:
        group.run_all("setup")
    except BaseException:
        group.shutdown()
        raise
    return group


class Policy:
    """The legacy policy: in-memory batches are sliced on the driver and shipped to the ranks.

    Args:
        config: layout and batching.
        group: a started group of ``config.sharding`` (from :func:`build_group`); built when None.
    """

    def __init__(self, config: PolicyConfig, *, group: WorkerGroup | None = None) -> None:
        if not isinstance(config, PolicyConfig):
            raise TypeError(f"'config' must be a PolicyConfig: got {type(config).__name__}")
        self.config = config
        self.group = group if group is not None else build_group(config)
        self._driver_bytes = 0

    def shutdown(self) -> None:
        """Shut the worker group down (a second call does nothing)."""
        self.group.shutdown()

    def drain_driver_bytes(self) -> int:
        """Tensor bytes this policy sent to or received from its workers since the last call."""
        out, self._driver_bytes = self._driver_bytes, 0
        return out

    def get_logprobs(self, data: TensorDict) -> TensorDict:
        """``prev_logprobs`` FloatTensor[N, S_pad] of ``data``'s rows, in caller order."""
        return self._logprobs(data, "get_logprobs", PREV_LOGPROBS)

    def get_reference_logprobs(self, data: TensorDict) -> TensorDict:
        """``reference_policy_logprobs`` FloatTensor[N, S_pad] of ``data``'s rows, in caller order."""
        return self._logprobs(data, "get_reference_logprobs", REFERENCE_LOGPROBS)

    def get_logprobs_and_reference(self, data: TensorDict) -> TensorDict:
        """``prev_logprobs`` and ``reference_policy_logprobs`` of ``data``'s rows from one call, in caller order.

        The same values as :meth:`get_logprobs` and :meth:`get_reference_logprobs`, with one shipment of rows.
        """
        shards, unsorted = legacy_shards(data, self.config, fields=[INPUT_IDS], train=False)
        results = self.group.run_sharded("get_logprobs_and_reference", shards)
        order = torch.tensor(unsorted, dtype=torch.long)
        out = TensorDict(
            {
                PREV_LOGPROBS: torch.cat([r["logprobs"] for r in results])[order],
                REFERENCE_LOGPROBS: torch.cat([r["reference"] for r in results])[order],
            },
            batch_size=[len(unsorted)],
        )
        self._driver_bytes += _shard_bytes(shards) + tensor_bytes(out)
        return out

    def _logprobs(self, data: TensorDict, method: str, name: str) -> TensorDict:
        shards, unsorted = legacy_shards(data, self.config, fields=[INPUT_IDS], train=False)
        results = self.group.run_sharded(method, shards)
        merged = torch.cat([r["logprobs"] for r in results])[torch.tensor(unsorted, dtype=torch.long)]
        self._driver_bytes += _shard_bytes(shards) + tensor_bytes(merged)
        return TensorDict({name: merged}, batch_size=[len(unsorted)])

    def train(self, data: TensorDict, loss_fn: Any) -> TrainResult:
        """One optimizer step per ``train_global_batch_size`` rows of ``data``."""
        shards, _ = legacy_shards(data, self.config, fields=_train_fields(loss_fn), train=True)
        self._driver_bytes += _shard_bytes(shards)
        return merge_train(self.group.run_sharded("train", shards, common_kwargs={"loss_fn": loss_fn}))


class DataPlanePolicy:
    """The data-plane policy: the driver ships metas; workers fetch rows and write results to the store.

    Args:
        config: layout and batching.
        client: the driver's store client (prepare, read, write, clear).
        group: a started group of ``config.sharding``; built when None.
        client_factory: how each worker opens its store client (default ``TransferQueueStore.attach``).
        fetch_policy: how workers fetch (see :meth:`PolicyWorker.fetch`).
    """

    def __init__(
        self,
        config: PolicyConfig,
        client: DataPlaneClient,
        *,
        group: WorkerGroup | None = None,
        client_factory: ClientFactory | None = None,
        fetch_policy: FetchPolicy = "auto",
    ) -> None:
        if not isinstance(config, PolicyConfig):
            raise TypeError(f"'config' must be a PolicyConfig: got {type(config).__name__}")
        self.config = config
        self.client = client
        self.fetch_policy = fetch_policy
        self.group = group if group is not None else build_group(config, client_factory=client_factory)
        self.group.run_all("setup_data_plane", client_factory)
        self._worker_io = {"ms": 0.0, "bytes": 0.0}

    def drain_worker_io(self) -> dict[str, float]:
        """Store time (ms, summed over ranks) and bytes the workers reported since the last call.

        Workers report their store activity when their client is metered
        (a ``client_factory`` returning :class:`shell.metering.MeteredClient`); else zeros.
        """
        out, self._worker_io = self._worker_io, {"ms": 0.0, "bytes": 0.0}
        return out

    def shutdown(self) -> None:
        """Shut the worker group down (a second call does nothing); the driver's client stays open."""
        self.group.shutdown()

    # ------------------------------------------------------------ the step

    def prepare_step(self, meta: KVBatchMeta) -> KVBatchMeta:
        """``meta`` stamped with the step's ``global_forward_pad_seqlen`` (once per step; see :func:`stamp_step`)."""
        return stamp_step(meta, multiple=self.config.step_pad_multiple)

    def finish_step(self, meta: KVBatchMeta) -> None:
        """Clear the step's keys that are still stored (so a second call does nothing)."""
        stored = set(self.client.list_keys(meta.partition_id))
        keys = [k for k in meta.keys if k in stored]
        if keys:
            self.client.clear(keys, meta.partition_id)

    @contextmanager
    def step(self, meta: KVBatchMeta) -> Iterator[KVBatchMeta]:
        """``with policy.step(meta) as m: ...``: prepare the step, and clear its keys on the way out."""
        stamped = self.prepare_step(meta)
        try:
            yield stamped
        finally:
            self.finish_step(stamped)

    def _check_stamped(self, meta: KVBatchMeta) -> None:
        if GLOBAL_FORWARD_PAD_SEQLEN not in meta.extra_info:
            raise ValueError(
                f"'meta.extra_info' must hold {GLOBAL_FORWARD_PAD_SEQLEN!r}: got {sorted(meta.extra_info)}; "
                f"call meta = policy.prepare_step(meta) first"
            )

    def _run(self, meta: KVBatchMeta, method: str, *, train: bool, **kwargs: Any) -> list[Any]:
        """Shard ``meta`` and run ``method`` on it; on any failure clear the step's keys, then re-raise."""
        self._check_stamped(meta)
        try:
            shards, _ = shard_step(meta, self.config, train=train)
            results = self.group.run_sharded(
                method, shards, common_kwargs={"fetch_policy": self.fetch_policy, **kwargs}
            )
        except BaseException:
            self.finish_step(meta)
            raise
        for result in results:
            io = result.get("data_plane") if isinstance(result, Mapping) else None
            if io:
                self._worker_io = {k: self._worker_io[k] + float(io[k]) for k in self._worker_io}
        return results

    # ------------------------------------------------------------ calls

    def get_logprobs(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Write ``prev_logprobs`` of ``meta``'s rows to the store; return ``meta`` listing it."""
        self._run(meta, "get_logprobs_presharded", train=False)
        return meta.with_fields([PREV_LOGPROBS])

    def get_reference_logprobs(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Write ``reference_policy_logprobs`` of ``meta``'s rows; return ``meta`` listing it."""
        self._run(meta, "get_reference_logprobs_presharded", train=False)
        return meta.with_fields([REFERENCE_LOGPROBS])

    def get_logprobs_and_reference(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Write both log-probs of ``meta``'s rows from one fetch and one put per replica; return ``meta`` listing them."""
        self._run(meta, "get_logprobs_and_reference_presharded", train=False)
        return meta.with_fields([PREV_LOGPROBS, REFERENCE_LOGPROBS])

    def train(self, meta: KVBatchMeta, loss_fn: Any) -> TrainResult:
        """One optimizer step per ``train_global_batch_size`` rows of ``meta``."""
        return merge_train(self._run(meta, "train_presharded", train=True, loss_fn=loss_fn))

    def read(self, meta: KVBatchMeta, fields: Sequence[str], *, layout: Any = "padded") -> TensorDict:
        """Read ``fields`` of ``meta``'s rows (token fields padded to the step's pad length)."""
        return read_columns(self.client, meta, fields, layout=layout)

    def write(self, meta: KVBatchMeta, fields: TensorDict | Mapping[str, Any], *, token_fields: Sequence[str] | None = None) -> KVBatchMeta:
        """Write ``fields`` under ``meta``'s keys (per-token fields trimmed); return ``meta`` listing them."""
        return write_columns(self.client, meta, fields, token_fields=token_fields)
