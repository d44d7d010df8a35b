"""The position-match reward of the built-in tasks: credit per matching position, plus a bonus for the exact answer.

For a target ``ans`` (token ids, non-empty) and a response whose ids before
its EOS are ``gen`` (all of them if it has none):

    reward = digit_weight * (#{i : gen[i] == ans[i]}) / max(len(ans), len(gen))
           + exact_bonus * [response == ans + EOS]

Invariants (``tests/property/test_task.py``): with ``digit_weight, exact_bonus``
finite and ``>= 0``, every reward lies in ``[0, digit_weight + exact_bonus]``; the
target followed by EOS reaches the upper bound and, when ``exact_bonus > 0``,
nothing else does; turning a wrong position into the right id never lowers the
reward; a response of another length, or without EOS, earns at most ``digit_weight``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from core.task import EOS_ID, TokenIds


def reward_weight(name: str) -> Callable[[object], float]:
    """A converter of a reward weight to float, checking it is a finite real number ``>= 0``.

    Args:
        name: the field's name, for messages.

    Returns:
        A function that returns the value as a float.

    Raises:
        TypeError (from the converter): the value is not a real number (bools are not).
        ValueError (from the converter): the value is negative, infinite or NaN.

    Example:
        >>> reward_weight("exact_bonus")(1)
        1.0
    """

    def convert(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"'{name}' must be a real number >= 0: got {type(value).__name__}")
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"'{name}' must be a finite real number >= 0: got {value!r}")
        return number

    return convert


def match_reward(target: TokenIds, response: TokenIds, *, digit_weight: float, exact_bonus: float) -> float:
    """The reward of ``response`` (ids, at most one EOS, at its end) against ``target`` (see the module docstring).

    The caller has checked both: ``target`` is non-empty, ``response`` obeys the
    response contract (``core.task.validate_responses``).

    Example:
        >>> match_reward((4, 5), (4, 6, 2), digit_weight=0.5, exact_bonus=0.5)
        0.25
    """
    ended = bool(response) and response[-1] == EOS_ID
    generated = response[:-1] if ended else response
    matches = sum(1 for got, want in zip(generated, target) if got == want)
    credit = digit_weight * (matches / max(len(target), len(generated)))  # ratio first: exact 1.0 at full credit
    return credit + (exact_bonus if ended and generated == target else 0.0)
