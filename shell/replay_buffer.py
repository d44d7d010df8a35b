"""The replay buffer actor: receipts of generated prompt groups, never their tensors.

:class:`ReplayBuffer` is a Ray actor that holds a :class:`core.replay.ReplayState`
and applies core's pure steps to it (:func:`core.replay.offer`,
:func:`core.replay.sample`, :func:`core.replay.drain`); its only I/O is
clearing the store keys of the receipts it evicts or drains. It runs one call
at a time (a plain Ray actor), so offers and samples are serialised.
:class:`ReplayBufferClient` is the typed proxy the trainer and the collector
call it through.

Invariants:
  * the buffer holds receipts only (metas and per-row carries): the bulk rows
    stay in the store;
  * every receipt offered is, in the end, either returned by ``sample`` (the
    trainer then owns its keys) or evicted / drained, and then its keys are
    cleared before the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import ray

from adapters.store_health import actor_pids, actor_resident_mib
from adapters.store_port import DataPlaneClient
from core.replay import GroupReceipt, ReplayState, drain, init_replay, offer, sample
from shell.column_io import clear_stored
from shell.model_worker import ClientFactory
from shell.node_placement import node_of

ASK_S = 10.0
"""How long the buffer's pid or memory may take to come back (it serves one call at a time, each short)."""


@attrs.frozen
class SampleReport:
    """What one ``sample`` call did.

    Attributes:
        groups: the sampled groups, oldest first (empty when too few were eligible).
        evicted_groups: receipts evicted by this call (their keys are cleared).
        buffered_groups: receipts left in the buffer after the call.
    """

    groups: tuple[GroupReceipt, ...]
    evicted_groups: int
    buffered_groups: int


class ReplayBuffer:
    """The buffer's actor body (see the module docstring); build it with :meth:`ReplayBufferClient.start`.

    Args:
        capacity_groups: how many group receipts it holds (>= 1).
        client_factory: opens the store client that clears evicted keys (picklable).
        partition_id: the partition of the rows.
    """

    def __init__(self, capacity_groups: int, client_factory: ClientFactory, partition_id: str) -> None:
        self._state: ReplayState = init_replay(capacity_groups)
        self._client: DataPlaneClient = client_factory()
        self._partition = partition_id
        self._offered = 0

    def offer(self, receipts: Sequence[GroupReceipt]) -> bool:
        """Append ``receipts`` if they all fit; False (nothing taken) when the buffer lacks room."""
        accepted, self._state = offer(self._state, receipts)
        if accepted:
            self._offered += len(receipts)
        return accepted

    def sample(self, num_groups: int, current_version: int, max_staleness: int) -> SampleReport:
        """Evict what is too stale (clearing its keys), then take ``num_groups`` groups FIFO, or none."""
        result, state = sample(self._state, num_groups, current_version, max_staleness)
        clear_stored(self._client, result.evicted_keys, self._partition)
        self._state = state
        return SampleReport(result.groups, len(result.evicted), len(state.groups))

    def keys(self) -> tuple[str, ...]:
        """Every buffered key, in arrival order."""
        return self._state.keys

    def stats(self) -> dict[str, int]:
        """``{"buffered_groups", "evicted_total", "offered_total"}``."""
        return {
            "buffered_groups": len(self._state.groups),
            "evicted_total": self._state.evicted_total,
            "offered_total": self._offered,
        }

    def drain(self) -> int:
        """Drop every receipt and clear its keys (shutdown); how many groups were dropped."""
        receipts, self._state = drain(self._state)
        clear_stored(self._client, [key for receipt in receipts for key in receipt.keys], self._partition)
        return len(receipts)


class ReplayBufferClient:
    """A typed proxy of a :class:`ReplayBuffer` actor (picklable: the collector holds one too).

    Every method waits for the actor's answer; an actor that died raises
    ``ray.exceptions.RayActorError``.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    def start(cls, capacity_groups: int, client_factory: ClientFactory, partition_id: str, *, name: str | None = None) -> ReplayBufferClient:
        """Start the actor (0 CPUs: it only moves receipts) and return its proxy."""
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if name is not None:
            options["name"] = name
        actor = ray.remote(ReplayBuffer).options(**options).remote(capacity_groups, client_factory, partition_id)
        return cls(actor)

    def offer(self, receipts: Sequence[GroupReceipt]) -> bool:
        return ray.get(self.handle.offer.remote(tuple(receipts)))

    def sample(self, num_groups: int, current_version: int, max_staleness: int) -> SampleReport:
        return ray.get(self.handle.sample.remote(num_groups, current_version, max_staleness))

    def keys(self) -> tuple[str, ...]:
        return ray.get(self.handle.keys.remote())

    def stats(self) -> dict[str, int]:
        return ray.get(self.handle.stats.remote())

    def process_id(self) -> int | None:
        """The actor's OS pid (None if it does not answer within ``ASK_S``)."""
        return actor_pids([self.handle], ASK_S)[0]

    def resident_mib(self) -> float | None:
        """The actor's resident memory in MiB, read by the actor itself (None if it does not answer within
        ``ASK_S``)."""
        return actor_resident_mib([self.handle], ASK_S)[0]

    def node_id(self) -> str:
        """The id of the Ray node the actor runs on."""
        return node_of(self.handle)

    def drain(self, timeout_s: float | None = None) -> int:
        return ray.get(self.handle.drain.remote(), timeout=timeout_s)

    def kill(self) -> None:
        """Stop the actor (idempotent)."""
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone
            pass
