"""``TransferQueueStore``: the store port over TransferQueue 0.1.11 (``import transfer_queue as tq``).

A store is a handle on one TransferQueue (TQ) system running on a Ray cluster
(:mod:`adapters.tq_system`). :meth:`TransferQueueStore.start` starts TQ and
owns it; :meth:`TransferQueueStore.attach` joins a running TQ from another
process, a Ray actor, or the same process, and never stops it. Every store in
a process shares TQ's one client per process; this module keeps no state of
its own beyond each store's flags and, on the ``RayObjectStore`` backend, its
line to TQ's controller (:mod:`adapters.tq_controller_line`), on which every
call sends its controller requests from the caller's thread instead of TQ's
client loop (but the clean-up of a failed put's new keys). What travels on the wire, and how, is
:mod:`adapters.tq_wire` (with :mod:`adapters.tq_mooncake` on that backend);
this module sequences the TQ calls of each operation.

Invariants (the port's semantics, see :mod:`adapters.store_port`, checked by
``tests/e2e/test_store_contract.py``):
  * shape-faithful round trips: every field comes back in the kind, dtype and
    shape it was put, restored from the :class:`adapters.rows.ColumnSpec` that
    each put records per key and field in the reserved tag ``__kvspec__``;
  * a rejected put writes nothing: arguments and every column are checked
    before the first TQ call, and keys a failed TQ put registered are cleared;
  * ``get``, ``clear`` and ``describe`` raise ``KeyError`` for unknown keys or
    missing fields instead of TQ's silent drops and empty results;
  * after ``close()`` every call but ``close()`` raises ``RuntimeError``; only
    the store that started TQ (and Ray) shuts them down.

TQ quirks hidden here, once (TQ 0.1.11 with tensordict 0.15.3):
  * Rectangular fields come back jagged (``(N, D)`` as rows ``(D,)``, ``(N,)``
    dense): :func:`adapters.tq_wire.decode_column` restores the put's kind and
    shape with whole-column ops (``values().reshape(N, *shape)``).
  * A selected field that some keys lack yields no error (TQ drops it), and
    unknown keys mixed with known ones are dropped: presence is checked
    against the reserved tags and the size of TQ's meta.
  * ``kv_batch_put`` registers keys before it validates them: this adapter
    validates first and uses TQ's low-level client, clearing keys it registered
    if the TQ put then fails.
  * Tags merge per key but shallowly, and a clear removes them: the reserved
    tags ``__kvspec__`` (wire fields) and ``__kvlen__`` (sequence length)
    are merged here and hidden from :meth:`TransferQueueStore.describe`. User
    tags stay native TQ tags (msgpack: tuples and sets come back as lists).
  * A rewrite with another spec leaves the old wire field behind for that key,
    unreadable through this adapter, until the key is cleared (TQ 0.1.11
    cannot clear one field of a key).
  * On Mooncake, clears go one field set at a time (it clears per field set).

Not transactional: puts of the same key from several processes race on the
key's tags (TQ merges tags on the client), a TQ failure in the middle of a
put may leave keys that already existed partly rewritten, and a get that races
a rewrite of its keys may read the rows from just before or just after it,
with the tags of the other (never another key's rows).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any

import attrs
import ray
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue.utils.zmq_utils import ZMQRequestType as Request

from adapters import tq_object_store, tq_system, tq_wire
from adapters.store_health import (
    DEFAULT_DEADLINES,
    ActorParts,
    Deadlines,
    ProbedActors,
    StoreFailure,
    StoreTimeout,
    wait_for,
)
from adapters.store_port import (
    RESERVED_TAG_PREFIX,
    StoreAdapter,
    pick_tags,
    unknown_keys_error,
    validate_put,
)
from adapters.tq_controller_line import ControllerLine, Exchange
from adapters.tq_system import Config, SystemHold, is_running
from adapters.tq_wire import (
    PutPlan,
    decode_columns,
    describe_meta,
    field_set_groups,
    new_keys,
    parse_wire_name,
    plan_get,
    plan_put,
    select_wires,
    tag_updates,
    unknown_keys,
    wire_name,
)
from core.meta import KVBatchMeta

__all__ = ["TransferQueueStore", "is_running"]

_WIRES_MEMO = 1024
"""How many ``(partition, fields)`` a store remembers the wire fields of (see :meth:`TransferQueueStore._get`)."""


async def _drop_registered(client: tq.TransferQueueClient, meta: tq.BatchMeta) -> None:
    """Undo the registration of keys whose first put failed; never raises.

    ``clear_samples`` removes whatever data reached storage. A key/value
    backend (Mooncake) refuses it when the keys hold no field yet, so the
    keys are then dropped from the controller alone (TQ's own two steps of a
    clear, without the storage step).
    """
    try:
        await client.async_clear_samples(meta)
    except Exception:
        with contextlib.suppress(Exception):
            await client._mark_clearing_in_controller(meta)
            await client._clear_meta_in_controller(meta)


class _TagsToSend(tq.BatchMeta):
    """Keys' tags for one ``async_set_custom_meta``, all in one partition, sent without TQ's copies.

    TQ's ``async_set_custom_meta`` deep-copies every key's tags three times
    before it sends them (``get_all_custom_meta``, then ``chunk_by_partition``'s
    ``select_samples``, then ``get_all_custom_meta`` of each chunk), which at
    thousands of keys takes longer than the send. The adapter builds this meta
    for one send, from tags it owns, and drops it after, so it hands TQ the
    tags themselves.
    """

    __slots__ = ()

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return self.custom_meta

    def chunk_by_partition(self) -> list[tq.BatchMeta]:
        return [self]


async def _write(
    client: tq.TransferQueueClient,
    store_rows: Callable[[tq.BatchMeta], Coroutine[Any, Any, None]],
    meta: tq.BatchMeta,
    previous: list[dict[str, Any]] | None,
) -> None:
    """What TQ's ``put`` does that this adapter needs: store the columns (``store_rows(meta)``, the storage
    manager's put of them) and record the keys' tags, at once.

    TQ's own ``put`` also rebuilds the meta it returns (unbinding every jagged
    column row by row) and resets torch's thread count on every call; the
    adapter keeps its own receipt, so it skips both. The tags go to the
    controller on a meta of their own.

    The controller replaces each key's tags with what it is sent (the merge is
    the adapter's, on ``meta``), so a put's tags can always be set back: when
    the columns fail and the tags were recorded, ``previous`` (each key's tags
    before the put) is sent back, and the keys' tags are as they were (if that
    send fails too, the raised error says so; after a deadline the send is
    made without waiting for it: best effort). When
    every key is new, ``previous`` is None: the caller drops the keys, tags
    and rows with them.
    """
    # TQ's client deep-copies the meta it is given, field schemas (a shape per row and field) included:
    # hand it the keys' tags alone.
    tags = _TagsToSend(global_indexes=meta.global_indexes, partition_ids=meta.partition_ids, custom_meta=meta.custom_meta)
    undo = None
    if previous is not None:
        undo = _TagsToSend(global_indexes=meta.global_indexes, partition_ids=meta.partition_ids, custom_meta=previous)
    # Both halves finish before either's error is raised: the caller's clean-up must not race a half still in flight.
    try:
        stored, tagged = await asyncio.gather(
            store_rows(meta), client.async_set_custom_meta(tags), return_exceptions=True
        )
    except asyncio.CancelledError:  # the call's deadline passed: set the old tags back, best effort, after it
        if undo is not None:
            asyncio.ensure_future(client.async_set_custom_meta(undo))
        raise
    if isinstance(stored, BaseException) and not isinstance(tagged, BaseException) and undo is not None:
        try:
            await client.async_set_custom_meta(undo)
        except Exception as error:  # the columns' error is the one to raise; say the tags could not be set back
            stored.add_note(f"the keys' previous tags could not be set back either: {error!r}")
    for outcome in (stored, tagged):
        if isinstance(outcome, BaseException):
            raise outcome


def _forget_keys(client: tq.TransferQueueClient, meta: tq.BatchMeta) -> None:
    """After a failed put on :data:`adapters.tq_object_store.BACKEND`: have the index answer these keys by key no more
    (:meth:`adapters.tq_object_store.RowIndex.forget_keys`), since their rows may have reached it while their tags
    were set back (or the keys dropped). Sent from the thread that sent the put's index call, so Ray delivers it
    after that call; never raises."""
    forget = getattr(client.storage_manager, "forget_keys", None)
    owners = meta.extra_info.get(tq_object_store.OWNERS)
    if forget is not None and owners is not None:
        with contextlib.suppress(Exception):
            forget(*owners)


def _check_notice(reply: Mapping[str, Any], partition_id: str) -> None:
    """Raise unless TQ's controller says it recorded a put's fields as produced (its ``NOTIFY_DATA_UPDATE_ACK``)."""
    if not reply.get("success", False):
        raise RuntimeError(
            f"TransferQueue's controller did not record the put's fields as produced in partition {partition_id!r} "
            "(its log says why)"
        )


def _blocking_get(refs: Any) -> concurrent.futures.Future[Any]:
    """``ray.get(refs)`` in a daemon thread of its own (no timeout, so Ray keeps one transfer going), as a future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # the caller's wait ended before this thread ran
            return
        try:
            future.set_result(ray.get(refs))
        except Exception as error:  # the caller's wait raises it
            future.set_exception(error)

    threading.Thread(target=run, name="transfer-queue-get", daemon=True).start()
    return future


