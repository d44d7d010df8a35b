"""Where a GRPO step's rows come from: generated on demand (synchronous) or sampled from a replay buffer (async).

The step itself is one script (:meth:`shell.grpo_trainer.GRPOTrainer.step`);
a *step source* hands it the rows to train on and takes the new weights back:

* :class:`RolloutSource` (synchronous): the rollout engine generates the
  step's batch now (more than one with DAPO dynamic sampling), with the weights
  of the previous step;
* :class:`CollectorSource` (``grpo.async.enabled``): a
  :class:`shell.collector.RolloutCollector` generates ahead into the store and
  a :class:`shell.replay_buffer.ReplayBuffer` holds the receipts; the step
  samples whole prompt groups no more than ``max_staleness`` versions old.

Both return a :class:`StepInput`; the step then plans advantages, computes
log-probs, writes the per-row columns (the source's own ones too: the async
``version_lag``), trains, and hands the new weights to ``source.refit``.

Invariant: the step's version is ``step - 1`` (the weights after ``step - 1``
GRPO steps); every row a source returns was sampled with version
``>= step - 1 - max_staleness`` (0 for the synchronous source), and its keys
belong to the step's transport from then on (``transport.admit``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import ray
import torch

from core.fields import VERSION_LAG, WEIGHT_VERSION
from core.replay import GroupReceipt, version_lag
from core.rollout_carry import RolloutCarry, dapo_selection, group_count
from core.task import Task
from core.topology import NamedSharding
from shell.collector import CollectorPlan, RolloutCollector
from shell.metering import OPS
from shell.node_placement import rank_options
from shell.phases import PhaseTimer
from shell.policy import Policy
from shell.replay_buffer import ReplayBufferClient
from shell.rollout import RolloutConfig, RolloutResult, RolloutWorker
from shell.run_config import RunConfig
from shell.step_rows import StepRows
from shell.transport import Transport
from shell.worker_errors import WorkerError, WorkerTimeoutError, component_error
from shell.worker_group import WorkerGroup

_POLL_S = (0.002, 0.05)  # first and longest pause while the trainer waits for the buffer
_PING_S = 5.0  # how long a failed weight push waits for the engine to answer, to tell whether it died


class NotEnoughGroups(RuntimeError):
    """DAPO kept too few groups after its generation batches (the step's rows are released)."""


@attrs.frozen
class StepInput:
    """The rows a step trains on and what the record reports about them.

    Attributes:
        rows: the rows (meta; on the legacy path the bulk batch too).
        carry: their per-row carry (group ids unique within the step).
        entropy: per row, summed sampling entropy (nats).
        response_tokens: per row, generated tokens (EOS included).
        generated_rewards: the rewards of every row generated for the step (DAPO's dropped ones too).
        columns: per-row columns the step writes beside the advantages (``version_lag`` in async).
        samples: decoded responses for ``samples.jsonl``.
        generation_batches: generation batches the step's rows came from.
        carry_bytes: pickled bytes of the carries that crossed to the driver.
        metrics: the source's own per-step metrics.
    """

    rows: StepRows
    carry: RolloutCarry
    entropy: tuple[float, ...]
    response_tokens: tuple[int, ...]
    generated_rewards: tuple[float, ...]
    columns: Mapping[str, torch.Tensor]
    samples: tuple[Mapping[str, Any], ...]
    generation_batches: int
    carry_bytes: int
    metrics: Mapping[str, float]


class StepSource(Protocol):
    """Hands a step its rows and takes the new weights back (see the module docstring)."""

    def refit(self, policy: Policy) -> None:
        """Send the policy's new weights to the generator (rank 0 to the engine's ``load_weights``, not via the driver)."""
        ...

    def next_input(self, step: int, transport: Transport, timer: PhaseTimer) -> StepInput:
        """The rows of GRPO step ``step`` (admitted to ``transport``)."""
        ...

    def load_weights(self, state_ref: Any) -> None:
        """Load full weights now (``--resume``; before the first step)."""
        ...

    def process_ids(self) -> dict[str, int]:
        """The OS pids of the source's actors, by role."""
        ...

    def node_ids(self) -> dict[str, str]:
        """The Ray node ids of the source's actors, by role (where ``ray.placement`` put them)."""
        ...

    def resident_mib(self) -> dict[str, float | None]:
        """The resident memory of the source's actors in MiB, by role (each reads its own, on its node; None for
        one that did not answer)."""
        ...

    def close(self) -> None:
        """Stop the source's actors, releasing every key they hold. Idempotent, best effort."""
        ...


def _carry_bytes(carry: RolloutCarry) -> int:
    return len(pickle.dumps(carry, protocol=pickle.HIGHEST_PROTOCOL))


def _samples(prompt_ids: Sequence[int], texts: Sequence[str], rewards: Sequence[float], limit: int) -> tuple[dict[str, Any], ...]:
    return tuple(
        {"prompt_id": int(pid), "response": text, "reward": float(r)} for pid, text, r in zip(prompt_ids, texts, rewards)
    )[:limit]


def _rollout_group(config: RunConfig, worker: type[RolloutWorker], rollout_config: RolloutConfig, client_factory: Any,
                   name: str, max_concurrency: int = 1, *, role: str = "") -> WorkerGroup:
    group = WorkerGroup(
        worker,
        NamedSharding({"data_parallel": 1}),
        init_args=(rollout_config, client_factory),
        backend="gloo",
        num_cpus_per_worker=config.policy.num_cpus_per_worker,
        timeout_s=config.policy.timeout_s,
        name_prefix=f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}",  # unique: trainers may share a process
        max_concurrency=max_concurrency,
        role=role,
        rank_options=rank_options(config.ray.placement, config.ray.worker_resource, 1),
    )
    try:
        group.call(worker.setup)
    except BaseException:
        group.shutdown()
        raise
    return group


