"""``Policy``: the driver side of a megatron policy, over either transport.

A call splits the step in core, executes on the worker group, and merges in
core (the verl-style dispatch / execute / collect):

1. split: :func:`core.step_plan.shard_step` shards the step meta over the DP
   ranks (length-balanced, micro-batch spans stamped), and the transport turns
   each shard into a rank input (:mod:`shell.transport`);
2. execute: ``group.call(PolicyWorker.logprobs | PolicyWorker.train, inputs)``;
3. merge: the transport gathers the results (or notes they are in the store),
   and :func:`core.step_plan.merge_train` folds the train results.

Invariant: a failed call releases the step's stored rows (``transport.abort``)
before the error reaches the caller, so no key outlives a failed step; except
when a rank's store call found a part of the store dead: the caller (the
trainer) then tells its client of the failure and releases them, so the clear
fails at once instead of waiting on the dead part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, get_args

import attrs
import torch

from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, PREV_LOGPROBS, REFERENCE_LOGPROBS
from core.gpu_share import gpu_share_problem
from core.model_config import TinyGPTConfig
from core.meta import KVBatchMeta
from core.sharding import DynamicBatchingSpec, PackingSpec, Shards, Unsorted, shard_like
from core.step_plan import StepLayout, TrainResult, check_kept_rows, merge_train, shard_step, stamp_step
from core.topology import NamedSharding
from adapters.store_health import failure_in
from shell.model_worker import ClientFactory
from shell.policy_worker import FetchPolicy, PolicyWorker, PolicyWorkerConfig, slowest_compute
from shell.step_rows import StepRows
from shell.transport import Transport
from shell.config_schema import NodePlacement
from shell.node_placement import rank_options
from shell.worker_group import GPUShortageError, WorkerGroup


DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""Where a policy's ranks can run (:attr:`PolicyConfig.device`)."""


def _optional(cls: type) -> Any:
    return attrs.validators.optional(attrs.validators.instance_of(cls))


