"""``GRPOTrainer``: one GRPO step, written once, over either transport (legacy in-memory, or the data plane).

:meth:`GRPOTrainer.step` is one script: take the step's rows from the step
source (generated now, with DAPO's dynamic sampling when enabled; or, for
async GRPO, sampled from the replay buffer a rollout collector fills ahead of
the trainer: :mod:`shell.step_source`), plan the advantages from the per-row
carry (core), stamp the step, compute the previous and reference log-probs,
write the advantages, train, refit the generator, finish. The driver's decisions come from core
(:mod:`core.rollout_carry`, :mod:`core.grpo`, :mod:`core.step_plan`); how rows
move is the transport's business alone (:mod:`shell.transport`): on the
legacy path the bulk rows pass through the driver, on the data plane they
stay in the store and only metas and per-row values cross the driver.

Invariants:
  * for the same config and seed both paths produce bitwise the same rewards,
    losses and grad norms on CPU (same prompts, sampling streams, shards,
    pad lengths and micro-batches), and so does async GRPO with
    ``grpo.async.max_staleness=0``;
  * after every step, finished or failed, the store holds none of its keys
    (async: besides those of receipts in the buffer or of a batch in flight);
  * on any error or interrupt, :meth:`GRPOTrainer.close` stops every actor it
    started, clears every key the run wrote (all carry the run id), and
    closes what it owns (the store, an embedded Ray cluster).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import attrs
import ray
import torch

from core.entropy import mean_token_entropy
from core.fields import ADVANTAGES, SAMPLE_MASK
from core.memory_trend import MemoryTrend, observe, rising
from core.model_config import TinyGPTConfig
from core.rollout_carry import plan_advantages, zero_variance_group_fraction
from core.sharding import PackingSpec
from core.step_plan import TrainResult, token_mean_metric
from core.task import Task
from core.topology import NamedSharding
from adapters import proc_memory
from adapters.store_health import HealthCheckedStore, StoreFailure, StorePart, failure_in
from adapters.store_port import DataPlaneClient
from shell.config_error import ConfigError
from shell.loss import GRPOLoss
from shell.metering import MeteredClient
from shell.node_placement import check_storage_resource, transfer_queue_settings
from shell.phases import PhaseTimer
from shell.policy import Policy, PolicyConfig
from shell.rollout import RolloutConfig
from shell.ray_cluster import connect as connect_ray
from shell.run_config import RunConfig, StoreBackend, dump_run_config
from shell.run_log import MEMORY_ERROR_KEY, MEMORY_KEY, RISING_KEY
from shell.step_source import NotEnoughGroups, StepInput, StepSource, build_source
from shell.transport import DataPlaneTransport, LegacyTransport, Transport, TransportReport
from shell.worker_group import GPUShortageError

CHECKPOINT_FILE = "checkpoint.pt"
_VOCAB_MULTIPLE = 8


# ---------------------------------------------------------------- configuration -> parts
# The loader (shell.run_config) made every check: building the parts raises nothing.


def build_task(config: RunConfig) -> Task:
    """The run's task (``task.name`` built with ``task.kwargs``; loaded and probed by the config's checks)."""
    return config.task.instance


def model_config(config: RunConfig, task: Task) -> TinyGPTConfig:
    """The tiny GPT's shape: the config's sizes (MoE experts and top-k included) and the task's vocabulary (padded to a
    multiple of 8 and of TP)."""
    m = config.policy.model
    return TinyGPTConfig(
        vocab_size=task.tokenizer.padded_vocab_size(math.lcm(_VOCAB_MULTIPLE, config.policy.layout.tensor_parallel)),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        max_sequence_length=m.max_sequence_length,
        num_experts=m.num_experts,
        moe_topk=m.moe_topk,
    )


def policy_config(config: RunConfig, model: TinyGPTConfig) -> PolicyConfig:
    """The policy's layout, packing and optimizer settings."""
    p = config.policy
    return PolicyConfig(
        sharding=NamedSharding({
            "data_parallel": p.layout.data_parallel,
            "tensor_parallel": p.layout.tensor_parallel,
            "pipeline_parallel": p.layout.pipeline_parallel,
        }),
        model=model,
        seed=config.seed,
        packing=PackingSpec(max_tokens_per_microbatch=p.micro_batch_tokens) if p.micro_batch_tokens else None,
        learning_rate=p.learning_rate,
        fetch_policy=p.fetch_policy.value,
        router_replay=p.replays_routing,
        train_global_batch_size=p.train_global_batch_size,
        num_cpus_per_worker=p.num_cpus_per_worker,
        timeout_s=p.timeout_s,
        placement=config.ray.placement.value,
        worker_resource=config.ray.worker_resource,
        device=p.device.value,
        gpus_per_rank=p.gpus_per_rank,
    )


