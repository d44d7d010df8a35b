"""The index of the ``RayObjectStore`` backend: where each row of each field lives, and whose row it is.

:class:`RowIndex` is the index's logic without Ray; :class:`ObjectStoreIndex` runs it as one named Ray actor per
TransferQueue system (:func:`start_index`, :func:`find_index`). The rest of the backend, the column frames and
TransferQueue's storage manager, is :mod:`adapters.tq_object_store`, which re-exports these names.

This module imports Ray and the standard library only, so the index actor's process starts without torch,
tensordict or TransferQueue: in a fraction of the time and memory (``tests/property/test_architecture.py``
keeps it so).

Invariant: see :class:`RowIndex`; ``tests/property/test_tq_object_store.py`` states its laws.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, groupby
from operator import eq, itemgetter
from typing import Any

import ray

from adapters.node_resource import resource_options

BACKEND = "RayObjectStore"
"""The backend's name in TQ's config (``backend.storage_backend``) and factories."""

INDEX_NAME = "TransferQueueObjectStoreIndex"
INDEX_NAMESPACE = "transfer_queue"

CLEARED_EARLY_LIMIT = 4096
"""How many of the latest ``(key, global index)`` pairs :meth:`RowIndex.clear_owned` released it remembers, so that a
put racing the clear is not answered by key (16 GRPO steps of 256 rows; about 0.75 MB)."""

IndexTags = Sequence[Mapping[str, Any]] | dict[str, dict[str, Any]]
"""A put's reserved tags as :meth:`RowIndex.register` takes them: a mapping per row, or by name, ``{"values":
{name: [value of each row]}, "absent": {name: [rows that lack it]}}`` (see
:func:`adapters.tq_object_store.index_tags`)."""

_first, _second = itemgetter(0), itemgetter(1)

_NO_FIELDS: Mapping[str, tuple[str, int]] = {}
"""The fields of a global index no put wrote (never written)."""

_NO_TAGS: Mapping[str, Any] = {}
"""The reserved tags of a row no put merged any into (never written)."""

Owners = tuple[str, Sequence[str]]
"""``(partition id, [key of each row])``: whose rows a put's columns hold (the adapter sends them as
:data:`adapters.tq_object_store.OWNERS`)."""


class RowIndex:
    """The live columns, and which column holds each ``(global index, field)``: the index's logic, without Ray.

    A column's ``stored`` value is opaque here (an object ref and the field inside the put's object, or a frame).

    Invariants (``tests/property/test_tq_object_store.py`` states them as laws):
      * :meth:`locate` answers, for each ``(global index, field)``, the column and row of the latest
        :meth:`register` of it since the index was last cleared, or ``missing``;
      * given owners, it never answers a row that a put registered under another partition or key: it
        reports ``reused`` instead;
      * :meth:`locate_keys` answers, for each key, the global index whose latest register named that key (no
        clear or register without owners there since, no later register of the key elsewhere, and no
        :meth:`clear_owned` of the key at that index before that register came), or
        ``unknown``;
      * a column is counted by :meth:`stats` exactly while one of its rows is the latest of its
        ``(global index, field)``: after every index is cleared, none is;
      * :meth:`locate_keys` with ``tags`` answers each key's reserved tags merged, new values winning, from the puts
        that named it since its row's last clear, or reports the first key whose row a put without owners, or a
        failed put (:meth:`forget_keys`), reached since that clear.
    """

    def __init__(self) -> None:
        # column id -> [object ref, live rows, writer, owners: (partition, [key of each row]) or None]
        self._columns: dict[str, list[Any]] = {}
        self._rows: dict[int, dict[str, tuple[str, int]]] = {}  # global index -> {field: (column id, row)}
        # The key each global index was last put under, by a put that named its owners, and back.
        self._index_of: dict[tuple[str, str], int] = {}
        self._key_of: dict[int, tuple[str, str]] = {}
        # Global indexes where a put that named its owners added a wire field beside another wire field of the same
        # user field (a rewrite in another kind, dtype or shape): which of the two is current, only the keys' tags say.
        self._shadowed: set[int] = set()
        # The reserved tags (integrity digests) that the puts naming an index's key merged into its tags, since the
        # index's last clear or change of key: what TQ's controller holds of them, unless the index is in
        # ``_untagged`` (a put without owners, or a failed put, may have changed the controller's), until a clear.
        self._tags: dict[int, dict[str, Any]] = {}
        self._untagged: set[int] = set()
        # (partition, key) -> the global index an owned clear released it at, the latest CLEARED_EARLY_LIMIT: a put
        # of the key there may still be on its way here (racing the clear), and its rows must not be answered by key.
        self._cleared_early: OrderedDict[tuple[str, str], int] = OrderedDict()

    def register(
        self,
        writer: str,
        puts: Sequence[tuple[str, str, list[Any], Sequence[int]]],
        owners: Owners | None = None,
        tags: IndexTags | None = None,
    ) -> None:
        """Record columns ``(field, column id, [stored], global indexes)`` put by ``writer``, where ``stored`` is
        ``(object ref, field)`` for a column inside a put's shared object and ``(frame, None)`` for one kept here;
        row ``i`` of a column holds global index ``indexes[i]``, of key ``owners[1][i]`` in partition
        ``owners[0]`` when ``owners`` is given. Releases the rows they overwrite.

        ``tags[i]`` (with ``owners``) are the reserved tags the put merges into row ``i``'s key's tags (see
        :meth:`locate_keys`), or ``tags`` holds them by name (:data:`IndexTags`); a put without owners leaves the
        tags of its rows unknown here until they are cleared. A row whose key an owned clear released at its index
        before this register arrived (see :meth:`clear_owned`) is kept as a row of no known key, as a put without
        owners leaves it.

        Raises:
            ValueError: a column's ``[stored]`` holds other than one entry, or ``owners`` (or, with owners,
                ``tags``) names another number of rows than the first column has; nothing is recorded.
        """
        if not puts:
            return
        first = puts[0][3]
        _check_register(puts, len(first), owners, tags)
        # Every column of a put holds the same rows: their keys and tags are recorded once, from the first.
        self._own_rows(first, owners, tags)
        bases = [_user_field(field) if owners is not None else None for field, *_ in puts]
        if self._fresh_columns(puts, bases):
            self._register_rows(writer, puts, bases, owners)
            return
        for (field, column, (stored,), indexes), base in zip(puts, bases):  # a column, then its rows
            self._columns[column] = [stored, len(indexes), writer, owners]
            for row, index in enumerate(indexes):
                old = self._put_field(self._rows.setdefault(index, {}), index, field, (column, row), base)
                if old is not None:
                    self._release(old, 1)

    def _fresh_columns(
        self, puts: Sequence[tuple[str, str, list[Any], Sequence[int]]], bases: list[str | None]
    ) -> bool:
        """Whether :meth:`_register_rows` may record ``puts``, as the adapter's puts are: new column ids, one per
        column; distinct fields (and user fields ``bases``, when the put names its owners); the same rows in every
        column."""
        first = puts[0][3]
        fields = [field for field, *_ in puts]
        columns = [column for _field, column, *_ in puts]
        return (
            len(set(fields)) == len(fields)
            and (bases[0] is None or len(set(bases)) == len(bases))
            and len(set(columns)) == len(columns)
            and not any(column in self._columns for column in columns)
            and all(indexes is first or list(indexes) == list(first) for *_, indexes in puts)
        )

    def _register_rows(
        self,
        writer: str,
        puts: Sequence[tuple[str, str, list[Any], Sequence[int]]],
        bases: list[str | None],
        owners: Owners | None,
    ) -> None:
        """The rows' half of :meth:`register` for :meth:`_fresh_columns` puts, row by row: a row that holds no field
        yet takes every column's field in one mapping (none is overwritten, none shadows another wire field of its
        user field); the rows overwritten are released at the end (never one of these columns, which are new)."""
        named = []
        for (field, column, (stored,), indexes), base in zip(puts, bases):
            self._columns[column] = [stored, len(indexes), writer, owners]
            named.append((field, column, base))
        released: Counter[str] = Counter()
        for row, index in enumerate(puts[0][3]):
            fields = self._rows.get(index)
            if not fields:
                self._rows[index] = {field: (column, row) for field, column, _base in named}
                continue
            for field, column, base in named:
                old = self._put_field(fields, index, field, (column, row), base)
                if old is not None:
                    released[old] += 1
        for column, count in released.items():
            self._release(column, count)

    def _own_rows(self, indexes: Sequence[int], owners: Owners | None, tags: IndexTags | None) -> None:
        """Record the key of each row of a put at ``indexes`` (:meth:`_own`) and merge its reserved tags: the keys' half
        of :meth:`register`."""
        by_name = None
        if isinstance(tags, dict):  # [(name, values, rows that lack it)]
            absent = tags.get("absent", {})
            by_name = [(name, values, set(absent.get(name, ()))) for name, values in tags["values"].items()]
        for row, index in enumerate(indexes):
            key = None if owners is None else (owners[0], owners[1][row])
            if key is not None and self._cleared_early.get(key) == index:  # cleared before it landed
                del self._cleared_early[key]
                self.forget_keys(key[0], [key[1]])
                key = None
            self._own(index, key)
            if key is None:
                self._untagged.add(index)
            elif by_name is not None:
                for name, values, lacking in by_name:
                    if row not in lacking:
                        self._tags.setdefault(index, {})[name] = values[row]
            elif tags is not None and tags[row]:
                self._tags.setdefault(index, {}).update(tags[row])

    def _put_field(
        self,
        fields: dict[str, tuple[str, int]],
        index: int,
        field: str,
        where: tuple[str, int],
        base: str | None,
    ) -> str | None:
        """Set ``field`` of the row at ``index`` (its ``fields``) to ``where``, marking the row shadowed when it now
        holds two wire fields of user field ``base``; returns the column of the row it overwrites, for the caller to
        release, or None."""
        old = fields.get(field)
        if old is None and base is not None and fields and any(_user_field(f) == base for f in fields):
            self._shadowed.add(index)
        fields[field] = where
        return None if old is None else old[0]

    def locate_keys(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        sole: bool = False,
        tags: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """:meth:`locate` of the global indexes that ``keys`` of ``partition`` were last put at (by puts that named
        their owners), with those indexes under ``"indexes"``; or ``{"unknown": key}`` for the first key the index
        holds no row of. A caller that also asked TQ's controller keeps this answer only when the controller's
        global indexes are the same (the index may be behind or ahead of it).

        With ``sole``, also ``{"shadowed": key}`` for the first key whose row holds two wire fields of one user
        field, any field, asked for or not (a rewrite in another kind, dtype or shape, put through the adapter, since
        the row's last clear): only the key's tags tell which is current, so a caller that reads without TQ's lookup
        (:meth:`adapters.tq_object_store.RayObjectStorageManager.read_by_key`) does not read such a row.

        With ``tags`` (reserved tag names: only a put's reserved tags, the integrity digests, are kept here), also
        ``"tags"``: per key, those of ``tags`` that the puts naming it merged into its tags since its row's last
        clear, as TQ's controller holds them, by name (``{"values": {name: [value of each key]}, "absent": {name:
        [positions of the keys that lack it]}}``, the fields of :class:`adapters.store_port.TagColumns`: lists
        of ints, which Ray's reply encoding carries natively, where a dict per key is pickled one by one); or
        ``{"untagged": key}`` for the first key whose tags the controller may hold otherwise (a put that named no
        owners or that failed, see :meth:`forget_keys`, reached its row since the row's last clear)."""
        index_of = self._index_of
        indexes = [index_of.get((partition, key)) for key in keys]
        known = indexes.index(None) if None in indexes else len(indexes)  # the keys before the first unknown one
        if (sole and self._shadowed) or (tags is not None and self._untagged):
            for key, index in zip(keys[:known], indexes[:known]):
                if sole and index in self._shadowed:
                    return {"shadowed": key}
                if tags is not None and index in self._untagged:
                    return {"untagged": key}
        if known < len(indexes):
            return {"unknown": keys[known]}
        found = self.locate(indexes, fields, (partition, keys))
        found["indexes"] = indexes
        if tags is not None and "locations" in found:
            held = [self._tags.get(index, _NO_TAGS) for index in indexes]
            values: dict[str, list[Any]] = {}
            absent: dict[str, list[int]] = {}
            for name in tags:
                values[name] = column = [tag.get(name) for tag in held]
                if any(value is None for value in column):  # a lacking key, or a value of None: tell them apart
                    absent[name] = [i for i, tag in enumerate(held) if name not in tag]
            found["tags"] = {"values": values, "absent": absent}
        return found

    def locate(self, indexes: Sequence[int], fields: Sequence[str], owners: Owners | None = None) -> dict[str, Any]:
        """Where the rows of ``fields`` at ``indexes`` are: ``{"locations": {field: [runs, [row in its column of
        each index]]}, "columns": {column id: [stored, writer]}}``, where ``runs`` (``[[column id, count], ...]``)
        says which column holds each index's row: the first ``count`` indexes' rows are in the first column, and
        so on (one run when one put wrote them all); or ``{"missing": [field, global index]}`` for the first row
        it does not hold; or, when ``owners`` (the partition and the key of each index, as the caller's lookup
        found them) is given, ``{"reused": [field, global index, [partition, key] stored there]}`` for the first
        row that a put registered under another partition or key.

        The reply is lists of strings and ints, which Ray's reply encoding carries natively (a tuple per row
        would be pickled one by one), with each column id once per run rather than once per row.
        """
        if owners is not None and len(owners[1]) != len(indexes):
            raise ValueError(f"'owners' names {len(owners[1])} keys for {len(indexes)} global indexes")
        locations: dict[str, list[list[Any]]] = {}
        wanted: dict[str, None] = {}
        held = [self._rows.get(index, _NO_FIELDS) for index in indexes]
        for field in fields:
            wheres = [fields_of.get(field) for fields_of in held]
            found = wheres.index(None) if None in wheres else len(wheres)  # the rows before the first missing one
            rows = list(map(_second, wheres[:found]))
            runs = [[column, len(list(run))] for column, run in groupby(map(_first, wheres[:found]))]
            if owners is not None:  # the first row another key's put registered, among those
                start = 0
                for column, count in runs:
                    reused = self._reused(field, column, indexes, rows, start, start + count, owners)
                    if reused is not None:
                        return reused
                    start += count
            if found < len(wheres):
                return {"missing": [field, indexes[found]]}
            wanted.update(dict.fromkeys(column for column, _count in runs))
            locations[field] = [runs, rows]
        return {"locations": locations, "columns": {c: [self._columns[c][0], self._columns[c][2]] for c in wanted}}

    def _reused(
        self, field: str, column: str, indexes: Sequence[int], rows: Sequence[int], start: int, stop: int, owners: Owners
    ) -> dict[str, Any] | None:
        """:meth:`locate`'s answer for the first of positions ``start:stop`` (a run of ``column``, whose row of
        position ``i`` is ``rows[i]``) whose row a put registered under another partition or key than ``owners``
        names, or None."""
        stored = self._columns[column][3]
        if stored is None:
            return None
        partition, keys = stored
        if partition == owners[0] and all(map(eq, map(keys.__getitem__, rows[start:stop]), owners[1][start:stop])):
            return None
        for i in range(start, stop):
            if partition != owners[0] or keys[rows[i]] != owners[1][i]:
                return {"reused": [field, indexes[i], [partition, keys[rows[i]]]]}
        return None

    def clear(self, indexes: Sequence[int]) -> None:
        """Release every field of the rows at ``indexes`` (unknown ones are ignored)."""
        indexes = list(indexes)
        held = [self._rows.pop(index, _NO_FIELDS) for index in indexes]
        released = Counter(map(_first, chain.from_iterable(fields.values() for fields in held)))
        for index in indexes:
            self._own(index, None)
            self._tags.pop(index, None)  # a row of no known key's too
        self._shadowed.difference_update(indexes)
        self._untagged.difference_update(indexes)
        for column, count in released.items():
            self._release(column, count)

    def clear_owned(self, partition: str, keys: Sequence[str], indexes: Sequence[int]) -> None:
        """:meth:`clear` of each of ``indexes`` whose rows key ``keys[i]`` of ``partition`` still holds there, or no
        known key does (a put that named no owners, or whose keys were forgotten, wrote them); an index that a put
        has since given another key keeps that put's rows.

        The keys are answered by key nowhere after it (one the index had at another index, where a put racing an
        earlier clear left it, is forgotten there: :meth:`forget_keys`).

        This is the index's half of a clear that releases the global indexes in TQ's controller at the same time
        (:meth:`adapters.transfer_queue.TransferQueueStore._drop_and_release`): a put may take a released index and reach the index
        first.

        Each ``(key, index)`` is also remembered (the latest :data:`CLEARED_EARLY_LIMIT` of them): a put that gave
        the key that index may not have reached the index yet (the clear raced it), or may rewrite rows of the key
        there (a write-back racing the clear). When the next :meth:`register` of that key at that index arrives,
        its rows are kept as rows of no known key: :meth:`locate_keys` reports the key unknown, so the adapter asks
        TQ's controller, which no longer holds the key (``KeyError``), rather than reading the raced put's rows by
        key. A put of the key after the clear that TQ gives the same index again is answered through the
        controller's lookup as well, until the key's next put there."""
        named = [(partition, key) for key in keys]
        dropped = [index for key, index in zip(named, indexes) if self._key_of.get(index, key) == key]
        remembered = self._cleared_early
        for key, index in zip(named, indexes):
            remembered[key] = index
            remembered.move_to_end(key)  # the newest
            if self._index_of.get(key, index) != index:  # TQ holds the key no more, here or there
                self.forget_keys(partition, [key[1]])
        while len(remembered) > CLEARED_EARLY_LIMIT:
            remembered.popitem(last=False)
        self.clear(dropped)

    def forget_keys(self, partition: str, keys: Sequence[str]) -> None:
        """Stop answering ``keys`` of ``partition`` by key (:meth:`locate_keys` reports them unknown until a later
        put names them again); their rows stay, and :meth:`locate` by global index still finds them.

        A put that failed after its rows reached the index calls this: its keys' tags were set back, or the keys
        dropped, so which rows and fields the keys hold now, and which tags, only TQ's lookup can say: their rows'
        tags stay unknown here (:meth:`locate_keys` with ``tags``) until the rows are cleared."""
        for key in keys:
            index = self._index_of.pop((partition, key), None)
            if index is not None and self._key_of.get(index) == (partition, key):
                del self._key_of[index]
                self._untagged.add(index)

    def stats(self) -> dict[str, int]:
        """``columns`` (live column objects) and ``rows`` (global indexes holding a field)."""
        return {"columns": len(self._columns), "rows": len(self._rows)}

    def _own(self, index: int, key: tuple[str, str] | None) -> None:
        """Record that global index ``index`` is now ``key``'s (None: no known key's); another key's tags go."""
        old = self._key_of.pop(index, None)
        if old != key:
            self._tags.pop(index, None)
        if old is not None and self._index_of.get(old) == index:
            del self._index_of[old]
        if key is not None:
            stale = self._index_of.get(key)
            if stale is not None and stale != index:
                self._key_of.pop(stale, None)
            self._index_of[key] = index
            self._key_of[index] = key

    def _release(self, column: str, count: int) -> None:
        entry = self._columns.get(column)
        if entry is None:
            return
        entry[1] -= count
        if entry[1] <= 0:
            del self._columns[column]


def _check_register(
    puts: Sequence[tuple[str, str, list[Any], Sequence[int]]], rows: int, owners: Owners | None, tags: IndexTags | None
) -> None:
    """:meth:`RowIndex.register`'s checks of its arguments, before it records anything (``rows``: the first column's)."""
    for field, _column, stored, _indexes in puts:
        if len(stored) != 1:
            raise ValueError(f"the column of field {field!r} must hold one stored entry: got {len(stored)}")
    if owners is None:
        return
    if len(owners[1]) != rows:
        raise ValueError(f"'owners' names {len(owners[1])} keys for the {rows} rows of the put")
    if isinstance(tags, dict):
        for name, values in tags["values"].items():
            if len(values) != rows:
                raise ValueError(f"'tags' holds {len(values)} values of {name!r} for the {rows} rows of the put")
    elif tags is not None and len(tags) != rows:
        raise ValueError(f"'tags' holds {len(tags)} rows' tags for the {rows} rows of the put")


def _user_field(wire: str) -> str:
    """The user field of an adapter's wire field ``name@kind.dtype.shape`` (see :func:`adapters.tq_wire.wire_name`)."""
    return wire.rpartition("@")[0]


def _served(method: Callable[..., Any]) -> Callable[..., Any]:
    """An actor method that runs the :class:`RowIndex` method ``method`` on the actor's index (its signature and
    docstring)."""

    @functools.wraps(method)
    def serve(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self.rows, *args, **kwargs)

    return serve


@ray.remote(num_cpus=0)
class ObjectStoreIndex:
    """:class:`RowIndex` as one Ray actor per TQ system.

    Borrows every column object (its writer owns it); serves one call at a
    time, so its counts are consistent.

    The actor holds its :class:`RowIndex` (``rows``) rather than being one:
    Ray wraps every method of an actor's class in its tracing hook, private
    ones included, so each per-row helper call of a put or a clear (one per
    row) would go through that wrapper too.
    """

    def __init__(self) -> None:
        self.rows = RowIndex()

    register = _served(RowIndex.register)
    locate_keys = _served(RowIndex.locate_keys)
    locate = _served(RowIndex.locate)
    clear = _served(RowIndex.clear)
    clear_owned = _served(RowIndex.clear_owned)
    forget_keys = _served(RowIndex.forget_keys)
    stats = _served(RowIndex.stats)


INDEX_RESOURCE = "required_node_resource"
"""The key of TQ's config section ``backend.RayObjectStore`` that names a custom node resource the index needs
(null: any node; as ``backend.SimpleStorage.required_node_resource`` places SimpleStorage's units). The index
receives every column smaller than :data:`adapters.tq_object_store.INLINE_BYTES` of every put, so on a cluster it
decides which node's links carry those bytes: with a resource that only worker nodes have, the driver's node carries
none of them."""


def start_index(resource: str | None = None) -> Any:
    """Start this TQ system's index actor (named :data:`INDEX_NAME`); the caller owns it.

    Args:
        resource: a custom node resource: the index runs on a node that has it (Ray picks which); None: where Ray
            puts it (its default policy prefers the caller's node).

    Raises:
        ValueError: no alive node of the Ray cluster has ``resource`` (checked first: Ray would leave the actor
            pending for ever).
    """
    options = resource_options(resource, f"backend.{BACKEND}.{INDEX_RESOURCE}")
    return ObjectStoreIndex.options(name=INDEX_NAME, namespace=INDEX_NAMESPACE, lifetime=None, **options).remote()


def find_index() -> Any:
    """The running index actor.

    Raises:
        RuntimeError: none runs on this Ray cluster.
    """
    try:
        return ray.get_actor(INDEX_NAME, namespace=INDEX_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"no {BACKEND} index is running on this Ray cluster (actor {INDEX_NAME!r} in namespace {INDEX_NAMESPACE!r}): "
            "start TransferQueue with this backend first"
        ) from None
