"""``RayObjectStore``: a TransferQueue storage backend that keeps rows in Ray's shared-memory object store.

TransferQueue (TQ) still owns keys, partitions, tags and production status
(its controller); this backend owns only the bytes. A put stores each field
of the batch as a **column frame** (the column's bytes, its dtype and shape,
and for a jagged column its row offsets). The put's frames of
:data:`INLINE_BYTES` or more go into **one Ray object per put**, with one
``ray.put`` in the writing process; a smaller frame travels inside the index
call instead (Ray inlines small task arguments and replies, where a
``ray.put`` costs about a millisecond whatever its size). The frames and
that ``ray.put`` need no global index (:meth:`RayObjectStorageManager.stage`):
the adapter makes them while the controller looks the put's keys up. The index records
each row's location, ``(column id, row)``, per global index and field, and
the key each global index was last put under, with the reserved tags
(integrity digests) each put merged into its keys' tags. A get of fields whose wire
names the adapter already knows, that asks for no tags but reserved ones, is one call to the
index, by key (:meth:`RayObjectStorageManager.read_by_key`, in the caller's
thread), and one ``ray.get``: no controller lookup. Any other get is one controller lookup,
one call to the index for the rows' locations and their columns' object refs
(sent beside the lookup, by key, when the adapter knows the wire names: see
:meth:`RowIndex.locate_keys`), and one ``ray.get``. The ``ray.get`` is
zero-copy from the node's shared memory on the same node, Ray's own object
transfer across nodes (which moves the put's whole object, all its large
fields, even when a get asks for some of them). The put's index
call and its controller notification run at once; the put returns when both
are done.

The controller holds no per-row state of this backend: no per-row backend
meta, and no per-row shapes (a jagged column is reported with the fixed row
shape ``(0, *inner)``, see :func:`field_schema`; its frame holds the row
lengths). TransferQueue's controller copies its per-row metadata in Python
on every notify and every lookup, so each piece of it lengthens every put,
get and clear, the more so the more rows.

The index (:class:`ObjectStoreIndex`, one named actor per TQ system, started
with TQ, beside its controller or on a node with :data:`INDEX_RESOURCE`, and stopped with it) borrows every live column's object ref and
counts its live rows per ``(global index, field)``. A rewrite of a field or a
clear of a row releases that row; a column whose last row is released is
dropped, and Ray frees a put's object once none of its columns is live.

Ownership: Ray makes the process that calls ``ray.put`` the object's owner,
and Ray 2.56 removed the way to name another owner. A column therefore lives
in the object store of its writer's node and as long as its writer's process:
if the writer exits, its rows are lost, and a get of them raises naming the
writer. Every writer of a GRPO run (rollout engine, policy workers, driver)
lives for the whole run.

Invariants:
  * a get returns exactly the rows and fields the meta names, in its order,
    bitwise as they were put (every torch dtype travels as raw bytes);
  * a column lives while any of its rows is live, and not after: after a
    clear of every key, :meth:`ObjectStoreIndex.stats` reports 0 columns;
  * every row location the index holds names a live column; a get of a row
    the index does not hold (cleared, or its put not finished, after the
    controller's lookup found it) raises ``RuntimeError`` naming the field
    and the global index;
  * a get located by key (:meth:`RowIndex.locate_keys`) beside a lookup reads exactly what a get located by the
    controller's global indexes would: the adapter keeps a by-key answer only when its global indexes equal the
    lookup's. A get by key alone reads the rows of the latest put of each key that the index has registered (a
    put whose index call is done counts as done, though its controller notice may still be in flight); it
    answers only when the index holds every key and field and no row holds two wire fields of one user field
    (a rewrite in another kind, dtype or shape, whose current wire field only the keys' tags name), and leaves
    every other case to the lookup. A put that fails after its index call (its keys' tags set back, or the keys
    dropped) has the index forget its keys (:meth:`RowIndex.forget_keys`), so their gets go by the lookup;
  * a get by key alone of reserved tags (a verified get) answers, per key, the reserved tags that the puts naming
    it merged since its row's last clear, which is what TQ's controller holds, since every adapter put sends its
    reserved tags to both; where a put the index did not see in full may have changed the controller's (a put
    without owners, or a failed put), the get goes by the lookup until the row is cleared. (A process that sets
    tags through TQ alone, bypassing the adapter, is not seen.)
  * a get never returns another key's row. Rows are found by global index,
    and TQ gives a cleared key's index to a later put; so the index records
    each row's partition and key (:data:`OWNERS`, sent by the adapter) and
    a get whose lookup found key ``k`` at an index that a put has since
    given to another key raises ``RuntimeError`` naming both keys. (TQ's
    own ``kv_batch_put``/``kv_batch_get`` send no owners and are not checked,
    as on SimpleStorage, where such a get reads the new row.)

Limits: a column's memory is held until its last row is cleared (a partial
clear frees nothing). Rows are lost with their writer (see above). A put
whose index call reaches the index after another process cleared its keys
(a clear racing the put) leaves its rows there until TQ gives those global
indexes to new keys and they are rewritten or cleared, or TQ stops: the
index cannot tell such a late call from a new put of the same keys. Until
then, a get by key alone of such a key returns that put's rows where the
lookup would raise ``KeyError``.
Only tensor columns are stored (dense or jagged); the adapter
(:mod:`adapters.transfer_queue`) sends object columns as jagged bytes.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import ray
import torch
from tensordict import TensorDict
from transfer_queue.storage.bootstrap import StorageBootstrapProvider
from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory

from adapters.store_port import RESERVED_TAG_PREFIX, TagColumns
from adapters.tq_row_index import (  # the index (a light module: its actor starts without torch); re-exported
    BACKEND,
    INDEX_NAME,
    INDEX_NAMESPACE,
    INDEX_RESOURCE,
    IndexTags,
    ObjectStoreIndex,
    Owners,
    RowIndex,
    find_index,
    start_index,
)
from core.jagged import JaggedParts, from_values_offsets, jagged_parts

__all__ = [
    "BACKEND",
    "INDEX_NAME",
    "INDEX_NAMESPACE",
    "INDEX_RESOURCE",
    "INLINE_BYTES",
    "OWNERS",
    "STARTED_INDEX",
    "Frame",
    "ObjectStoreIndex",
    "Owners",
    "RayObjectStorageManager",
    "RowIndex",
    "StagedColumns",
    "assemble_column",
    "field_schema",
    "find_index",
    "frame_column",
    "gather_rows",
    "start_index",
    "unframe",
]

_WRITER = f"pid {os.getpid()} on {socket.gethostname()}"
"""How the index names this process as a writer (in the error when its rows are lost)."""

INLINE_BYTES = 64 << 10
"""Columns of fewer bytes are kept in the index's memory rather than as objects of their own."""