# ---------------------------------------------------------------- synchronous: generate on demand


class RolloutSource:
    """The synchronous source: the rollout engine generates the step's rows when the step asks.

    Args:
        config: the run's config.
        rollout_config: the engine's settings.
        client_factory: the engine's store client (None on the legacy path).
        key_prefix: before every key.
    """

    def __init__(self, config: RunConfig, rollout_config: RolloutConfig, client_factory: Any, *, key_prefix: str) -> None:
        self.config = config
        self.key_prefix = key_prefix
        self.group = _rollout_group(
            config, RolloutWorker, rollout_config, client_factory, "rollout", role="rollout engine"
        )
        self._last: float | None = None  # when the previous step's rows were handed over

    def refit(self, policy: Policy) -> None:
        """Policy rank 0 pushes the weights to the engine; if the engine died, the error names the engine.

        Raises:
            WorkerError: the rollout engine is dead (named so), or a policy rank failed.
        """
        try:
            policy.push_weights(self.group.actors[0])
        except WorkerError as error:
            if self._engine_dead():
                raise _named(
                    "the rollout engine", "load_weights", "its actor is dead (policy rank 0 could not push the weights to it)"
                ) from error
            raise

    def load_weights(self, state_ref: Any) -> None:
        self._call_engine(RolloutWorker.load_weights, state_ref)

    def process_ids(self) -> dict[str, int]:
        from shell.worker import Worker

        return {"rollout": self._call_engine(Worker.process_id)}

    def resident_mib(self) -> dict[str, float | None]:
        from shell.worker import Worker

        return {"rollout": self._call_engine(Worker.resident_mib)}

    def _call_engine(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the engine; a failure is a :class:`WorkerError` naming the rollout engine."""
        try:
            return self.group.call(method, *args, **kwargs)[0]
        except WorkerError as error:
            raise _named("the rollout engine", method.__name__, str(error)) from error

    def _write_landed(self) -> Callable[[], Mapping[str, float]]:
        """A wait for the engine's write behind, asked for now (the engine answers once the write is stored);
        its failure is a :class:`WorkerError` naming the rollout engine."""
        refs = self.group.submit(RolloutWorker.wait_write)

        def landed() -> Mapping[str, float]:
            try:
                return self.group.collect(refs, RolloutWorker.wait_write)[0]
            except WorkerError as error:
                raise _named("the rollout engine", "wait_write", str(error)) from error

        return landed

    def _engine_dead(self) -> bool:
        """Whether the engine fails a ping (a ``Worker.process_id`` call) within ``_PING_S``; busy is not dead."""
        from shell.worker import Worker

        try:
            self.group.collect(self.group.submit(Worker.process_id), Worker.process_id, timeout_s=_PING_S)
        except WorkerTimeoutError:
            return False
        except WorkerError:
            return True
        return False

    def node_ids(self) -> dict[str, str]:
        from shell.worker import Worker

        return {"rollout": self.group.call(Worker.node_id)[0]}

    def close(self) -> None:
        self.group.shutdown()

    def next_input(self, step: int, transport: Transport, timer: PhaseTimer) -> StepInput:
        """Generate until the step has its groups (one batch unless DAPO drops some).

        Raises:
            NotEnoughGroups: DAPO kept too few groups within ``grpo.dapo.max_generation_batches``.
            WorkerError: the engine failed.
        """
        g = self.config.grpo
        target = g.num_prompts_per_step
        dapo = g.dapo.enabled
        limit = g.dapo.max_generation_batches if dapo else 1
        rows: StepRows | None = None
        carry: RolloutCarry | None = None
        batches: list[RolloutResult] = []
        kept: list[tuple[RolloutResult, Sequence[int]]] = []
        kept_groups = 0
        wait = 0.0
        if self._last is None:
            self._last = time.perf_counter()
        for batch_index in range(limit):
            prompts = self.config.task.instance.prompts(self.config.seed, step * limit + batch_index, target)
            started = time.perf_counter()
            write_behind = transport.partition_id is not None
            with timer.phase("rollout"):
                result = self._call_engine(
                    RolloutWorker.generate,
                    prompts,
                    step=step,
                    batch_index=batch_index,
                    num_generations=g.num_generations_per_prompt,
                    partition_id=transport.partition_id,
                    num_texts=self.config.run.samples_to_log,
                    key_prefix=self.key_prefix,
                    write_behind=write_behind,
                )
            wait += time.perf_counter() - started
            batches.append(result)
            # The engine writes the batch while the driver plans the step; the transport waits for it first.
            transport.admit(result.rows, result.store_io, landed=self._write_landed() if write_behind else None)
            keep: Sequence[int] = range(result.carry.size)
            if dapo:
                with timer.phase("dapo"):
                    keep = dapo_selection(result.carry, max_groups=target - kept_groups)
                    chosen = set(keep)
                    dropped = [i for i in range(result.carry.size) if i not in chosen]
                    if dropped:
                        transport.discard(result.rows.subset(dropped))
            if keep:
                kept.append((result, keep))
                new_rows, new_carry = result.rows.subset(keep), result.carry.subset(keep)
                rows = new_rows if rows is None else rows.concat(new_rows)
                carry = new_carry if carry is None else carry.concat(new_carry)
                kept_groups += group_count(new_carry)
            if rows is not None and carry is not None and (not dapo or kept_groups >= target):
                return self._input(rows, carry, batches, kept, wait)
        raise NotEnoughGroups(
            f"DAPO dynamic sampling kept {kept_groups} of {target} groups after {limit} generation batches "
            f"(every other group's rewards were all equal); raise grpo.dapo.max_generation_batches "
            f"(now {limit}) or disable grpo.dapo.enabled"
        )

    def _input(self, rows: StepRows, carry: RolloutCarry, batches: Sequence[RolloutResult],
               kept: Sequence[tuple[RolloutResult, Sequence[int]]], wait: float) -> StepInput:
        now = time.perf_counter()
        interval, self._last = now - (self._last or now), now
        generated = sum(n for b in batches for n in b.response_tokens)
        first = batches[0]
        return StepInput(
            rows=rows,
            carry=carry,
            entropy=tuple(b.entropy[i] for b, keep in kept for i in keep),
            response_tokens=tuple(b.response_tokens[i] for b, keep in kept for i in keep),
            generated_rewards=tuple(r for b in batches for r in b.carry.rewards),
            columns={},
            samples=_samples(first.carry.prompt_ids, first.responses, first.carry.rewards, self.config.run.samples_to_log),
            generation_batches=len(batches),
            carry_bytes=sum(_carry_bytes(b.carry) for b in batches),
            metrics={
                "version_lag_mean": 0.0,
                "version_lag_max": 0,
                "buffer_groups": 0,
                "groups_evicted": 0,
                "trainer_wait_s": wait,
                "collector_wait_s": 0.0,
                "generated_tokens_per_s": generated / interval if interval > 0 else 0.0,
            },
        )


# ---------------------------------------------------------------- async: a collector runs ahead


class CollectorSource:
    """The async source: a collector generates ahead into the store; the step samples the replay buffer.

    Args:
        config: the run's config (``grpo.async_`` enabled).
        rollout_config: the collector's engine settings.
        client_factory: the collector's and the buffer's store clients.
        partition_id: the store partition.
        key_prefix: before every key.
    """

    def __init__(self, config: RunConfig, rollout_config: RolloutConfig, client_factory: Any, *, partition_id: str,
                 key_prefix: str) -> None:
        self.config = config
        self.settings = config.grpo.async_
        self.partition_id = partition_id
        self.key_prefix = key_prefix
        self.buffer: ReplayBufferClient | None = None
        self.group: WorkerGroup | None = None
        self._loop: Any = None  # the collector's run() ref, once started
        self._last = 0.0  # when the previous step's rows were handed over (the loop's start, first)
        self._collector_stats: dict[str, float] = {}
        self.buffer = ReplayBufferClient.start(self.settings.buffer_groups, client_factory, partition_id)
        try:
            self.group = _rollout_group(
                config, RolloutCollector, rollout_config, client_factory, "collector", max_concurrency=4,
                role="rollout collector",
            )
        except BaseException:
            self.close()  # the buffer started: nothing else holds this source to stop it
            raise

    def refit(self, policy: Policy) -> None:
        """Rank 0 pushes the weights to the collector (staged there: the next version)."""
        try:
            policy.push_weights(self._group.actors[0])
        except WorkerError:
            self._check_collector()  # a dead collector is the cause: name it
            raise

    @property
    def _group(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("the collector is closed")
        return self.group

    @property
    def _buffer(self) -> ReplayBufferClient:
        if self.buffer is None:
            raise RuntimeError("the replay buffer is closed")
        return self.buffer

    def load_weights(self, state_ref: Any) -> None:
        if self._loop is not None:
            raise RuntimeError("load weights before the first step: the collector is already running")
        self._call_collector(RolloutCollector.set_weights, state_ref)

    def process_ids(self) -> dict[str, int]:
        from shell.worker import Worker

        out = {"collector": self._call_collector(Worker.process_id)}
        pid = self.buffer.process_id() if self.buffer is not None else None
        return out if pid is None else {**out, "replay_buffer": pid}

    def resident_mib(self) -> dict[str, float | None]:
        from shell.worker import Worker

        out = {"collector": self._call_collector(Worker.resident_mib)}
        return out if self.buffer is None else {**out, "replay_buffer": self.buffer.resident_mib()}

    def node_ids(self) -> dict[str, str]:
        from shell.worker import Worker

        out = {"collector": self._call_collector(Worker.node_id)}
        return out if self.buffer is None else {**out, "replay_buffer": self.buffer.node_id()}

    def _start(self, step: int) -> None:
        g = self.config.grpo
        plan = CollectorPlan(
            first_seq=step,
            num_prompts=g.num_prompts_per_step,
            num_generations=g.num_generations_per_prompt,
            max_staleness=self.settings.max_staleness,
            partition_id=self.partition_id,
            key_prefix=self.key_prefix,
            num_texts=self.config.run.samples_to_log,
        )
        (self._loop,) = self._group.submit(RolloutCollector.run, plan, self.buffer)
        self._last = time.perf_counter()

    def _call_collector(self, method: Any, *args: Any) -> Any:
        """``method`` on the collector; a failure is a :class:`WorkerError` naming the collector."""
        try:
            return self._group.call(method, *args)[0]
        except WorkerError as error:
            raise _named("the rollout collector", method.__name__, str(error)) from error

    def _check_collector(self) -> None:
        """Raise a :class:`WorkerError` naming the collector if its loop ended (before ``close`` it only ends by failing)."""
        if self._loop is None:
            return
        ready, _ = ray.wait([self._loop], timeout=0)
        if not ready:
            return
        try:
            self._group.collect([self._loop], RolloutCollector.run, timeout_s=1.0)
        except WorkerError as error:
            raise _named("the rollout collector", "run", str(error)) from error
        raise _named("the rollout collector", "run", "its loop ended before the run did")

    def next_input(self, step: int, transport: Transport, timer: PhaseTimer) -> StepInput:
        """Sample ``num_prompts_per_step`` whole groups of version ``>= step - 1 - max_staleness``, waiting if needed.

        Raises:
            WorkerError: the collector (or the buffer) failed, or no data came within ``policy.timeout_s``.
        """
        if self._loop is None:
            self._start(step)
        buffer = self._buffer
        g = self.config.grpo
        version = step - 1
        started = time.perf_counter()
        pause = _POLL_S[0]
        with timer.phase("wait"):
            while True:
                try:
                    report = buffer.sample(g.num_prompts_per_step, version, self.settings.max_staleness)
                except ray.exceptions.RayActorError as error:
                    raise _named("the replay buffer", "sample", f"its actor died: {error}") from error
                if report.groups:
                    break
                self._check_collector()
                if time.perf_counter() - started > self.config.policy.timeout_s:
                    raise _named(
                        "the replay buffer", "sample",
                        f"had fewer than {g.num_prompts_per_step} eligible groups for "
                        f"{self.config.policy.timeout_s:g} s (policy.timeout_s)",
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_S[1])
        wait = time.perf_counter() - started
        groups = report.groups
        rows, carry = _step_rows(groups)
        try:
            stats = self._call_collector(RolloutCollector.stats)
        except BaseException:  # the sampled keys left the buffer: the step owns them, so its abort clears them
            transport.admit(rows, {})
            raise
        previous, self._collector_stats = self._collector_stats, stats
        delta = {k: v - previous.get(k, 0.0) for k, v in stats.items()}
        transport.admit(rows, {
            "ms": delta["store_ms"], "bytes": delta["store_bytes"], **{f"{op}_ms": delta[f"store_{op}_ms"] for op in OPS}
        })
        lags = [version_lag(version, int(v)) for v in rows.meta.tag_column(WEIGHT_VERSION)]
        now = time.perf_counter()
        interval, self._last = now - self._last, now
        texts = [(r.carry.prompt_ids[i], text, r.carry.rewards[i]) for r in groups for i, text in enumerate(r.responses)]
        return StepInput(
            rows=rows,
            carry=carry,
            entropy=tuple(h for r in groups for h in r.entropy),
            response_tokens=tuple(n for r in groups for n in r.response_tokens),
            generated_rewards=carry.rewards,
            columns={VERSION_LAG: torch.tensor(lags, dtype=torch.float32)},
            samples=_samples([t[0] for t in texts], [t[1] for t in texts], [t[2] for t in texts], self.config.run.samples_to_log),
            generation_batches=len({r.batch_seq for r in groups}),
            carry_bytes=sum(_carry_bytes(r.carry) for r in groups),
            metrics={
                "version_lag_mean": sum(lags) / len(lags),
                "version_lag_max": max(lags),
                "buffer_groups": report.buffered_groups,
                "groups_evicted": report.evicted_groups,
                "trainer_wait_s": wait,
                "collector_wait_s": delta["wait_s"],
                "generated_tokens_per_s": delta["generated_tokens"] / interval if interval > 0 else 0.0,
            },
        )

    def close(self) -> None:
        """Stop the loop (it clears its keys in flight), drain the buffer (clearing its keys), stop both actors.

        Best effort and silent: a collector or buffer that already died (the
        run's failure was reported then) cannot clear its keys, so the trainer
        sweeps every key of the run afterwards (:meth:`GRPOTrainer.close`).
        """
        group, self.group = self.group, None
        buffer, self.buffer = self.buffer, None
        if group is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    group.call(RolloutCollector.stop)
                    ray.wait([self._loop], timeout=self.config.policy.timeout_s)
            group.shutdown()
        if buffer is not None:
            with contextlib.suppress(Exception):
                buffer.drain(timeout_s=30.0)
            buffer.kill()
        self._loop = None


_named = component_error  # the engine's, the collector's and the buffer's failures name them


def _step_rows(groups: Sequence[GroupReceipt]) -> tuple[StepRows, RolloutCarry]:
    """The sampled groups as one step: metas concatenated, group ids renumbered 0..G-1 in order."""
    meta = groups[0].meta.concat(*(g.meta for g in groups[1:]))
    carries = [attrs.evolve(g.carry, group_ids=[index] * g.size) for index, g in enumerate(groups)]
    carry = carries[0].concat(*carries[1:])
    return StepRows(meta), carry


def build_source(config: RunConfig, task: Task, rollout_config: RolloutConfig, transport: Transport, *,
                 key_prefix: str) -> StepSource:
    """The run's step source: the collector and replay buffer with ``grpo.async.enabled``, else the rollout engine."""
    if config.grpo.async_.enabled:
        if transport.partition_id is None:
            raise ValueError("async GRPO moves rows through the store: 'transport' must be a data plane (got the legacy one)")
        return CollectorSource(config, rollout_config, transport.client_factory,
                               partition_id=transport.partition_id, key_prefix=key_prefix)
    return RolloutSource(config, rollout_config, transport.client_factory, key_prefix=key_prefix)
