"""Argument checks shared by core modules, in the project's one error format.

Invariant: a check either returns the value in canonical form or raises
``TypeError`` (wrong type) / ``ValueError`` (wrong value) naming the argument,
the expected and the actual value.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` as a Python int, at least ``minimum`` (bools are rejected).

    Example:
        >>> check_int("dp_world", 2, minimum=1)
        2
    """
    if isinstance(value, bool):
        raise TypeError(f"'{name}' must be an int: got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"'{name}' must be an int: got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"'{name}' must be >= {minimum}: got {number}")
    return number


def check_int_entries(name: str, values: Iterable[object], *, minimum: int) -> tuple[int, ...]:
    """Each of ``values`` as a Python int, at least ``minimum`` (bools are rejected).

    Errors name the entry's index, e.g. ``'lengths' entries must be >= 0: got -1 at index 3``.

    Example:
        >>> check_int_entries("shape", [2, 3], minimum=0)
        (2, 3)
    """
    out: list[int] = []
    for index, entry in enumerate(values):
        if isinstance(entry, bool):
            raise TypeError(f"'{name}' entries must be int: got bool at index {index}")
        try:
            number = operator.index(entry)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"'{name}' entries must be int: got {type(entry).__name__} at index {index}") from None
        if number < minimum:
            raise ValueError(f"'{name}' entries must be >= {minimum}: got {number} at index {index}")
        out.append(number)
    return tuple(out)