OWNERS = "kv_row_owners"
"""The ``extra_info`` entry by which the adapter (:mod:`adapters.transfer_queue`) tells this backend the
:data:`Owners` of the global indexes of a put's or a get's meta; TQ's own ``put``/``get`` leave it out."""

Frame = dict[str, Any]
"""A stored column: ``bytes`` (uint8 array), ``dtype`` (torch dtype name), ``shape`` (of the values), ``offsets``
(int64 row offsets of a jagged column, or None for a dense one)."""


# ---------------------------------------------------------------- column frames


def frame_column(field: str, value: Any, n: int) -> Frame:
    """The frame that stores ``value``, a column of ``n`` rows: dense ``(n, ...)`` or jagged (nested, jagged layout).

    Raises:
        TypeError: ``value`` is not a tensor (this backend stores tensor columns only).
        ValueError: ``value`` does not have ``n`` rows.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{BACKEND} stores tensor columns only: field {field!r} is a {type(value).__name__} "
            "(put object columns through adapters.transfer_queue.TransferQueueStore, which sends them as bytes)"
        )
    parts = jagged_parts(value)
    if parts is not None or value.is_nested:
        values, offsets = _jagged_parts(field, value, parts)
    else:
        values, offsets = value, None
    rows = len(offsets) - 1 if offsets is not None else (values.shape[0] if values.dim() else None)
    if rows != n:
        raise ValueError(f"field {field!r} has {rows} rows: expected {n}")
    values = values.detach().contiguous()
    return {
        "bytes": values.reshape(-1).view(torch.uint8).numpy(),
        "dtype": str(values.dtype).removeprefix("torch."),
        "shape": tuple(values.shape),
        "offsets": None if offsets is None else offsets.numpy(),
    }


def _jagged_parts(field: str, value: torch.Tensor, parts: JaggedParts | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of a nested column (``parts``: its buffers when it is jagged), offsets starting at 0."""
    if parts is not None and parts.lengths is None:
        offsets = parts.offsets.to(torch.int64)
        values = parts.values
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
            values = values[int(offsets[0]) : int(offsets[-1])]
            offsets = offsets - offsets[0]
        return values, offsets
    rows = list(value.unbind())
    if not rows:
        raise ValueError(f"field {field!r} is a nested tensor of 0 rows")
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    return torch.cat(rows), torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def unframe(frame: Frame) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, offsets)`` of a frame as fresh tensors (copies: the object store's buffers are read-only)."""
    raw, offsets = _frame_bytes(frame)
    return _column_values(raw.copy(), frame), None if offsets is None else torch.from_numpy(offsets.copy())


def _frame_bytes(frame: Frame) -> tuple[np.ndarray, np.ndarray | None]:
    """The frame's values as ``uint8 [rows of values, bytes per row]``, a numpy view of its buffer, and its offsets:
    gathered as bytes, every dtype moves the same way (torch has no index kernels for some, e.g. ``uint16`` and the
    float8 types). Numpy, not torch: a torch view of a read-only buffer warns, and silencing that is not
    thread-safe, while a get may run in any thread."""
    rows, inner = frame["shape"][0], frame["shape"][1:]
    width = torch.empty((), dtype=getattr(torch, frame["dtype"])).element_size() * math.prod(inner)
    return frame["bytes"].reshape(rows, width), frame["offsets"]


def _column_values(raw: np.ndarray, frame: Frame) -> torch.Tensor:
    """Fresh bytes ``[rows, bytes per row]`` (C-contiguous, writable) read as the frame's dtype and row shape."""
    dtype, inner = getattr(torch, frame["dtype"]), tuple(frame["shape"][1:])
    if raw.size == 0:
        return torch.empty((raw.shape[0], *inner), dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(raw.shape[0], *inner)


def _gather_bytes(
    raw: np.ndarray, offsets: np.ndarray | None, rows: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows ``rows`` of a column's bytes ``[rows of values, bytes per row]`` (``offsets`` None: dense), as fresh
    arrays: a jagged row as one slice of bytes (one concatenation), with no per-value index, which costs more than
    the copy itself."""
    picked = np.asarray(rows, dtype=np.int64)
    if offsets is None:
        return raw[picked], None
    starts, ends = offsets[picked], offsets[picked + 1]
    out_offsets = np.zeros(len(picked) + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=out_offsets[1:])
    total = int(out_offsets[-1])
    if total == 0 or raw.shape[1] == 0:
        return np.zeros((total, raw.shape[1]), dtype=np.uint8), out_offsets
    return np.concatenate([raw[a:b] for a, b in zip(starts.tolist(), ends.tolist())]), out_offsets


def gather_rows(values: torch.Tensor, offsets: torch.Tensor | None, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``rows`` (int64 positions) of a column, as a fresh ``(values, offsets)``; offsets None for dense.

    A jagged column's rows are copied as one slice of bytes each (see :func:`_gather_bytes`).

    Example:
        >>> v, o = gather_rows(torch.arange(5), torch.tensor([0, 2, 2, 5]), torch.tensor([2, 0]))
        >>> v.tolist(), o.tolist()
        ([2, 3, 4, 0, 1], [0, 3, 5])
    """
    if offsets is None:
        return values.index_select(0, rows), None
    inner = tuple(values.shape[1:])
    width = values.element_size() * math.prod(inner)
    if values.numel() == 0:
        raw = np.zeros((values.shape[0], width), dtype=np.uint8)
    else:
        flat = values.contiguous().reshape(-1)
        if flat.stride(0) != 1:  # a one-element tensor may carry any stride, which a dtype view refuses
            flat = flat.clone()
        raw = flat.view(torch.uint8).numpy().reshape(values.shape[0], width)
    gathered, out_offsets = _gather_bytes(raw, offsets.numpy(), rows.numpy())
    total = gathered.shape[0]
    if gathered.size == 0:
        out = values.new_empty((total, *inner))
    else:
        out = torch.from_numpy(gathered).view(values.dtype).reshape(total, *inner)
    return out, torch.from_numpy(out_offsets)


def assemble_column(
    field: str, runs: Sequence[Sequence[Any]], rows: Sequence[int], frames: Mapping[str, Frame]
) -> torch.Tensor:
    """The column of rows ``rows`` (each a row of its column, in output order) of the columns ``runs`` names
    (``[column id, count]`` each: the next ``count`` rows are that column's), from ``frames`` by column id.

    Dense columns come back as ``(n, ...)`` tensors, jagged ones as nested tensors (jagged layout), both fresh
    (never a view of a frame's read-only buffer).

    Raises:
        ValueError: the rows come from columns of different kinds, dtypes or row shapes, or ``runs`` does not
            cover ``rows``.

    Example:
        >>> frames = {"c": frame_column("x", torch.tensor([[1, 2], [3, 4], [5, 6]]), 3)}
        >>> assemble_column("x", [["c", 2]], [2, 0], frames).tolist()
        [[5, 6], [1, 2]]
    """
    covered = sum(count for _column, count in runs)
    if covered != len(rows):
        raise ValueError(f"field {field!r}: the runs of columns cover {covered} rows: expected {len(rows)}")
    if len({column for column, _count in runs}) == 1:  # every row from one column (one put's), in any order
        frame = frames[runs[0][0]]
        raw, offsets = _frame_bytes(frame)
        stored = raw.shape[0] if offsets is None else len(offsets) - 1
        if len(rows) == stored and rows == list(range(stored)):  # the whole column in its order: one copy
            raw, offsets = raw.copy(), None if offsets is None else offsets.copy()
        else:
            raw, offsets = _gather_bytes(raw, offsets, rows)
        return _column_tensor(raw, offsets, frame)
    columns: dict[str, list[int]] = {}
    start = 0
    for column, count in runs:
        columns.setdefault(column, []).extend(range(start, start + count))
        start += count
    kinds = {(frames[c]["offsets"] is None, frames[c]["dtype"], tuple(frames[c]["shape"][1:])) for c in columns}
    if len(kinds) > 1:
        raise ValueError(f"field {field!r}: its rows were put with different kinds, dtypes or shapes: {sorted(map(str, kinds))}")
    parts = []
    order: list[int] = []
    for column, positions in columns.items():
        raw, offsets = _frame_bytes(frames[column])
        parts.append(_gather_bytes(raw, offsets, [rows[p] for p in positions]))
        order.extend(positions)
    raw, offsets = _concat(parts)
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[np.asarray(order, dtype=np.int64)] = np.arange(len(order), dtype=np.int64)
    raw, offsets = _gather_bytes(raw, offsets, inverse)
    return _column_tensor(raw, offsets, frames[next(iter(columns))])


def _column_tensor(raw: np.ndarray, offsets: np.ndarray | None, frame: Frame) -> torch.Tensor:
    """Fresh gathered bytes ``[rows of values, bytes per row]`` (and a jagged column's offsets) as the frame's
    column."""
    values = _column_values(raw, frame)
    if offsets is None:
        return values
    return from_values_offsets(values, torch.from_numpy(offsets))


def _concat(parts: Sequence[tuple[np.ndarray, np.ndarray | None]]) -> tuple[np.ndarray, np.ndarray | None]:
    values = np.concatenate([p[0] for p in parts])
    if parts[0][1] is None:
        return values, None
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for _values, part_offsets in parts:
        offsets.append(part_offsets[1:] + base)
        base += int(part_offsets[-1])
    return values, np.concatenate(offsets)


def field_schema(frames: Mapping[str, Frame]) -> dict[str, dict[str, Any]]:
    """The field schema this backend reports to TQ's controller for a put's ``frames``: each field's dtype and a
    row shape, no per-row state.

    A dense field's row shape is what TQ itself reports (an ``(N,)`` field's rows as ``(1,)``). A jagged field is
    reported as a regular one with row shape ``(0, *inner)``: its frame holds the row lengths, which TQ would
    otherwise keep per row and copy in every lookup. Only this backend reads its rows, so nothing reads the
    reported shape as a row's length. The shape is a list, as TQ's own (msgpack) framing delivers a ``torch.Size`` to
    the controller, so that the pickle framing of :data:`adapters.tq_controller_line.PICKLED` delivers the same.
    """
    schema = {}
    for field, frame in frames.items():
        inner = tuple(frame["shape"][1:])
        if frame["offsets"] is None:
            shape = inner if inner else (1,)
        else:
            shape = (0, *inner)
        schema[field] = {
            "dtype": getattr(torch, frame["dtype"]), "shape": list(shape), "is_nested": False, "is_non_tensor": False,
        }
    return schema


# ---------------------------------------------------------------- the index


STARTED_INDEX = "started_index"
"""The key of TQ's config section ``backend.RayObjectStore`` under which a caller that started the index before
``transfer_queue.init`` (:func:`adapters.tq_system.start`, so that its process boots beside the controller's)
hands its handle to the bootstrap, which uses it rather than start one and takes the key out of the config."""


@StorageBootstrapProvider.register_provider(BACKEND)
def _bootstrap(conf: Any) -> dict[str, Any]:
    """TQ's start-up hook for this backend: start the index, or take the one started before (:data:`STARTED_INDEX`);
    stopped by :func:`adapters.tq_system.release`.

    The handle returned is the creator's (kept in TQ's globals): Ray stops an actor once its creator's handles are
    gone, whatever other processes looked it up by name.
    """
    section = conf.backend.get(BACKEND)
    started = section.pop(STARTED_INDEX, None) if section is not None else None
    index = started if started is not None else start_index(section.get(INDEX_RESOURCE) if section is not None else None)
    ray.get(index.stats.remote())  # started and reachable before TQ's first client
    return {"index": index}


# ---------------------------------------------------------------- the storage manager


@attrs.frozen
class StagedColumns:
    """A put's columns ready to store (:meth:`RayObjectStorageManager.stage`): framed, the large ones already in
    Ray's object store, none yet at a global index.

    Attributes:
        rows: the put's rows.
        frames: each field's frame.
        large: the fields of :data:`INLINE_BYTES` or more, stored in ``shared``; the others travel inside the
            index call.
        shared: the object that holds the large fields' frames (None when there are none).
    """

    rows: int
    frames: dict[str, Frame]
    large: frozenset[str]
    shared: Any


@StorageManagerFactory.register(BACKEND)
class RayObjectStorageManager(StorageManager):
    """TQ's storage manager for :data:`BACKEND`: columns into Ray's object store, row locations to the index."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        super().__init__(controller_info, config, zmq_context=zmq_context)
        self._index = find_index()

    async def put_data(self, data: TensorDict, metadata: Any, data_parser: Callable[[Any], Any] | None = None) -> None:
        if data_parser is not None:
            raise NotImplementedError(f"data_parser is not supported by the {BACKEND} backend")
        await self.put_staged(self.stage(data), metadata)

    def stage(self, data: TensorDict) -> StagedColumns:
        """The first half of :meth:`put_data`, which needs no global index: frame ``data``'s columns and put its large
        ones into Ray's object store (one ``ray.put``, in the calling thread). A caller runs it while TQ's
        controller registers the put's keys, then stores the rows with :meth:`put_staged`. Until then nothing is
        stored: the object is freed with the last reference to the value returned.

        Raises:
            TypeError, ValueError: a column is not a tensor, or not of ``data``'s rows (see :func:`frame_column`).
        """
        n = data.batch_size[0]
        frames = {field: frame_column(field, data.get(field), n) for field in data.keys()} if n else {}
        large = frozenset(field for field, frame in frames.items() if frame["bytes"].nbytes >= INLINE_BYTES)
        # One object for the put's large columns: one ray.put.
        shared = ray.put({field: frames[field] for field in large}) if large else None
        return StagedColumns(n, frames, large, shared)

    async def put_staged(
        self, staged: StagedColumns, metadata: Any, reserved_tags: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """Store the rows of ``staged`` (:meth:`stage`) at the global indexes ``metadata`` names: the second half of
        :meth:`put_data`. ``reserved_tags[i]``, the reserved tags (integrity digests) the put merges into key
        ``i``'s tags, go to the index too, which keeps them by key for :meth:`read_by_key` (only with the
        :data:`OWNERS` the adapter names).

        Raises:
            ValueError: ``metadata`` names another number of global indexes than ``staged`` has rows.
        """
        indexes = list(metadata.global_indexes)
        if staged.rows == len(indexes) == 0:
            return
        # The index's register (which checks the row count) and the controller's notify run at once; the put
        # returns when both are done, so a get after it finds the rows in both.
        registered = self.register_staged(staged, metadata, reserved_tags)
        await self.notify_data_update(metadata.partition_ids[0], indexes, field_schema(staged.frames))
        await _wait(registered)

    def register_staged(
        self, staged: StagedColumns, metadata: Any, reserved_tags: Sequence[Mapping[str, Any]] | None = None
    ) -> Any:
        """Send the index the rows of ``staged`` at the global indexes ``metadata`` names (the index half of
        :meth:`put_staged`, without the controller's notice, which the caller sends) and return the call's object
        ref at once.

        Raises:
            ValueError: ``metadata`` names another number of global indexes than ``staged`` has rows.
        """
        indexes = list(metadata.global_indexes)
        if staged.rows != len(indexes):
            raise ValueError(f"the put has {staged.rows} rows: its meta names {len(indexes)} global indexes")
        puts = [
            (field, uuid.uuid4().hex, [(staged.shared, field) if field in staged.large else (frame, None)], indexes)
            for field, frame in staged.frames.items()
        ]
        return self._index.register.remote(_WRITER, puts, _owners(metadata), index_tags(reserved_tags))

    async def get_data(self, metadata: Any) -> TensorDict:
        """:meth:`read_indexed` as TQ's client loop runs a storage call (its waits block the loop)."""
        return self.read_indexed(metadata)

    def read_indexed(self, metadata: Any, *, wait: Callable[[Any], Any] = ray.get) -> TensorDict:
        """The rows at ``metadata``'s global indexes of its fields, located by the index (which checks each row's
        key against the owners the adapter put on ``metadata``), in the calling thread; ``wait`` as for
        :meth:`read_by_key`."""
        indexes = list(metadata.global_indexes)
        fields = list(metadata.field_names)
        owners = _owners(metadata)
        found = wait(self._index.locate.remote(indexes, fields, owners))
        return self._read(found, indexes, fields, owners, wait)

    def drop_owned(
        self, partition_id: str, keys: Sequence[str], indexes: Sequence[int], *, wait: Callable[[Any], Any] = ray.get
    ) -> None:
        """Have the index drop the rows that ``keys`` of ``partition_id`` hold at ``indexes`` (the global indexes TQ's
        controller gave them), in the calling thread; ``wait`` waits for the index's answer (see
        :meth:`read_by_key`). A row that a put has since given another key stays (:meth:`RowIndex.clear_owned`)."""
        wait(self._index.clear_owned.remote(partition_id, list(keys), list(indexes)))

    def forget_keys(self, partition_id: str, keys: Sequence[str]) -> None:
        """Send the index :meth:`RowIndex.forget_keys` without waiting for it. Ray runs one caller's calls to an
        actor in the order they were sent, so it lands after any put's index call this process sent before."""
        self._index.forget_keys.remote(partition_id, list(keys))

    def locate_keys(self, partition_id: str, keys: Sequence[str], fields: Sequence[str]) -> Any:
        """Send the index a locate of ``keys``' rows of ``fields`` by key (:meth:`RowIndex.locate_keys`) and return
        the reply's object ref at once, so that it runs while the controller's lookup of the same keys does."""
        return self._index.locate_keys.remote(partition_id, list(keys), list(fields))

    async def get_by_key(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], tag_names: Sequence[str] = ()
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]] | None:
        """:meth:`read_by_key` as TQ's client loop runs a storage call (its waits block the loop)."""
        return self.read_by_key(partition_id, keys, fields, tag_names)

    def read_by_key(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        tag_names: Sequence[str] = (),
        *,
        wait: Callable[[Any], Any] = ray.get,
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]] | None:
        """The rows of wire ``fields`` that ``keys`` of ``partition_id`` were last put at, and per key the reserved
        tags of ``tag_names`` it holds (a :class:`adapters.store_port.TagColumns`), found by the index alone (one
        call, no controller lookup: :meth:`RowIndex.locate_keys` with ``sole``); None when the index cannot answer
        for every key, field and tag (a key it does not know, a missing field, a rewrite in another wire field,
        tags a put it did not see may have changed), for the caller to read through TQ's lookup instead, which
        raises what is wrong.

        It runs in the calling thread: it touches Ray only (the index actor and the columns' objects), not TQ's
        controller, so it needs no hop to TQ's client loop. ``wait`` waits for an object ref, or a list of them,
        and returns what ``ray.get`` returns (the adapter's waits within the call's deadline, probing the store).

        ``tag_names`` must be reserved tag names (:data:`adapters.store_port.RESERVED_TAG_PREFIX`): the index keeps
        no other tags."""
        unkept = [name for name in tag_names if not name.startswith(RESERVED_TAG_PREFIX)]
        if unkept:
            raise ValueError(
                f"'tag_names' must be reserved tag names (prefix {RESERVED_TAG_PREFIX!r}), the only tags the {BACKEND} "
                f"index keeps: got {unkept}"
            )
        asked = list(tag_names) if tag_names else None
        found = wait(self._index.locate_keys.remote(partition_id, list(keys), list(fields), sole=True, tags=asked))
        if "locations" not in found:
            return None
        data = self._read(found, found["indexes"], list(fields), (partition_id, list(keys)), wait)
        if not asked:
            return data, tuple({} for _ in keys)
        return data, TagColumns(found["tags"]["values"], len(keys), absent=found["tags"]["absent"])

    async def get_located(self, metadata: Any, located: Any) -> TensorDict:
        """:meth:`read_located` as TQ's client loop runs a storage call (its waits block the loop)."""
        return self.read_located(metadata, located)

    def read_located(self, metadata: Any, located: Any, *, wait: Callable[[Any], Any] = ray.get) -> TensorDict:
        """:meth:`read_indexed` of ``metadata`` using ``located``, the ref :meth:`locate_keys` returned for the same
        keys and fields, when the index found every row at the global indexes ``metadata`` names; otherwise (the
        index and the controller disagree, or a row is missing) the rows are located again by index, as
        ``read_indexed`` does, which raises what it finds wrong. In the calling thread; ``wait`` as for
        :meth:`read_by_key`."""
        indexes = list(metadata.global_indexes)
        fields = list(metadata.field_names)
        owners = _owners(metadata)
        found = wait(located)
        if found.get("indexes") != indexes or set(found.get("locations", ())) != set(fields):
            found = wait(self._index.locate.remote(indexes, fields, owners))
        return self._read(found, indexes, fields, owners, wait)

    def _read(
        self,
        found: dict[str, Any],
        indexes: list[int],
        fields: list[str],
        owners: Owners | None,
        wait: Callable[[Any], Any] = ray.get,
    ) -> TensorDict:
        """The rows ``found`` (an index's locate reply for ``indexes`` and ``fields``) locates, read (``wait`` on
        their objects' refs) and assembled."""
        if "missing" in found:
            field, index = found["missing"]
            raise RuntimeError(
                f"{BACKEND}: no stored row of field {field!r} at global index {index}: it was cleared, or its put "
                "had not finished, while this get ran"
            )
        if "reused" in found:
            field, index, (partition, key) = found["reused"]
            assert owners is not None  # only a get that names its owners is told of reuse
            wanted = owners[1][indexes.index(index)]
            raise RuntimeError(
                f"{BACKEND}: the row of field {field!r} at global index {index} is key {key!r} of partition "
                f"{partition!r}, not key {wanted!r} of partition {owners[0]!r}: {wanted!r} was cleared and its index "
                "reused by another put while this get ran"
            )
        columns = found["columns"]
        frames: dict[str, Frame] = {}
        shared: dict[Any, list[tuple[str, str]]] = {}  # object ref -> [(column id, field in the object)]
        for column, ((stored, member), _writer) in columns.items():
            if member is None:
                frames[column] = stored
            else:
                shared.setdefault(stored, []).append((column, member))
        try:
            for members, objects in zip(shared.values(), wait(list(shared)) if shared else []):
                frames.update((column, objects[member]) for column, member in members)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as error:
            writers = sorted({entry[1] for entry in columns.values()})
            raise RuntimeError(
                f"{BACKEND}: rows of fields {fields} are lost: the process that wrote them died "
                f"(writers of these rows: {', '.join(writers)})"
            ) from error
        assembled = {
            field: assemble_column(field, runs, rows, frames) for field, (runs, rows) in found["locations"].items()
        }
        return TensorDict(assembled, batch_size=[len(indexes)])

    async def clear_data(self, metadata: Any) -> None:
        await _wait(self._index.clear.remote(list(metadata.global_indexes)))


