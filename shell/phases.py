"""Wall-clock time per named phase of a training step: ``PhaseTimer``.

``with timer.phase("rollout"): ...`` adds the seconds spent inside the block
to the running total of ``"rollout"``; ``durations()`` returns the totals in
the order the phases were first used, and ``reset()`` starts a new step.

Invariants:
  * at most one phase runs at a time: entering a phase while another is
    running raises, so no second is ever counted twice;
  * every entered phase is counted, also when its block raises (the exception
    still propagates);
  * totals only grow between two ``reset()`` calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Clock = Callable[[], float]  # monotonic seconds, e.g. time.perf_counter
Durations = dict[str, float]  # phase name -> total wall seconds, in first-use order


class PhaseTimer:
    """Accumulates wall seconds per named phase.

    Args:
        clock: monotonic clock in seconds; ``time.perf_counter`` unless a test
            injects a fake one.

    Example:
        >>> timer = PhaseTimer()
        >>> with timer.phase("rollout"):
        ...     pass
        >>> list(timer.durations())
        ['rollout']
    """

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        if not callable(clock):
            raise TypeError(f"'clock' must be a callable returning seconds: got {type(clock).__name__}")
        self._clock = clock
        self._totals: Durations = {}
        self._running: str | None = None

    @property
    def running(self) -> str | None:
        """The name of the phase now running, or ``None``."""
        return self._running

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block and add its seconds to phase ``name``.

        Args:
            name: the phase, a non-empty string such as ``"rollout"``.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``name`` is empty, or another phase is running (phases
                do not nest; time the inner work as a phase of its own, after
                the outer one).

        Example:
            >>> timer = PhaseTimer()
            >>> with timer.phase("train"):
            ...     pass
            >>> timer.durations()["train"] >= 0.0
            True
        """
        if not isinstance(name, str):
            raise TypeError(f"'name' must be a str: got {type(name).__name__}")
        if not name:
            raise ValueError("'name' must be a non-empty phase name: got ''")
        if self._running is not None:
            raise ValueError(
                f"'name' {name!r} cannot start while phase {self._running!r} is running: phases do not nest; "
                f"close the 'with timer.phase({self._running!r})' block first"
            )
        self._running = name
        self._totals.setdefault(name, 0.0)
        start = self._clock()
        try:
            yield
        finally:
            self._totals[name] += self._clock() - start
            self._running = None

    def durations(self) -> Durations:
        """Total seconds per phase since the last ``reset()``, in first-use order.

        Returns:
            A new dict; changing it does not change the timer.
        """
        return dict(self._totals)

    def reset(self) -> None:
        """Forget every total, e.g. at the start of the next step.

        Raises:
            ValueError: a phase is running (its time would be lost).
        """
        if self._running is not None:
            raise ValueError(f"'reset' cannot run while phase {self._running!r} is running: leave its 'with' block first")
        self._totals = {}
