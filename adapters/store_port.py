"""The store port: the protocols a key/value store of per-row tensors implements, and their checks.

The adapters (``adapters.memory``, ``adapters.ray_memory``,
``adapters.transfer_queue``) implement it and the shell consumes it, so the
port sits with the adapters and imports nothing of the shell.

A store holds rows under ``(partition_id, key)``; each row has named fields.
``put`` returns a :class:`core.meta.KVBatchMeta` receipt; ``get`` reads columns
back by key. Every adapter keeps these semantics, checked by one contract
suite (``tests/e2e/test_store_contract.py``):

* **Shape-faithful round trips.** A dense ``(N, ...)`` field comes back dense,
  a jagged field jagged with the same rows, ``(N,)`` stays ``(N,)`` and
  ``(N, 1)`` stays ``(N, 1)``; object columns come back equal and in the same
  container kind; every dtype of ``core.dtypes.CODEC_DTYPES`` is kept bit for
  bit, and a tensor of another dtype is refused (``TypeError``) before I/O.
* **Fail loudly.** A field that some keys lack raises ``KeyError`` naming the
  field and the keys; unknown or cleared keys raise ``KeyError``; duplicate
  keys, a batch size that differs from the key count, and tags or lengths not
  1:1 with keys raise ``ValueError`` before any I/O, so a rejected put writes
  nothing.
* **Exact clears.** ``clear(K)`` leaves every key outside ``K`` readable.
* **Reserved tags.** Tag names under :data:`RESERVED_TAG_PREFIX` (the
  integrity digests) are rejected by ``put``, writing nothing; only
  :meth:`ReservedTagPutClient.put_with_reserved_tags` writes them.
* **Independent partitions; last write wins** for a field under a key.

This module holds the protocols, the pre-I/O validation every adapter calls, and
:class:`StoreAdapter`, the adapters' base, whose public methods call it.

Invariant: every adapter raises exactly the errors of :func:`validate_put`,
:func:`validate_get`, :func:`missing_field_error` and :func:`unknown_keys_error`,
so callers see one error vocabulary whatever the store.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from tensordict import TensorDict

from core.meta import KVBatchMeta

Keys = Sequence[str]
Tags = Sequence[Mapping[str, Any]]
SeqLens = Sequence[int]

RESERVED_TAG_PREFIX = "__digest__."
"""Tag names with this prefix are reserved for the integrity digests (``shell.metering``): a ``put``
rejects them, so a caller cannot forge a digest; only :meth:`ReservedTagPutClient.put_with_reserved_tags`
writes them."""


class TagColumns(Sequence[Mapping[str, Any]]):
    """Per-key tags held by tag name: ``values[name][i]`` is key ``i``'s value of tag ``name``.

    What :meth:`TaggedGetClient.get_with_tags` returns in place of a tuple of
    per-key dicts where the store keeps the tags by name (the ``RayObjectStore``
    index does): item ``i`` is key ``i``'s mapping, built when read, and the
    sequence equals the tuple of those mappings. :meth:`column` gives one tag
    of every key without building them; ``shell.metering`` reads the integrity
    digests so.

    Invariant: every name has one value per key, and ``absent[name]`` holds
    the positions of the keys that lack tag ``name`` (their entries in
    ``values[name]`` mean nothing), so a tag whose value is None is told from a
    missing one.

    Example:
        >>> tags = TagColumns({"__digest__.x": [7, None]}, 2, absent={"__digest__.x": [1]})
        >>> tags == ({"__digest__.x": 7}, {}), tags.column("__digest__.x")
        (True, [7, None])
    """

    __slots__ = ("_values", "_absent", "_n")

    def __init__(
        self, values: Mapping[str, Sequence[Any]], n: int, *, absent: Mapping[str, Collection[int]] | None = None
    ) -> None:
        for name, column in values.items():
            if len(column) != n:
                raise ValueError(f"tag {name!r} must have {n} values (one per key): got {len(column)}")
        unknown = [name for name in absent or {} if name not in values]
        if unknown:
            raise ValueError(f"'absent' names tags without values: {unknown}")
        for name, where in (absent or {}).items():
            outside = sorted(i for i in where if not 0 <= i < n)
            if outside:
                raise ValueError(f"'absent' positions of tag {name!r} must be in range({n}): got {outside}")
        self._values = {name: list(column) for name, column in values.items()}
        self._absent = {name: frozenset(where) for name, where in (absent or {}).items() if where}
        self._n = n

    @classmethod
    def from_mappings(cls, rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> TagColumns:
        """The tags ``names`` of per-key mappings ``rows``, held by name (a name a key lacks is absent there)."""
        values = {name: [row.get(name) for row in rows] for name in names}
        absent = {name: [i for i, row in enumerate(rows) if name not in row] for name in names}
        return cls(values, len(rows), absent=absent)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._n)))
        i = operator.index(i)
        if not -self._n <= i < self._n:
            raise IndexError(f"key position {i} out of range for {self._n} keys")
        i %= self._n
        return {
            name: column[i] for name, column in self._values.items() if i not in self._absent.get(name, ())
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._n and all(mine == theirs for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TagColumns({list(self)!r})"

    @property
    def names(self) -> tuple[str, ...]:
        """The tag names held (a key may lack some: :meth:`lacking`)."""
        return tuple(self._values)

    def lacking(self, name: str) -> frozenset[int]:
        """The positions of the keys that lack tag ``name`` (every key, for a name not held)."""
        if name not in self._values:
            return frozenset(range(self._n))
        return self._absent.get(name, frozenset())

    def column(self, name: str, default: Any = None) -> list[Any]:
        """Tag ``name`` of every key, in key order; ``default`` for a key that lacks it."""
        column = self._values.get(name)
        if column is None:
            return [default] * self._n
        absent = self._absent.get(name)
        if not absent:
            return list(column)
        return [default if i in absent else value for i, value in enumerate(column)]


@runtime_checkable
class DataPlaneClient(Protocol):
    """Synchronous store client. See the module docstring for the semantics."""

    def put(
        self, keys: Keys, partition_id: str, fields: TensorDict, *, tags: Tags | None = None,
        sequence_lengths: SeqLens | None = None, require_stored: bool = False,
    ) -> KVBatchMeta:
        """Write ``fields`` (batch size ``len(keys)``) under ``keys``; return the receipt.

        With ``require_stored`` every key must already be stored (a write-back
        of results under the keys a first write stored): otherwise ``KeyError``
        names the missing keys and nothing is written, checked in the same
        store call as the write.
        """
        ...

    def get(self, keys: Keys, partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """Read ``select_fields`` of ``keys`` (in that order) as a TensorDict of batch size ``len(keys)``."""
        ...

    def clear(self, keys: Keys, partition_id: str) -> None:
        """Remove ``keys`` (all their fields and tags) from ``partition_id``."""
        ...

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        """The keys currently stored in ``partition_id`` (empty for an unknown partition)."""
        ...

    def describe(self, keys: Keys, partition_id: str) -> KVBatchMeta:
        """What is stored for ``keys``: the fields every key holds, merged tags and sequence lengths.

        Raises:
            KeyError: some keys are not stored.
        """
        ...

    def close(self) -> None:
        """Release the client's resources. Closing twice does nothing."""
        ...


