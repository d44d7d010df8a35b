"""Argument checks shared by core modules, in the project's one error format.

Invariant: a check either returns the value in canonical form (Python ints,
tuples) or raises ``TypeError`` (wrong type) / ``ValueError`` (wrong value)
naming the argument, the expected and the actual value, always in these
words:

* ``'<name>' must be an int: got <type>`` and ``'<name>' must be >= <min>: got <value>``;
* ``'<name>' must be a sequence of ints: got <type>``;
* ``'<name>' entries must be int: got <type> at index <i>`` and
  ``'<name>' entries must be >= <min>: got <value> at index <i>``.

Bools (Python and numpy) are never ints here.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import numpy as np


def _as_int(value: object) -> int | None:
    """``value`` as a Python int, or None when it is not an integer (bools are not)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _type_name(value: object) -> str:
    return "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a Python int, at least ``minimum`` when given (bools are rejected).

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: ``value < minimum``.

    Example:
        >>> check_int("dp_world", 2, minimum=1)
        2
    """
    number = _as_int(value)
    if number is None:
        raise TypeError(f"'{name}' must be an int: got {_type_name(value)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"'{name}' must be >= {minimum}: got {number}")
    return number


def check_int_entries(name: str, values: Iterable[object], *, minimum: int | None = None) -> tuple[int, ...]:
    """Each of ``values`` as a Python int, at least ``minimum`` when given (bools are rejected).

    ``values`` is any iterable but a string (a 1-d integer numpy array too).
    Errors name the entry's index, e.g. ``'lengths' entries must be >= 0: got -1 at index 3``.

    Raises:
        TypeError: ``values`` is a string or not iterable, or an entry is not an int.
        ValueError: an entry is below ``minimum``.

    Example:
        >>> check_int_entries("shape", [2, 3], minimum=0)
        (2, 3)
    """
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        items: list[object] = values.tolist()  # Python ints
    elif isinstance(values, (str, bytes)):
        raise TypeError(f"'{name}' must be a sequence of ints: got {type(values).__name__}")
    else:
        try:
            items = list(values)
        except TypeError:
            raise TypeError(f"'{name}' must be a sequence of ints: got {type(values).__name__}") from None
    if all(type(entry) is int for entry in items) and (minimum is None or not items or min(items) >= minimum):  # type: ignore[type-var]
        return tuple(items)  # type: ignore[arg-type]  # fast path: plain ints in range
    out: list[int] = []
    for index, entry in enumerate(items):
        number = _as_int(entry)
        if number is None:
            raise TypeError(f"'{name}' entries must be int: got {_type_name(entry)} at index {index}")
        if minimum is not None and number < minimum:
            raise ValueError(f"'{name}' entries must be >= {minimum}: got {number} at index {index}")
        out.append(number)
    return tuple(out)