def loss_fn(config: RunConfig) -> GRPOLoss:
    """The GRPO loss of the config (with the sample mask, so filtered rows do not count; async: decoupled)."""
    loss, settings = config.grpo.loss, config.grpo.async_
    return GRPOLoss(
        clip_low=loss.clip_low,
        clip_high=loss.clip_high,
        kl_coef=loss.kl_coef,
        sample_mask=True,
        is_cap=settings.is_cap if settings.enabled else None,
    )


@attrs.frozen
class MeteredFactory:
    """A picklable client factory: ``inner()`` wrapped in a :class:`MeteredClient` (so workers report store I/O).

    The clients it builds keep no outstanding-bytes table (``track_outstanding=False``): a worker puts rows that
    the driver clears, so its table would only grow, a row and field per write, for the whole run.
    """

    inner: Callable[[], DataPlaneClient]
    verify_integrity: bool = False

    def __call__(self) -> MeteredClient:
        return MeteredClient(self.inner(), verify_integrity=self.verify_integrity, track_outstanding=False)


# ---------------------------------------------------------------- the trainer


def build_at_once(
    builders: Mapping[str, Callable[[], Any]],
    *,
    keep: Callable[[str, Any], None],
    discard: Callable[[str, Any], None],
) -> None:
    """Run every builder at once, one daemon thread each, and ``keep(name, built)`` what each built.

    If every builder finishes, each success is kept and the first failure (in ``builders`` order) is raised,
    naming its builder in a note. If an interrupt reaches the caller first (Ctrl-C, SIGTERM), the successes so
    far are kept and the interrupt is raised at once: a builder that finishes later hands what it built to
    ``discard(name, built)`` (on its own thread) instead, so nothing built is lost and the caller need not wait
    for a slow or stuck build.

    Raises:
        the first failed builder's error, or the interrupt.

    Example:
        >>> started = {}
        >>> build_at_once({"a": lambda: 1, "b": lambda: 2}, keep=started.__setitem__, discard=print)
        >>> started
        {'a': 1, 'b': 2}
    """
    lock = threading.Lock()
    finished = threading.Event()
    outcomes: dict[str, tuple[bool, Any]] = {}
    given_up = False

    def run(name: str, build: Callable[[], Any]) -> None:
        try:
            outcome: tuple[bool, Any] = (True, build())
        except BaseException as error:  # handed to the caller (or dropped with the build, if it gave up)
            outcome = (False, error)
        with lock:
            if not given_up:
                outcomes[name] = outcome
                if len(outcomes) == len(builders):
                    finished.set()
                return
        if outcome[0]:
            with contextlib.suppress(Exception):
                discard(name, outcome[1])

    if not builders:
        return
    try:
        for name, build in builders.items():
            threading.Thread(target=run, args=(name, build), name=f"build-{name}", daemon=True).start()
        finished.wait()
    except BaseException:
        with lock:
            given_up = True
            done = dict(outcomes)
        for name in builders:
            if name in done and done[name][0]:
                keep(name, done[name][1])
        raise
    for name in builders:
        if outcomes[name][0]:
            keep(name, outcomes[name][1])
    for name in builders:
        succeeded, value = outcomes[name]
        if not succeeded:
            value.add_note(f"(while starting the {name})")
            raise value


class StepError(RuntimeError):
    """A GRPO step failed; ``step`` is its index. The cause is chained."""

    def __init__(self, step: int, message: str) -> None:
        self.step = step
        super().__init__(f"step {step}: {message}")


class StoreStartError(RuntimeError):
    """The run's store did not start (the cause is chained); the run ends before its first step."""