@attrs.frozen
class PolicyConfig:
    """Layout, batching and model settings of a :class:`Policy`.

    Args:
        sharding: the DP / TP / PP layout (CP must be 1 for the megatron backend).
        model: the tiny GPT's shape.
        seed: initial weights (the same on every rank).
        train_global_batch_size: rows per optimizer step (None: one step per ``train`` call).
        packing: sequence packing into micro-batches (exclusive with ``dynamic_batching``).
        dynamic_batching: length-sorted padded micro-batches.
        pad_multiple: the step's pad length is a multiple of this (None: the
            packing pad multiple, else the TP size).
        learning_rate: Adam's step size.
        fetch_policy: how each replica group fetches data-plane rows (see :data:`shell.policy_worker.FetchPolicy`).
        router_replay: replay each row's recorded MoE routing (field ``routed_experts``) in log-probs and training.
        num_cpus_per_worker: Ray CPUs per rank.
        timeout_s: how long a call may take.
        placement: ``"pack"`` (Ray's default) or ``"spread"`` (rank ``i`` on eligible node ``i mod n``),
            see :mod:`shell.node_placement`.
        worker_resource: a custom node resource every rank needs (None: any node).
        device: where each rank runs megatron-core: ``"cpu"`` (gloo, the CPU shim in the rank's process) or
            ``"cuda"`` (a GPU per rank, Ray's ``num_gpus=gpus_per_rank``, NCCL, megatron-core without the CPU shim). Either
            way what the driver and the store exchange with the ranks is CPU tensors: the transports see no device.
        gpus_per_rank: Ray GPUs each rank takes on ``"cuda"`` (unused on ``"cpu"``), in ``(0, 1]``, a multiple of
            ``core.gpu_share.GPU_SHARE_STEP`` (Ray's finest share). Below 1, ranks
            of other groups may share its device (two policies side by side on one GPU); the ranks of one group
            never do, since NCCL refuses two ranks on one device, so on ``"cuda"`` a share of 0.5 or less needs a
            one-rank group.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: the batching settings are inconsistent (see :class:`core.step_plan.StepLayout`),
            ``device`` is not ``"cpu"`` or ``"cuda"``, or ``gpus_per_rank`` is not a number, is outside ``(0, 1]``,
            is finer than Ray's step, or would let Ray put two of the group's ranks on one device
            (:func:`core.gpu_share.gpu_share_problem`).
    """

    sharding: NamedSharding = attrs.field(validator=attrs.validators.instance_of(NamedSharding))
    model: TinyGPTConfig = attrs.field(factory=TinyGPTConfig, validator=attrs.validators.instance_of(TinyGPTConfig))
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    train_global_batch_size: int | None = attrs.field(default=None, validator=_optional(int))
    packing: PackingSpec | None = attrs.field(default=None, validator=_optional(PackingSpec))
    dynamic_batching: DynamicBatchingSpec | None = attrs.field(default=None, validator=_optional(DynamicBatchingSpec))
    pad_multiple: int | None = attrs.field(default=None, validator=_optional(int))
    learning_rate: float = 1e-3
    fetch_policy: FetchPolicy = attrs.field(default="auto", validator=attrs.validators.in_(get_args(FetchPolicy)))
    router_replay: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    num_cpus_per_worker: float = 0.25
    timeout_s: float = 600.0
    placement: str = attrs.field(default="pack", validator=attrs.validators.in_(("pack", "spread")))
    worker_resource: str | None = attrs.field(default=None, validator=_optional(str))
    device: str = attrs.field(default="cpu", validator=attrs.validators.in_(DEVICES))
    gpus_per_rank: float = 1.0
    layout: StepLayout = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        ranks = self.sharding.world_size if self.device == "cuda" else 1  # on CPU (unused): its range and grid only
        problem = gpu_share_problem(self.gpus_per_rank, ranks)
        if problem is not None:
            raise ValueError(f"'gpus_per_rank' must {problem}: got {self.gpus_per_rank!r}")

    @layout.default
    def _layout(self) -> StepLayout:
        return StepLayout.for_sharding(
            self.sharding,
            train_global_batch_size=self.train_global_batch_size,
            packing=self.packing,
            dynamic_batching=self.dynamic_batching,
            pad_multiple=self.pad_multiple,
        )

    @property
    def replay_fields(self) -> tuple[str, ...]:
        """The fields every forward reads beside ``input_ids`` to replay routing (the workers' rule)."""
        return self.worker_config().replay_fields

    def worker_config(self) -> PolicyWorkerConfig:
        """The settings every worker builds its backend from."""
        return PolicyWorkerConfig(
            model=self.model,
            seed=self.seed,
            learning_rate=self.learning_rate,
            fetch_policy=self.fetch_policy,
            router_replay=self.router_replay,
            device=self.device,
        )

    @property
    def num_gpus_per_worker(self) -> float:
        """Ray GPUs per rank: ``gpus_per_rank`` on ``"cuda"``, else 0."""
        return self.gpus_per_rank if self.device == "cuda" else 0.0


def build_group(
    config: PolicyConfig, *, worker_cls: type[PolicyWorker] = PolicyWorker, client_factory: ClientFactory | None = None
) -> WorkerGroup:
    """Start one ``worker_cls`` actor per rank of ``config.sharding`` and build every backend (and store client).

    On ``config.device == "cuda"`` every rank takes ``config.gpus_per_rank`` of a GPU and the group joins over
    NCCL; the cluster must have the GPUs the ranks take (``gpus_needed``; the group checks it before any actor
    starts).

    Raises:
        RuntimeError: Ray is not initialised.
        GPUShortageError: (a ``ValueError``) ``device`` is ``"cuda"`` and the cluster has fewer GPUs than the ranks
            take, worded for the policy's ``device``; its cause is the group's own.
        WorkerError: a rank failed to start or to build its backend.
    """
    try:
        group = WorkerGroup(
            worker_cls,
            config.sharding,
            init_args=(config.worker_config(), client_factory),
            backend="nccl" if config.device == "cuda" else "gloo",
            num_cpus_per_worker=config.num_cpus_per_worker,
            num_gpus_per_worker=config.num_gpus_per_worker,
            timeout_s=config.timeout_s,
            pg_timeout_s=config.timeout_s,
            role="policy",
            rank_options=rank_options(NodePlacement(config.placement), config.worker_resource, config.sharding.world_size),
        )
    except GPUShortageError as error:  # name the policy's own setting, not the group's
        raise GPUShortageError(
            error.ranks, error.per_worker, error.need, error.have,
            message=f"'device' is 'cuda': the policy's {error.ranks} ranks need {error.need:g} GPUs "
            f"({error.per_worker:g} each), the Ray cluster has {error.have:g}; give the cluster GPUs, or use device='cpu'",
        ) from error
    try:
        group.call(PolicyWorker.setup)
    except BaseException:
        group.shutdown()
        raise
    return group


