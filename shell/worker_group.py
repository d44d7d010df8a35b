"""``WorkerGroup``: one Ray actor per rank of a ``NamedSharding``, all joined in one ``torch.distributed`` process group.

The driver builds a group from a ``Worker`` subclass and a layout; the group
starts one actor per rank, finds a free port on rank 0's node, and has every
actor join the process group (gloo on CPU, NCCL on GPU) and create every
replica group (the TP x CP x PP ranks of one data-parallel index). Work is then
dispatched in three steps (split in ``core.dispatch``, execute here, merge in
``core.dispatch``):

* ``run_all``: every rank runs a method; one result per rank, in rank order;
* ``run_sharded``: the shard of dp index ``d`` goes to every rank of replica
  group ``d``; one result per dp index, the replica leader's.

Invariants:
  * actor ``i`` holds rank ``i``: its ``rank``, ``world_size`` and ``coords``
    are ``i``, ``sharding.world_size`` and ``sharding.coords(i)``;
  * every actor has created every replica group in ``replica_groups(sharding)``
    order (torch requires all ranks to create all groups in one order);
  * a call either returns one value per rank (or per dp index) or raises ONE
    ``WorkerError`` naming the lowest failed rank, its coordinates, how many
    ranks failed and the remote traceback; a dead actor is reported the same way.

After a failure inside a collective the surviving ranks may stay blocked in it
until the process-group timeout: shut such a group down and build a new one.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, get_args

import attrs
import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError, RayTaskError

from core.dispatch import dp_results, replica_groups, shard_for_ranks
from core.topology import AXES, Coords, NamedSharding, Rank
from shell.broadcast import broadcast_tensors, describe

Backend = Literal["gloo", "nccl", "auto"]
ResolvedBackend = Literal["gloo", "nccl"]
ObjectRefs = list[ray.ObjectRef]

_BACKENDS: tuple[str, ...] = get_args(Backend)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _format_coords(coords: Coords) -> str:
    return ", ".join(f"{axis}={coords[axis]}" for axis in AXES)


# ---------------------------------------------------------------- errors


class WorkerError(RuntimeError):
    """A worker of a group failed: raised a Python exception, died, or did not answer in time.

    Attributes:
        rank: the lowest failed (or, on a timeout, still running) rank.
        coords: that rank's coordinates on every axis.
        method: the method that was called.
        remote_traceback: the traceback text from the worker ("" when it died
            or timed out and so has none).
        failed_ranks: every rank known to have failed, ascending.
        world_size: the number of ranks called.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: Rank,
        coords: Coords,
        method: str,
        remote_traceback: str = "",
        failed_ranks: tuple[Rank, ...] = (),
        world_size: int = 0,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.method = method
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks
        self.world_size = world_size

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_error,
            (type(self), str(self), self.rank, self.coords, self.method, self.remote_traceback, self.failed_ranks, self.world_size),
        )


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Some ranks did not finish within the call's timeout (none had failed); ``rank`` is the lowest of them."""


def _rebuild_error(
    cls: type[WorkerError],
    message: str,
    rank: Rank,
    coords: Coords,
    method: str,
    remote_traceback: str,
    failed_ranks: tuple[Rank, ...],
    world_size: int,
) -> WorkerError:
    return cls(
        message,
        rank=rank,
        coords=coords,
        method=method,
        remote_traceback=remote_traceback,
        failed_ranks=failed_ranks,
        world_size=world_size,
    )