@runtime_checkable
class TaggedGetClient(Protocol):
    """Optional capability of a synchronous client: a get that also returns some of each key's tags.

    ``get_with_tags`` reads the columns and the tags in the same lookup, so
    they describe one state of the store, at the cost of one ``get``.
    ``shell.metering.MeteredClient`` uses it, when the inner client has it, to
    read the integrity digests with the data instead of a separate
    ``describe``. Every adapter in ``adapters/`` implements it.
    """

    def get_with_tags(
        self, keys: Keys, partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]]:
        """``get(keys, partition_id, select_fields)`` and, per key in request order, the tags of
        ``tag_names`` that key holds (a name the key lacks is absent from its mapping): a tuple of
        dicts, or a :class:`TagColumns` (equal to that tuple) where the store keeps the tags by name.

        Raises:
            Whatever ``get`` raises; ``TypeError`` if ``tag_names`` is a single
            string; ``ValueError`` if it names a tag reserved by the adapter.
        """
        ...


@runtime_checkable
class ReservedTagPutClient(Protocol):
    """Optional capability of a synchronous client: a put that also writes reserved tags.

    ``put`` rejects tag names under :data:`RESERVED_TAG_PREFIX`; this is the
    one way to write them. ``shell.metering.MeteredClient`` writes its
    integrity digests through it and needs it to verify integrity. Every
    adapter in ``adapters/`` implements it.
    """

    def put_with_reserved_tags(
        self, keys: Keys, partition_id: str, fields: TensorDict, *, reserved_tags: Tags,
        tags: Tags | None = None, sequence_lengths: SeqLens | None = None, require_stored: bool = False,
    ) -> KVBatchMeta:
        """``put``, also merging ``reserved_tags[i]`` (every name under :data:`RESERVED_TAG_PREFIX`)
        into key ``i``'s stored tags. The receipt is ``put``'s: its ``tags`` are the ones passed in
        ``tags``, without the reserved ones (the caller has those already).

        Raises:
            Whatever ``put`` raises; ``ValueError`` if ``reserved_tags`` is not
            1:1 with keys or names a tag outside the prefix; ``TypeError`` if
            an entry is not a mapping.
        """
        ...


