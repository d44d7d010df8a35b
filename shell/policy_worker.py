"""``PolicyWorker``: one rank of a megatron policy, fed either from the data plane or from a driver-sliced shard.

Two families of entry points reach THE SAME private compute functions
(``_compute_logprobs``, ``_compute_train``) once they hold the rank's rows as a
:class:`~tensordict.TensorDict` (the *rank batch*: token fields ``[B, S]``
padded to the step's ``global_forward_pad_seqlen``, other fields ``[B, ...]``,
and ``lengths`` LongTensor[B]):

* data plane (``*_presharded``): the driver sends a small
  :class:`~core.meta.KVBatchMeta` shard; the worker fetches its rows
  (:func:`fetch_rank_batch`, or the replica leader fetches and broadcasts
  them to its replica group), computes, and the replica leader alone writes
  results back under the same keys;
* legacy (``get_logprobs``, ``get_reference_logprobs``, ``train``): the driver
  sends a :class:`RankShard`, the rank batch already sliced and padded, and
  gets bulk results back.

So the two paths agree exactly when their rank batches and ``extra_info``
agree (see ``tests/e2e/test_policy_parity_data.py``).

Micro-batches: the driver's ``micro_batch_indices`` (per global batch, the
``(start, end)`` row spans of this rank, from ``core.sharding.shard_meta_for_dp``
with packing or dynamic batching) are used as they are, never recomputed here.
Without them a call is one global batch (logprobs) or
``train_global_batch_size // dp`` rows per global batch (train), each run as
ONE micro-batch. Every micro-batch is forwarded at the step's pad length.

Invariants:
  * exactly one writer per (key, field): only the replica leader (tp = cp =
    pp = 0) writes back, whatever the TP / CP / PP sizes;
  * leader broadcast never pickles a tensor (``shell.broadcast``), and a
    leader whose fetch fails tells its replica group, so none hangs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import attrs
import ray
import torch
from tensordict import TensorDict

from adapters.model_port import PolicyBackend
from adapters.rows import build_tensordict
from adapters.store_port import DataPlaneClient
from core.codec import Layout
from core.frozen import FrozenDict, freeze
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from shell.column_io import read_columns, write_columns
from shell.loss import PREV_LOGPROBS, REFERENCE_LOGPROBS
from shell.worker_group import Worker

FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
ClientFactory = Callable[[], DataPlaneClient]
Spans = tuple[tuple[int, int], ...]
StepPlan = tuple[Spans, ...]
"""Per global batch (train step), the ``(start, end)`` row spans of its micro-batches."""

LENGTHS = "lengths"  # LongTensor[B]: valid tokens per row
INPUT_IDS = "input_ids"  # LongTensor[B, S]
MICRO_BATCH_INDICES = "micro_batch_indices"
TRAIN_GLOBAL_BATCH_SIZE = "train_global_batch_size"
_FETCH_POLICIES: tuple[str, ...] = get_args(FetchPolicy)


@attrs.frozen
class RankShard:
    """A legacy per-rank shard: the rank batch, sliced and padded on the driver, and its shard's ``extra_info``.

    Args:
        data: the rank batch (token fields ``[B, S]``, ``lengths`` LongTensor[B]).
        extra_info: the shard meta's ``extra_info`` (pad length, micro-batch plan, ...).
    """

    data: TensorDict = attrs.field(validator=attrs.validators.instance_of(TensorDict))
    extra_info: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze)


@attrs.frozen
class PolicyWorkerConfig:
    """What every rank builds its backend from (the same on all ranks).

    Args:
        model: the tiny GPT's shape.
        seed: the initial weights' seed.
        device: ``"cpu"`` (megatron's CPU shim) or ``"cuda"``.
        learning_rate: Adam's step size.
        torch_threads: intra-op threads per worker (1 keeps a shared CPU machine usable).
    """

    model: TinyGPTConfig = attrs.field(factory=TinyGPTConfig, validator=attrs.validators.instance_of(TinyGPTConfig))
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    device: str = attrs.field(default="cpu", validator=attrs.validators.in_(("cpu", "cuda")))
    learning_rate: float = 1e-3
    torch_threads: int = 1


# ---------------------------------------------------------------- pure helpers (no I/O)


def micro_batch_plan(extra_info: Mapping[str, Any], rows: int, *, rows_per_step: int | None = None) -> StepPlan:
    """The micro-batch spans of a rank's ``rows`` rows, per global batch.

    The driver's ``extra_info["micro_batch_indices"]`` when present; else one
    micro-batch per global batch of ``rows_per_step`` rows (all rows when None).

    Raises:
        ValueError: ``rows`` is not a multiple of ``rows_per_step``, or the
            driver's spans do not tile ``range(rows)``.

    Example:
        >>> micro_batch_plan({}, 4, rows_per_step=2)
        (((0, 2),), ((2, 4),))
    """
    indices = extra_info.get(MICRO_BATCH_INDICES)
    if indices is not None:
        plan = tuple(tuple((int(a), int(b)) for a, b in step) for step in indices)
        flat = [span for step in plan for span in step]
        ends = [0] + [b for _, b in flat]
        if any(a != prev for (a, _), prev in zip(flat, ends)) or ends[-1] != rows:
            raise ValueError(f"'micro_batch_indices' must tile range({rows}) in order: got {plan}")
        return plan
    if rows_per_step is None:
        return (((0, rows),),)
    if rows_per_step < 1 or rows % rows_per_step:
        raise ValueError(
            f"'rows_per_step' must be >= 1 and divide the rank's {rows} rows: got {rows_per_step}; "
            f"'train_global_batch_size' must split evenly over the DP ranks"
        )
    return tuple(((s, s + rows_per_step),) for s in range(0, rows, rows_per_step))


def fetch_rank_batch(
    client: DataPlaneClient, meta: KVBatchMeta, fields: Sequence[str], *, layout: Layout = "padded"
) -> TensorDict:
    """The rank batch of ``meta``'s rows read from ``client``: ``fields`` (token fields padded) plus ``lengths``.

    Token fields are padded to ``meta.extra_info["global_forward_pad_seqlen"]``
    by :func:`shell.column_io.read_columns`; ``lengths`` comes from
    ``meta.sequence_lengths``. This is the data-plane half of the parity: no
    Ray, no process group.

    Raises:
        ValueError: ``meta`` has no ``sequence_lengths``.
        KeyError: a key or field is not stored.
    """
    if meta.sequence_lengths is None:
        raise ValueError(
            "'meta.sequence_lengths' is required to fetch a rank batch: got None; "
            "write rows with shell.column_io.first_write(..., lengths=...)"
        )
    batch = read_columns(client, meta, list(fields), layout=layout)
    batch.set(LENGTHS, torch.tensor(meta.sequence_lengths, dtype=torch.long))
    return batch


def client_io(client: DataPlaneClient | None) -> dict[str, float]:
    """The store activity of ``client`` since the last call: ``{"ms", "bytes"}`` (zeros unless it is metered).

    A :class:`shell.metering.MeteredClient` reports its ``step_delta()``; any
    other client reports nothing measured.
    """
    delta = getattr(client, "step_delta", None)
    if delta is None:
        return {"ms": 0.0, "bytes": 0.0}
    stats = delta()
    return {"ms": float(stats.total_ms), "bytes": float(stats.total_bytes)}


def _tensors(batch: TensorDict) -> dict[str, torch.Tensor]:
    return {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}


# ---------------------------------------------------------------- the worker


class PolicyWorker(Worker):
    """A megatron policy rank (see the module docstring); the driver calls ``setup`` once after the group starts.

    Args:
        config: the backend's settings (the same on every rank).
        client_factory: builds this worker's store client in ``setup_data_plane``
            (default: ``TransferQueueStore.attach()``); must be picklable.
    """

    def __init__(self, config: PolicyWorkerConfig, client_factory: ClientFactory | None = None) -> None:
        if not isinstance(config, PolicyWorkerConfig):
            raise TypeError(f"'config' must be a PolicyWorkerConfig: got {type(config).__name__}")
        self.config = config
        self._client_factory = client_factory
        self._client: DataPlaneClient | None = None
        self._backend: PolicyBackend | None = None

    # ------------------------------------------------------------ set-up

    def setup(self) -> dict[str, int]:
        """Build the backend from this rank's layout (TP, PP of the group's sharding); returns its coords.

        Raises:
            ValueError: the layout has context parallelism (the backend has none).
        """
        torch.set_num_threads(self.config.torch_threads)
        self._backend = self._build_backend()
        return self._backend.parallel_coords()

    def _build_backend(self) -> PolicyBackend:
        from adapters.megatron import MegatronGPTBackend  # the one adapter behind the port: megatron loads here

        sharding = self.sharding
        return MegatronGPTBackend(
            self.config.model,
            tensor_parallel=sharding.axis_size("tensor_parallel"),
            pipeline_parallel=sharding.axis_size("pipeline_parallel"),
            context_parallel=sharding.axis_size("context_parallel"),
            seed=self.config.seed,
            device=self.config.device,
            learning_rate=self.config.learning_rate,
        )

    def reset(self) -> None:
        """Rebuild the backend: initial weights of the seed and a fresh optimizer. Collective."""
        self._backend = self._build_backend()

    @property
    def backend(self) -> PolicyBackend:
        """The rank's backend.

        Raises:
            RuntimeError: ``setup`` has not run.
        """
        if self._backend is None:
            raise RuntimeError(f"rank {self.rank}: the backend is not built; call group.run_all('setup') first")
        return self._backend

    def setup_data_plane(self, client_factory: ClientFactory | None = None) -> None:
        """Open this worker's store client: ``client_factory()``, the constructor's, or ``TransferQueueStore.attach()``."""
        factory = client_factory or self._client_factory
        if factory is None:
            from adapters.transfer_queue import TransferQueueStore

            factory = TransferQueueStore.attach
        if self._client is not None:
            self._client.close()
        self._client = factory()

    @property
    def client(self) -> DataPlaneClient:
        """The store client.

        Raises:
            RuntimeError: ``setup_data_plane`` has not run.
        """
        if self._client is None:
            raise RuntimeError(f"rank {self.rank}: no store client; call group.run_all('setup_data_plane') first")
        return self._client

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (collective)."""
        return self.backend.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights (as ``state_dict`` returns) into the policy; the reference model is kept."""
        self.backend.load_state_dict(state)

    def push_weights(self, target: Any) -> bool:
        """Send the policy's full weights to ``target.load_weights`` (a Ray actor handle) from rank 0 only.

        Collective (every rank gathers its shards); the weights go worker to
        rollout directly, never through the driver. Returns whether this rank sent.
        """
        state = self.backend.state_dict()
        if self.rank != 0:
            return False
        ray.get(target.load_weights.remote(state))
        return True

    # ------------------------------------------------------------ data plane

    def fetch(
        self,
        meta: KVBatchMeta,
        *,
        fields: Sequence[str] | None = None,
        policy: FetchPolicy = "auto",
        layout: Layout = "padded",
    ) -> TensorDict:
        """This rank's batch of ``meta``'s rows: ``fields`` (default ``meta.fields``) plus ``lengths``.

        ``policy="independent"``: every rank reads the store; ``"leader_broadcast"``:
        the replica leader reads and broadcasts to its replica group (two
        phases, no tensor pickled); ``"auto"``: leader broadcast when the
        replica group has more than one rank.

        Raises:
            ValueError: an unknown ``policy``.
            KeyError: a key or field is not stored (on every rank of the replica group).
        """
        if policy not in _FETCH_POLICIES:
            raise ValueError(f"'policy' must be one of {list(_FETCH_POLICIES)}: got {policy!r}")
        names = list(meta.fields if fields is None else fields)
        group = self.replica_group()
        if policy == "independent" or (policy == "auto" and group is None):
            return fetch_rank_batch(self.client, meta, names, layout=layout)
        if self.is_replica_leader:
            try:
                batch = fetch_rank_batch(self.client, meta, names, layout=layout)
            except BaseException:
                if group is not None:  # tell the replica group, so none waits in the broadcast
                    with contextlib.suppress(TypeError):
                        self.broadcast_from_leader(None)
                raise
            tensors = self.broadcast_from_leader(_tensors(batch))
        else:
            tensors = self.broadcast_from_leader(None)
        return build_tensordict(tensors, len(meta))

    def write_back(self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor], *, token_fields: Sequence[str] = ()) -> bool:
        """Write ``fields`` under ``meta``'s keys from the replica leader only; whether this rank wrote.

        Per-token fields (``token_fields``) are trimmed to each row's length.
        """
        if not self.is_replica_leader:
            return False
        write_columns(self.client, meta, dict(fields), token_fields=list(token_fields))
        return True

    def get_logprobs_presharded(self, meta: KVBatchMeta, *, fetch_policy: FetchPolicy = "auto") -> dict[str, Any]:
        """Log-probs of ``meta``'s rows, written back as ``prev_logprobs``; returns only small stats."""
        return self._logprobs_presharded(meta, reference=False, fetch_policy=fetch_policy)

    def get_reference_logprobs_presharded(self, meta: KVBatchMeta, *, fetch_policy: FetchPolicy = "auto") -> dict[str, Any]:
        """Reference log-probs of ``meta``'s rows, written back as ``reference_policy_logprobs``; small stats."""
        return self._logprobs_presharded(meta, reference=True, fetch_policy=fetch_policy)

    def get_logprobs_and_reference_presharded(self, meta: KVBatchMeta, *, fetch_policy: FetchPolicy = "auto") -> dict[str, Any]:
        """Both log-probs of ``meta``'s rows from one fetch, written back together (``prev_logprobs`` and
        ``reference_policy_logprobs``) in one put; returns only small stats."""
        batch = self.fetch(meta, fields=[INPUT_IDS], policy=fetch_policy)
        logprobs, stats = self._compute_logprobs(batch, meta.extra_info, reference=False)
        reference, _ = self._compute_logprobs(batch, meta.extra_info, reference=True)
        names = [PREV_LOGPROBS, REFERENCE_LOGPROBS]
        stats["wrote"] = self.write_back(meta, dict(zip(names, (logprobs, reference))), token_fields=names)
        stats["data_plane"] = client_io(self._client)
        return stats

    def _logprobs_presharded(self, meta: KVBatchMeta, *, reference: bool, fetch_policy: FetchPolicy) -> dict[str, Any]:
        batch = self.fetch(meta, fields=[INPUT_IDS], policy=fetch_policy)
        logprobs, stats = self._compute_logprobs(batch, meta.extra_info, reference=reference)
        name = REFERENCE_LOGPROBS if reference else PREV_LOGPROBS
        stats["wrote"] = self.write_back(meta, {name: logprobs}, token_fields=[name])
        stats["data_plane"] = client_io(self._client)
        return stats

    def train_presharded(self, meta: KVBatchMeta, *, loss_fn: Any, fetch_policy: FetchPolicy = "auto") -> dict[str, Any]:
        """One train step per global batch of ``meta``'s rows; returns losses, grad norms and metrics."""
        fields = [INPUT_IDS, *getattr(loss_fn, "input_fields", ())]
        batch = self.fetch(meta, fields=fields, policy=fetch_policy)
        result = self._compute_train(batch, meta.extra_info, loss_fn)
        result["data_plane"] = client_io(self._client)
        return result

    # ------------------------------------------------------------ legacy (driver-sliced shards)

    def get_logprobs(self, shard: RankShard) -> dict[str, Any] | None:
        """Log-probs of the shard's rows (``logprobs`` [B, S] plus stats) on the replica leader; None elsewhere."""
        return self._legacy_logprobs(shard, reference=False)

    def get_reference_logprobs(self, shard: RankShard) -> dict[str, Any] | None:
        """Reference log-probs of the shard's rows, as ``get_logprobs``."""
        return self._legacy_logprobs(shard, reference=True)

    def get_logprobs_and_reference(self, shard: RankShard) -> dict[str, Any] | None:
        """Both log-probs of the shard's rows (``logprobs``, ``reference`` [B, S] plus stats) on the replica leader."""
        logprobs, stats = self._compute_logprobs(shard.data, shard.extra_info, reference=False)
        reference, _ = self._compute_logprobs(shard.data, shard.extra_info, reference=True)
        return {"logprobs": logprobs, "reference": reference, **stats} if self.is_replica_leader else None

    def _legacy_logprobs(self, shard: RankShard, *, reference: bool) -> dict[str, Any] | None:
        logprobs, stats = self._compute_logprobs(shard.data, shard.extra_info, reference=reference)
        return {"logprobs": logprobs, **stats} if self.is_replica_leader else None

    def train(self, shard: RankShard, *, loss_fn: Any) -> dict[str, Any]:
        """One train step per global batch of the shard's rows; returns losses, grad norms and metrics."""
        return self._compute_train(shard.data, shard.extra_info, loss_fn)

    # ------------------------------------------------------------ the shared compute

    def _compute_logprobs(
        self, batch: TensorDict, extra_info: Mapping[str, Any], *, reference: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Log-probs FloatTensor[B, S] of the rank batch, micro-batch by micro-batch, and stats."""
        input_ids, lengths = batch[INPUT_IDS], batch[LENGTHS]
        plan = micro_batch_plan(extra_info, len(batch))
        forward = self.backend.reference_logprobs if reference else self.backend.logprobs
        parts = [forward(input_ids[a:b], lengths[a:b]) for step in plan for a, b in step]
        return torch.cat(parts), self._stats(batch, plan)

    def _compute_train(self, batch: TensorDict, extra_info: Mapping[str, Any], loss_fn: Any) -> dict[str, Any]:
        """One ``train_step`` per global batch of the rank batch; stats, losses, grad norms and metrics."""
        gbs = extra_info.get(TRAIN_GLOBAL_BATCH_SIZE)
        dp = self.sharding.axis_size("data_parallel")
        plan = micro_batch_plan(extra_info, len(batch), rows_per_step=None if gbs is None else gbs // dp)
        tensors = _tensors(batch)
        steps = []
        for step in plan:
            micro_batches = [{name: t[a:b] for name, t in tensors.items()} for a, b in step]
            steps.append(self.backend.train_step(micro_batches, loss_fn))
        return {
            **self._stats(batch, plan),
            "loss": [s["loss"] for s in steps],
            "grad_norm": [s["grad_norm"] for s in steps],
            "metrics": [s["metrics"] for s in steps],
        }

    def _stats(self, batch: TensorDict, plan: StepPlan) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "rows": len(batch),
            "micro_batches": [len(step) for step in plan],
            "forward_seq_length": int(batch[INPUT_IDS].shape[1]),
        }