# ---------------------------------------------------------------- the worker side


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
        ...     def where(self) -> tuple[int, int]:
        ...         return self.rank, self.world_size
        >>> group = WorkerGroup(Echo, NamedSharding({"data_parallel": 2}))  # doctest: +SKIP
        >>> group.run_all("where")  # doctest: +SKIP
        [(0, 2), (1, 2)]
    """

    _placement: Placement | None = None
    _replica_group: dist.ProcessGroup | None = None

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
            group = dist.new_group(ranks=list(ranks))
            if rank in ranks:
                mine = group
        self._placement = placement
        self._replica_group = mine

    def process_id(self) -> int:
        """This worker's OS process id (for operators: e.g. to find or signal a rank's process)."""
        return os.getpid()

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
                "move rank-dependent set-up into a method the driver calls with group.run_all(...)"
            )
        return self._placement

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


# ---------------------------------------------------------------- the driver side


def _check_worker_cls(worker_cls: Any) -> type[Worker]:
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        got = worker_cls.__name__ if isinstance(worker_cls, type) else type(worker_cls).__name__
        raise TypeError(
            f"'worker_cls' must be a subclass of shell.worker_group.Worker: got {got}; "
            f"declare it as `class MyWorker(Worker): ...` and pass the class, not an instance or a Ray actor class"
        )
    return worker_cls


def _check_amount(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"'{name}' must be a number: got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"'{name}' must be a finite number >= 0: got {value}")
    return float(value)


def _check_timeout(name: str, value: Any) -> float | None:
    if value is None:
        return None
    amount = _check_amount(name, value)
    if amount == 0:
        raise ValueError(f"'{name}' must be > 0 seconds, or None to wait forever: got {value}")
    return amount


def _resolve_backend(backend: Any, num_gpus_per_worker: float) -> ResolvedBackend:
    if backend not in _BACKENDS:
        raise ValueError(f"'backend' must be one of {list(_BACKENDS)}: got {backend!r}")
    if backend == "auto":
        return "nccl" if num_gpus_per_worker > 0 else "gloo"
    if backend == "nccl" and num_gpus_per_worker <= 0:
        raise ValueError(
            "'num_gpus_per_worker' must be > 0 for backend 'nccl': got 0; "
            "e.g. WorkerGroup(cls, sharding, backend='nccl', num_gpus_per_worker=1)"
        )
    return backend


class WorkerGroup:
    """One Ray actor of ``worker_cls`` per rank of ``sharding``, joined in one process group.

    Args:
        worker_cls: a ``Worker`` subclass (a plain class: the group makes it a Ray actor).
        sharding: the rank layout; ``sharding.world_size`` actors are started.
        init_args: positional arguments of ``worker_cls`` (the same on every rank).
        init_kwargs: keyword arguments of ``worker_cls``.
        backend: ``"gloo"``, ``"nccl"``, or ``"auto"`` (NCCL when workers have GPUs).
        num_cpus_per_worker: Ray CPUs per actor (may be fractional).
        num_gpus_per_worker: Ray GPUs per actor (0: a CPU group).
        env: extra environment variables of every actor.
        name_prefix: actors are named ``f"{name_prefix}-rank{r}"`` (default: a fresh unique prefix).
        timeout_s: how long a call waits for its results (None: forever).
        setup_timeout_s: how long starting the actors and joining the process group may take.
        pg_timeout_s: the process group's own timeout for collectives.
        failure_grace_s: after a first failure, how long to wait for the other
            ranks' outcomes before raising (so simultaneous failures are counted).

    Raises:
        TypeError: ``worker_cls`` is not a ``Worker`` subclass, ``sharding`` is
            not a ``NamedSharding``, or an amount is not a number.
        ValueError: an unknown backend, NCCL without GPUs, or a negative amount.
        RuntimeError: Ray is not initialised.
        WorkerError: an actor failed to start or to join the process group.

    Example:
        >>> group = WorkerGroup(MyWorker, NamedSharding({"data_parallel": 2, "tensor_parallel": 2}),  # doctest: +SKIP
        ...                     num_cpus_per_worker=0.5)
        >>> group.run_sharded("train_step", [batch_for_dp0, batch_for_dp1])  # doctest: +SKIP
        [metrics_dp0, metrics_dp1]
        >>> group.shutdown()  # doctest: +SKIP
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        sharding: NamedSharding,
        *,
        init_args: Sequence[Any] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        backend: Backend = "auto",
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        env: Mapping[str, str] | None = None,
        name_prefix: str | None = None,
        timeout_s: float | None = None,
        setup_timeout_s: float = 300.0,
        pg_timeout_s: float = 600.0,
        failure_grace_s: float = 1.0,
    ) -> None:
        cls = _check_worker_cls(worker_cls)
        if not isinstance(sharding, NamedSharding):
            raise TypeError(
                f"'sharding' must be a NamedSharding: got {type(sharding).__name__}; "
                f"e.g. WorkerGroup(cls, NamedSharding({{'data_parallel': 2}}))"
            )
        num_cpus = _check_amount("num_cpus_per_worker", num_cpus_per_worker)
        num_gpus = _check_amount("num_gpus_per_worker", num_gpus_per_worker)
        self._backend: ResolvedBackend = _resolve_backend(backend, num_gpus)
        self._timeout_s = _check_timeout("timeout_s", timeout_s)
        setup_timeout = _check_timeout("setup_timeout_s", setup_timeout_s)
        pg_timeout = _check_timeout("pg_timeout_s", pg_timeout_s)
        if pg_timeout is None:
            raise ValueError("'pg_timeout_s' must be a number of seconds > 0: got None")
        self._grace_s = _check_amount("failure_grace_s", failure_grace_s)
        if isinstance(init_args, (str, bytes)) or not isinstance(init_args, Sequence):
            raise TypeError(f"'init_args' must be a sequence of positional arguments: got {type(init_args).__name__}")
        if init_kwargs is not None and not isinstance(init_kwargs, Mapping):
            raise TypeError(f"'init_kwargs' must be a mapping: got {type(init_kwargs).__name__}")
        env_vars = dict(env or {})
        for key, value in env_vars.items():
            if not (isinstance(key, str) and isinstance(value, str)):
                raise TypeError(
                    f"'env' must map str -> str: got {type(key).__name__} -> {type(value).__name__} for {key!r}"
                )
        if name_prefix is not None and not (isinstance(name_prefix, str) and name_prefix):
            raise TypeError(f"'name_prefix' must be a non-empty str or None: got {name_prefix!r}")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init(...) before building a WorkerGroup")

        self._worker_cls = cls
        self._sharding = sharding
        self._name_prefix = name_prefix or f"{cls.__name__}-{uuid.uuid4().hex[:8]}"
        self._closed = False
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        actor_cls = ray.remote(cls)
        started: list[ActorHandle] = []
        self._actors: tuple[ActorHandle, ...] = ()
        try:
            for r in range(sharding.world_size):
                named = actor_cls.options(name=f"{self._name_prefix}-rank{r}", **options)
                started.append(named.remote(*init_args, **dict(init_kwargs or {})))
            self._actors = tuple(started)
            (address,) = self._gather(
                [self._actors[0].rendezvous_address.remote()], (0,), method="rendezvous_address", timeout_s=setup_timeout
            )
            master_addr, master_port = address
            refs = [
                actor.setup_distributed.remote(
                    rank=r,
                    sharding=sharding,
                    master_addr=master_addr,
                    master_port=master_port,
                    backend=self._backend,
                    timeout_s=pg_timeout,
                )
                for r, actor in enumerate(self._actors)
            ]
            self.collect(refs, method="setup_distributed", timeout_s=setup_timeout)
        except BaseException:
            self._actors = tuple(started)
            self._kill_actors()
            self._closed = True
            raise

    # ------------------------------------------------------------ properties

    @property
    def sharding(self) -> NamedSharding:
        """The group's layout."""
        return self._sharding

    @property
    def world_size(self) -> int:
        """The number of ranks (actors)."""
        return self._sharding.world_size

    @property
    def backend(self) -> ResolvedBackend:
        """The process-group backend the workers joined with."""
        return self._backend

    @property
    def actors(self) -> tuple[ActorHandle, ...]:
        """The actor of each rank, in rank order."""
        return self._actors

    @property
    def name_prefix(self) -> str:
        """The prefix of the actors' Ray names."""
        return self._name_prefix

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` has run."""
        return self._closed

    # ------------------------------------------------------------ dispatch

    def _check_call(self, method: Any) -> str:
        if self._closed:
            raise RuntimeError(f"this WorkerGroup ({self._name_prefix}) is shut down: build a new one")
        if not isinstance(method, str):
            raise TypeError(f"'method' must be a method name (str): got {type(method).__name__}; e.g. group.run_all('step')")
        if not callable(getattr(self._worker_cls, method, None)):
            raise ValueError(f"'method' must name a method of {self._worker_cls.__name__}: got {method!r}")
        return method

    def submit_all(self, method: str, *args: Any, **kwargs: Any) -> ObjectRefs:
        """Start ``method(*args, **kwargs)`` on every rank and return its refs in rank order (collect them with ``collect``).

        Each argument is put into the object store once and shared by all ranks.

        Raises:
            TypeError: ``method`` is not a str.
            ValueError: ``worker_cls`` has no method ``method``.
            RuntimeError: the group is shut down.
        """
        name = self._check_call(method)
        shared_args = [_put_once(a) for a in args]
        shared_kwargs = {k: _put_once(v) for k, v in kwargs.items()}
        return [getattr(actor, name).remote(*shared_args, **shared_kwargs) for actor in self._actors]

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method(*args, **kwargs)`` on every rank; one result per rank, in rank order.

        Waits up to the group's ``timeout_s``.

        Raises:
            TypeError, ValueError, RuntimeError: as ``submit_all``.
            WorkerError: a rank raised or died (the lowest such rank is named).
            WorkerTimeoutError: some ranks did not finish within ``timeout_s``.
        """
        return self.collect(self.submit_all(method, *args, **kwargs), method=method)

    def run_sharded(
        self,
        method: str,
        shards: Sequence[Any],
        *,
        common_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None | Literal["group"] = "group",
    ) -> list[Any]:
        """Run ``method(shard, **common_kwargs)`` with each dp index's shard on every rank of its replica group.

        Replicas (the tp / cp / pp ranks of one dp index) receive the same shard;
        their results are fetched (so their errors surface) and dropped, keeping
        the replica leader's: return small values from non-leaders.

        Args:
            method: the worker method's name.
            shards: one entry per data-parallel index, in dp order.
            common_kwargs: keyword arguments passed to every rank.
            timeout_s: seconds to wait; ``"group"`` uses the group's ``timeout_s``.

        Returns:
            One result per data-parallel index, in dp order (the leaders').

        Raises:
            TypeError: ``method`` is not a str, or ``shards`` is not a sequence.
            ValueError: ``shards`` does not have one entry per dp index, or
                ``worker_cls`` has no method ``method``.
            RuntimeError: the group is shut down.
            WorkerError: a rank raised or died.
            WorkerTimeoutError: some ranks did not finish in time.

        Example:
            >>> group.run_sharded("score", [rows_dp0, rows_dp1], common_kwargs={"step": 3})  # doctest: +SKIP
            [scores_dp0, scores_dp1]
        """
        name = self._check_call(method)
        indices = shard_for_ranks(self._sharding, shards)
        if common_kwargs is not None and not isinstance(common_kwargs, Mapping):
            raise TypeError(f"'common_kwargs' must be a mapping: got {type(common_kwargs).__name__}")
        shard_refs = [_put_once(shard) for shard in shards]
        shared_kwargs = {k: _put_once(v) for k, v in (common_kwargs or {}).items()}
        refs = [
            getattr(actor, name).remote(shard_refs[indices[r]], **shared_kwargs) for r, actor in enumerate(self._actors)
        ]
        wait = self._timeout_s if timeout_s == "group" else _check_timeout("timeout_s", timeout_s)
        return list(dp_results(self._sharding, self.collect(refs, method=name, timeout_s=wait)))

    def collect(self, refs: ObjectRefs, *, method: str, timeout_s: float | None | Literal["group"] = "group") -> list[Any]:
        """Wait for one ref per rank and return their values in rank order, or raise ONE ``WorkerError``.

        Waits with ``ray.wait`` and fails fast: at the first failure it waits at
        most ``failure_grace_s`` more for the other ranks' outcomes, then names
        the lowest failed rank and how many failed.

        Args:
            refs: the refs of one call, one per rank in rank order (from ``submit_all``).
            method: the method's name (for the error message).
            timeout_s: seconds to wait; ``"group"`` uses the group's ``timeout_s``.

        Raises:
            ValueError: ``refs`` does not have one ref per rank.
            WorkerError: a rank raised (``remote_traceback`` holds its
                traceback) or its actor died.
            WorkerTimeoutError: no rank failed but some did not finish in time.
        """
        if len(refs) != self.world_size:
            raise ValueError(f"'refs' must have {self.world_size} entries (one per rank): got {len(refs)}")
        wait = self._timeout_s if timeout_s == "group" else _check_timeout("timeout_s", timeout_s)
        return self._gather(refs, tuple(range(self.world_size)), method=method, timeout_s=wait)

    def _gather(self, refs: ObjectRefs, ranks: tuple[Rank, ...], *, method: str, timeout_s: float | None) -> list[Any]:
        wait = timeout_s
        deadline = None if wait is None else time.monotonic() + wait
        rank_of = dict(zip(refs, ranks))
        values: dict[Rank, Any] = {}
        failures: dict[Rank, RayError] = {}

        def harvest(ready: ObjectRefs) -> None:
            for ref in ready:
                try:
                    values[rank_of[ref]] = ray.get(ref)
                except RayError as error:
                    failures[rank_of[ref]] = error

        pending = list(refs)
        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                break
            if pending:  # also take whatever else is ready now
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            harvest(ready)
        if failures and pending:
            left = self._grace_s if deadline is None else min(self._grace_s, max(0.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
            harvest(ready)
        if failures:
            raise self._failure(method, failures, still_running=len(pending), called=len(refs))
        if pending:
            running = sorted(rank_of[ref] for ref in pending)
            first = running[0]
            coords = self._sharding.coords(first)
            raise WorkerTimeoutError(
                f"rank {first} ({_format_coords(coords)}) did not finish '{method}' within {wait} s "
                f"[{len(running)} of {len(refs)} ranks still running: {running[:8]}"
                f"{' ...' if len(running) > 8 else ''}]",
                rank=first,
                coords=coords,
                method=method,
                world_size=self.world_size,
            )
        return [values[r] for r in ranks]

    def _failure(
        self, method: str, failures: Mapping[Rank, RayError], *, still_running: int, called: int
    ) -> WorkerError:
        failed = tuple(sorted(failures))
        # A dead actor is the cause; ranks in a collective with it fail as a consequence: name it first.
        dead = [r for r in failed if isinstance(failures[r], RayActorError)]
        first = dead[0] if dead else failed[0]
        shown = "dead rank shown" if dead and len(failed) > 1 else "lowest rank shown"
        error = failures[first]
        coords = self._sharding.coords(first)
        where = f"rank {first} ({_format_coords(coords)})"
        tally = f"{len(failed)} of {called} ranks failed"
        if still_running:
            tally += f", {still_running} still running"
        if isinstance(error, RayTaskError):
            cause = error.cause
            summary = f"{type(cause).__name__}: {cause}"
            remote = _ANSI.sub("", str(error))  # ray's own text: the remote process, then its traceback
            message = f"{where} raised in '{method}': {summary} [{tally}; {shown}]\n--- remote traceback of rank {first} ---\n{remote}"
        elif isinstance(error, RayActorError):
            remote = ""
            message = f"{where} died during '{method}': its actor is dead [{tally}; {shown}]\n{error}"
        else:
            remote = ""
            message = f"{where} failed in '{method}': {type(error).__name__}: {error} [{tally}; {shown}]"
        failure = WorkerError(
            message,
            rank=first,
            coords=coords,
            method=method,
            remote_traceback=remote,
            failed_ranks=failed,
            world_size=self.world_size,
        )
        failure.__cause__ = error
        return failure

    # ------------------------------------------------------------ shutdown

    def shutdown(self, *, timeout_s: float = 10.0) -> None:
        """Destroy the workers' process groups (best effort, waiting at most ``timeout_s``), kill the actors,
        and wait (at most ``timeout_s`` more) until they are gone, so no call reaches a half-closed worker.

        A second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        refs = []
        for actor in self._actors:
            try:
                refs.append(actor.destroy_distributed.remote())
            except RayError:
                pass  # the actor is already gone
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self._kill_actors()
        self._wait_gone(timeout_s)

    def _kill_actors(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except (RayError, ValueError):
                pass  # already dead

    def _wait_gone(self, timeout_s: float) -> None:
        """Poll each killed actor until Ray reports it dead (``ray.kill`` returns before the process exits)."""
        deadline = time.monotonic() + timeout_s
        for actor in self._actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.process_id.remote(), timeout=max(0.1, deadline - time.monotonic()))
                except RayError:
                    break  # dead (or unreachable): gone for callers
                time.sleep(0.05)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={s}" for a, s in self._sharding.sizes.items() if s > 1) or "world_size=1"
        state = "closed" if self._closed else "open"
        return f"WorkerGroup({self._worker_cls.__name__}, {sizes}, backend={self._backend!r}, {state})"


def _put_once(value: Any) -> Any:
    """``value`` as an object-store ref, so that every rank reads one serialized copy (refs pass through)."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)