class StoreAdapter:
    """Base of every adapter: the port's public methods, written once.

    Each public method checks that the store is open (the adapter's
    ``_check_open``) and checks its arguments before any I/O, with the
    validators below, then hands them to the adapter's hook, which does the
    I/O: ``_put`` (which also checks the put: see there), ``_get``,
    ``_clear``, ``_list_keys`` and ``_describe``. ``put`` passes no reserved
    tags, so only ``put_with_reserved_tags`` can write them.

    Attributes:
        RESERVED_TAGS: tag names the adapter keeps for itself, which
            ``get_with_tags`` must not be asked for (none by default).
    """

    RESERVED_TAGS: ClassVar[frozenset[str]] = frozenset()

    def put(
        self,
        keys: Keys,
        partition_id: str,
        fields: TensorDict,
        *,
        tags: Tags | None = None,
        sequence_lengths: SeqLens | None = None,
        require_stored: bool = False,
    ) -> KVBatchMeta:
        """Write ``fields`` (batch size ``len(keys)``) under ``keys`` in ``partition_id``.

        Each field of each key is replaced (last write wins); fields this put
        does not name are kept. ``tags[i]`` is merged into key ``i``'s tags;
        ``sequence_lengths[i]`` replaces its length (omitted: kept). With
        ``require_stored``, every key must already be stored, checked in the
        same store call as the write.

        Returns:
            The receipt of :func:`validate_put`: ``fields`` lists the fields
            *this put* wrote, ``tags`` and ``sequence_lengths`` are the ones
            passed (not merged). ``describe`` tells what is stored.

        Raises:
            RuntimeError: the store is closed, or its backend is gone.
            TypeError: ``fields`` is not a TensorDict, or a column is of an
                unsupported kind (see :func:`adapters.rows.column_spec`).
            ValueError: keys repeat or are empty; the batch size differs from
                the key count; tags or lengths are not 1:1 with keys; a tag
                name is reserved (:data:`RESERVED_TAG_PREFIX`, or by the adapter).
            KeyError: ``require_stored`` and some keys are not stored (nothing is written).
        """
        return self._put(keys, partition_id, fields, tags, sequence_lengths, None, require_stored)

    def put_with_reserved_tags(
        self, keys: Keys, partition_id: str, fields: TensorDict, *, reserved_tags: Tags,
        tags: Tags | None = None, sequence_lengths: SeqLens | None = None, require_stored: bool = False,
    ) -> KVBatchMeta:
        """See :meth:`ReservedTagPutClient.put_with_reserved_tags`."""
        return self._put(keys, partition_id, fields, tags, sequence_lengths, reserved_tags, require_stored)

    def get(self, keys: Keys, partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """Read ``select_fields`` of ``keys`` as a TensorDict of batch size ``len(keys)``, in request order.

        Each field comes back in the kind it was put (dense, jagged, object
        array, NonTensorStack), bit for bit, as fresh data the store does not share.

        Raises:
            RuntimeError: the store is closed, or its backend is gone or disagrees with what it recorded.
            TypeError: ``select_fields`` is a single string.
            ValueError: keys repeat or are empty; no field is selected; a field
                was put with different layouts for the requested keys.
            KeyError: some keys are not stored (never put, or cleared); a
                selected field is missing for some keys (names the field and keys).
        """
        return self.get_with_tags(keys, partition_id, select_fields, ())[0]

    def get_with_tags(
        self, keys: Keys, partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]]:
        """:meth:`get` plus, per key, the tags of ``tag_names`` it holds, from the same lookup.

        Raises:
            Whatever :meth:`get` raises; ``TypeError`` if ``tag_names`` is a
            single string; ``ValueError`` if it names one of :attr:`RESERVED_TAGS`.
        """
        self._check_open()
        keys, names = validate_get(keys, partition_id, select_fields)
        return self._get(keys, partition_id, names, validate_tag_names(tag_names, self.RESERVED_TAGS))

    def clear(self, keys: Keys, partition_id: str) -> None:
        """Remove ``keys`` (all their fields, tags and lengths) from ``partition_id``.

        Exact (``"k1"`` never touches ``"k11"``) and all-or-nothing: if any key is
        not stored nothing is removed. Clearing no keys does nothing.

        Raises:
            RuntimeError: the store is closed, or its backend is gone.
            TypeError: ``keys`` is a single string.
            ValueError: keys repeat or are empty strings.
            KeyError: some keys are not stored in ``partition_id``.
        """
        self._check_open()
        keys = validate_keys(keys, partition_id, allow_empty=True)
        if keys:
            self._clear(keys, partition_id)

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        """The keys stored in ``partition_id``, in the order they were first put (empty if unknown).

        Raises:
            RuntimeError: the store is closed, or its backend is gone.
            TypeError: ``partition_id`` is not a str.
        """
        self._check_open()
        return self._list_keys(validate_partition(partition_id))

    def describe(self, keys: Keys, partition_id: str) -> KVBatchMeta:
        """What is stored for ``keys``: a meta whose ``fields`` every key holds (first-put order),
        ``tags`` the merged user tags of each key, and ``sequence_lengths`` when every key has one.

        Raises:
            RuntimeError: the store is closed, or its backend is gone.
            ValueError: keys repeat or are empty.
            KeyError: some keys are not stored.
        """
        self._check_open()
        return self._describe(validate_keys(keys, partition_id), partition_id)

    # ------------------------------------------------------------ the adapter's own

    def _check_open(self) -> None:
        """Raise ``RuntimeError`` (saying how to get a working client) if the store is closed."""
        raise NotImplementedError(f"{type(self).__name__} must implement _check_open")

    def _put(self, keys: Keys, partition_id: str, fields: TensorDict, tags: Tags | None,
             sequence_lengths: SeqLens | None, reserved_tags: Tags | None, require_stored: bool) -> KVBatchMeta:
        """Check (``_check_open``, then ``validate_put(..., reserved_tags=reserved_tags)``) and write;
        with ``require_stored``, raise :func:`unknown_keys_error` for keys not stored, writing nothing.

        The one hook that gets the caller's arguments unchecked: an adapter
        that forwards the put to another process (``adapters.ray_memory``)
        sends them as they came, and also checks the columns before sending.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _put")

    def _get(
        self, keys: tuple[str, ...], partition_id: str, names: tuple[str, ...], tag_names: tuple[str, ...]
    ) -> tuple[TensorDict, Sequence[Mapping[str, Any]]]:
        """Read checked ``names`` of checked ``keys`` and, per key, its tags of ``tag_names``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _get")

    def _clear(self, keys: tuple[str, ...], partition_id: str) -> None:
        """Remove checked, non-empty ``keys``, all or nothing."""
        raise NotImplementedError(f"{type(self).__name__} must implement _clear")

    def _list_keys(self, partition_id: str) -> tuple[str, ...]:
        """The keys of a checked ``partition_id``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _list_keys")

    def _describe(self, keys: tuple[str, ...], partition_id: str) -> KVBatchMeta:
        """What is stored for checked, non-empty ``keys``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _describe")


