"""The rollout collector: a rollout engine that loops on its own, running ahead of the trainer.

:class:`RolloutCollector` is the :class:`shell.rollout.RolloutWorker` (the same
``generate``, the same megatron engine) with a loop. Batch ``seq`` of the loop
is meant for trainer step ``seq``; for each:

1. **gate**: wait until the weights it holds (or has been pushed) are recent
   enough, :func:`core.replay.may_generate` (``max_staleness = k``: batch
   ``seq`` needs version ``>= seq - 1 - k``), then load the newest pushed
   weights (between batches, never during one);
2. **generate**: sample and score the batch, write it once to the store under
   ``f"{run}-v{version}_b{seq}_p{j}_g{i}"`` with a per-key ``weight_version``
   tag and the behaviour policy's ``generation_logprobs``;
3. **hand over**: offer one receipt per prompt group to the replay buffer;
   while the buffer is full, wait with backoff.

The policy's rank 0 pushes weights straight to :meth:`RolloutCollector.load_weights`
after each GRPO step (``PolicyWorker.push_weights``); each push is the next
version. The actor runs calls in several threads (``max_concurrency``), so a
push, ``stop`` or ``stats`` reaches it while the loop runs.

Invariants:
  * every batch is generated with weights at most ``max_staleness`` versions
    behind the trainer step it is meant for; ``max_staleness = 0`` generates
    batch ``seq`` with exactly version ``seq - 1``, as the synchronous trainer does;
  * a key is *in flight* from just before its write until the buffer accepted
    its receipt; when the loop ends (stop or error) it clears every key still
    in flight, so it never leaves rows that nobody holds a receipt for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from core.replay import GroupReceipt, may_generate
from core.task import Task
from shell.column_io import clear_stored
from shell.metering import OPS
from shell.replay_buffer import ReplayBufferClient
from shell.rollout import RolloutResult, RolloutWorker, row_keys
from shell.worker import on_all_ranks

_BACKOFF_S = (0.002, 0.1)  # first and longest sleep while the gate or the buffer makes the loop wait


@attrs.frozen
class CollectorPlan:
    """What the loop generates.

    Attributes:
        first_seq: the first batch's sequence number (the first trainer step it feeds).
        num_prompts: prompts per batch (one prompt group each).
        num_generations: responses per prompt.
        max_staleness: the version bound (see the module docstring).
        partition_id: the store partition.
        key_prefix: before every key (the run id, so runs sharing a partition never collide).
        num_texts: decoded responses kept per batch (for logging samples).
    """

    first_seq: int
    num_prompts: int
    num_generations: int
    max_staleness: int
    partition_id: str
    key_prefix: str = ""
    num_texts: int = 0


def batch_uids(key_prefix: str, version: int, seq: int, num_prompts: int) -> list[str]:
    """The key stems of batch ``seq`` sampled with weights ``version``: ``f"{prefix}v{version}_b{seq}_p{j}"``."""
    return [f"{key_prefix}v{version}_b{seq}_p{j}" for j in range(num_prompts)]


def group_receipts(result: RolloutResult, *, num_generations: int, weight_version: int, batch_seq: int) -> tuple[GroupReceipt, ...]:
    """One receipt per prompt group of a prompt-major batch (rows ``j * n .. j * n + n - 1``)."""
    receipts = []
    for start in range(0, result.carry.size, num_generations):
        rows = list(range(start, start + num_generations))
        receipts.append(GroupReceipt(
            meta=result.rows.meta.subset(rows),
            carry=result.carry.subset(rows),
            weight_version=weight_version,
            batch_seq=batch_seq,
            entropy=[result.entropy[r] for r in rows],
            response_tokens=[result.response_tokens[r] for r in rows],
            responses=result.responses[start : start + num_generations],
        ))
    return tuple(receipts)


class RolloutCollector(RolloutWorker):
    """The collector (see the module docstring); a one-rank group with ``max_concurrency >= 3``."""

    def __init__(self, config: Any, client_factory: Any = None) -> None:
        super().__init__(config, client_factory)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._version = 0  # of the weights in the engine
        self._pushed_version = 0  # of the newest weights received (staged or loaded)
        self._staged: Mapping[str, torch.Tensor] | None = None
        self._in_flight: dict[str, None] = {}
        self._stats = {"batches": 0, "generated_tokens": 0, "generate_s": 0.0, "wait_s": 0.0,
                       "store_ms": 0.0, "store_bytes": 0.0, **{f"store_{op}_ms": 0.0 for op in OPS}}

    # ------------------------------------------------------------ weights

    @on_all_ranks
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """A weight push (the next version): staged, and loaded by the loop between batches."""
        with self._cond:
            self._staged = state
            self._pushed_version += 1
            self._cond.notify_all()

    @on_all_ranks
    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load weights now, keeping the version (before the loop starts: ``--resume``)."""
        self.backend.load_state_dict(state)

    # ------------------------------------------------------------ the loop

    @on_all_ranks
    def run(self, plan: CollectorPlan, buffer: ReplayBufferClient) -> dict[str, float]:
        """Loop until :meth:`stop`: gate, generate, hand over (see the module docstring); the final stats.

        Raises:
            whatever generation, the store or the buffer raise (after clearing the keys in flight).
        """
        task: Task = self.config.task
        with self._cond:
            self._version = self._pushed_version = plan.first_seq - 1
        seq = plan.first_seq
        try:
            while not self._stop.is_set():
                version = self._wait_for_weights(seq, plan.max_staleness)
                if version is None:
                    break
                keys = [k for uid in batch_uids(plan.key_prefix, version, seq, plan.num_prompts)
                        for k in row_keys(uid, plan.num_generations)]
                with self._cond:
                    self._in_flight.update(dict.fromkeys(keys))
                started = time.perf_counter()
                result = self.generate(
                    task.prompts(self.config.seed, seq, plan.num_prompts),
                    step=seq,
                    batch_index=0,
                    num_generations=plan.num_generations,
                    partition_id=plan.partition_id,
                    num_texts=plan.num_texts,
                    uids=batch_uids(plan.key_prefix, version, seq, plan.num_prompts),
                    weight_version=version,
                    record_logprobs=True,
                )
                elapsed = time.perf_counter() - started
                receipts = group_receipts(result, num_generations=plan.num_generations, weight_version=version, batch_seq=seq)
                # Counted before the buffer has the batch: a trainer that samples it and then reads ``stats`` must
                # find its tokens there (counted after the offer, a step could read 0 and the next step twice).
                with self._cond:
                    # The batch's store I/O as generate read it off the client's counters (a second read finds none).
                    io = result.store_io
                    self._stats["batches"] += 1
                    self._stats["generated_tokens"] += sum(result.response_tokens)
                    self._stats["generate_s"] += elapsed
                    self._stats["store_ms"] += io["ms"]
                    self._stats["store_bytes"] += io["bytes"]
                    for op in OPS:
                        self._stats[f"store_{op}_ms"] += io.get(f"{op}_ms", 0.0)
                if not self._hand_over(buffer, receipts):
                    break
                with self._cond:
                    for key in keys:
                        self._in_flight.pop(key, None)
                seq += 1
        finally:
            self._clear_in_flight(plan.partition_id)
        return self.stats()

    def _wait_for_weights(self, seq: int, max_staleness: int) -> int | None:
        """Block until batch ``seq`` may be generated; load staged weights; the version to use (None: stopped)."""
        started = time.perf_counter()
        with self._cond:
            while not may_generate(seq, self._pushed_version, max_staleness):
                if self._stop.is_set():
                    return None
                self._cond.wait(timeout=_BACKOFF_S[1])
            staged, self._staged = self._staged, None
            version = self._pushed_version
            self._stats["wait_s"] += time.perf_counter() - started
        if staged is not None:
            self.backend.load_state_dict(staged)
        with self._cond:
            self._version = version
        return None if self._stop.is_set() else version

    def _hand_over(self, buffer: ReplayBufferClient, receipts: tuple[GroupReceipt, ...]) -> bool:
        """Offer ``receipts`` until the buffer takes them (backing off while it is full); False if stopped first."""
        pause, refused_at = _BACKOFF_S[0], None
        try:
            while not buffer.offer(receipts):
                refused_at = refused_at or time.perf_counter()
                if self._stop.wait(pause):
                    return False
                pause = min(2 * pause, _BACKOFF_S[1])
            return True
        finally:
            if refused_at is not None:
                with self._cond:
                    self._stats["wait_s"] += time.perf_counter() - refused_at

    def _clear_in_flight(self, partition_id: str) -> None:
        with self._cond:
            keys, self._in_flight = list(self._in_flight), {}
        if self._client is not None:
            clear_stored(self._client, keys, partition_id)

    # ------------------------------------------------------------ control

    @on_all_ranks
    def stop(self) -> None:
        """Ask the loop to end after its current batch (it then clears its keys in flight and returns)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    @on_all_ranks
    def stats(self) -> dict[str, float]:
        """Totals so far: ``batches``, ``generated_tokens``, ``generate_s``, ``wait_s`` (gate and full
        buffer), ``store_ms``, ``store_bytes``, the store's milliseconds per operation (``store_put_ms``,
        ``store_get_ms``, ``store_clear_ms``), and ``version`` (of the engine's weights). A batch counts once it
        is generated, before the buffer takes it, so a trainer that sampled it finds it counted."""
        with self._cond:
            return {**self._stats, "version": float(self._version)}

    @on_all_ranks
    def in_flight_keys(self) -> tuple[str, ...]:
        """The keys written (or being written) whose receipts the buffer has not taken yet."""
        with self._cond:
            return tuple(self._in_flight)
