"""``GRPOTrainer``: one GRPO loop over two interchangeable transports (legacy in-memory, or the data plane).

The driver's decisions are the same on both paths and come from core
(:mod:`core.rollout_carry`, :mod:`core.grpo`); only the way rows move differs:

=====================  ===========================================  =============================================
step                   legacy (``data_plane.enabled=false``)        data plane (default)
=====================  ===========================================  =============================================
1. rollout             the engine returns the bulk batch + carry    the engine ``first_write``s, returns meta + carry
2. DAPO (optional)     drop rows of the in-memory batch             ``clear`` the dropped keys
3. baselines, filter   from the carry (driver)                      from the carry (driver), stamped on ``meta.tags``
4. logprobs            ``Policy`` ships padded shards, gets results  workers fetch by key and write back
5. advantages          set on the in-memory batch                   ``write_columns`` (per-row slices only)
6. train               ``Policy.train(batch)``                      ``DataPlanePolicy.train(meta)``
7. refit               policy rank 0 pushes weights to the engine (both paths; never through the driver)
8. finish              nothing stored                               ``finish_step``: the step's keys are cleared
=====================  ===========================================  =============================================

Invariants:
  * for the same config and seed both paths produce bitwise the same rewards,
    losses and grad norms on CPU (same prompts, sampling streams, shards,
    pad lengths and micro-batches);
  * after every step, finished or failed, the store holds none of its keys;
  * on any error or interrupt, :meth:`GRPOTrainer.close` stops every actor it
    started and closes what it owns (the store, an embedded Ray cluster).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import pickle
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from adapters.rows import build_tensordict
from adapters.store_port import DataPlaneClient
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from core.rollout_carry import AdvantagePlan, RolloutCarry, dapo_selection, group_count, plan_advantages
from core.sharding import PackingSpec
from core.task import Task
from core.topology import NamedSharding
from shell.loss import ADVANTAGES, PREV_LOGPROBS, REFERENCE_LOGPROBS, SAMPLE_MASK, GRPOLoss
from shell.metering import MeteredClient
from shell.phases import PhaseTimer
from shell.policy import DataPlanePolicy, Policy, PolicyConfig, TrainResult, build_group, tensor_bytes
from shell.rollout import RolloutConfig, RolloutResult, RolloutWorker
from shell.run_config import ConfigError, StoreBackend
from shell.worker_group import WorkerGroup

CHECKPOINT_FILE = "checkpoint.pt"
_VOCAB_MULTIPLE = 8


# ---------------------------------------------------------------- configuration -> parts


def build_task(config: DictConfig) -> Task:
    """The task named by ``task.name`` (``addition`` or ``package.module:Class``), built with ``task.kwargs``.

    Raises:
        ConfigError: the name cannot be imported, the class rejects its
            kwargs, or it does not implement :class:`core.task.Task`.
    """
    name = str(config.task.name)
    kwargs = OmegaConf.to_container(config.task.kwargs, resolve=True) or {}
    if name == "addition":
        name = "core.addition:AdditionTask"
    module_name, _, class_name = name.partition(":")
    if not class_name:
        raise ConfigError("task.name", f"must be 'addition' or 'package.module:Class': got {name!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError("task.name", f"cannot import {name!r}: {error}") from None
    try:
        task = cls(**kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise ConfigError("task.kwargs", f"{name} rejected {kwargs}: {error}") from None
    if not isinstance(task, Task):
        raise ConfigError("task.name", f"{name} does not implement core.task.Task (prompts, prompt_ids, rewards, ...)")
    return task


def model_config(config: DictConfig, task: Task) -> TinyGPTConfig:
    """The tiny GPT's shape: the config's sizes and the task's vocabulary (padded to a multiple of 8 and of TP).

    Raises:
        ConfigError: the longest prompt plus ``max_new_tokens`` does not fit ``policy.model.max_sequence_length``.
    """
    m, tp = config.policy.model, int(config.policy.layout.tensor_parallel)
    longest = max(len(task.prompt_ids(p)) for p in task.prompts(int(config.seed), 0, 64))
    needed = longest + int(task.max_new_tokens)
    if needed > m.max_sequence_length:
        raise ConfigError(
            "policy.model.max_sequence_length",
            f"must fit the task's prompts plus max_new_tokens ({longest} + {task.max_new_tokens} = {needed}): "
            f"got {m.max_sequence_length}",
        )
    multiple = math.lcm(_VOCAB_MULTIPLE, tp)
    return TinyGPTConfig(
        vocab_size=task.tokenizer.padded_vocab_size(multiple),
        hidden_size=int(m.hidden_size),
        num_layers=int(m.num_layers),
        num_attention_heads=int(m.num_attention_heads),
        max_sequence_length=int(m.max_sequence_length),
    )


def policy_config(config: DictConfig, model: TinyGPTConfig) -> PolicyConfig:
    """The policy's layout, packing and optimizer settings."""
    p = config.policy
    tokens = int(p.micro_batch_tokens)
    return PolicyConfig(
        sharding=NamedSharding({
            "data_parallel": int(p.layout.data_parallel),
            "tensor_parallel": int(p.layout.tensor_parallel),
            "pipeline_parallel": int(p.layout.pipeline_parallel),
        }),
        model=model,
        seed=int(config.seed),
        packing=PackingSpec(max_tokens_per_microbatch=tokens) if tokens else None,
        learning_rate=float(p.learning_rate),
        train_global_batch_size=None if p.train_global_batch_size is None else int(p.train_global_batch_size),
        num_cpus_per_worker=float(p.num_cpus_per_worker),
        timeout_s=float(p.timeout_s),
    )