def index_tags(reserved_tags: Sequence[Mapping[str, Any]] | None) -> IndexTags | None:
    """A put's reserved tags as the index's :meth:`RowIndex.register` takes them: by name (the lists of a
    :class:`adapters.store_port.TagColumns`, which Ray's encoding carries natively), else a dict per key."""
    if reserved_tags is None:
        return None
    if isinstance(reserved_tags, TagColumns):
        return {
            "values": {name: reserved_tags.column(name) for name in reserved_tags.names},
            "absent": {name: sorted(reserved_tags.lacking(name)) for name in reserved_tags.names},
        }
    return [dict(tags) for tags in reserved_tags]


def _owners(metadata: Any) -> Owners | None:
    """The :data:`Owners` the adapter put on ``metadata`` (checked against its global indexes), or None."""
    owners = metadata.extra_info.get(OWNERS)
    if owners is None:
        return None
    partition, keys = owners
    if len(keys) != len(metadata.global_indexes):
        raise ValueError(f"'{OWNERS}' names {len(keys)} keys: the meta has {len(metadata.global_indexes)} global indexes")
    return partition, list(keys)


async def _wait(ref: Any) -> Any:
    # A blocking get on TQ's client loop: the caller waits for this operation anyway, and Ray's own
    # blocking get answers sooner than awaiting the ref on a loop Ray does not drive.
    return ray.get(ref)