def _check_prepared(rows: StepRows) -> None:
    if GLOBAL_FORWARD_PAD_SEQLEN not in rows.meta.extra_info:
        raise ValueError(
            f"'rows.meta.extra_info' must hold {GLOBAL_FORWARD_PAD_SEQLEN!r}: got {sorted(rows.meta.extra_info)}; "
            f"call rows = policy.prepare(rows) first"
        )


class Policy:
    """A megatron policy on a worker group; rows move by ``transport`` (see the module docstring).

    Args:
        config: layout and batching.
        transport: how rows reach the ranks (:class:`shell.transport.LegacyTransport`
            or :class:`shell.transport.DataPlaneTransport`).
        group: a started group of ``config.sharding`` whose workers opened
            ``transport.client_factory``'s clients; built when None.

    Example:
        >>> policy = Policy(config, LegacyTransport())  # doctest: +SKIP
        >>> rows = policy.prepare(StepRows(meta, batch))  # doctest: +SKIP
        >>> rows = policy.logprobs(rows, reference=True)  # doctest: +SKIP
        >>> result = policy.train(transport.write(rows, {"advantages": adv}), loss)  # doctest: +SKIP
    """

    def __init__(self, config: PolicyConfig, transport: Transport, *, group: WorkerGroup | None = None) -> None:
        if not isinstance(config, PolicyConfig):
            raise TypeError(f"'config' must be a PolicyConfig: got {type(config).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"'transport' must implement shell.transport.Transport: got {type(transport).__name__}")
        self.config = config
        self.transport = transport
        self.group = group if group is not None else build_group(config, client_factory=transport.client_factory)
        self._kept: dict[str, int] = {}  # key -> DP rank that kept its log-probs for the next train call
        # The train sharding logprobs(keep_for_train=True) planned, with the keys and lengths it planned it for.
        self._train_split: tuple[KVBatchMeta, Shards, Unsorted] | None = None
        self._model_seconds: dict[str, float] = {}

    def shutdown(self) -> None:
        """Shut the worker group down (a second call does nothing)."""
        self.group.shutdown()

    @property
    def model_seconds(self) -> Mapping[str, float]:
        """The seconds the latest ``logprobs`` call, and the ``train`` call after it, spent in the model: each call's
        slowest rank's (:func:`shell.policy_worker.slowest_compute`), under the keys ``"logprobs"`` and ``"train"``.

        A ``logprobs`` call starts afresh (a key is absent until its call has returned), so after a GRPO step it
        holds that step's two calls. A call's wall time less its model seconds is what it spent moving rows and
        dispatching."""
        return MappingProxyType(dict(self._model_seconds))

    # ------------------------------------------------------------ the step

    def prepare(self, rows: StepRows) -> StepRows:
        """``rows`` stamped with the step's one ``global_forward_pad_seqlen`` (see :func:`core.step_plan.stamp_step`)."""
        return rows.with_meta(stamp_step(rows.meta, multiple=self.config.layout.step_pad_multiple))

    def logprobs(
        self, rows: StepRows, *, reference: bool = False, prefetch: Sequence[str] = (), keep_for_train: bool = False
    ) -> StepRows:
        """``rows`` with ``prev_logprobs`` (and, with ``reference``, ``reference_policy_logprobs``) of every row.

        Both come from one fetch and at most one write-back (or one gather) per replica.
        ``prefetch``: fields the step's ``train`` call will read (e.g. the loss's
        ``input_fields``); on the data plane each rank reads those already stored
        in the same fetch and keeps them, with what it writes back, for ``train``.

        ``keep_for_train``: the next call is ``train`` on these same rows (as a
        GRPO step makes it). The call is then sharded as that train call will
        be (:func:`core.step_plan.shard_step` with ``train=True``: one global
        batch per ``train_global_batch_size`` rows, each balanced over the DP
        ranks), not as one global batch, so each DP rank computes the log-probs
        of exactly the rows it will train on. On the data plane every rank keeps
        them, with the rows it read, for its own train call: nothing is written
        back, and the train call reads nothing from the store. Until that train
        call the log-probs are in no store: a ``transport.read`` of them raises
        ``KeyError``. The legacy transport gathers every row either way, with
        the same sharding, so both paths compute the same values. (A row is
        padded to the step's one pad length whatever micro-batch holds it, but
        a backend whose kernels depend on a micro-batch's shape may give
        log-probs that differ in the last bits from those of a call sharded as
        one global batch.)
        """
        names = (PREV_LOGPROBS, REFERENCE_LOGPROBS) if reference else (PREV_LOGPROBS,)
        _check_prepared(rows)
        self._kept, self._train_split, self._model_seconds = {}, None, {}
        with self._releasing_on_failure():
            keep: tuple[frozenset[str], ...] = ()
            train_split = None
            if keep_for_train:  # every rank computes the rows it trains on: it keeps them all, none travels
                shards, unsorted = shard_step(rows.meta, self.config.layout, train=True)
                train_split = (rows.meta, shards, unsorted)
                keep = tuple(frozenset(shard.keys) for shard in shards)
            else:
                shards, unsorted = shard_step(rows.meta, self.config.layout, train=False)
            inputs = self.transport.rank_inputs(
                rows, shards, unsorted, fields=(INPUT_IDS, *self.config.replay_fields), keep=keep
            )
            results = self.group.call(PolicyWorker.logprobs, inputs, outputs=names, prefetch=tuple(prefetch))
            self._model_seconds["logprobs"] = slowest_compute(results)
            collected = self.transport.collect(rows, results, unsorted, names)
        self._kept = {key: rank for rank, keys in enumerate(keep) for key in keys}
        self._train_split = train_split
        return collected

    def train(self, rows: StepRows, loss_fn: Any) -> TrainResult:
        """One optimizer step per ``train_global_batch_size`` rows (``loss_fn.input_fields`` are read).

        Raises:
            ValueError: the previous ``logprobs(..., keep_for_train=True)`` kept a row on a rank that this call's
                sharding does not give it to (``rows`` are not the rows of that call); nothing is called then.
        """
        fields = (INPUT_IDS, *self.config.replay_fields, *getattr(loss_fn, "input_fields", ()))
        _check_prepared(rows)
        kept, self._kept = self._kept, {}
        split, self._train_split = self._train_split, None
        with self._releasing_on_failure():
            meta = rows.meta
            if split is not None and (split[0].keys, split[0].sequence_lengths) == (meta.keys, meta.sequence_lengths):
                shards, unsorted = shard_like(meta, split[1], split[2])  # the split depends on the lengths alone
            else:
                shards, unsorted = shard_step(meta, self.config.layout, train=True)
            check_kept_rows(kept, shards)
            inputs = self.transport.rank_inputs(rows, shards, unsorted, fields=fields)
            results = self.group.call(PolicyWorker.train, inputs, loss_fn=loss_fn)
            self._model_seconds["train"] = slowest_compute(results)
            self.transport.collect(rows, results, unsorted, ())
            return merge_train(results)

    # ------------------------------------------------------------ weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (gathered on the driver: for checkpoints only)."""
        return self.group.call(PolicyWorker.state_dict)[0]

    def load_state_dict(self, state: Mapping[str, torch.Tensor] | Any) -> None:
        """Load full weights (or an object ref of them) into every rank."""
        self.group.call(PolicyWorker.load_state_dict, state)

    def push_weights(self, target: Any) -> None:
        """Rank 0 sends the full weights to ``target.load_weights`` (an actor handle), never through the driver."""
        self.group.call(PolicyWorker.push_weights, target)

    @contextlib.contextmanager
    def _releasing_on_failure(self) -> Iterator[None]:
        """Release the step's rows when a call fails; not when a rank's store call found a part of the store dead
        (:func:`adapters.store_health.failure_in`): a clear would wait on that part, so the caller, who can tell
        its own client of the failure first (:meth:`shell.grpo_trainer.GRPOTrainer.step`), releases them."""
        try:
            yield
        except BaseException as error:
            if failure_in(error) is None:
                with contextlib.suppress(Exception):  # the call's own error is the one to report
                    self.transport.abort()
            raise