def loss_fn(config: DictConfig) -> GRPOLoss:
    """The GRPO loss of the config (with the sample mask, so filtered rows do not count)."""
    loss = config.grpo.loss
    return GRPOLoss(
        clip_low=float(loss.clip_low), clip_high=float(loss.clip_high), kl_coef=float(loss.kl_coef), sample_mask=True
    )


@attrs.frozen
class MeteredFactory:
    """A picklable client factory: ``inner()`` wrapped in a :class:`MeteredClient` (so workers report store I/O)."""

    inner: Callable[[], DataPlaneClient]
    verify_integrity: bool = False

    def __call__(self) -> MeteredClient:
        return MeteredClient(self.inner(), verify_integrity=self.verify_integrity)


def carry_bytes(carry: RolloutCarry) -> int:
    """The carry's size as it crosses to the driver: its pickled bytes (Ray pickles it so)."""
    return len(pickle.dumps(carry, protocol=pickle.HIGHEST_PROTOCOL))


# ---------------------------------------------------------------- one step's rows, per transport


class _StepRows:
    """The rows of the step being built: the carry, plus the meta (data plane) or the batch (legacy)."""

    def __init__(self) -> None:
        self.carry: RolloutCarry | None = None
        self.meta: KVBatchMeta | None = None
        self.batch: TensorDict | None = None

    def require_carry(self) -> RolloutCarry:
        if self.carry is None:
            raise RuntimeError("the step has no rows yet")
        return self.carry

    def add(self, result: RolloutResult, rows: Sequence[int]) -> None:
        carry = result.carry.subset(rows)
        self.carry = carry if self.carry is None else self.carry.concat(carry)
        if result.meta is not None:
            meta = result.meta.subset(rows)
            self.meta = meta if self.meta is None else self.meta.concat(meta)
        if result.batch is not None:
            batch = _take_rows(result.batch, rows)
            self.batch = batch if self.batch is None else _cat_batches(self.batch, batch)


def _take_rows(batch: TensorDict, rows: Sequence[int]) -> TensorDict:
    index = torch.tensor(list(rows), dtype=torch.long)
    return build_tensordict({k: v[index] for k, v in batch.items()}, len(rows))


def _cat_batches(a: TensorDict, b: TensorDict) -> TensorDict:
    """Rows of ``a`` then ``b``; per-token fields are right-padded with 0 to the wider of the two."""
    out: dict[str, torch.Tensor] = {}
    for name in a.keys():
        x, y = a[name], b[name]
        if x.dim() >= 2 and x.shape[1] != y.shape[1]:
            width = max(x.shape[1], y.shape[1])
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
            y = torch.nn.functional.pad(y, (0, width - y.shape[1]))
        out[name] = torch.cat([x, y])
    return build_tensordict(out, len(a) + len(b))


# ---------------------------------------------------------------- the trainer


class StepError(RuntimeError):
    """A GRPO step failed; ``step`` is its index. The cause is chained."""

    def __init__(self, step: int, message: str) -> None:
        self.step = step
        super().__init__(f"step {step}: {message}")


