"""``RayMemoryStore``: the data-plane port over one :class:`adapters.memory.MemoryStore` hosted in a named Ray actor.

The in-process ``MemoryStore`` cannot serve Ray actors in other processes
(policy workers, the rollout worker). Here one :class:`MemoryStoreActor` holds
the ``MemoryStore``, registered under a name in the Ray namespace
:data:`NAMESPACE`; every :class:`RayMemoryStore` is a client that forwards each
call to it. :meth:`RayMemoryStore.start` creates the actor and owns it;
:meth:`RayMemoryStore.attach` joins it by name from any process of the cluster
and never stops it, so ``functools.partial(RayMemoryStore.attach, store.name)``
is a picklable client factory for workers.

Invariants (the port's semantics, see :mod:`adapters.store_port`, checked by
``tests/e2e/test_store_contract.py``):
  * the semantics are exactly ``MemoryStore``'s: shape-faithful round trips
    (Ray pickles the TensorDicts both ways, object columns included), all or
    nothing puts and clears, exact clears, no aliasing (data is copied across
    processes);
  * every call's arguments, and every put column, are checked in the caller's
    process before any remote call (:class:`adapters.store_port.StoreAdapter`),
    so a rejected call sends nothing and a rejected put writes nothing;
  * every carried dtype (``core.dtypes.CODEC_DTYPES``) round-trips: columns
    torch cannot unpickle (uint16/32/64, float8) cross Ray as their
    same-width integer bit views (:func:`adapters.rows.to_bit_views`) with
    their true dtypes beside them, and are stored and returned in those;
  * an error the ``MemoryStore`` raises in the actor reaches the caller as that
    exception (same type, same message), never as a ``RayTaskError``;
  * after ``close()`` every call but ``close()`` raises ``RuntimeError``; only
    the owner's ``close()`` kills the actor, and a client of a killed actor
    raises ``RuntimeError`` naming it.

Limits: one actor holds every row in its memory and serves calls one at a
time; the actor shares the fate of the process that started it; each op's data
crosses Ray's object store twice (request and reply).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from tensordict import TensorDict

from adapters.memory import MemoryStore
from adapters.store_health import (
    DEFAULT_DEADLINES, ActorParts, Deadlines, ProbedActors, StoreFailure, StorePart, actor_pids, wait_for,
)
from adapters.ray_actors import named_actor_exists
from adapters.rows import column_spec, from_bit_views, read_columns_of, to_bit_views
from adapters.store_port import Keys, SeqLens, StoreAdapter, Tags, validate_put
from core.meta import KVBatchMeta

NAMESPACE = "rl-dataplane-memory"
"""The Ray namespace the store actors are named in (any driver of the cluster finds them there)."""


@ray.remote(num_cpus=0, concurrency_groups={"health": 1})
class MemoryStoreActor:
    """A Ray actor holding one :class:`adapters.memory.MemoryStore`; each method forwards to it.

    It takes no CPU (``num_cpus=0``), so it schedules on any cluster, and runs
    one store call at a time; :meth:`ping` has a thread of its own (concurrency
    group ``health``), so it answers while a store call runs. Build it through
    :meth:`RayMemoryStore.start`.
    """

    def __init__(self) -> None:
        self._store = MemoryStore()

    def ready(self) -> bool:
        """True once the actor is constructed (a call that waits for it)."""
        return True

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        """True: the health probe, served beside a running store call."""
        return True

    def put(
        self, keys: Keys, partition_id: str, fields: TensorDict, bit_views: dict[str, str], tags: Tags | None,
        sequence_lengths: SeqLens | None, reserved_tags: Tags | None, require_stored: bool = False,
    ) -> KVBatchMeta:
        """:meth:`adapters.memory.MemoryStore.put`, or ``put_with_reserved_tags`` when ``reserved_tags`` is given.

        ``fields`` arrives as :func:`adapters.rows.to_bit_views` sent it; the
        columns named in ``bit_views`` are stored in their true dtypes.
        """
        fields = from_bit_views(fields, bit_views)
        if reserved_tags is None:
            return self._store.put(
                keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, require_stored=require_stored
            )
        return self._store.put_with_reserved_tags(
            keys, partition_id, fields, reserved_tags=reserved_tags, tags=tags, sequence_lengths=sequence_lengths,
            require_stored=require_stored,
        )

    def get_with_tags(
        self, keys: Keys, partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, dict[str, str], tuple[dict[str, Any], ...]]:
        """:meth:`adapters.memory.MemoryStore.get_with_tags`, its columns as :func:`adapters.rows.to_bit_views` sends them.

        Returns:
            ``(columns, bit_views, tags)``; :func:`adapters.rows.from_bit_views`
            restores the columns.
        """
        columns, tags = self._store.get_with_tags(keys, partition_id, select_fields, tag_names)
        wire, bit_views = to_bit_views(columns)
        return wire, bit_views, tags

    def clear(self, keys: Keys, partition_id: str) -> None:
        """See :meth:`adapters.memory.MemoryStore.clear`."""
        self._store.clear(keys, partition_id)

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        """See :meth:`adapters.memory.MemoryStore.list_keys`."""
        return self._store.list_keys(partition_id)

    def describe(self, keys: Keys, partition_id: str) -> KVBatchMeta:
        """See :meth:`adapters.memory.MemoryStore.describe`."""
        return self._store.describe(keys, partition_id)


def is_running(name: str) -> bool:
    """Whether a store actor named ``name`` is registered in :data:`NAMESPACE` (False without Ray).

    Never starts Ray.

    Raises:
        TypeError: ``name`` is not a str.
    """
    return named_actor_exists(_check_name(name), NAMESPACE)


class RayMemoryStore(ProbedActors, StoreAdapter):
    """A :class:`adapters.store_port.DataPlaneClient` over a :class:`MemoryStoreActor`; thread-safe.

    Build one with :meth:`start` (creates and owns the actor) or :meth:`attach`
    (joins it by name); the constructor only records the handle and ownership.
    Pickling a client gives a non-owning client of the same actor (as :meth:`attach`).

    Every call has a deadline (``deadlines.call_s``) and, while it waits, the actor is probed
    (:meth:`MemoryStoreActor.ping`): a dead or silent actor fails the call with
    :class:`adapters.store_health.StoreFailure` naming it (``"Ray memory store actor 'x' (pid 4242) died"``), and
    every later call fails at once with the same error.

    Args:
        name: the actor's name in :data:`NAMESPACE`.
        handle: the actor.
        owns_actor: ``close()`` kills the actor.
        deadlines: how long a call may take and how often the actor is probed.

    Example:
        >>> store = RayMemoryStore.start()  # doctest: +SKIP
        >>> make_client = functools.partial(RayMemoryStore.attach, store.name)  # doctest: +SKIP
        >>> # in a worker: client = make_client(); client.get(keys, "train", ["input_ids"])
        >>> store.close()  # kills the actor  # doctest: +SKIP
    """

    def __init__(
        self, name: str, handle: ActorHandle, *, owns_actor: bool = False, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self._name = _check_name(name)
        self._handle = handle
        self._owns_actor = owns_actor
        self._deadlines = deadlines
        (pid,) = actor_pids([handle], deadlines.probe_timeout_s)
        self._part = StorePart(f"Ray memory store actor {self._name!r}", pid)
        self._parts = ActorParts("Ray memory store", [(self._part, handle)], probe="ping")
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        role = "owner" if self._owns_actor else "attached"
        return f"RayMemoryStore({self._name!r}, {role}{', closed' if self._closed else ''})"

    def __reduce__(self) -> tuple[Callable[[str], RayMemoryStore], tuple[str]]:
        return (RayMemoryStore.attach, (self._name,))

    @classmethod
    def start(cls, name: str | None = None) -> RayMemoryStore:
        """Create a store actor named ``name`` on this process's Ray cluster and own it.

        The actor lives until the returned client is closed or this process exits.

        Args:
            name: the actor's name in :data:`NAMESPACE`; a fresh unique one when None.

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: ``name`` is empty, or an actor of that name already exists (use :meth:`attach`).
            RuntimeError: Ray is not initialised in this process.
        """
        name = f"ray-memory-store-{uuid.uuid4().hex}" if name is None else _check_name(name)
        _check_ray("start")
        if is_running(name):
            raise ValueError(
                f"'name' must be unused: a store actor {name!r} already runs in namespace {NAMESPACE!r}; "
                f"join it with RayMemoryStore.attach({name!r})"
            )
        handle = MemoryStoreActor.options(name=name, namespace=NAMESPACE).remote()  # type: ignore[attr-defined]
        try:
            ray.get(handle.ready.remote())
        except BaseException:
            ray.kill(handle)
            raise
        return cls(name, handle, owns_actor=True)

    @classmethod
    def attach(cls, name: str) -> RayMemoryStore:
        """Join the store actor named ``name``; closing the client leaves the actor running.

        Works from the process that started it, another driver of the cluster,
        or any Ray actor or task.

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: ``name`` is empty, or no store actor of that name runs.
            RuntimeError: Ray is not initialised in this process.
        """
        _check_name(name)
        _check_ray(f"attach({name!r})")
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ValueError(
                f"'name' must name a running store actor in namespace {NAMESPACE!r}: got {name!r}, which does not "
                f"exist (never started, or its owner closed it); start one with RayMemoryStore.start({name!r})"
            ) from None
        return cls(name, handle)

    @property
    def name(self) -> str:
        """The actor's name: ``RayMemoryStore.attach(store.name)`` joins it."""
        return self._name

    @property
    def owns_actor(self) -> bool:
        """Whether ``close()`` kills the actor."""
        return self._owns_actor

    def _put(self, keys, partition_id, fields, tags, sequence_lengths, reserved_tags, require_stored):
        """Check the arguments and every column here, then send them to the actor (see ``StoreAdapter``)."""
        self._check_open()
        receipt = validate_put(
            keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, reserved_tags=reserved_tags
        )
        for column, value in read_columns_of(fields).items():
            column_spec(column, value, len(receipt))
        lengths = receipt.sequence_lengths
        wire, bit_views = to_bit_views(fields.detach())
        return self._call(
            "put", self._handle.put, receipt.keys, partition_id, wire, bit_views, tags, lengths, reserved_tags,
            require_stored,
        )

    def _get(
        self, keys: tuple[str, ...], partition_id: str, names: tuple[str, ...], tag_names: tuple[str, ...]
    ) -> tuple[TensorDict, tuple[dict[str, Any], ...]]:
        wire, bit_views, tags = self._call("get", self._handle.get_with_tags, keys, partition_id, names, tag_names)
        return from_bit_views(wire, bit_views), tags

    def _clear(self, keys: tuple[str, ...], partition_id: str) -> None:
        self._call("clear", self._handle.clear, keys, partition_id)

    def _list_keys(self, partition_id: str) -> tuple[str, ...]:
        return self._call("list_keys", self._handle.list_keys, partition_id)

    def _describe(self, keys: tuple[str, ...], partition_id: str) -> KVBatchMeta:
        return self._call("describe", self._handle.describe, keys, partition_id)

    def close(self) -> None:
        """Mark the client closed; the owner also kills the actor (its data is gone). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_actor:
            ray.kill(self._handle)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"RayMemoryStore {self._name!r} is closed: attach a new client, "
                f"e.g. store = RayMemoryStore.attach({self._name!r}) (if its owner has not closed it)"
            )

    def _call(self, op: str, method: Any, *args: Any) -> Any:
        """The result of ``method.remote(*args)`` within the deadline, the actor probed while it waits; the actor's
        own exception (type and message kept) if it raised."""
        self._parts.raise_if_failed()
        ref = method.remote(*args)

        def poll(timeout: float) -> tuple[bool, Any]:
            ready, _ = ray.wait([ref], timeout=timeout)
            return (True, ray.get(ref)) if ready else (False, None)

        try:
            return wait_for(
                poll, op=op, store="Ray memory store", deadlines=self._deadlines, check=self.check_health,
                cancel=lambda: ray.cancel(ref),
            )
        except RayTaskError as e:
            if isinstance(e.cause, Exception):
                raise e.cause from e
            raise
        except RayActorError as e:
            raise self._parts.fail(StoreFailure(
                f"RayMemoryStore {self._name!r} is gone (its owner closed it, or its process died): {self._part} died",
                part=self._part,
            )) from e


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"'name' must be a str (the store actor's name): got {type(name).__name__}")
    if not name:
        raise ValueError("'name' must be a non-empty str: got ''")
    return name


def _check_ray(call: str) -> None:
    if not ray.is_initialized():
        raise RuntimeError(
            f"Ray is not initialised in this process: connect to the cluster first, e.g. ray.init(address='auto'), "
            f"then call RayMemoryStore.{call}"
        )