def validate_put(
    keys: Keys,
    partition_id: str,
    fields: TensorDict,
    *,
    tags: Tags | None = None,
    sequence_lengths: SeqLens | None = None,
    reserved_tags: Tags | None = None,
) -> KVBatchMeta:
    """Check a put's arguments and build its receipt, before any I/O.

    Args:
        reserved_tags: per key, tags under :data:`RESERVED_TAG_PREFIX` that the
            adapter merges into what it writes for key ``i`` (only
            :meth:`ReservedTagPutClient.put_with_reserved_tags` passes them); checked
            here, not copied into the receipt.

    Returns:
        The ``KVBatchMeta`` receipt: ``fields`` lists the written field names,
        ``tags`` the user tags passed (never the reserved ones).

    Raises:
        TypeError: ``fields`` is not a TensorDict; a tag entry is not a mapping.
        ValueError: keys repeat or are empty; the batch size differs from the
            key count; tags or lengths are not 1:1 with keys; no field given;
            a name in ``tags`` starts with :data:`RESERVED_TAG_PREFIX`, or one
            in ``reserved_tags`` does not.
    """
    if not isinstance(fields, TensorDict):
        raise TypeError(
            f"'fields' must be a TensorDict with batch_size [len(keys)]: got {type(fields).__name__}; "
            f"wrap it, e.g. TensorDict(fields, batch_size=[{len(keys)}])"
        )
    receipt = KVBatchMeta(
        partition_id=partition_id,
        keys=keys,
        fields=tuple(fields.keys()),
        sequence_lengths=sequence_lengths,
        tags=tags,
    )
    batch = fields.batch_size[0] if len(fields.batch_size) else None
    if batch != len(receipt):
        raise ValueError(f"'fields' batch size must equal the key count {len(receipt)}: got {batch}")
    if not receipt.fields:
        raise ValueError("'fields' must hold at least one field: got an empty TensorDict")
    if not receipt.keys:
        raise ValueError("'keys' must name at least one row: got none")
    for i, tag in enumerate(receipt.tags or ()):
        forged = [name for name in tag if _is_reserved(name)]
        if forged:
            raise ValueError(
                f"tag names starting with {RESERVED_TAG_PREFIX!r} are reserved for integrity digests: got {forged} "
                f"at index {i}; rename them (only the integrity layer writes these tags)"
            )
    if reserved_tags is not None:
        _check_reserved(reserved_tags, len(receipt))
    return receipt


