"""``Worker``: the base class of a ``WorkerGroup``'s actors, and how a worker method declares its dispatch.

A worker method that the driver calls is declared where it is defined, with
one of two decorators, and the driver calls it by reference, never by name:

* ``@on_all_ranks``: every rank runs the method with the same arguments;
  ``group.call(MyWorker.method, ...)`` returns one result per rank;
* ``@sharded``: the method's first argument is one data-parallel shard;
  ``group.call(MyWorker.method, shards, ...)`` sends shard ``d`` to every
  rank of replica group ``d`` and returns one result per dp index (the
  replica leader's).

Invariant: a method without a declaration cannot be called through a group,
so every remote entry point of a worker is visible, with its dispatch, in the
worker's own source (and a reader or a tool can follow the reference from the
call site to the definition).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import attrs
import ray
import torch
import torch.distributed as dist

from adapters import proc_memory
from core.dispatch import replica_groups
from core.topology import Coords, NamedSharding, Rank
from shell.broadcast import broadcast_tensors, describe

ResolvedBackend = Literal["gloo", "nccl"]
Dispatch = Literal["on_all_ranks", "sharded"]
Method = TypeVar("Method", bound=Callable[..., Any])

_DISPATCH_ATTR = "__worker_dispatch__"


def on_all_ranks(method: Method) -> Method:
    """Declare ``method`` as run by every rank with the same arguments (one result per rank).

    Example:
        >>> class Echo(Worker):
        ...     @on_all_ranks
        ...     def where(self) -> tuple[int, int]:
        ...         return self.rank, self.world_size
    """
    setattr(method, _DISPATCH_ATTR, "on_all_ranks")
    return method


def sharded(method: Method) -> Method:
    """Declare ``method(self, shard, ...)`` as run with one shard per data-parallel index.

    Every rank of replica group ``d`` receives shard ``d``; the group keeps the
    replica leader's result, so non-leaders should return small values.
    """
    setattr(method, _DISPATCH_ATTR, "sharded")
    return method


def dispatch_of(method: Any) -> Dispatch:
    """The dispatch ``method`` was declared with.

    Raises:
        TypeError: ``method`` is a string, or a callable declared with neither
            ``@on_all_ranks`` nor ``@sharded``.
    """
    if isinstance(method, str):
        raise TypeError(
            f"'method' must be a worker method, not its name: got {method!r}; "
            f"pass the function, e.g. group.call(MyWorker.{method}, ...)"
        )
    dispatch = getattr(method, _DISPATCH_ATTR, None)
    if dispatch is None:
        name = getattr(method, "__qualname__", type(method).__name__)
        raise TypeError(
            f"'method' must be declared with @on_all_ranks or @sharded where it is defined: got {name} without one"
        )
    return dispatch


@attrs.frozen
class Placement:
    """Where a worker sits: its rank in ``sharding`` and the process-group backend."""

    rank: Rank = attrs.field(validator=attrs.validators.instance_of(int))
    sharding: NamedSharding = attrs.field(validator=attrs.validators.instance_of(NamedSharding))
    backend: ResolvedBackend = attrs.field(validator=attrs.validators.in_(("gloo", "nccl")))

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.sharding.world_size:
            raise ValueError(f"'rank' must be in range({self.sharding.world_size}) (the world size): got {self.rank}")


class Worker:
    """Base class of the actors of a ``WorkerGroup``: subclass it and add methods.

    The group constructs the subclass with its ``init_args`` / ``init_kwargs``
    and then calls ``setup_distributed``; so ``rank``, ``coords``, the process
    group and ``replica_group()`` are available in every method, but not yet in
    ``__init__`` (put rank-dependent set-up in a method the driver calls next).

    Example:
        >>> class Echo(Worker):
        ...     @on_all_ranks
        ...     def where(self) -> tuple[int, int]:
        ...         return self.rank, self.world_size
        >>> group = WorkerGroup(Echo, NamedSharding({"data_parallel": 2}))  # doctest: +SKIP
        >>> group.call(Echo.where)  # doctest: +SKIP
        [(0, 2), (1, 2)]
    """

    _placement: Placement | None = None
    _replica_group: dist.ProcessGroup | None = None
    _pg_timeout_s: float | None = None

    # ------------------------------------------------------------ set-up (called by the group)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port that is free on it now: the process group's rendezvous (run on rank 0)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = int(probe.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def setup_distributed(
        self,
        *,
        rank: Rank,
        sharding: NamedSharding,
        master_addr: str,
        master_port: int,
        backend: ResolvedBackend,
        timeout_s: float,
    ) -> None:
        """Join the world process group as ``rank`` and create every replica group, in ``replica_groups`` order.

        Raises:
            RuntimeError: this process already joined a process group, or NCCL
                was asked for and no CUDA device is visible.
        """
        if dist.is_initialized():
            raise RuntimeError(f"rank {rank}: this worker already joined a process group; build a new WorkerGroup")
        placement = Placement(rank=rank, sharding=sharding, backend=backend)
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"rank {rank}: backend 'nccl' needs a CUDA device and none is visible; "
                    f"give workers GPUs (num_gpus_per_worker=1) or use backend='gloo'"
                )
            torch.cuda.set_device(0)  # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPUs
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=sharding.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        mine = None
        for ranks in replica_groups(sharding):
            if len(ranks) == 1:
                continue  # every rank skips the same groups, so creation order still agrees
            # The group's own timeout: without one, torch gives a new group its backend's default (30 min on gloo,
            # 10 on NCCL), so a leader broadcast whose peer failed would block that long, not timeout_s.
            group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                mine = group
        self._placement = placement
        self._replica_group = mine
        self._pg_timeout_s = timeout_s

    @on_all_ranks
    def process_id(self) -> int:
        """This worker's OS process id (for operators: e.g. to find or signal a rank's process)."""
        return os.getpid()

    @on_all_ranks
    def resident_mib(self) -> float:
        """This worker's resident memory (``VmRSS``), in MiB (for operators: a leak shows as steady growth)."""
        return proc_memory.resident_mib()

    @on_all_ranks
    def node_id(self) -> str:
        """The id (hex) of the Ray node this worker runs on (where ``ray.placement`` put it)."""
        return ray.get_runtime_context().get_node_id()

    def destroy_distributed(self) -> None:
        """Leave the process group (and its replica groups); a no-op when not joined."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._replica_group = None

    # ------------------------------------------------------------ where this worker sits

    @property
    def placement(self) -> Placement:
        """This worker's rank, layout and backend.

        Raises:
            RuntimeError: the group has not set this worker up yet (e.g. inside ``__init__``).
        """
        if self._placement is None:
            raise RuntimeError(
                "this worker has no rank yet: the WorkerGroup sets it after __init__; "
                "move rank-dependent set-up into an @on_all_ranks method the driver calls with group.call(...)"
            )
        return self._placement

    @property
    def pg_timeout_s(self) -> float | None:
        """The timeout (seconds) of this worker's process groups; None before it joined one."""
        return self._pg_timeout_s

    @property
    def rank(self) -> Rank:
        """This worker's global rank."""
        return self.placement.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.placement.sharding.world_size

    @property
    def sharding(self) -> NamedSharding:
        """The group's layout."""
        return self.placement.sharding

    @property
    def coords(self) -> Coords:
        """This worker's coordinate on every axis (``sharding.coords(rank)``)."""
        return self.placement.sharding.coords(self.placement.rank)

    @property
    def dp_index(self) -> int:
        """This worker's data-parallel index."""
        return self.placement.sharding.dp_index(self.placement.rank)

    @property
    def is_replica_leader(self) -> bool:
        """Whether this worker leads its replica group (tp = cp = pp = 0)."""
        return self.placement.sharding.is_replica_leader(self.placement.rank)

    @property
    def replica_leader(self) -> Rank:
        """The global rank of this worker's replica-group leader."""
        return self.placement.sharding.dp_leaders()[self.dp_index]

    @property
    def device(self) -> torch.device:
        """Where this worker's collectives run: ``cuda:0`` under NCCL, else the CPU."""
        return torch.device("cuda", 0) if self.placement.backend == "nccl" else torch.device("cpu")

    def replica_group(self) -> dist.ProcessGroup | None:
        """The process group of this worker's replica group (its TP x CP x PP ranks); None when it has one rank."""
        _ = self.placement  # raises when not set up
        return self._replica_group

    def broadcast_from_leader(self, data: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Hand the leader's tensors to every rank of this replica group (see ``shell.broadcast``).

        Args:
            data: on the replica leader, the tensors; on every other rank, None.

        Returns:
            The leader's tensors, on ``self.device``, on every rank of the replica group.
        """
        group = self.replica_group()
        if group is None:  # a replica group of one rank: nothing to send
            if data is None:
                raise ValueError(f"'data' must be the tensors on a replica leader: got None on rank {self.rank}")
            return {entry.name: data[entry.name].to(self.device) for entry in describe(data)}
        return broadcast_tensors(
            data if self.is_replica_leader else None, src=self.replica_leader, group=group, device=self.device
        )
