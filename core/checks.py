"""Argument checks shared by core modules, in the project's one error format.

Invariant: a check either returns the value in canonical form or raises
``TypeError`` (wrong type) / ``ValueError`` (wrong value) naming the argument,
the expected and the actual value.
"""

from __future__ import annotations

import operator


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