class GRPOTrainer:
    """GRPO on Ray: a rollout engine (or, async, a rollout collector and a replay buffer), megatron policy
    workers, and (by default) a store for the bulk rows.

    Args:
        config: a checked run config (:func:`shell.run_config.load_run_config`).
        client: a store client to use instead of starting one (library use; the
            caller owns it); needs ``client_factory`` too.
        client_factory: how workers open their store client (with ``client``).

    Call :meth:`start`, then :meth:`step` for each step, and :meth:`close`
    (also on errors). ``with GRPOTrainer(config) as trainer:`` does both ends.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        client: DataPlaneClient | None = None,
        client_factory: Callable[[], DataPlaneClient] | None = None,
    ) -> None:
        if (client is None) != (client_factory is None):
            raise ValueError("'client' and 'client_factory' go together: pass both or neither")
        self.config = config
        self.task = build_task(config)
        self.model = model_config(config, self.task)
        self.policy_config = policy_config(config, self.model)
        self.loss = loss_fn(config)
        self.data_plane = config.data_plane.enabled
        self.partition = config.data_plane.partition
        self._given_client = client
        self._given_factory = client_factory
        self._owns_ray = False
        self._store: Any = None  # the store we started (closed by us)
        self.client: MeteredClient | None = None
        self.transport: Transport | None = None
        self.policy: Policy | None = None
        self.source: StepSource | None = None
        self.timer = PhaseTimer()
        self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-finish")
        self.run_id = uuid.uuid4().hex[:8]  # prefixes the store keys: runs sharing a partition never collide
        self.key_prefix = self.run_id + "-"
        self._store_failed = False  # a step failed because a store part died (reported once, by that step)
        self.start_seconds: dict[str, float] = {}  # wall seconds of start's parts: ray, store (data plane), workers
        run = config.run
        # each process's last rss_mib readings; None when run.memory_rise_limit is 0 (never judged)
        self.memory_trend: MemoryTrend | None = (
            MemoryTrend(run.memory_rise_window, run.memory_rise_limit) if run.memory_rise_limit > 0 else None
        )

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> GRPOTrainer:
        try:
            self.start()
        except BaseException:
            self.close()  # what started before the failure (``__exit__`` does not run for it)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, on_status: Callable[[str], None] | None = None) -> None:
        """Start (or join) Ray, the store, the policy workers and the rollout engine (async: collector and buffer).

        The policy workers and the rollout engine start at once (:func:`build_at_once`); whatever started is
        stopped by :meth:`close` even when the other failed. ``start_seconds`` then holds the wall seconds of
        each part: ``ray``, ``store`` (on the data plane) and ``workers``.

        Raises:
            WorkerError: a worker failed to start.
            StoreStartError: the store failed to start (e.g. a part of it could not be placed in time).
            ConfigError: the config does not fit the cluster (e.g. no node has ``data_plane.storage_resource``).
        """
        say = on_status or (lambda _message: None)
        timed = self.start_seconds
        began = time.perf_counter()
        self._owns_ray = connect_ray(self.config.ray, say) or self._owns_ray
        timed["ray"] = time.perf_counter() - began
        began = time.perf_counter()
        transport = self.transport = self._open_transport(say)
        if self.data_plane:
            timed["store"] = time.perf_counter() - began
        generator = "a rollout collector and a replay buffer" if self.config.grpo.async_.enabled else "the rollout engine"
        say(f"starting {self.policy_config.sharding.world_size} policy workers and {generator}")
        rollout = RolloutConfig(
            self.model,
            self.config.seed,
            self.task,
            self.config.grpo.temperature,
            precision=self.config.rollout.precision.value,
            record_routing=self.config.policy.replays_routing,
        )
        began = time.perf_counter()
        # Each engine's actors import and build their models (seconds each) and neither needs the other: start both
        # at once. Whatever started is kept, so close() stops it even when the other failed.
        build_at_once(
            {
                "policy": functools.partial(self._start_policy, transport),
                "source": functools.partial(
                    build_source, self.config, self.task, rollout, transport, key_prefix=self.key_prefix
                ),
            },
            keep=functools.partial(setattr, self),
            discard=lambda _name, engine: engine.shutdown() if isinstance(engine, Policy) else engine.close(),
        )
        timed["workers"] = time.perf_counter() - began

    def _start_policy(self, transport: Transport) -> Policy:
        """The policy's worker group; a cluster short of the GPUs ``policy.device=cuda`` needs is a config error."""
        try:
            return Policy(self.policy_config, transport)
        except GPUShortageError as shortage:
            ranks = "1 policy rank needs" if shortage.ranks == 1 else f"{shortage.ranks} policy ranks need"
            raise ConfigError(
                "policy.device",
                f"must be cpu on a Ray cluster without the GPUs of the policy ranks (the run's {ranks} "
                f"{shortage.need:g} GPU{'' if shortage.need == 1 else 's'} at policy.gpus_per_rank="
                f"{shortage.per_worker:g}, the cluster has {shortage.have:g}): got cuda",
            ) from shortage

    def _open_transport(self, say: Callable[[str], None]) -> Transport:
        """The legacy transport, or the data plane over a started (or given) store."""
        if not self.data_plane:
            return LegacyTransport()
        say(f"starting the store ({self.config.data_plane.backend.value})")
        try:
            inner, inner_factory = self._open_store()
        except ConfigError:
            raise
        except Exception as error:
            resource = self.config.data_plane.storage_resource
            hint = f" (data_plane.storage_resource={resource!r} placed its parts)" if resource is not None else ""
            raise StoreStartError(f"the store failed to start: {error}{hint}") from error
        verify = self.config.data_plane.verify_integrity
        self.client = MeteredClient(inner, verify_integrity=verify)
        return DataPlaneTransport(
            self.client,
            MeteredFactory(inner_factory, verify),
            partition_id=self.partition,
            key_prefix=self.key_prefix,
        )

    def _open_store(self) -> tuple[DataPlaneClient, Callable[[], DataPlaneClient]]:
        if self._given_client is not None:
            return self._given_client, self._given_factory  # type: ignore[return-value]
        if self.config.data_plane.backend == StoreBackend.memory:
            from adapters.ray_memory import RayMemoryStore

            store = RayMemoryStore.start()
            self._store = store
            return store, functools.partial(RayMemoryStore.attach, store.name)
        from adapters.transfer_queue import TransferQueueStore, is_running

        wanted = self.config.data_plane.backend.tq_storage
        if is_running():  # a cluster that already runs TransferQueue: join it, leave it running
            store = TransferQueueStore.attach()
            if store.storage_backend != wanted:
                store.close()
                raise ConfigError(
                    "data_plane.backend",
                    f"{self.config.data_plane.backend.value} needs TransferQueue's {wanted} storage, but the "
                    f"TransferQueue running on this cluster uses {store.storage_backend}: set data_plane.backend "
                    f"to match it, or stop that TransferQueue",
                )
        else:
            d = self.config.data_plane
            check_storage_resource(d.storage_resource)
            store = TransferQueueStore.start(transfer_queue_settings(wanted, d.storage_units, d.storage_resource))
        self._store = store
        return store, TransferQueueStore.attach

    def close(self) -> None:
        """Clear the open step's keys, stop every actor, close the store and an embedded Ray. Idempotent, best effort.

        Every action is bounded (worker shutdowns by their timeouts, store calls by the store's deadlines). An
        interrupt (a second Ctrl-C) during one does not skip the rest: the actors are still stopped and the run's
        keys still swept (after every writer is gone, so a rollout that finishes its write late is swept too);
        the interrupt is raised once all is done.
        """
        errors: list[BaseException] = []
        interrupt: BaseException | None = None
        for action in (self._abort_step, self._stop_source, self._stop_policy, self.sweep_keys, self._close_store):
            try:
                action()
            except StoreFailure as error:  # a dead store part: already reported by the step it failed, if any
                if not self._store_failed:
                    errors.append(error)
                self._store_failed = True
            except Exception as error:  # keep shutting down; report the first problem afterwards
                errors.append(error)
            except BaseException as error:  # an interrupt: finish the (bounded) shutdown first
                interrupt = interrupt or error
        self._finisher.shutdown(wait=False)  # a step waits for its own finish: nothing is pending here
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
        if interrupt is not None:
            raise interrupt
        if errors:
            raise errors[0]

    def _abort_step(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _health_checked(self) -> HealthCheckedStore | None:
        """The run's store, when it can name and probe its processes (both built-in stores can)."""
        store = self._store if self._store is not None else self._given_client
        return store if isinstance(store, HealthCheckedStore) else None

    def store_parts(self) -> tuple[StorePart, ...]:
        """The store's processes (e.g. TransferQueue's controller and storage units, with their pids); () on the
        legacy path or for a store that cannot name them."""
        store = self._health_checked()
        return store.parts() if store is not None else ()

    @property
    def owns_store(self) -> bool:
        """Whether this run started its store (closing the run stops it), rather than joining a running one."""
        store = self._store
        return bool(getattr(store, "owns_transfer_queue", False) or getattr(store, "owns_actor", False))

    def store_failure(self) -> StoreFailure | None:
        """Probe the store's processes: the failure naming the first dead or silent one, or None (all answer, or
        nothing to probe). Bounded by the store's ``deadlines.probe_timeout_s``."""
        store = self._health_checked()
        if store is None:
            return None
        try:
            store.check_health()
        except StoreFailure as failure:
            return failure
        return None

    def _stop_source(self) -> None:
        if self.source is not None:
            self.source.close()

    def sweep_keys(self) -> None:
        """Clear every key of this run still in the partition (a dead actor's half-written batch included)."""
        client = self.client
        if client is None:
            return
        mine = [k for k in client.list_keys(self.partition) if k.startswith(self.key_prefix)]
        if mine:
            client.clear(mine, self.partition)

    def _stop_policy(self) -> None:
        if self.policy is not None:
            self.policy.shutdown()

    def _close_store(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    def process_ids(self) -> dict[str, Any]:
        """The OS pids of the run's processes, by role: the driver's, each policy rank's (``policy``, by rank), the
        source's actors' (by role, e.g. ``rollout``) and the store's parts' (``store``, by role; empty on the legacy
        path). ``python -m shell.run`` writes this record to the run's ``processes.json``."""
        from shell.worker import Worker

        out: dict[str, Any] = {"driver": os.getpid()}
        if self.policy is not None:
            out["policy"] = {str(rank): pid for rank, pid in enumerate(self.policy.group.call(Worker.process_id))}
        if self.source is not None:
            out.update(self.source.process_ids())
        out["store"] = {part.role: part.pid for part in self.store_parts()}
        return out

    def resident_memory(self) -> dict[str, float | None]:
        """Each process's resident memory in MiB, read by the process itself on its own node: ``driver``, ``policy
        <rank>`` per rank, the source's actors (``rollout``; async: ``collector`` and ``replay_buffer``, None when
        the buffer does not answer within 10 s) and ``store <role>`` per store part (e.g. ``store TransferQueue
        controller``; None for a part that did not answer within the store's ``deadlines.probe_timeout_s``). A
        policy rank or the engine that fails to answer fails the call as any call to it does.

        Every ``run.memory_every`` steps, :meth:`step` adds it to its record as ``rss_mib``, after the step's time
        is taken, and adds ``rss_rising`` when a process's last ``run.memory_rise_window`` readings grow faster
        than ``run.memory_rise_limit`` MiB per 100 steps (:attr:`memory_trend`, :mod:`core.memory_trend`)."""
        from shell.worker import Worker

        out: dict[str, float | None] = {"driver": proc_memory.resident_mib()}
        if self.policy is not None:
            out.update({f"policy {rank}": mib for rank, mib in enumerate(self.policy.group.call(Worker.resident_mib))})
        if self.source is not None:
            out.update(self.source.resident_mib())
        parts = getattr(self._health_checked(), "parts_resident_mib", None)
        if parts is not None:
            out.update({f"store {role}": mib for role, mib in parts().items()})
        return out

    def node_ids(self) -> dict[str, Any]:
        """Where the run's processes are: the Ray node id of the driver, of each policy rank (by rank), of the
        source's actors (by role), of each TransferQueue storage unit this trainer started (``storage``, by name),
        of TransferQueue's controller (``store_controller``) and of the ``RayObjectStore`` backend's index
        (``store_index``, on that backend only)."""
        from adapters import tq_object_store, tq_system
        from shell.node_placement import driver_node, node_of
        from shell.worker import Worker

        out: dict[str, Any] = {"driver": driver_node()}
        if self.policy is not None:
            out["policy"] = {str(r): node for r, node in enumerate(self.policy.group.call(Worker.node_id))}
        if self.source is not None:
            out.update(self.source.node_ids())
        if self._store is not None:
            out["storage"] = {name: node_of(unit) for name, unit in tq_system.storage_units().items()}
            backend = getattr(self._store, "storage_backend", None)  # TransferQueue's; None on the memory store
            if backend is not None:
                out["store_controller"] = node_of(
                    ray.get_actor(tq_system.CONTROLLER_NAME, namespace=tq_system.CONTROLLER_NAMESPACE)
                )
            if backend == tq_object_store.BACKEND:
                out["store_index"] = node_of(tq_object_store.find_index())
        return out

    # ------------------------------------------------------------ weights

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (on the driver: for checkpoints only)."""
        return self._policy.state_dict()

    def load_policy_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights into every policy rank and the generator (``--resume``; before the first step)."""
        ref = ray.put(dict(state))
        self._policy.load_state_dict(ref)
        self._source.load_weights(ref)

    @property
    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("the trainer is not started: call trainer.start() first")
        return self.policy

    @property
    def _source(self) -> StepSource:
        if self.source is None:
            raise RuntimeError("the trainer is not started: call trainer.start() first")
        return self.source

    @property
    def _transport(self) -> Transport:
        if self.transport is None:
            raise RuntimeError("the trainer is not started: call trainer.start() first")
        return self.transport

    # ------------------------------------------------------------ the step

    def step(self, step: int) -> dict[str, Any]:
        """Run GRPO step ``step``; return its metrics record.

        A failed memory reading (``run.memory_every``) does not fail the step, which has finished: its record
        then has ``rss_error`` (why) instead of ``rss_mib``, and a process that died fails the next step.

        Raises:
            StepError: DAPO found too few varying groups (the step's keys are cleared); or a process of the store
                died or stopped answering (the message names it, e.g. "the store failed: TransferQueue storage
                unit 1 (pid 4242) died"; whatever else failed because of it is chained).
            WorkerError: a worker, the rollout engine, the collector or the buffer failed
                (the step's keys are cleared).
        """
        try:
            record = self._step(step)
        except NotEnoughGroups as error:
            with contextlib.suppress(Exception):
                self._abort_step()
            raise StepError(step, str(error)) from None
        except StoreFailure as failure:
            self._fail_step(step, failure, failure)
        except Exception as error:
            # A dead store part makes every process that waits on it fail: name the store, not what failed first
            # (a worker's store call that found it says so; else the driver probes the store).
            self._fail_step(step, error, failure_in(error) or self.store_failure())
        except BaseException:  # an interrupt: clean up (bounded) and let it through
            with contextlib.suppress(Exception):
                self._abort_step()
            raise
        every = self.config.run.memory_every
        if every and step % every == 0:
            self._read_memory(step, record)
        return record

    def _read_memory(self, step: int, record: dict[str, Any]) -> None:
        """Add the processes' resident memory to ``record`` (and ``rss_rising`` when it grows too fast), or, when the
        reading fails, ``rss_error``: the step has finished, and a process that died fails the next one."""
        try:
            readings = self.resident_memory()
        except Exception as error:
            record[MEMORY_ERROR_KEY] = f"{type(error).__name__}: {error}"
            return
        record[MEMORY_KEY] = readings
        if self.memory_trend is not None:
            self.memory_trend = observe(self.memory_trend, step, readings)
            growing = rising(self.memory_trend)
            if growing:
                record[RISING_KEY] = {process: round(slope, 3) for process, slope in growing.items()}

    def _fail_step(self, step: int, error: Exception, failure: StoreFailure | None) -> NoReturn:
        """Clear the failed step's keys (bounded by the store's deadlines), then raise: a ``StepError`` naming the
        store part when ``failure`` says the store failed, else ``error`` itself.

        A store failure that a worker found is handed to the driver's client first, so that nothing after it (the
        clear, the sweep, closing the store) waits on the failed part."""
        store = self._health_checked()
        if failure is not None and failure.part is not None and store is not None:  # a timeout names no part
            store.note_failure(failure)
        with contextlib.suppress(Exception):  # the step's own error is the one to report
            self._abort_step()
        if failure is not None:
            self._store_failed = True  # close() then skips what needs the store, silently
            raise StepError(step, f"the store failed: {failure}") from error
        raise error

    def _step(self, step: int) -> dict[str, Any]:
        """One GRPO step, the same script on either transport and either source."""
        self.timer.reset()
        start = time.perf_counter()
        policy, transport, g = self._policy, self._transport, self.config.grpo
        taken = self._source.next_input(step, transport, self.timer)
        rows, carry = taken.rows, taken.carry
        with self.timer.phase("advantages"):
            plan = plan_advantages(
                carry,
                leave_one_out=g.leave_one_out,
                normalize_by_std=g.normalize_by_std,
                overlong_filter=g.overlong_filter,
            )
        tags = {"baseline": plan.baseline, "std": plan.std, "reward": carry.rewards}
        rows = policy.prepare(rows.with_meta(rows.meta.stamp_tags(tags)))
        with self.timer.phase("logprobs"):  # one fetch and one write-back for both log-probs
            rows = policy.logprobs(
                rows, reference=self.loss.kl_coef > 0, prefetch=self.loss.input_fields, keep_for_train=True
            )
        with self.timer.phase("write"):
            advantages = torch.tensor(plan.advantages, dtype=torch.float32)
            sample_mask = torch.tensor(plan.sample_mask, dtype=torch.float32)
            rows = transport.write(rows, {ADVANTAGES: advantages, SAMPLE_MASK: sample_mask, **taken.columns})
        with self.timer.phase("train"):
            result = policy.train(rows, self.loss)
        # The step's clear runs while the new weights go out: they touch neither each other's data nor process.
        finishing = self._finisher.submit(transport.finish, rows)
        try:
            with self.timer.phase("refit"):
                self._source.refit(policy)
        finally:
            with self.timer.phase("finish"):  # what the clear adds after the refit
                report = finishing.result()
        return self._record(step, start, taken, result, report)

    def _record(self, step: int, start: float, taken: StepInput, result: TrainResult, report: TransportReport) -> dict[str, Any]:
        """The step's metrics record (one line of ``metrics.jsonl``)."""
        carry = taken.carry
        generated = taken.generated_rewards
        return {
            "step": step,
            "reward_mean": sum(generated) / len(generated),
            "reward_mean_trained": sum(carry.rewards) / carry.size,
            "entropy": mean_token_entropy(taken.entropy, taken.response_tokens),
            "zero_variance_group_frac": zero_variance_group_fraction(carry),
            "loss": sum(result.loss) / len(result.loss),
            "kl": token_mean_metric(result, "kl"),  # over the global batch's tokens, as the loss
            "grad_norm": sum(result.grad_norm) / len(result.grad_norm),
            "optimizer_steps": len(result.loss),
            "step_time_s": time.perf_counter() - start,
            **{f"phase_{name}_s": value for name, value in self.timer.durations().items()},
            # the policy's time in the model, within the logprobs and train phases (the rest is moving rows)
            **{f"model_{call}_s": seconds for call, seconds in self._policy.model_seconds.items()},
            **taken.metrics,
            "data_plane_ms": report.store_ms,
            "data_plane_ms_by_call": dict(report.store_ms_by_call),
            "data_plane_bytes": report.store_bytes,
            # what crossed the driver: every batch's carry, plus what the transport moved through it
            "driver_bytes": taken.carry_bytes + report.driver_bytes,
            "store_keys_outstanding": report.keys_outstanding,
            "rows": carry.size,
            "generation_batches": taken.generation_batches,
            "truncated_frac": sum(carry.truncated) / carry.size,
            "sequence_tokens_mean": sum(carry.lengths) / carry.size,
            "samples": [dict(sample) for sample in taken.samples],
        }

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, run_dir: Path, step: int) -> Path:
        """Write the policy's weights and the last finished step to ``run_dir/checkpoint.pt`` (atomically)."""
        path = Path(run_dir) / CHECKPOINT_FILE
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"step": step, "weights": self.policy_state(), "config": dump_run_config(self.config)}, tmp
        )
        os.replace(tmp, path)
        return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :meth:`GRPOTrainer.save_checkpoint` (``path`` may be the run folder).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: the file is not such a checkpoint.
    """
    file = Path(path)
    if file.is_dir():
        file = file / CHECKPOINT_FILE
    if not file.is_file():
        raise FileNotFoundError(f"'--resume' must name a run folder or a {CHECKPOINT_FILE}: no file {file}")
    data = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not {"step", "weights"} <= set(data):
        raise ValueError(f"'{file}' is not a GRPO checkpoint: expected keys step, weights; got {sorted(data)}")
    return data