def _is_reserved(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(RESERVED_TAG_PREFIX)


def _check_reserved(reserved_tags: Tags, n: int) -> None:
    """Check that ``reserved_tags`` has ``n`` mappings, each of whose names is reserved.

    The names are checked once per distinct name tuple: the integrity layer
    gives every key the same names, so a put of thousands of keys checks one
    (and a :class:`TagColumns`, each name once).
    """
    if isinstance(reserved_tags, (str, bytes, Mapping)) or len(reserved_tags) != n:
        got = type(reserved_tags).__name__ if isinstance(reserved_tags, (str, bytes, Mapping)) else len(reserved_tags)
        raise ValueError(f"'reserved_tags' must have {n} entries (one per key): got {got}")
    if isinstance(reserved_tags, TagColumns):  # held by name: each name once; the error names the first key's
        first = {}  # plain name -> the first key holding it (a name no key holds is not written)
        for name in reserved_tags.names:
            if not _is_reserved(name):
                held = set(range(n)) - reserved_tags.lacking(name)
                if held:
                    first[name] = min(held)
        if first:
            at = min(first.values())
            plain = [name for name, i in first.items() if i == at]
            raise ValueError(f"'reserved_tags' names must start with {RESERVED_TAG_PREFIX!r}: got {plain} at index {at}")
        return
    checked: set[tuple[Any, ...]] = set()
    for i, extra in enumerate(reserved_tags):
        if type(extra) is not dict and not isinstance(extra, Mapping):
            raise TypeError(f"'reserved_tags' entries must be mappings: got {type(extra).__name__} at index {i}")
        names = tuple(extra)
        if names in checked:
            continue
        plain = [name for name in names if not _is_reserved(name)]
        if plain:
            raise ValueError(f"'reserved_tags' names must start with {RESERVED_TAG_PREFIX!r}: got {plain} at index {i}")
        checked.add(names)


def validate_get(keys: Keys, partition_id: str, select_fields: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Check a get's arguments; return ``(keys, select_fields)`` as tuples.

    Raises:
        ValueError: keys repeat or are empty, or no field is selected.
        TypeError: ``select_fields`` is a single string.
    """
    meta = KVBatchMeta(partition_id=partition_id, keys=keys, fields=select_fields)
    if not meta.fields:
        raise ValueError("'select_fields' must name at least one field: got none")
    if not meta.keys:
        raise ValueError("'keys' must name at least one row: got none")
    return meta.keys, meta.fields


def validate_keys(keys: Keys, partition_id: str, *, allow_empty: bool = False) -> tuple[str, ...]:
    """Check the keys of a ``clear`` (``allow_empty=True``) or ``describe``; return them as a tuple.

    Raises:
        TypeError: ``keys`` is a single string, or holds a non-string.
        ValueError: keys repeat or are empty strings; no key (unless ``allow_empty``).
    """
    checked = KVBatchMeta(partition_id, keys).keys
    if not checked and not allow_empty:
        raise ValueError("'keys' must name at least one row: got none")
    return checked


def validate_partition(partition_id: Any) -> str:
    """Check the ``partition_id`` of a ``list_keys``; return it.

    Raises:
        TypeError: ``partition_id`` is not a str.
    """
    if not isinstance(partition_id, str):
        raise TypeError(f"'partition_id' must be a str: got {type(partition_id).__name__}")
    return partition_id


def stored_meta(
    keys: Sequence[str],
    partition_id: str,
    held: Sequence[Collection[str]],
    tags: Tags,
    lengths: Sequence[int | None],
) -> KVBatchMeta:
    """The ``describe`` of ``keys``: the fields every key holds, in first-put order, their tags, and
    their sequence lengths when every key has one.

    Args:
        keys: the described keys.
        partition_id: their partition.
        held: per key, the fields it holds, in the order they were first put.
        tags: per key, its merged user tags.
        lengths: per key, its sequence length or None.
    """
    names = dict.fromkeys(name for fields in held for name in fields)
    return KVBatchMeta(
        partition_id,
        keys,
        fields=[name for name in names if all(name in fields for fields in held)],
        tags=tags,
        sequence_lengths=None if None in lengths else lengths,
    )


def validate_tag_names(tag_names: Sequence[str], reserved: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Check the ``tag_names`` of a :meth:`TaggedGetClient.get_with_tags`; return them as a tuple.

    Raises:
        TypeError: ``tag_names`` is a single string, or holds a non-string.
        ValueError: a name is one of the adapter's ``reserved`` tags.
    """
    if isinstance(tag_names, (str, bytes)):
        raise TypeError(f"'tag_names' must be a sequence of tag names, not a single string: got {tag_names!r}")
    names = tuple(tag_names)
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"'tag_names' entries must be str: got {bad[:5]}")
    hidden = sorted(set(names) & reserved)
    if hidden:
        raise ValueError(f"'tag_names' must not name the adapter's reserved tags {sorted(reserved)}: got {hidden}")
    return names


def pick_tags(tags: Sequence[Mapping[str, Any]], names: Sequence[str]) -> tuple[dict[str, Any], ...]:
    """Per key, the entries of ``names`` its tags hold (request order kept)."""
    return tuple({name: tag[name] for name in names if name in tag} for tag in tags)


def missing_field_error(field: str, partition_id: str, keys: Sequence[str]) -> KeyError:
    """The ``KeyError`` every adapter raises when ``field`` is absent for ``keys``."""
    shown = list(keys[:5])
    more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
    return KeyError(f"field {field!r} is missing in partition {partition_id!r} for {len(keys)} keys: {shown}{more}")


def unknown_keys_error(partition_id: str, keys: Sequence[str]) -> KeyError:
    """The ``KeyError`` every adapter raises for keys that are not stored (never put, or cleared)."""
    shown = list(keys[:5])
    more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
    return KeyError(f"{len(keys)} keys are not stored in partition {partition_id!r}: {shown}{more}")
