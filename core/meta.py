"""``KVBatchMeta``: the driver's receipt for a batch of rows held in a key/value store.

A meta names rows by key inside one partition and carries only small metadata:
the fields known to be stored, per-row sequence lengths, per-row tags and a
batch-wide ``extra_info`` mapping. Bulk tensors never live here.

Invariants (checked on construction):
  * ``keys`` are unique, non-empty strings;
  * ``sequence_lengths`` and ``tags``, when present, have one entry per key;
  * a meta is deeply immutable: tuples for sequences, read-only copies for tag
    dicts and ``extra_info``, so no two metas ever share mutable state.

The empty meta ``KVBatchMeta()`` has no partition and holds nothing (no
keys, fields, lengths, tags, ``extra_info`` or task name); every other meta
names a partition.

Laws (see ``tests/property/test_meta.py``):
  * ``m.slice(0, k).concat(m.slice(k, len(m))) == m``;
  * neutral element: ``KVBatchMeta().concat(m) == m == m.concat(KVBatchMeta())``;
  * associativity: ``a.concat(b).concat(c) == a.concat(b.concat(c)) == a.concat(b, c)``;
  * ``m.subset(p).subset(inverse_permutation(p)) == m`` for a permutation ``p``;
  * ``m.subset(i).stamp_tags(...)`` never changes ``m``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from core.checks import check_int_entries
from core.frozen import FrozenDict, freeze

Keys = tuple[str, ...]
FieldNames = tuple[str, ...]
SeqLens = tuple[int, ...]
Tags = tuple[FrozenDict, ...]
Indices = Sequence[int]


def _to_str_tuple(name: str) -> Any:
    def convert(value: Any) -> tuple[Any, ...]:
        if isinstance(value, str):
            raise TypeError(
                f"'{name}' must be a sequence of strings, not a single string: got {value!r}; "
                f"wrap it, e.g. {name}=[{value!r}]"
            )
        try:
            return tuple(value)
        except TypeError:
            raise TypeError(
                f"'{name}' must be a sequence of strings: got {type(value).__name__}"
            ) from None

    return convert


def _to_lengths(value: Any) -> SeqLens | None:
    return None if value is None else check_int_entries("sequence_lengths", value)


def _to_tags(value: Any) -> Tags | None:
    if value is None:
        return None
    out = []
    for i, tag in enumerate(value):
        if not isinstance(tag, Mapping):
            raise TypeError(f"'tags' entries must be mappings: got {type(tag).__name__} at index {i}")
        out.append(freeze(tag))
    return tuple(out)


def _to_extra_info(value: Any) -> FrozenDict:
    if not isinstance(value, Mapping):
        raise TypeError(f"'extra_info' must be a mapping: got {type(value).__name__}")
    return freeze(value)


def _check_unique_strings(name: str, values: tuple[Any, ...]) -> None:
    if set(map(type, values)) <= {str}:  # the common case, checked without a Python step per value
        held = set(values)
        if len(held) == len(values) and "" not in held:
            return
    seen: set[str] = set()  # find the first bad value, to name it
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"'{name}' entries must be str: got {type(value).__name__} at index {i}")
        if not value:
            raise ValueError(f"'{name}' entries must be non-empty strings: got '' at index {i}")
        if value in seen:
            raise ValueError(f"'{name}' must be unique: {value!r} repeats (second at index {i})")
        seen.add(value)


def _check_indices(name: str, indices: Iterable[int], size: int) -> tuple[int, ...]:
    out: list[int] = []
    seen: set[int] = set()
    for position, index in enumerate(check_int_entries(name, indices)):
        if not -size <= index < size:
            raise ValueError(f"'{name}' entries must be in range({size}) (one per row): got {index} at index {position}")
        index %= size
        if index in seen:
            raise ValueError(f"'{name}' must not repeat rows: row {index} repeats at index {position}")
        seen.add(index)
        out.append(index)
    return tuple(out)


@attrs.frozen(eq=True, hash=False, repr=True)
class KVBatchMeta:
    """Metadata for rows stored under ``keys`` in partition ``partition_id``.

    Args:
        partition_id: the store partition the keys live in; ``""`` (the
            default) only for the empty meta ``KVBatchMeta()``.
        keys: one unique, non-empty key per row.
        fields: names of the fields stored for every key.
        sequence_lengths: per-row token counts (non-negative), or None.
        tags: per-row small metadata mappings (rewards, advantages, ...), or None.
        extra_info: batch-wide metadata (packing layout, pad length, ...).
        task_name: an optional label of the task that produced the batch.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: keys are empty or repeat; ``sequence_lengths`` or ``tags``
            do not have one entry per key; a length is negative; no
            ``partition_id`` for a meta that holds anything.

    Example:
        >>> m = KVBatchMeta("train", ["a", "b"], sequence_lengths=[3, 5])
        >>> m.subset([1]).keys
        ('b',)
    """

    partition_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    keys: Keys = attrs.field(default=(), converter=_to_str_tuple("keys"))
    fields: FieldNames = attrs.field(default=(), converter=_to_str_tuple("fields"))
    sequence_lengths: SeqLens | None = attrs.field(default=None, converter=_to_lengths)
    tags: Tags | None = attrs.field(default=None, converter=_to_tags)
    extra_info: FrozenDict = attrs.field(factory=FrozenDict, converter=_to_extra_info)
    task_name: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )

    def __attrs_post_init__(self) -> None:
        if not self.partition_id and not self.is_empty_meta():
            raise ValueError(
                "'partition_id' must be a non-empty string: got ''; only the empty meta KVBatchMeta(), "
                "which holds nothing, has no partition"
            )
        _check_unique_strings("keys", self.keys)
        _check_unique_strings("fields", self.fields)
        n = len(self.keys)
        if self.sequence_lengths is not None:
            if len(self.sequence_lengths) != n:
                raise ValueError(
                    f"'sequence_lengths' must have {n} entries (one per key): "
                    f"got {len(self.sequence_lengths)}"
                )
            for i, length in enumerate(self.sequence_lengths):
                if length < 0:
                    raise ValueError(
                        f"'sequence_lengths' entries must be >= 0: got {length} at index {i} (key {self.keys[i]!r})"
                    )
        if self.tags is not None and len(self.tags) != n:
            raise ValueError(f"'tags' must have {n} entries (one per key): got {len(self.tags)}")
        for name in self.extra_info:
            if not isinstance(name, str):
                raise TypeError(f"'extra_info' keys must be str: got {type(name).__name__}")

    def __len__(self) -> int:
        return len(self.keys)

    def is_empty_meta(self) -> bool:
        """Whether this is the empty meta ``KVBatchMeta()`` (the neutral element of :meth:`concat`)."""
        return (
            not self.keys
            and not self.fields
            and self.sequence_lengths is None
            and self.tags is None
            and not self.extra_info
            and self.task_name is None
            and not self.partition_id
        )

    # ------------------------------------------------------------------ selection

    def subset(self, indices: Indices) -> KVBatchMeta:
        """Rows at ``indices``, in that order (any order; repeats rejected).

        Raises:
            ValueError: an index is out of range or repeats.
        """
        idx = _check_indices("indices", indices, len(self))
        return self._take(idx)

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """Rows ``start:stop`` with Python slice semantics (negative and clipped bounds allowed)."""
        return self._take(tuple(range(len(self)))[slice(start, stop)])

    def drop(self, indices: Indices) -> KVBatchMeta:
        """All rows except those at ``indices``, in their original order.

        Raises:
            ValueError: an index is out of range or repeats.
        """
        dropped = set(_check_indices("indices", indices, len(self)))
        return self._take(tuple(i for i in range(len(self)) if i not in dropped))

    def _take(self, idx: tuple[int, ...]) -> KVBatchMeta:
        return attrs.evolve(
            self,
            keys=tuple(self.keys[i] for i in idx),
            sequence_lengths=(
                None if self.sequence_lengths is None else tuple(self.sequence_lengths[i] for i in idx)
            ),
            tags=None if self.tags is None else tuple(self.tags[i] for i in idx),
        )

    # ------------------------------------------------------------------ combination

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """Rows of ``self`` followed by the rows of each of ``others``.

        ``fields`` becomes the ordered intersection; ``sequence_lengths`` and
        ``tags`` are kept when every input has them (else None); ``extra_info``
        is merged; ``task_name`` must agree. The empty meta ``KVBatchMeta()``
        is the neutral element: it is skipped wherever it stands, so
        ``KVBatchMeta().concat(m) == m == m.concat(KVBatchMeta())``. ``concat``
        is associative.

        Raises:
            TypeError: an argument is not a ``KVBatchMeta``.
            ValueError: partitions differ, keys would repeat, ``extra_info``
                has a key with conflicting values, or task names differ.

        Example:
            >>> m = KVBatchMeta("p", ["a"], sequence_lengths=[3])
            >>> KVBatchMeta().concat(m) == m == m.concat(KVBatchMeta())
            True
        """
        for i, other in enumerate(others):
            if not isinstance(other, KVBatchMeta):
                raise TypeError(f"concat arguments must be KVBatchMeta: got {type(other).__name__} at position {i}")
        metas = tuple(m for m in (self, *others) if not m.is_empty_meta())
        if len(metas) <= 1:
            return metas[0] if metas else self
        first = metas[0]
        for i, other in enumerate(others):
            if other.is_empty_meta():
                continue
            if other.partition_id != first.partition_id:
                raise ValueError(
                    f"'partition_id' must match to concat: expected {first.partition_id!r}, "
                    f"got {other.partition_id!r} at position {i}"
                )
            if other.task_name != first.task_name:
                raise ValueError(
                    f"'task_name' must match to concat: expected {first.task_name!r}, "
                    f"got {other.task_name!r} at position {i}"
                )
        common = set(first.fields)
        for other in metas[1:]:
            common &= set(other.fields)
        merged: dict[str, Any] = {}
        for m in metas:
            for name, value in m.extra_info.items():
                if name in merged and merged[name] != value:
                    raise ValueError(
                        f"'extra_info[{name!r}]' conflicts across concatenated metas: "
                        f"{merged[name]!r} vs {value!r}"
                    )
                merged[name] = value
        lengths = None
        if all(m.sequence_lengths is not None for m in metas):
            lengths = tuple(x for m in metas for x in m.sequence_lengths)  # type: ignore[union-attr]
        tags = None
        if all(m.tags is not None for m in metas):
            tags = tuple(t for m in metas for t in m.tags)  # type: ignore[union-attr]
        return KVBatchMeta(
            partition_id=first.partition_id,
            keys=tuple(k for m in metas for k in m.keys),
            fields=tuple(f for f in first.fields if f in common),
            sequence_lengths=lengths,
            tags=tags,
            extra_info=merged,
            task_name=first.task_name,
        )

    # ------------------------------------------------------------------ updates

    def stamp_tags(self, columns: Mapping[str, Sequence[Any]]) -> KVBatchMeta:
        """Return a meta whose row ``i`` tags gain ``{name: column[i]}`` for each column.

        0-d numpy / torch values are stored as Python scalars. The receiver is
        unchanged.

        Raises:
            ValueError: a column does not have one entry per key.

        Example:
            >>> m = KVBatchMeta("p", ["a", "b"]).stamp_tags({"reward": [1.0, 0.0]})
            >>> m.tags[1]["reward"]
            0.0
        """
        n = len(self)
        if not isinstance(columns, Mapping):
            raise TypeError(f"'columns' must be a mapping of name -> per-row values: got {type(columns).__name__}")
        rows: list[dict[str, Any]] = [dict(t) for t in self.tags] if self.tags is not None else [{} for _ in range(n)]
        for name, column in columns.items():
            if not isinstance(name, str):
                raise TypeError(f"'columns' keys must be str: got {type(name).__name__}")
            if len(column) != n:
                raise ValueError(f"'columns[{name!r}]' must have {n} entries (one per key): got {len(column)}")
            for row, value in zip(rows, column):
                row[name] = _scalar(value)
        return attrs.evolve(self, tags=rows)

    def with_fields(self, names: Iterable[str]) -> KVBatchMeta:
        """Return a meta whose ``fields`` also lists ``names`` (ordered union, existing first).

        To narrow the fields instead, use ``attrs.evolve(meta, fields=...)``.
        """
        added = _to_str_tuple("names")(names)
        return attrs.evolve(self, fields=self.fields + tuple(f for f in dict.fromkeys(added) if f not in self.fields))

    def with_extra_info(self, **updates: Any) -> KVBatchMeta:
        """Return a meta whose ``extra_info`` is updated (overridden) with ``updates``."""
        return attrs.evolve(self, extra_info={**self.extra_info, **updates})

    def tag_column(self, name: str) -> tuple[Any, ...]:
        """The per-row values of tag ``name``.

        Raises:
            KeyError: the meta has no tags, or a row lacks ``name``.
        """
        if self.tags is None:
            raise KeyError(f"tag {name!r}: this meta has no tags; stamp them with meta.stamp_tags({{{name!r}: values}})")
        missing = [k for k, t in zip(self.keys, self.tags) if name not in t]
        if missing:
            raise KeyError(f"tag {name!r} is missing for {len(missing)} keys, e.g. {missing[:3]}")
        return tuple(t[name] for t in self.tags)


def _scalar(value: Any) -> Any:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value
