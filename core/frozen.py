"""Deeply immutable copies of plain Python metadata.

Invariant: ``freeze(x)`` shares no mutable container with ``x``. Mappings become
:class:`FrozenDict`, lists and tuples become tuples, sets become frozensets and
numpy arrays become read-only copies; scalars and strings are kept as they are.
``thaw`` is the inverse up to container type (``FrozenDict`` -> ``dict``,
tuple -> list), for handing metadata to code that expects plain containers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class FrozenDict(Mapping[str, Any]):
    """A read-only, picklable mapping. Compares equal to any mapping with the same items.

    Example:
        >>> d = FrozenDict({"a": 1})
        >>> d["a"], d == {"a": 1}
        (1, True)
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self._data.items())))
        return self._hash  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (self._data,))


_ATOMS = frozenset({int, float, str, bool, bytes, complex, type(None)})
"""Exact types that are immutable leaves: checked by ``type(x) in _ATOMS``, far cheaper than the ABC checks."""


def freeze(value: Any) -> Any:
    """Return a deeply immutable copy of ``value`` (see the module invariant)."""
    kind = type(value)
    if kind in _ATOMS or kind is FrozenDict:
        return value
    if kind is dict or isinstance(value, Mapping):
        return FrozenDict({k: v if type(v) in _ATOMS else freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        copy = value.copy()
        copy.flags.writeable = False
        return copy
    return value


def thaw(value: Any) -> Any:
    """Return plain mutable containers for a frozen value (``FrozenDict`` -> dict, tuple -> list)."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is FrozenDict or isinstance(value, Mapping):
        items = value._data.items() if kind is FrozenDict else value.items()
        return {k: v if type(v) in _ATOMS else thaw(v) for k, v in items}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    if isinstance(value, frozenset):
        return {thaw(v) for v in value}
    if isinstance(value, np.ndarray):
        return value.copy()
    return value