# ---------------------------------------------------------------- stores


def _within_one_deadline(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`TransferQueueStore` call whose waits share one deadline (:meth:`TransferQueueStore._one_deadline`)."""

    @functools.wraps(method)
    def call(self: TransferQueueStore, *args: Any, **kwargs: Any) -> Any:
        with self._one_deadline():
            return method(self, *args, **kwargs)

    return call


class TransferQueueStore(ProbedActors, StoreAdapter):
    """A :class:`adapters.store_port.DataPlaneClient` over TransferQueue; thread-safe.

    Build one with :meth:`start` (starts and owns TQ) or :meth:`attach` (joins a
    running TQ); the constructor only records the process's hold on TQ.

    Every TQ call has a deadline and is watched (:mod:`adapters.store_health`): its waits, on TQ's controller, on
    the client's loop and on Ray, share one ``deadlines.call_s`` from the call's start (a put's clean-up after a
    failure gets one of its own); while it waits, the
    controller and the storage units are probed every ``deadlines.probe_every_s``; a dead one fails the call
    with :class:`adapters.store_health.StoreFailure` naming it (``"TransferQueue storage unit 1 (pid 4242)
    died"``), and every later call fails at once with the same error.

    Args:
        hold: what ``close()`` shuts down, and the storage backend
            (:class:`adapters.tq_system.SystemHold`); owning nothing by default.
        parts: TQ's processes to probe (:func:`adapters.tq_system.parts`); none by default.
        deadlines: how long a call may take and how often the parts are probed.

    Example:
        >>> store = TransferQueueStore.start()  # doctest: +SKIP
        >>> store.put(["a"], "train", TensorDict({"x": torch.zeros(1, 3)}, batch_size=[1]))  # doctest: +SKIP
        >>> store.get(["a"], "train", ["x"])["x"].shape  # doctest: +SKIP
        torch.Size([1, 3])
        >>> store.close()  # doctest: +SKIP
    """

    RESERVED_TAGS = tq_wire.RESERVED_TAGS
    """The wire's own tags (``__kvspec__``, ``__kvlen__``): merged by the adapter, hidden from ``describe``."""

    def __init__(
        self, hold: SystemHold = SystemHold(), *, parts: ActorParts | None = None, deadlines: Deadlines = DEFAULT_DEADLINES
    ) -> None:
        self._hold = hold
        self._parts = parts if parts is not None else ActorParts(tq_system.STORE_NAME, ())
        self._deadlines = deadlines
        self._kv_backend = hold.kv_backend
        self._by_key = hold.storage_backend == tq_object_store.BACKEND  # the index locates rows by key too
        self._wires: dict[tuple[str, tuple[str, ...]], list[str]] = {}  # the wire fields of the last get of some names
        self._line: ControllerLine | None = None  # on the by-key backend: controller requests from the caller's thread
        self._closed = False
        self._lock = threading.Lock()
        self._call_end = threading.local()  # .at: when the store call this thread is in must end (time.monotonic)

    def __repr__(self) -> str:
        role = "owner" if self._hold.owns_transfer_queue else "attached"
        return f"TransferQueueStore({role}{', closed' if self._closed else ''})"

    @classmethod
    def start(cls, config: Config | None = None, *, start_timeout_s: float = tq_system.START_TIMEOUT_S) -> TransferQueueStore:
        """Start TransferQueue on the current Ray cluster (or a local one) and own it (and Ray, if it started it).

        See :func:`adapters.tq_system.start`.

        Raises:
            TypeError: ``config`` is not a mapping.
            ValueError: an unknown storage backend (checked before anything starts), or a placement resource
                (``required_node_resource``) that no alive node has.
            RuntimeError: TransferQueue did not start within ``start_timeout_s`` (naming the parts not started),
                or a TransferQueue already runs on this Ray cluster (use :meth:`attach`).
        """
        hold = tq_system.start(config, start_timeout_s=start_timeout_s)
        try:
            return cls(hold, parts=tq_system.parts(DEFAULT_DEADLINES.probe_timeout_s))
        except BaseException:
            tq_system.release(hold)
            raise

    @classmethod
    def attach(cls) -> TransferQueueStore:
        """Join the TransferQueue running on this process's Ray cluster; closing the store leaves TQ running.

        See :func:`adapters.tq_system.attach`.

        Raises:
            RuntimeError: Ray is not initialised in this process, or no
                TransferQueue runs on the cluster.
        """
        return cls(tq_system.attach(), parts=tq_system.parts(DEFAULT_DEADLINES.probe_timeout_s))

    @contextlib.contextmanager
    def _one_deadline(self, *, fresh: bool = False) -> Iterator[None]:
        """The waits this thread makes inside share one deadline: ``call_s`` from entering the outermost (or, with
        ``fresh``, from entering this one: a failed call's clean-up, which must not inherit a spent deadline)."""
        outer = getattr(self._call_end, "at", None)
        if outer is not None and not fresh:
            yield
            return
        self._call_end.at = time.monotonic() + self._deadlines.call_s
        try:
            yield
        finally:
            self._call_end.at = outer

    def _end(self) -> float:
        """When this thread's store call must end: the :meth:`_one_deadline` it is in, else ``call_s`` from now."""
        at = getattr(self._call_end, "at", None)
        return time.monotonic() + self._deadlines.call_s if at is None else at

    def _left(self, end: float) -> Deadlines:
        """The store's deadlines with ``call_s`` what is left until ``end`` (at least a millisecond)."""
        return attrs.evolve(self._deadlines, call_s=max(end - time.monotonic(), 1e-3))

    def _call(self, op: str, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` run on TQ's client loop, within the deadline, the parts probed while it waits.

        A part found dead earlier fails the call before anything is sent.
        """
        return self._result(op, self._submit(function, *args, **kwargs))

    def _submit(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Start ``function(*args, **kwargs)`` on TQ's client loop and return at once; :meth:`_result` waits for it.

        Raises:
            StoreFailure: a part was found dead earlier (nothing is sent).
        """
        self._parts.raise_if_failed()
        return asyncio.run_coroutine_threadsafe(function(*args, **kwargs), tq_system.client()._loop)

    def _result(self, op: str, future: concurrent.futures.Future[Any], deadlines: Deadlines | None = None) -> Any:
        """The result of a call :meth:`_submit` started (or of any future), within the deadline (``deadlines``, by
        default what is left of the store call's, :meth:`_end`), the parts probed while it waits."""

        def poll(timeout: float) -> tuple[bool, Any]:
            concurrent.futures.wait([future], timeout=timeout)
            return (True, future.result()) if future.done() else (False, None)

        return wait_for(
            poll,
            op=op,
            store=tq_system.STORE_NAME,
            deadlines=self._left(self._end()) if deadlines is None else deadlines,
            check=self.check_health,
            cancel=future.cancel,
            call_s=self._deadlines.call_s,
        )

    def _ray_waiter(self, op: str) -> Callable[[Any], Any]:
        """``ray.get`` of object refs in the calling thread, for one store call: its waits share the call's one
        deadline (:meth:`_end`), and the store's parts are probed while they wait.

        A wait first polls ``ray.get`` for one probe interval. If that does not finish, the rest of the wait is one
        blocking ``ray.get`` in a thread of its own, which it polls: a ``ray.get`` that times out gives up Ray's
        transfer of an object from another node, so polling with timeouts would never finish a transfer longer
        than a probe interval. (If the call then fails, that thread's ``ray.get`` ends with the transfer.)
        """
        end = self._end()

        def left() -> float:
            return max(end - time.monotonic(), 1e-3)

        def wait(refs: Any) -> Any:
            try:
                return ray.get(refs, timeout=min(self._deadlines.probe_every_s, left()))
            except ray.exceptions.GetTimeoutError:
                pass
            return self._result(op, _blocking_get(refs), self._left(end))

        return wait

    @contextlib.contextmanager
    def _exchange(self, op: str) -> Iterator[Exchange]:
        """The calling thread's line to TQ's controller for one call (:mod:`adapters.tq_controller_line`): the
        waits for its replies share the call's one deadline (:meth:`_end`), and the store's parts are probed while
        they wait.

        Raises:
            StoreFailure: a part was found dead earlier (nothing is sent).
            RuntimeError: the store is closed.
        """
        self._parts.raise_if_failed()
        with self._lock:
            self._check_open()
            if self._line is None:
                client = tq_system.client()
                self._line = ControllerLine(client._controller, client.client_id)
            line = self._line
        end = self._end()

        def wait(poll: Callable[[float], tuple[bool, Any]]) -> Any:
            return wait_for(
                poll, op=op, store=tq_system.STORE_NAME, deadlines=self._left(end), check=self.check_health,
                call_s=self._deadlines.call_s,
            )

        with line.exchange(wait) as exchange:
            yield exchange

    @property
    def storage_backend(self) -> str:
        """TransferQueue's storage backend: ``SimpleStorage``, ``RayObjectStore`` (:mod:`adapters.tq_object_store`),
        ``MooncakeStore``."""
        return self._hold.storage_backend

    @property
    def owns_transfer_queue(self) -> bool:
        """Whether ``close()`` shuts TransferQueue down."""
        return self._hold.owns_transfer_queue

    @_within_one_deadline
    def _put(self, keys, partition_id, fields, tags, sequence_lengths, reserved_tags, require_stored):
        """Check the put completely (the port's checks, then :func:`adapters.tq_wire.plan_put`), then write it (see
        :class:`adapters.store_port.StoreAdapter`); a TQ failure chains TQ's error and clears the keys it registered.

        Besides the port's reserved tags, ``__kvspec__`` and ``__kvlen__`` are reserved here.
        """
        self._check_open()
        receipt = validate_put(
            keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, reserved_tags=reserved_tags
        )
        plan = plan_put(receipt, fields, pad_rows=self._kv_backend)
        client = tq_system.client()
        if self._by_key:
            return self._put_by_line(client, plan, partition_id, reserved_tags, require_stored)
        meta = self._call(
            "put", client.async_kv_retrieve_meta, keys=list(plan.receipt.keys), partition_id=partition_id, create=not require_stored
        )
        if require_stored:  # the same lookup that finds the keys tells which are missing: no extra round trip
            self._check_found(client, plan.receipt.keys, partition_id, meta)
        fresh, previous = self._merge_tags(plan, meta, partition_id, reserved_tags)
        try:
            self._call("put", _write, client, functools.partial(client.storage_manager.put_data, plan.payload), meta, previous)
        except BaseException:
            self._drop_new_keys(client, meta, fresh)
            raise
        return plan.receipt

    def _merge_tags(
        self, plan: PutPlan, meta: tq.BatchMeta, partition_id: str, reserved_tags: Sequence[Mapping[str, Any]] | None
    ) -> tuple[list[int], list[dict[str, Any]] | None]:
        """Merge a put's tags into its lookup's ``meta`` (in place) and name the rows' owners there; returns the
        positions of the keys the put registers, and the keys' tags before the put, to set back if its rows fail
        (None when every key is new: the caller drops them instead)."""
        fresh = new_keys(plan, meta.custom_meta)
        previous = None if len(fresh) == len(plan.receipt.keys) else [dict(tags) for tags in meta.custom_meta]
        meta.update_custom_meta(tag_updates(plan, meta.custom_meta, reserved_tags))
        self._name_owners(meta, partition_id, plan.receipt.keys)
        return fresh, previous

    def _put_by_line(
        self,
        client: tq.TransferQueueClient,
        plan: PutPlan,
        partition_id: str,
        reserved_tags: Sequence[Mapping[str, Any]] | None,
        require_stored: bool,
    ) -> KVBatchMeta:
        """:meth:`_put` on :data:`adapters.tq_object_store.BACKEND`, its controller requests on the caller's line.

        The key lookup goes out first; the columns go into Ray's object store while the controller answers it
        (:meth:`adapters.tq_object_store.RayObjectStorageManager.stage`); then the keys' tags, the controller's
        notice and the index call go out together (:meth:`_write_by_line`). A put whose columns fail drops the keys
        its lookup registered; one that fails later sets the keys' tags back or drops the new keys, as
        :func:`_write` does on TQ's loop.
        """
        manager = client.storage_manager
        keys = plan.receipt.keys
        with self._exchange("put") as line:
            line.send(Request.KV_RETRIEVE_META, {"keys": list(keys), "partition_id": partition_id, "create": not require_stored})
            try:
                staged = manager.stage(plan.payload)  # while the controller looks the keys up
            except BaseException:
                if not require_stored:  # the lookup registered the new keys: drop them (never raises)
                    with contextlib.suppress(Exception):
                        meta = line.receive(Request.KV_RETRIEVE_META_RESPONSE)["metadata"]
                        self._drop_new_keys(client, meta, new_keys(plan, meta.custom_meta))
                raise
            meta = line.receive(Request.KV_RETRIEVE_META_RESPONSE)["metadata"]
            if require_stored:  # the same lookup that finds the keys tells which are missing: no extra round trip
                self._check_found(client, keys, partition_id, meta)
            fresh, previous = self._merge_tags(plan, meta, partition_id, reserved_tags)
            try:
                self._write_by_line(client, line, staged, meta, previous, reserved_tags)
            except BaseException:
                self._drop_new_keys(client, meta, fresh)
                raise
        return plan.receipt

    def _write_by_line(
        self,
        client: tq.TransferQueueClient,
        line: Exchange,
        staged: tq_object_store.StagedColumns,
        meta: tq.BatchMeta,
        previous: list[dict[str, Any]] | None,
        reserved_tags: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """Store a staged put's rows at ``meta``'s global indexes: the keys' tags and the controller's notice that
        the fields are produced go out on ``line``, and the index call to the index, at once; the put is done when
        all three are.

        All three finish before an error is raised, unless the line itself fails (a dead part, the call's
        deadline, an interrupt), which ends the wait. On any failure the index forgets the keys; when the rows or
        the notice failed and the tags were recorded, ``previous`` (the keys' tags before the put) is sent back and
        waited for, as :func:`_write` does; after the line's own failure it is sent without waiting, best effort.
        ``previous`` is None when every key is new: the caller drops them.
        """
        manager = client.storage_manager
        indexes = list(meta.global_indexes)
        partition_id = meta.partition_ids[0]
        line.send(Request.SET_CUSTOM_META, {"partition_custom_meta": {partition_id: dict(zip(indexes, meta.custom_meta))}})
        line.send(
            Request.NOTIFY_DATA_UPDATE,
            {
                "partition_id": partition_id,
                "global_indexes": indexes,
                "field_schema": tq_object_store.field_schema(staged.frames),
                "custom_backend_meta": None,
            },
        )
        lost: BaseException | None = None

        def outcome(step: Callable[[], Any]) -> BaseException | None:
            nonlocal lost
            if lost is not None:
                return lost
            try:
                step()
            except (StoreFailure, StoreTimeout, KeyboardInterrupt) as error:
                lost = error
                return error
            except Exception as error:
                return error
            return None

        refs: list[Any] = []
        stored = outcome(lambda: refs.append(manager.register_staged(staged, meta, reserved_tags)))
        tagged = outcome(lambda: line.receive(Request.SET_CUSTOM_META_RESPONSE))
        noticed = outcome(lambda: _check_notice(line.receive(Request.NOTIFY_DATA_UPDATE_ACK), partition_id))
        if refs:
            stored = outcome(lambda: self._ray_waiter("put")(refs[0]))
        if stored is None and noticed is None and tagged is None:
            return
        _forget_keys(client, meta)
        rows_failed = stored if stored is not None else noticed
        if previous is not None and lost is not None:
            with contextlib.suppress(Exception):
                undo = _TagsToSend(global_indexes=meta.global_indexes, partition_ids=meta.partition_ids, custom_meta=previous)
                self._submit(client.async_set_custom_meta, undo)
        elif previous is not None and rows_failed is not None and tagged is None:
            try:
                line.send(Request.SET_CUSTOM_META, {"partition_custom_meta": {partition_id: dict(zip(indexes, previous))}})
                line.receive(Request.SET_CUSTOM_META_RESPONSE)
            except Exception as error:  # the rows' error is the one to raise; say the tags could not be set back
                rows_failed.add_note(f"the keys' previous tags could not be set back either: {error!r}")
        for error in (lost, stored, noticed, tagged):
            if error is not None:
                raise error

    def _drop_new_keys(self, client: tq.TransferQueueClient, meta: tq.BatchMeta, fresh: Sequence[int]) -> None:
        """Drop the keys at positions ``fresh`` of ``meta``, which a failed put registered; never raises."""
        if fresh:
            with contextlib.suppress(Exception), self._one_deadline(fresh=True):  # e.g. TQ's loop is gone too, or a part died
                self._call("put", _drop_registered, client, meta.select_samples(list(fresh)))

    @_within_one_deadline
    def _get(
        self, keys: tuple[str, ...], partition_id: str, names: tuple[str, ...], tag_names: tuple[str, ...]
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]]:
        """Columns and tags from one meta lookup; the columns decoded to the kinds the puts recorded.

        On :data:`adapters.tq_object_store.BACKEND` the index locates the rows by key while the controller's lookup
        is in flight, for the wire fields the last get of the same names read (a field's wire name holds its kind,
        dtype and shape, which a run's puts keep); the get uses that answer when the lookup names the same wire
        fields and the index found every row at the global indexes the lookup gives, and locates them by index
        otherwise. Either way the index checks each row's key.

        A get that asks for no tags but reserved ones (the integrity digests, which the index keeps by key), of
        names whose wire fields a get before it learnt, skips the lookup: the index alone finds the rows and the
        tags by key (:meth:`adapters.tq_object_store.RayObjectStorageManager.read_by_key`, in this thread: it calls
        Ray alone, not TQ's controller), one call in all; when
        it cannot answer for every key, field and tag, the get goes through the lookup as above.
        """
        client = tq_system.client()
        memo = (partition_id, names)
        guess = self._wires.get(memo) if self._by_key else None
        if guess is not None and all(name.startswith(RESERVED_TAG_PREFIX) for name in tag_names):
            self._parts.raise_if_failed()
            found = client.storage_manager.read_by_key(partition_id, keys, guess, tag_names, wait=self._ray_waiter("get"))
            if found is not None:
                data, tags = found
                specs = {name: parse_wire_name(wire)[1] for name, wire in zip(names, guess)}
                return decode_columns(specs, data, len(keys)), tags
        if self._by_key:
            with self._exchange("get") as line:
                line.send(Request.KV_RETRIEVE_META, {"keys": list(keys), "partition_id": partition_id, "create": False})
                # Sent once the lookup's request is out: the two are in flight at once.
                located = None if guess is None else client.storage_manager.locate_keys(partition_id, keys, guess)
                meta = line.receive(Request.KV_RETRIEVE_META_RESPONSE)["metadata"]
        else:
            meta, located = self._call("get", client.async_kv_retrieve_meta, keys=list(keys), partition_id=partition_id, create=False), None
        self._check_found(client, keys, partition_id, meta)
        specs = plan_get(keys, partition_id, names, meta.custom_meta)
        tags = pick_tags(meta.custom_meta, tag_names)
        selected = select_wires(meta, specs, partition_id)
        self._name_owners(selected, partition_id, keys)
        if self._by_key:
            wires = [wire_name(name, spec) for name, spec in specs.items()]
            if len(self._wires) >= _WIRES_MEMO and memo not in self._wires:
                self._wires.clear()
            self._wires[memo] = wires
            if wires != guess:  # a field's kind, dtype or shape changed: the by-key answer is of other wire fields
                located = None
        if self._by_key:  # in this thread, as a get by key alone: the rows are Ray's, no TQ call is left
            wait = self._ray_waiter("get")
            manager = client.storage_manager
            data = manager.read_indexed(selected, wait=wait) if located is None else manager.read_located(selected, located, wait=wait)
        else:
            data = self._call("get", client.storage_manager.get_data, selected)
        return decode_columns(specs, data, len(keys), pad_rows=self._kv_backend), tags

    def _name_owners(self, meta: tq.BatchMeta, partition_id: str, keys: Sequence[str]) -> None:
        """Tell the :data:`adapters.tq_object_store.BACKEND` backend whose rows ``meta``'s global indexes are
        (``keys`` in index order), so that a get never reads a reused index's new row; other backends get nothing."""
        if self._hold.storage_backend == tq_object_store.BACKEND:
            meta.extra_info[tq_object_store.OWNERS] = (partition_id, list(keys))

    @_within_one_deadline
    def _clear(self, keys: tuple[str, ...], partition_id: str) -> None:
        """One TQ clear of the keys, after checking that all are stored (the controller's lookup); on Mooncake, one
        per field set; on :data:`adapters.tq_object_store.BACKEND`, :meth:`_drop_and_release`."""
        client = tq_system.client()
        if self._by_key:
            self._drop_and_release(client, partition_id, keys)
            return
        meta = self._call("clear", client.async_kv_retrieve_meta, keys=list(keys), partition_id=partition_id, create=False)
        self._check_found(client, keys, partition_id, meta)
        groups = field_set_groups(meta.custom_meta) if self._kv_backend else []
        if len(groups) <= 1:
            self._call("clear", client.async_clear_samples, meta)
            return
        # A key/value backend removes (field, key) pairs of the fields every cleared key holds: one clear per field set.
        for group in groups:
            subset = [keys[i] for i in group]
            found = self._call("clear", client.async_kv_retrieve_meta, keys=subset, partition_id=partition_id, create=False)
            self._call("clear", client.async_clear_samples, found)

    def _drop_and_release(self, client: tq.TransferQueueClient, partition_id: str, keys: Sequence[str]) -> None:
        """A clear on :data:`adapters.tq_object_store.BACKEND`, on the caller's line: the controller's lookup checks
        that every key is stored; then the index drops the keys' rows (in this thread) while the controller releases
        their global indexes, one round trip for both. TQ's ``clear_samples`` makes three, one after another: it
        marks the rows as being cleared, so that its own consumers of new rows skip them, clears storage, and only
        then releases the indexes, so that no put can reuse an index before its rows are gone. Here the index drops
        only rows that the cleared keys still hold (:meth:`adapters.tq_object_store.RowIndex.clear_owned`), so a
        put of another key that reuses a released index keeps its rows whichever arrives first; and this adapter
        reads rows by key, never as TQ's consumer of new rows. Both halves finish before either's error is raised.

        Not covered: a put of one of the cleared keys that the controller registers after the release, at the same
        global index, and whose rows reach the index before the drop, loses them to the drop (its gets raise,
        naming the cleared row; none returns other rows). A key must not be put while a clear of it is in flight
        (docs/dataplane.md)."""
        with self._exchange("clear") as line:
            line.send(Request.KV_RETRIEVE_META, {"keys": list(keys), "partition_id": partition_id, "create": False})
            meta = line.receive(Request.KV_RETRIEVE_META_RESPONSE)["metadata"]
            self._check_found(client, keys, partition_id, meta)
            line.send(Request.CLEAR_META, {"global_indexes": meta.global_indexes, "partition_ids": meta.partition_ids})
            try:
                client.storage_manager.drop_owned(partition_id, keys, list(meta.global_indexes), wait=self._ray_waiter("clear"))
            except BaseException:
                with contextlib.suppress(Exception):  # the drop's error is the one to raise
                    line.receive(Request.CLEAR_META_RESPONSE)
                raise
            line.receive(Request.CLEAR_META_RESPONSE)

    @_within_one_deadline
    def _list_keys(self, partition_id: str) -> tuple[str, ...]:
        if self._by_key:
            with self._exchange("list_keys") as line:
                line.send(Request.KV_LIST, {"partition_id": partition_id})
                listed = line.receive(Request.KV_LIST_RESPONSE).get("partition_info") or {}
        else:
            listed = self._call("list_keys", tq_system.client().async_kv_list, partition_id)
        return tuple(listed.get(partition_id, {}))

    @_within_one_deadline
    def _describe(self, keys: tuple[str, ...], partition_id: str) -> KVBatchMeta:
        """The meta's tags with the reserved ones hidden (see :func:`adapters.tq_wire.describe_meta`)."""
        client = tq_system.client()
        if self._by_key:
            with self._exchange("describe") as line:
                line.send(Request.KV_RETRIEVE_META, {"keys": list(keys), "partition_id": partition_id, "create": False})
                meta = line.receive(Request.KV_RETRIEVE_META_RESPONSE)["metadata"]
        else:
            meta = self._call("describe", client.async_kv_retrieve_meta, keys=list(keys), partition_id=partition_id, create=False)
        self._check_found(client, keys, partition_id, meta)
        return describe_meta(keys, partition_id, meta.custom_meta)

    def close(self) -> None:
        """Mark the store closed; the owner also shuts TQ (and Ray, if it started it) down. Idempotent.

        After a part failed (found by a call, a probe, or :meth:`note_failure`), the storage units are killed at
        once instead of being asked to shut down: the close never waits on a dead or silent unit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            line, self._line = self._line, None
        if line is not None:
            line.close()
        tq_system.release(self._hold, graceful=self._parts.failure is None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "TransferQueueStore is closed: attach a new one, e.g. store = TransferQueueStore.attach()"
            )

    def _check_found(
        self, client: tq.TransferQueueClient, keys: Sequence[str], partition_id: str, meta: tq.BatchMeta
    ) -> None:
        if meta.size != len(keys):
            found = (
                self._call(
                    "lookup", client.async_kv_retrieve_keys, global_indexes=meta.global_indexes, partition_id=partition_id
                )
                if meta.size
                else []
            )
            raise unknown_keys_error(partition_id, unknown_keys(keys, found))