class GRPOTrainer:
    """GRPO on Ray: a rollout engine, megatron policy workers, and (by default) a store for the bulk rows.

    Args:
        config: a checked run config (:func:`shell.run_config.load_run_config`).
        client: a store client to use instead of starting one (library use; the
            caller owns it); needs ``client_factory`` too.
        client_factory: how workers open their store client (with ``client``).

    Call :meth:`start`, then :meth:`step` for each step, and :meth:`close`
    (also on errors). ``with GRPOTrainer(config) as trainer:`` does both ends.

    Raises:
        ConfigError: the task or model cannot be built from ``config``.
    """

    def __init__(
        self,
        config: DictConfig,
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
        self.data_plane = bool(config.data_plane.enabled)
        self.partition = str(config.data_plane.partition)
        self._given_client = client
        self._given_factory = client_factory
        self._owns_ray = False
        self._store: Any = None  # the store we started (closed by us)
        self.client: MeteredClient | None = None
        self.policy: Policy | DataPlanePolicy | None = None
        self.rollout: WorkerGroup | None = None
        self._open_meta: KVBatchMeta | None = None  # keys written in the current step (cleared on failure)
        self.timer = PhaseTimer()
        self.run_id = uuid.uuid4().hex[:8]  # prefixes the store keys: runs sharing a partition never collide

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> GRPOTrainer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, on_status: Callable[[str], None] | None = None) -> None:
        """Start (or join) Ray, the store, the policy workers and the rollout engine.

        Raises:
            WorkerError: a worker failed to start.
        """
        say = on_status or (lambda _message: None)
        if not ray.is_initialized():
            address = self.config.ray.address
            path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
            say(f"starting Ray ({'embedded' if address is None else address})")
            if address is None:
                ray.init(
                    num_cpus=int(self.config.ray.num_cpus),
                    include_dashboard=False,
                    runtime_env={"env_vars": {"PYTHONPATH": path}},
                    log_to_driver=False,
                )
            else:
                ray.init(address=str(address), runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
            self._owns_ray = True
        factory = None
        if self.data_plane:
            say(f"starting the store ({self.config.data_plane.backend.value})")
            inner, inner_factory = self._open_store()
            verify = bool(self.config.data_plane.verify_integrity)
            self.client = MeteredClient(inner, verify_integrity=verify)
            factory = MeteredFactory(inner_factory, verify)
        say(f"starting {self.policy_config.sharding.world_size} policy workers and the rollout engine")
        group = build_group(self.policy_config)
        if self.data_plane:
            self.policy = DataPlanePolicy(
                self.policy_config,
                self.client,  # type: ignore[arg-type]
                group=group,
                client_factory=factory,
                fetch_policy=self.config.policy.fetch_policy.value,
            )
        else:
            self.policy = Policy(self.policy_config, group=group)
        self.rollout = WorkerGroup(
            RolloutWorker,
            NamedSharding({"data_parallel": 1}),
            init_args=(
                RolloutConfig(self.model, int(self.config.seed), self.task, float(self.config.grpo.temperature)),
                factory,
            ),
            backend="gloo",
            num_cpus_per_worker=float(self.config.policy.num_cpus_per_worker),
            timeout_s=float(self.config.policy.timeout_s),
            name_prefix=f"rollout-{os.getpid()}",
        )
        self.rollout.run_all("setup")

    def _open_store(self) -> tuple[DataPlaneClient, Callable[[], DataPlaneClient]]:
        if self._given_client is not None:
            return self._given_client, self._given_factory  # type: ignore[return-value]
        if self.config.data_plane.backend == StoreBackend.memory:
            from adapters.ray_memory import RayMemoryStore

            store = RayMemoryStore.start()
            self._store = store
            return store, functools.partial(RayMemoryStore.attach, store.name)
        from adapters.transfer_queue import TransferQueueStore, is_running

        if is_running():  # a cluster that already runs TransferQueue: join it, leave it running
            store = TransferQueueStore.attach()
        else:
            store = TransferQueueStore.start()
        self._store = store
        return store, TransferQueueStore.attach

    def close(self) -> None:
        """Clear the open step's keys, stop every actor, close the store and an embedded Ray. Idempotent, best effort."""
        errors: list[BaseException] = []
        for action in (self._abort_step, self._stop_rollout, self._stop_policy, self._close_store):
            try:
                action()
            except Exception as error:  # keep shutting down; report the first problem afterwards
                errors.append(error)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
        if errors:
            raise errors[0]

    def _abort_step(self) -> None:
        meta, self._open_meta = self._open_meta, None
        if meta is None or self.client is None:
            return
        stored = set(self.client.list_keys(meta.partition_id))
        keys = [k for k in meta.keys if k in stored]
        if keys:
            self.client.clear(keys, meta.partition_id)

    def _stop_rollout(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()

    def _stop_policy(self) -> None:
        if self.policy is not None:
            self.policy.shutdown()

    def _close_store(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    # ------------------------------------------------------------ weights

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (on the driver: for checkpoints only)."""
        return self._policy.group.run_all("state_dict")[0]

    def load_policy_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights into every policy rank and the rollout engine (``--resume``)."""
        ref = ray.put(dict(state))
        self._policy.group.run_all("load_state_dict", ref)
        self._rollout.run_all("load_weights", ref)

    @property
    def _policy(self) -> Policy | DataPlanePolicy:
        if self.policy is None:
            raise RuntimeError("the trainer is not started: call trainer.start() first")
        return self.policy

    @property
    def _rollout(self) -> WorkerGroup:
        if self.rollout is None:
            raise RuntimeError("the trainer is not started: call trainer.start() first")
        return self.rollout

    # ------------------------------------------------------------ the step

    def step(self, step: int) -> dict[str, Any]:
        """Run GRPO step ``step``; return its metrics record.

        Raises:
            StepError: DAPO found too few varying groups (the step's keys are cleared).
            WorkerError: a worker or the rollout engine failed (the step's keys are cleared).
        """
        try:
            return self._step(step)
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to report
                self._abort_step()
            raise

    def _step(self, step: int) -> dict[str, Any]:
        self.timer.reset()
        start = time.perf_counter()
        driver_bytes = 0
        rows, all_rewards, batches = self._generate(step)
        result0 = batches[0]
        carry = rows.require_carry()
        g = self.config.grpo
        with self.timer.phase("advantages"):
            plan = plan_advantages(
                carry,
                leave_one_out=bool(g.leave_one_out),
                normalize_by_std=bool(g.normalize_by_std),
                overlong_filter=bool(g.overlong_filter),
            )
        # What the rollout handed the driver: every batch's carry, and on the legacy path its bulk rows.
        driver_bytes += sum(carry_bytes(b.carry) + tensor_bytes(b.batch) for b in batches)
        if self.data_plane:
            train_result, moved = self._data_plane_step(rows, plan)
        else:
            train_result, moved = self._legacy_step(rows, plan)
        driver_bytes += moved
        with self.timer.phase("refit"):
            self._policy.group.run_all("push_weights", self._rollout.actors[0])
        outstanding = 0
        io = {"ms": 0.0, "bytes": 0.0}
        with self.timer.phase("finish"):
            policy = self._policy
            if isinstance(policy, DataPlanePolicy) and rows.meta is not None and self.client is not None:
                policy.finish_step(rows.meta)
                self._open_meta = None
                outstanding = len(self.client.list_keys(self.partition))
                delta = self.client.step_delta()
                workers = policy.drain_worker_io()
                io = {
                    "ms": delta.total_ms + workers["ms"] + sum(b.data_plane["ms"] for b in batches),
                    "bytes": delta.total_bytes + workers["bytes"] + sum(b.data_plane["bytes"] for b in batches),
                }
        phases = self.timer.durations()
        metrics = [m for rank in train_result.micro_batch_metrics for per_step in rank for m in per_step]
        kl = [m["kl"] for m in metrics if "kl" in m]
        record: dict[str, Any] = {
            "step": step,
            "reward_mean": sum(all_rewards) / len(all_rewards),
            "reward_mean_trained": sum(carry.rewards) / carry.size,
            "loss": sum(train_result.loss) / len(train_result.loss),
            "kl": sum(kl) / len(kl) if kl else 0.0,
            "grad_norm": sum(train_result.grad_norm) / len(train_result.grad_norm),
            "optimizer_steps": len(train_result.loss),
            "step_time_s": time.perf_counter() - start,
            **{f"phase_{name}_s": value for name, value in phases.items()},
            "data_plane_ms": io["ms"],
            "data_plane_bytes": int(io["bytes"]),
            "driver_bytes": int(driver_bytes),
            "store_keys_outstanding": outstanding,
            "rows": carry.size,
            "generation_batches": len(batches),
            "truncated_frac": sum(carry.truncated) / carry.size,
            "sequence_tokens_mean": sum(carry.lengths) / carry.size,
            "samples": [
                {"prompt_id": int(pid), "response": text, "reward": float(r)}
                for pid, text, r in zip(result0.carry.prompt_ids, result0.responses, result0.carry.rewards)
            ][: int(self.config.run.samples_to_log)],
        }
        return record

    def _generate(self, step: int) -> tuple[_StepRows, list[float], list[RolloutResult]]:
        """Generation batches until the step has its groups (one batch unless DAPO drops some)."""
        g = self.config.grpo
        target = int(g.num_prompts_per_step)
        dapo = bool(g.dapo.enabled)
        limit = int(g.dapo.max_generation_batches) if dapo else 1
        rows = _StepRows()
        all_rewards: list[float] = []
        batches: list[RolloutResult] = []
        kept_groups = 0
        for batch_index in range(limit):
            prompts = self.task.prompts(int(self.config.seed), step * limit + batch_index, target)
            with self.timer.phase("rollout"):
                (result,) = self._rollout.run_all(
                    "generate",
                    prompts,
                    step=step,
                    batch_index=batch_index,
                    num_generations=int(g.num_generations_per_prompt),
                    partition_id=self.partition if self.data_plane else None,
                    num_texts=int(self.config.run.samples_to_log),
                    key_prefix=self.run_id + "-",
                )
            batches.append(result)
            if result.meta is not None:
                written = result.meta if self._open_meta is None else self._open_meta.concat(result.meta)
                self._open_meta = written
            all_rewards.extend(result.carry.rewards)
            if not dapo:
                rows.add(result, range(result.carry.size))
                return rows, all_rewards, batches
            with self.timer.phase("dapo"):
                keep = dapo_selection(result.carry, max_groups=target - kept_groups)
                kept = set(keep)
                dropped = [i for i in range(result.carry.size) if i not in kept]
                if result.meta is not None and dropped:
                    self.client.clear([result.meta.keys[i] for i in dropped], self.partition)  # type: ignore[union-attr]
                if keep:
                    rows.add(result, keep)
                    kept_groups += group_count(result.carry.subset(keep))
            if kept_groups >= target:
                return rows, all_rewards, batches
        raise StepError(
            step,
            f"DAPO dynamic sampling kept {kept_groups} of {target} groups after {limit} generation batches "
            f"(every other group's rewards were all equal); raise grpo.dapo.max_generation_batches "
            f"(now {limit}) or disable grpo.dapo.enabled",
        )

    def _data_plane_step(self, rows: _StepRows, plan: AdvantagePlan) -> tuple[TrainResult, int]:
        policy = self._policy
        if not isinstance(policy, DataPlanePolicy) or rows.meta is None:
            raise RuntimeError("a data-plane step needs a DataPlanePolicy and the rollout's receipt")
        meta = policy.prepare_step(
            rows.meta.stamp_tags({"baseline": plan.baseline, "std": plan.std, "reward": rows.require_carry().rewards})
        )
        self._open_meta = meta
        with self.timer.phase("logprobs"):
            if self.loss.kl_coef > 0:  # one fetch and one write-back for both
                policy.get_logprobs_and_reference(meta)
            else:
                policy.get_logprobs(meta)
        advantages = torch.tensor(plan.advantages, dtype=torch.float32)
        sample_mask = torch.tensor(plan.sample_mask, dtype=torch.float32)
        with self.timer.phase("write"):
            policy.write(meta, {ADVANTAGES: advantages, SAMPLE_MASK: sample_mask}, token_fields=())
        with self.timer.phase("train"):
            result = policy.train(meta, self.loss)
        return result, tensor_bytes(advantages) + tensor_bytes(sample_mask)

    def _legacy_step(self, rows: _StepRows, plan: AdvantagePlan) -> tuple[TrainResult, int]:
        policy = self._policy
        if not isinstance(policy, Policy) or rows.batch is None:
            raise RuntimeError("a legacy step needs a Policy and the rollout's batch")
        batch = rows.batch
        with self.timer.phase("logprobs"):
            if self.loss.kl_coef > 0:
                both = policy.get_logprobs_and_reference(batch)
                batch.set(PREV_LOGPROBS, both[PREV_LOGPROBS])
                batch.set(REFERENCE_LOGPROBS, both[REFERENCE_LOGPROBS])
            else:
                batch.set(PREV_LOGPROBS, policy.get_logprobs(batch)[PREV_LOGPROBS])
        with self.timer.phase("write"):
            batch.set(ADVANTAGES, torch.tensor(plan.advantages, dtype=torch.float32))
            batch.set(SAMPLE_MASK, torch.tensor(plan.sample_mask, dtype=torch.float32))
        with self.timer.phase("train"):
            result = policy.train(batch, self.loss)
        return result, policy.drain_driver_bytes()

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, run_dir: Path, step: int) -> Path:
        """Write the policy's weights and the last finished step to ``run_dir/checkpoint.pt`` (atomically)."""
        path = Path(run_dir) / CHECKPOINT_FILE
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"step": step, "weights": self.policy_state(), "config": OmegaConf.to_yaml(self.config)}, tmp
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
