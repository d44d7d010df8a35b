"""``MemoryStore``: an in-process store that implements the data-plane port.

Storage is ``partition -> key -> entry``; an entry holds, per field, the
:class:`adapters.rows.ColumnSpec` and the row value, plus the key's tags (merged
across puts, as TransferQueue merges them) and its sequence length. It is the
reference adapter: the contract suite (``tests/e2e/test_store_contract.py``)
runs against it and every other adapter alike.

Invariants (the port's semantics, see :mod:`adapters.store_port`):
  * a put or clear is all or nothing: arguments and every column are checked
    before storage changes, so a rejected call writes (or removes) nothing;
  * the store never aliases a caller's data: rows are copied on ``put`` and
    columns built fresh on ``get`` (see :mod:`adapters.rows`);
  * a field under a key is last-write-wins; fields not in a put are kept;
  * ``clear`` is exact (no prefix matching) and atomic: it raises ``KeyError``
    for keys that are not stored, removing nothing;
  * after ``close()`` every call but ``close()`` raises ``RuntimeError``.

Beyond the port, :meth:`MemoryStore.describe` returns what is stored for some
keys (fields, merged tags, lengths) as a :class:`core.meta.KVBatchMeta`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import attrs
from tensordict import TensorDict

from adapters.rows import ColumnSpec, build_tensordict, common_spec, read_columns_of, split_column, stack_column
from adapters.store_port import (
    StoreAdapter,
    missing_field_error,
    pick_tags,
    stored_meta,
    unknown_keys_error,
    validate_put,
)
from core.frozen import FrozenDict, freeze
from core.meta import KVBatchMeta

StoredRow = tuple[ColumnSpec, Any]


@attrs.frozen
class _Entry:
    """What one key holds: field -> (spec, row), merged tags, and its sequence length (or None)."""

    fields: Mapping[str, StoredRow] = attrs.field(factory=dict)
    tags: FrozenDict = attrs.field(factory=FrozenDict)
    sequence_length: int | None = None


class MemoryStore(StoreAdapter):
    """An in-process :class:`adapters.store_port.DataPlaneClient`; thread-safe.

    Example:
        >>> import torch
        >>> store = MemoryStore()
        >>> receipt = store.put(["a", "b"], "train", TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
        >>> store.get(["b"], "train", ["x"])["x"].shape
        torch.Size([1, 3])
    """

    def __init__(self) -> None:
        self._partitions: dict[str, dict[str, _Entry]] = {}
        self._lock = threading.RLock()
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._partitions)} partitions"
        return f"MemoryStore({state})"

    def _put(self, keys, partition_id, fields, tags, sequence_lengths, reserved_tags, require_stored):
        """Check, then copy every row into storage (see :class:`adapters.store_port.StoreAdapter`)."""
        self._check_open()
        receipt = validate_put(
            keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, reserved_tags=reserved_tags
        )
        n = len(receipt)
        columns = {name: split_column(name, value, n) for name, value in read_columns_of(fields).items()}
        with self._lock:
            self._check_open()
            if require_stored:
                stored = self._partitions.get(receipt.partition_id, {})
                missing = [key for key in receipt.keys if key not in stored]
                if missing:
                    raise unknown_keys_error(receipt.partition_id, missing)
            partition = self._partitions.setdefault(receipt.partition_id, {})
            for i, key in enumerate(receipt.keys):
                old = partition.get(key, _Entry())
                tags = old.tags
                if receipt.tags is not None or reserved_tags is not None:
                    user = {} if receipt.tags is None else receipt.tags[i]
                    tags = FrozenDict({**old.tags, **user, **({} if reserved_tags is None else freeze(reserved_tags[i]))})
                partition[key] = _Entry(
                    fields={**old.fields, **{name: (spec, rows[i]) for name, (spec, rows) in columns.items()}},
                    tags=tags,
                    sequence_length=(
                        old.sequence_length if receipt.sequence_lengths is None else receipt.sequence_lengths[i]
                    ),
                )
        return receipt

    def _get(
        self, keys: tuple[str, ...], partition_id: str, names: tuple[str, ...], tag_names: tuple[str, ...]
    ) -> tuple[TensorDict, tuple[dict[str, Any], ...]]:
        """The rows and tags under one lock hold; the columns are built after it, as fresh data."""
        with self._lock:
            self._check_open()
            entries = self._entries(keys, partition_id)
            selected: dict[str, dict[str, StoredRow]] = {}
            for name in names:
                missing = [key for key, entry in zip(keys, entries) if name not in entry.fields]
                if missing:
                    raise missing_field_error(name, partition_id, missing)
                selected[name] = {key: entry.fields[name] for key, entry in zip(keys, entries)}
            tags = pick_tags([entry.tags for entry in entries], tag_names)
        columns = {}
        for name, stored in selected.items():
            spec = common_spec(name, {key: spec for key, (spec, _) in stored.items()})
            columns[name] = stack_column(name, spec, [row for _, row in stored.values()])
        return build_tensordict(columns, len(keys)), tags

    def _clear(self, keys: tuple[str, ...], partition_id: str) -> None:
        with self._lock:
            self._check_open()
            partition = self._partitions.get(partition_id, {})
            unknown = [key for key in keys if key not in partition]
            if unknown:
                raise unknown_keys_error(partition_id, unknown)
            for key in keys:
                del partition[key]
            if not partition:
                self._partitions.pop(partition_id, None)

    def _list_keys(self, partition_id: str) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._partitions.get(partition_id, {}))

    def _describe(self, keys: tuple[str, ...], partition_id: str) -> KVBatchMeta:
        with self._lock:
            self._check_open()
            entries = self._entries(keys, partition_id)
        return stored_meta(
            keys,
            partition_id,
            [entry.fields for entry in entries],
            [entry.tags for entry in entries],
            [entry.sequence_length for entry in entries],
        )

    def close(self) -> None:
        """Drop all data; later calls (other than ``close``) raise ``RuntimeError``. Idempotent."""
        with self._lock:
            self._closed = True
            self._partitions.clear()

    def _entries(self, keys: tuple[str, ...], partition_id: str) -> list[_Entry]:
        partition = self._partitions.get(partition_id, {})
        unknown = [key for key in keys if key not in partition]
        if unknown:
            raise unknown_keys_error(partition_id, unknown)
        return [partition[key] for key in keys]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MemoryStore is closed: create a new one, e.g. store = MemoryStore()")

