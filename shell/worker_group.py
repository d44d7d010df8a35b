"""``WorkerGroup``: one Ray actor per rank of a ``NamedSharding``, all joined in one ``torch.distributed`` process group.

The driver builds a group from a ``Worker`` subclass and a layout; the group
starts one actor per rank, finds a free port on rank 0's node, and has every
actor join the process group (gloo on CPU, NCCL on GPU) and create every
replica group (the TP x CP x PP ranks of one data-parallel index). Work is then
dispatched in three steps (split in ``core.dispatch``, execute here, merge in
``core.dispatch``):

* a method declared ``@on_all_ranks`` (see :mod:`shell.worker`): every rank
  runs it; ``group.call(W.method, ...)`` returns one result per rank, in rank order;
* a method declared ``@sharded``: ``group.call(W.method, shards, ...)`` sends the
  shard of dp index ``d`` to every rank of replica group ``d``; one result per
  dp index, the replica leader's.

Methods are passed by reference, never by name, so the call site leads to the
definition and its declared dispatch.

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

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError

from core.dispatch import dp_results, shard_for_ranks
from core.gpu_share import gpus_needed  # public here too (shell.worker_group.gpus_needed)
from core.topology import NamedSharding, Rank
from shell.worker import ResolvedBackend, Worker, dispatch_of
from shell.worker_errors import WorkerError, WorkerTimeoutError, failure_error, format_coords

__all__ = ["Backend", "GPUShortageError", "WorkerError", "WorkerGroup", "WorkerTimeoutError", "gpus_needed"]

Backend = Literal["gloo", "nccl", "auto"]
ObjectRefs = list[ray.ObjectRef]
R = TypeVar("R")

_BACKENDS: tuple[str, ...] = get_args(Backend)


# ---------------------------------------------------------------- the driver side


def _check_worker_cls(worker_cls: Any) -> type[Worker]:
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        got = worker_cls.__name__ if isinstance(worker_cls, type) else type(worker_cls).__name__
        raise TypeError(
            f"'worker_cls' must be a subclass of shell.worker.Worker: got {got}; "
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


_OWN_OPTIONS = ("name", "num_cpus", "num_gpus", "max_restarts", "max_concurrency", "runtime_env")


def _check_rank_options(rank_options: Any, world_size: int) -> list[dict[str, Any]]:
    """One dict of extra actor options per rank (empty dicts for None)."""
    if rank_options is None:
        return [{} for _ in range(world_size)]
    if isinstance(rank_options, (str, bytes)) or not isinstance(rank_options, Sequence):
        raise TypeError(f"'rank_options' must be a sequence of mappings, one per rank: got {type(rank_options).__name__}")
    if len(rank_options) != world_size:
        raise ValueError(f"'rank_options' must have {world_size} entries (one per rank): got {len(rank_options)}")
    out = []
    for r, entry in enumerate(rank_options):
        if not isinstance(entry, Mapping):
            raise TypeError(f"'rank_options' entries must be mappings: got {type(entry).__name__} at rank {r}")
        taken = sorted(set(entry) & set(_OWN_OPTIONS))
        if taken:
            raise ValueError(
                f"'rank_options' must not set {taken} (the group's own arguments set them): got them at rank {r}"
            )
        out.append(dict(entry))
    return out


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


class GPUShortageError(ValueError):
    """A group's ranks ask for more GPUs than the Ray cluster has; raised before any of its actors starts.

    Attributes:
        ranks: the group's ranks.
        per_worker: the GPUs each rank asks for (``num_gpus_per_worker``).
        need: the GPUs the ranks take together (:func:`gpus_needed`).
        have: the GPUs the Ray cluster has, on all its nodes.

    ``message`` replaces the group's own wording, for a caller that names its own setting (``build_group``'s
    ``'device' is 'cuda'``); the counts stay, so every layer above catches the one type.
    """

    def __init__(self, ranks: int, per_worker: float, need: float, have: float, message: str | None = None) -> None:
        self.ranks, self.per_worker, self.need, self.have = ranks, per_worker, need, have
        super().__init__(
            message
            or f"'num_gpus_per_worker' is {per_worker:g}: the group's {ranks} ranks need {need:g} GPUs, the Ray "
            f"cluster has {have:g}; give the cluster GPUs, or build a CPU group (num_gpus_per_worker=0)"
        )


def _check_gpus(per_worker: float, ranks: int) -> None:
    """Raise :class:`GPUShortageError` unless the Ray cluster has the GPUs ``ranks`` ranks of ``per_worker`` take.

    It counts every GPU of the cluster: a group that passes can still wait for its placement (GPUs other actors
    hold, ``rank_options`` that pin a rank to a node without one) up to ``setup_timeout_s``.
    """
    need = gpus_needed(per_worker, ranks)
    if need <= 0:
        return
    have = ray.cluster_resources().get("GPU", 0.0)
    if have < need:
        raise GPUShortageError(ranks, per_worker, need, have)


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
        max_concurrency: calls an actor runs at once, each in its own thread (1: one at a
            time; more lets a long-running method, such as a collector loop, take other calls).
        role: what the ranks are, named in errors before the rank (``"policy"``:
            ``"policy rank 1 (...) died during 'train'"``; ``""``: ``"rank 1 (...)"``).
        rank_options: extra Ray actor options of each rank, one mapping per rank (e.g. a
            ``scheduling_strategy`` or custom ``resources``; see :mod:`shell.node_placement`);
            None: Ray's default placement.

    Raises:
        TypeError: ``worker_cls`` is not a ``Worker`` subclass, ``sharding`` is
            not a ``NamedSharding``, an amount is not a number, or ``role`` is not a str.
        ValueError: an unknown backend, NCCL without GPUs, or a negative amount.
        GPUShortageError: (a ``ValueError``) the Ray cluster has fewer GPUs than the ranks take
            (:func:`gpus_needed`), checked before any actor starts: Ray would wait for them until
            ``setup_timeout_s``.
        RuntimeError: Ray is not initialised.
        WorkerError: an actor failed to start or to join the process group.

    Example:
        >>> group = WorkerGroup(MyWorker, NamedSharding({"data_parallel": 2, "tensor_parallel": 2}),  # doctest: +SKIP
        ...                     num_cpus_per_worker=0.5)
        >>> group.call(MyWorker.train_step, [batch_for_dp0, batch_for_dp1])  # doctest: +SKIP
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
        max_concurrency: int = 1,
        role: str = "",
        rank_options: Sequence[Mapping[str, Any]] | None = None,
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
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"'max_concurrency' must be an int >= 1: got {max_concurrency!r}")
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
        per_rank = _check_rank_options(rank_options, sharding.world_size)
        if name_prefix is not None and not (isinstance(name_prefix, str) and name_prefix):
            raise TypeError(f"'name_prefix' must be a non-empty str or None: got {name_prefix!r}")
        if not isinstance(role, str):
            raise TypeError(f"'role' must be a str: got {type(role).__name__}")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init(...) before building a WorkerGroup")
        _check_gpus(num_gpus, sharding.world_size)
        self._role = role

        self._worker_cls = cls
        self._sharding = sharding
        self._name_prefix = name_prefix or f"{cls.__name__}-{uuid.uuid4().hex[:8]}"
        self._closed = False
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
        if max_concurrency > 1:
            options["max_concurrency"] = max_concurrency
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        actor_cls = ray.remote(cls)
        started: list[ActorHandle] = []
        self._actors: tuple[ActorHandle, ...] = ()
        try:
            for r in range(sharding.world_size):
                named = actor_cls.options(name=f"{self._name_prefix}-rank{r}", **{**options, **per_rank[r]})
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
            self._collect(refs, "setup_distributed", setup_timeout)
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

    def _check_call(self, method: Any) -> tuple[str, str]:
        if self._closed:
            raise RuntimeError(f"this WorkerGroup ({self._name_prefix}) is shut down: build a new one")
        dispatch = dispatch_of(method)
        name = getattr(method, "__name__", "")
        # The very function, defined on the worker class or a base (a same-named method of another class is not it).
        defined_here = any(vars(klass).get(name) is method for klass in self._worker_cls.__mro__)
        if not defined_here or getattr(getattr(self._worker_cls, name, None), "__worker_dispatch__", None) is None:
            raise ValueError(
                f"'method' must be a declared method of {self._worker_cls.__name__}: got {method.__qualname__}"
            )
        return name, dispatch

    def submit(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> ObjectRefs:
        """Start an ``@on_all_ranks`` method on every rank; its refs in rank order (wait with ``collect``).

        Each argument travels once: see :func:`_shared` (an argument that several ranks receive and that is not
        a small literal is put into the object store once and shared by them).

        Raises:
            TypeError: ``method`` is a name, undeclared, or declared ``@sharded``.
            ValueError: ``method`` is not a method of the group's worker class.
            RuntimeError: the group is shut down.
        """
        name, dispatch = self._check_call(method)
        if dispatch != "on_all_ranks":
            raise TypeError(f"'method' must be declared @on_all_ranks to be submitted: {name} is @{dispatch}")
        ranks = len(self._actors)
        shared_args = [_shared(a, ranks) for a in args]
        shared_kwargs = {k: _shared(v, ranks) for k, v in kwargs.items()}
        return [getattr(actor, name).remote(*shared_args, **shared_kwargs) for actor in self._actors]

    def call(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """Run a declared worker method and wait for it (up to the group's ``timeout_s``).

        * ``@on_all_ranks`` ``method(*args, **kwargs)`` runs on every rank: one
          result per rank, in rank order;
        * ``@sharded`` ``method(shard, *rest, **kwargs)`` with ``args = (shards,
          *rest)``, one shard per dp index: every rank of replica group ``d``
          runs it with shard ``d``; one result per dp index (the leader's;
          the others are fetched, so their errors surface, and dropped).

        Raises:
            TypeError: ``method`` is a name or undeclared, or ``shards`` is not a sequence.
            ValueError: ``method`` is not a method of the worker class, or
                ``shards`` does not have one entry per dp index.
            RuntimeError: the group is shut down.
            WorkerError: a rank raised or died (the lowest such rank is named).
            WorkerTimeoutError: some ranks did not finish within ``timeout_s``.

        Example:
            >>> group.call(MyWorker.score, [rows_dp0, rows_dp1], step=3)  # doctest: +SKIP
            [scores_dp0, scores_dp1]
        """
        name, dispatch = self._check_call(method)
        if dispatch == "on_all_ranks":
            return self._collect(self.submit(method, *args, **kwargs), name, "group")
        if not args:
            raise TypeError(f"{name} is @sharded: call it as group.call(..., shards, ...) with one shard per dp index")
        shards, rest = args[0], args[1:]
        indices = shard_for_ranks(self._sharding, shards)
        ranks = len(self._actors)
        shard_refs = [_shared(shard, indices.count(d)) for d, shard in enumerate(shards)]
        shared_args = [_shared(a, ranks) for a in rest]
        shared_kwargs = {k: _shared(v, ranks) for k, v in kwargs.items()}
        refs = [
            getattr(actor, name).remote(shard_refs[indices[r]], *shared_args, **shared_kwargs)
            for r, actor in enumerate(self._actors)
        ]
        return list(dp_results(self._sharding, self._collect(refs, name, "group")))

    def collect(
        self, refs: ObjectRefs, method: Callable[..., R], *, timeout_s: float | None | Literal["group"] = "group"
    ) -> list[R]:
        """Wait for one ref per rank and return their values in rank order, or raise ONE ``WorkerError``.

        Waits with ``ray.wait`` and fails fast: at the first failure it waits at
        most ``failure_grace_s`` more for the other ranks' outcomes, then names
        the lowest failed rank and how many failed.

        Args:
            refs: the refs of one call, one per rank in rank order (from ``submit``).
            method: the method they run (the one given to ``submit``; errors name it).
            timeout_s: seconds to wait; ``"group"`` uses the group's ``timeout_s``.

        Raises:
            ValueError: ``refs`` does not have one ref per rank.
            WorkerError: a rank raised (``remote_traceback`` holds its
                traceback) or its actor died.
            WorkerTimeoutError: no rank failed but some did not finish in time.
        """
        name, _ = self._check_call(method)
        return self._collect(refs, name, timeout_s)

    def _collect(self, refs: ObjectRefs, name: str, timeout_s: float | None | Literal["group"]) -> list[Any]:
        if len(refs) != self.world_size:
            raise ValueError(f"'refs' must have {self.world_size} entries (one per rank): got {len(refs)}")
        wait = self._timeout_s if timeout_s == "group" else _check_timeout("timeout_s", timeout_s)
        return self._gather(refs, tuple(range(self.world_size)), method=name, timeout_s=wait)

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
            raise failure_error(
                self._sharding, method, failures, still_running=len(pending), called=len(refs), role=self._role
            )
        if pending:
            running = sorted(rank_of[ref] for ref in pending)
            first = running[0]
            coords = self._sharding.coords(first)
            raise WorkerTimeoutError(
                f"{self._role + ' ' if self._role else ''}rank {first} ({format_coords(coords)}) did not finish "
                f"'{method}' within {wait} s "
                f"[{len(running)} of {len(refs)} ranks still running: {running[:8]}"
                f"{' ...' if len(running) > 8 else ''}]",
                rank=first,
                coords=coords,
                method=method,
                world_size=self.world_size,
            )
        return [values[r] for r in ranks]

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
        try:
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        finally:  # an interrupt while waiting (a second Ctrl-C) must not leave the actors running
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


_LITERAL_BYTES = 1024  # a str or bytes argument this long or shorter is a small literal
_LITERAL_ITEMS = 64  # a tuple, list or frozenset of at most this many small literals is one too


def _shared(value: Any, ranks: int) -> Any:
    """``value`` as an argument of a call that ``ranks`` ranks receive: an object-store ref when several ranks
    receive it and it is not a small literal (every rank then reads one serialized copy), else the value itself.

    Ray inlines a small argument into the call and puts a large one into the object store itself, so a value
    for one rank, or a small literal (an int, a short string: :func:`_small_literal`) for several, loses
    nothing by travelling as it is, and skips a ``ray.put``: a round trip to the object store that costs more
    than inlining a small value. Refs pass through.
    """
    if isinstance(value, ray.ObjectRef) or ranks <= 1 or _small_literal(value):
        return value
    return ray.put(value)


def _small_literal(value: Any, nested: bool = False) -> bool:
    """None, a bool, int or float, a str or bytes of at most ``_LITERAL_BYTES``, or (not nested) a tuple, list
    or frozenset of at most ``_LITERAL_ITEMS`` of those."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, (str, bytes)):
        return len(value) <= _LITERAL_BYTES
    if not nested and isinstance(value, (tuple, list, frozenset)) and len(value) <= _LITERAL_ITEMS:
        return all(_small_literal(item, nested=True) for item in value)
    return False
