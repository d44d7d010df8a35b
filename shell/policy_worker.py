"""``PolicyWorker``: one rank of a megatron policy, with two computations: log-probs and a train step.

Each computation has ONE entry point, declared ``@sharded``:

* :meth:`PolicyWorker.logprobs`: the policy's (and optionally the frozen
  reference's) per-token log-probs of the rank's rows;
* :meth:`PolicyWorker.train`: one optimizer step per global batch.

The rank receives a *rank input* (:mod:`shell.rank_input`): a store shard
(data plane: the worker fetches its rows by key, or its replica leader fetches
and broadcasts them, and the leader alone writes results back) or an inline
shard (legacy: the rows as the driver sliced them; the leader returns results
to the driver). Either way the compute in between is the same code on the
same *rank batch* (token fields ``[B, S]`` padded to the step's
``global_forward_pad_seqlen``, other fields ``[B, ...]``, ``lengths``
LongTensor[B]), so the two transports agree exactly when their rank batches
and ``extra_info`` agree.

Micro-batches: the spans the driver stamps (``micro_batch_indices``, from
:func:`core.sharding.shard_meta_for_dp`) are used as they are, never
recomputed here (:func:`core.step_plan.micro_batch_spans`). Every micro-batch
is forwarded at the step's pad length.

Invariants:
  * exactly one writer per (key, field): only the replica leader (tp = cp =
    pp = 0) writes back, whatever the TP / CP / PP sizes;
  * leader broadcast never pickles a tensor (``shell.broadcast``), and a
    leader whose fetch fails tells its replica group, so none hangs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import attrs
import ray
import torch
from tensordict import TensorDict

from adapters.model_port import PolicyBackend
from adapters.rows import build_tensordict
from adapters.store_port import DataPlaneClient
from core.codec import Layout
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, INPUT_IDS, LENGTHS, PREV_LOGPROBS, REFERENCE_LOGPROBS, ROUTED_EXPERTS
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from core.step_plan import micro_batch_spans
from shell.column_io import read_columns, write_columns
from shell.metering import client_io
from shell.rank_input import RankInput
from shell.model_worker import ClientFactory, ModelWorker
from shell.row_cache import StepRowCache
from shell.worker import on_all_ranks, sharded

FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
"""How a replica group reads its rows: every rank reads (``independent``), the leader reads and broadcasts
(``leader_broadcast``), or leader broadcast when the replica group has more than one rank (``auto``)."""
LOGPROB_OUTPUTS: tuple[str, ...] = (PREV_LOGPROBS, REFERENCE_LOGPROBS)
"""What :meth:`PolicyWorker.logprobs` can compute: the policy's and the frozen reference's log-probs."""
COMPUTE_SECONDS = "compute_s"
"""The key of a ``logprobs`` or ``train`` result that holds the wall seconds the rank spent in the model (its
forward passes, or its optimizer steps), from its rows in memory to its outputs in memory: none of the call's
transport (reading the rows, delivering the outputs) and none of its dispatch. A call's wall time less its slowest
rank's ``compute_s`` is what it spent outside the model: the transport, the dispatch and the driver's planning."""
_FETCH_POLICIES: tuple[str, ...] = get_args(FetchPolicy)


def slowest_compute(results: Sequence[Mapping[str, Any]]) -> float:
    """The model seconds of a ``logprobs`` or ``train`` call from its ranks' results: its slowest rank's
    :data:`COMPUTE_SECONDS` (the ranks compute at once), which the call's wall time cannot go below whatever moves
    its rows.

    Raises:
        KeyError: a rank's result holds no ``compute_s``.

    Example:
        >>> slowest_compute([{"compute_s": 1.5}, {"compute_s": 2.0}])
        2.0
    """
    return max(float(result[COMPUTE_SECONDS]) for result in results)


@attrs.frozen
class PolicyWorkerConfig:
    """What every rank builds its backend from (the same on all ranks).

    Args:
        model: the tiny GPT's shape.
        seed: the initial weights' seed.
        device: ``"cpu"`` (megatron's CPU shim) or ``"cuda"``.
        learning_rate: Adam's step size.
        fetch_policy: how the replica group fetches data-plane rows (see :data:`FetchPolicy`).
        torch_threads: intra-op threads per worker (1 keeps a shared CPU machine usable).
        router_replay: fetch each row's ``routed_experts`` with its tokens and replay it (R3) in the policy's
            log-prob forwards and training steps (an MoE ``model`` only); the frozen reference routes by its
            own scores (the routing is the sampling policy's, not the reference's).
    """

    model: TinyGPTConfig = attrs.field(factory=TinyGPTConfig, validator=attrs.validators.instance_of(TinyGPTConfig))
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    device: str = attrs.field(default="cpu", validator=attrs.validators.in_(("cpu", "cuda")))
    learning_rate: float = 1e-3
    fetch_policy: FetchPolicy = attrs.field(default="auto", validator=attrs.validators.in_(get_args(FetchPolicy)))
    torch_threads: int = 1
    router_replay: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.router_replay and not self.model.is_moe:
            raise ValueError("'router_replay' needs an MoE model (model.num_experts >= 2): got num_experts=0")

    @property
    def replay_fields(self) -> tuple[str, ...]:
        """The fields a forward fetches beside ``input_ids`` to replay routing: ``(routed_experts,)`` or none."""
        return (ROUTED_EXPERTS,) if self.router_replay else ()


# ---------------------------------------------------------------- pure helpers (no I/O)


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


def _tensors(batch: TensorDict) -> dict[str, torch.Tensor]:
    return {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}


# ---------------------------------------------------------------- the worker


class PolicyWorker(ModelWorker):
    """A megatron policy rank (see the module docstring); the driver calls ``setup`` once after the group starts.

    Args:
        config: the backend's settings (the same on every rank).
        client_factory: builds this worker's store client in ``setup`` (data
            plane; None on the legacy path); must be picklable.
    """

    CONFIG = PolicyWorkerConfig
    config: PolicyWorkerConfig

    def __init__(self, config: Any, client_factory: ClientFactory | None = None) -> None:
        super().__init__(config, client_factory)
        self._row_cache = StepRowCache()

    # ------------------------------------------------------------ set-up

    @on_all_ranks
    def setup(self) -> dict[str, int]:
        """Build the backend from this rank's layout (TP, PP of the group's sharding); returns its coords.

        Raises:
            ValueError: the layout has context parallelism (the backend has none).
        """
        return self.set_up().parallel_coords()

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
            group_timeout_s=self.pg_timeout_s,  # megatron's own groups (TP, PP, DP) fail as the world's do
        )

    @on_all_ranks
    def reset(self) -> None:
        """Rebuild the backend: initial weights of the seed and a fresh optimizer. Collective."""
        self._backend = self._build_backend()

    @property
    def client(self) -> DataPlaneClient:
        """The store client.

        Raises:
            RuntimeError: the worker was built without a ``client_factory``, or ``setup`` has not run.
        """
        if self._client is None:
            raise RuntimeError(f"rank {self.rank}: no store client; build the group with a client_factory")
        return self._client

    @on_all_ranks
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (collective)."""
        return self.backend.state_dict()

    @on_all_ranks
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights (as ``state_dict`` returns) into the policy; the reference model is kept."""
        self.backend.load_state_dict(state)

    @on_all_ranks
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
        policy: FetchPolicy | None = None,
        layout: Layout = "padded",
    ) -> TensorDict:
        """This rank's batch of ``meta``'s rows: ``fields`` (default ``meta.fields``) plus ``lengths``.

        ``policy`` (default: the worker config's ``fetch_policy``): ``"independent"``,
        every rank reads the store; ``"leader_broadcast"``, the replica leader
        reads and broadcasts to its replica group (two phases, no tensor
        pickled); ``"auto"``, leader broadcast when the replica group has more
        than one rank.

        Raises:
            ValueError: an unknown ``policy``.
            KeyError: a key or field is not stored (on every rank of the replica group).
        """
        policy = self.config.fetch_policy if policy is None else policy
        if policy not in _FETCH_POLICIES:
            raise ValueError(f"'policy' must be one of {list(_FETCH_POLICIES)}: got {policy!r}")
        names = list(meta.fields if fields is None else fields)
        group = self.replica_group()
        if policy == "independent" or (policy == "auto" and group is None):
            return self._read_rows(meta, names, layout)
        if self.is_replica_leader:
            try:
                batch = self._read_rows(meta, names, layout)
            except BaseException:
                if group is not None:  # tell the replica group, so none waits in the broadcast
                    with contextlib.suppress(TypeError):
                        self.broadcast_from_leader(None)
                raise
            tensors = self.broadcast_from_leader(_tensors(batch))
        else:
            tensors = self.broadcast_from_leader(None)
        return build_tensordict(tensors, len(meta))

    def _read_rows(self, meta: KVBatchMeta, names: list[str], layout: Layout) -> TensorDict:
        """This rank's read of ``meta``'s rows: the ``(row, field)`` pairs of this step it holds
        (:class:`shell.row_cache.StepRowCache`) and the rest from the store, in ``meta.keys`` order.

        Fields are grouped by the rows they miss, and each group is one store get: a step's reads are one get
        (or none), and a row the rank holds for one field is never read from the store for it.
        """
        pad = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
        if layout != "padded" or pad is None or not names:
            return fetch_rank_batch(self.client, meta, names, layout=layout)
        cache, keys, pad = self._row_cache, meta.keys, int(pad)
        by_misses: dict[tuple[int, ...], list[str]] = {}
        for name in names:
            by_misses.setdefault(tuple(cache.split(keys, [name], pad)[1]), []).append(name)
        columns: dict[str, torch.Tensor] = {}
        for misses, fields in by_misses.items():
            if len(misses) == len(keys):  # none held: the whole shard from the store
                fetched = fetch_rank_batch(self.client, meta, fields, layout=layout)
                cache.remember_fetched(keys, {name: fetched[name] for name in fields}, pad)
                columns.update({name: fetched[name] for name in fields})
                continue
            missing = set(misses)
            hits = [i for i in range(len(keys)) if i not in missing]
            held = cache.gather([keys[i] for i in hits], fields, pad)  # before a new block can push these out
            if not misses:
                columns.update(held)
                continue
            missed = meta.subset(misses)
            fetched = fetch_rank_batch(self.client, missed, fields, layout=layout)
            cache.remember_fetched(missed.keys, {name: fetched[name] for name in fields}, pad)
            inverse = torch.empty(len(keys), dtype=torch.long)
            inverse[torch.tensor(hits + list(misses), dtype=torch.long)] = torch.arange(len(keys))
            columns.update({name: torch.cat([held[name], fetched[name]]).index_select(0, inverse) for name in fields})
        columns[LENGTHS] = torch.tensor(meta.sequence_lengths, dtype=torch.long)
        return build_tensordict({name: columns[name] for name in [*names, LENGTHS]}, len(keys))

    def write_back(
        self,
        meta: KVBatchMeta,
        fields: Mapping[str, torch.Tensor],
        *,
        token_fields: Sequence[str] = (),
        keep: frozenset[str] = frozenset(),
    ) -> bool:
        """Write ``fields`` under ``meta``'s keys from the replica leader only, except the rows of ``keep``; whether
        this rank wrote.

        Per-token fields (``token_fields``) are trimmed to each row's length. The leader keeps every row it
        computed for this step's later reads (the train call); when every rank reads for itself
        (``fetch_policy="independent"``), the other ranks of its replica group keep the rows of ``keep``, which
        the store does not hold, so that the train call finds them whichever rank reads.

        Raises:
            ValueError: ``keep`` names rows but ``meta`` lacks the step's pad length or sequence lengths (the rows
                could not be kept as the train call reads them).
        """
        pad = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
        cacheable = pad is not None and meta.sequence_lengths is not None
        if keep and not cacheable:
            raise ValueError(
                f"'keep' needs 'meta' stamped with {GLOBAL_FORWARD_PAD_SEQLEN!r} and sequence lengths: "
                f"got extra_info {sorted(meta.extra_info)}, sequence_lengths {'set' if meta.sequence_lengths else None}"
            )
        leader = self.is_replica_leader
        sent = [i for i, key in enumerate(meta.keys) if key not in keep]
        if leader and sent:
            if len(sent) == len(meta):
                write_columns(self.client, meta, dict(fields), token_fields=list(token_fields))
            else:
                rows = torch.tensor(sent, dtype=torch.long)
                written = {name: value.index_select(0, rows) for name, value in fields.items()}
                write_columns(self.client, meta.subset(sent), written, token_fields=list(token_fields))
        if cacheable and (leader or (keep and self.config.fetch_policy == "independent")):
            held = meta
            if not leader:
                kept = [i for i, key in enumerate(meta.keys) if key in keep]
                held, rows = meta.subset(kept), torch.tensor(kept, dtype=torch.long)
                fields = {name: value.index_select(0, rows) for name, value in fields.items()}
            tokens = {name: value for name, value in fields.items() if name in token_fields}
            others = {name: value for name, value in fields.items() if name not in token_fields}
            self._row_cache.remember_written(held.keys, tokens, held.sequence_lengths, int(pad))
            if others:
                self._row_cache.remember_fetched(held.keys, others, int(pad))
        return leader and bool(sent)

    def store_io(self) -> dict[str, float]:
        """This rank's store activity since the last call (zeros unless its client is metered)."""
        return client_io(self._client)

    # ------------------------------------------------------------ the two computations

    @sharded
    def logprobs(
        self, shard: RankInput, *, outputs: Sequence[str] = (PREV_LOGPROBS,), prefetch: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Per-token log-probs FloatTensor[B, S] of the rank's rows, one per name in ``outputs``.

        ``outputs`` names ``prev_logprobs`` (the policy), ``reference_policy_logprobs``
        (the frozen reference), or both: one fetch and one delivery serve them all.
        ``prefetch`` names fields the step's train call will read: a store shard
        reads those already stored in the same fetch, and the rank keeps them.

        Returns:
            Small stats (rank, rows, micro-batch counts, forward length, and
            :data:`COMPUTE_SECONDS`: the seconds of the model's forward passes), plus
            what ``shard.deliver`` reports (the outputs themselves on the legacy
            path; the store I/O on the data plane).

        Raises:
            ValueError: ``outputs`` is empty or names something else.
        """
        names = tuple(outputs)
        unknown = [n for n in names if n not in LOGPROB_OUTPUTS]
        if not names or unknown:
            raise ValueError(f"'outputs' must name some of {list(LOGPROB_OUTPUTS)}: got {list(names)}")
        self._row_cache.clear()  # a step's rows start here: nothing of a failed step is read again
        batch = shard.rows(self, [INPUT_IDS, *self.config.replay_fields], also=prefetch)
        plan = micro_batch_spans(shard.extra_info, len(batch))
        input_ids, lengths = batch[INPUT_IDS], batch[LENGTHS]
        routed = batch[ROUTED_EXPERTS] if self.config.router_replay else None
        results = {}
        began = time.perf_counter()
        for name in names:
            # The routing is the sampling policy's: the policy replays it, the frozen reference routes by its own scores.
            forward = self.backend.reference_logprobs if name == REFERENCE_LOGPROBS else self.backend.logprobs
            replay = routed if name == PREV_LOGPROBS else None
            results[name] = torch.cat([
                forward(input_ids[a:b], lengths[a:b], None if replay is None else replay[a:b])
                for step in plan
                for a, b in step
            ])
        computed = time.perf_counter() - began
        return {**self._stats(batch, plan), COMPUTE_SECONDS: computed, **shard.deliver(self, results)}

    @sharded
    def train(self, shard: RankInput, *, loss_fn: Any) -> dict[str, Any]:
        """One optimizer step per global batch of the rank's rows (``loss_fn`` reads ``loss_fn.input_fields``).

        Returns:
            Stats (:data:`COMPUTE_SECONDS`: the seconds of the optimizer steps), and per step the loss, the grad
            norm and the micro-batches' metrics.
        """
        batch = shard.rows(self, [INPUT_IDS, *self.config.replay_fields, *getattr(loss_fn, "input_fields", ())])
        plan = micro_batch_spans(shard.extra_info, len(batch))
        tensors = _tensors(batch)
        steps = []
        began = time.perf_counter()
        for step in plan:
            micro_batches = [{name: t[a:b] for name, t in tensors.items()} for a, b in step]
            steps.append(self.backend.train_step(micro_batches, loss_fn))
        computed = time.perf_counter() - began
        self._row_cache.clear()  # the step's rows are done with
        return {
            **self._stats(batch, plan),
            COMPUTE_SECONDS: computed,
            "loss": [s["loss"] for s in steps],
            "loss_sum": [s["loss_sum"] for s in steps],
            "loss_weight": [s["loss_weight"] for s in steps],
            "grad_norm": [s["grad_norm"] for s in steps],
            "metrics": [s["metrics"] for s in steps],
            **shard.deliver(self, {}),
        }

    def _stats(self, batch: TensorDict, plan: Sequence[Sequence[tuple[int, int]]]) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "rows": len(batch),
            "micro_batches": [len(step) for step in plan],
            "forward_seq_length": int(batch[INPUT_IDS].shape[1]),
        }
