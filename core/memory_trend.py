"""The trend of each process's resident memory over a run: a leak's steady slope, told from an allocator's noise.

A run reads every process's resident memory every few steps (``rss_mib``). A
:class:`MemoryTrend` keeps each process's last ``window`` readings, and
:func:`rising` names the processes whose memory grows faster than
``limit_mib_per_100_steps``: the least-squares slope of those readings over
their steps, per 100 steps. A slope over a window of readings, rather than
last minus first, reads a steady leak through the step-to-step noise of an
allocator, and the window forgets the first steps' warm-up once the run is
past it.

Invariants:
  * a trend holds at most ``window`` readings per process, the latest ones,
    in increasing step order; a missing reading (``None``: the process did not
    answer) is skipped, never read as 0; a reading at a step not later than a
    process's last one (the steps started over) starts that process's
    readings over;
  * :func:`rising` names a process only when it holds a full window of
    readings and their slope is above the limit, and it gives that slope;
  * :func:`growth_per_100_steps` of a series that grows by ``r`` MiB a step
    is ``100 * r``, and adding a constant to every reading leaves it as it
    was.

Example:
    >>> trend = MemoryTrend(window=3, limit_mib_per_100_steps=50.0)
    >>> for step in (10, 20, 30):
    ...     trend = observe(trend, step, {"policy 0": 400.0 + step, "driver": 300.0})
    >>> rising(trend)
    {'policy 0': 100.0}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core.checks import check_int
from core.frozen import FrozenDict

Readings = tuple[tuple[int, float], ...]
"""One process's readings: ``(step, MiB)`` pairs in increasing step order."""


def growth_per_100_steps(steps: Sequence[int], mib: Sequence[float]) -> float:
    """The least-squares slope of ``mib`` over ``steps``, per 100 steps (0.0 for fewer than two readings).

    Raises:
        ValueError: ``mib`` does not hold one value per step, or two readings share a step.
    """
    if len(steps) != len(mib):
        raise ValueError(f"'mib' must have one value per step ({len(steps)}): got {len(mib)}")
    if len(steps) < 2:
        return 0.0
    if len(set(steps)) != len(steps):
        raise ValueError(f"'steps' must be distinct: got {list(steps)}")
    return statistics.linear_regression(steps, mib).slope * 100


def _window(value: Any) -> int:
    return check_int("window", value, minimum=2)


def _limit(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"'limit_mib_per_100_steps' must be a finite number of MiB > 0: got {value!r}")
    return float(value)


def _readings(value: Any) -> FrozenDict:
    if not isinstance(value, Mapping):
        raise TypeError(f"'readings' must be a mapping of process to (step, MiB) pairs: got {type(value).__name__}")
    return FrozenDict({str(process): tuple((int(s), float(m)) for s, m in pairs) for process, pairs in value.items()})


@attrs.frozen
class MemoryTrend:
    """Each process's last ``window`` (step, MiB) readings, and the growth above which it counts as rising.

    Args:
        window: readings per process that the slope is taken over (>= 2); a process is judged only once it has
            that many.
        limit_mib_per_100_steps: a process whose slope over its window is above this (MiB per 100 steps, > 0)
            is rising.
        readings: process -> its readings (built by :func:`observe`).

    Raises:
        ValueError: ``window`` < 2, or the limit is not a finite number > 0.
    """

    window: int = attrs.field(converter=_window)
    limit_mib_per_100_steps: float = attrs.field(converter=_limit)
    readings: Mapping[str, Readings] = attrs.field(factory=FrozenDict, converter=_readings)


def observe(trend: MemoryTrend, step: int, rss_mib: Mapping[str, float | None]) -> MemoryTrend:
    """``trend`` with the readings of step ``step`` added (each process keeps its last ``trend.window``).

    Args:
        trend: the readings so far.
        step: the step the readings were taken after; where it is not later than a process's last reading (the
            steps started over, e.g. a trainer stepped from 1 again), that process's readings start over with it.
        rss_mib: process -> its resident MiB; ``None`` for a process that did not answer (skipped).

    Raises:
        TypeError: ``step`` is not an int, or ``rss_mib`` is not a mapping.
        ValueError: ``step`` is negative, or a reading is not a finite number >= 0 (the error names the process).
    """
    step = check_int("step", step, minimum=0)
    if not isinstance(rss_mib, Mapping):
        raise TypeError(f"'rss_mib' must be a mapping of process to MiB: got {type(rss_mib).__name__}")
    readings = dict(trend.readings)
    for process, mib in rss_mib.items():
        if mib is None:
            continue
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not (math.isfinite(mib) and mib >= 0):
            raise ValueError(f"'rss_mib[{process!r}]' must be a finite number of MiB >= 0: got {mib!r}")
        earlier = readings.get(process, ())
        if earlier and earlier[-1][0] >= step:  # the steps started over: the earlier slope is not this one's
            earlier = ()
        readings[process] = (*earlier, (step, float(mib)))[-trend.window :]
    return attrs.evolve(trend, readings=readings)


def rising(trend: MemoryTrend) -> dict[str, float]:
    """The processes whose last ``trend.window`` readings grow faster than the limit: process -> MiB per 100 steps.

    A process with fewer readings than the window is not judged yet.
    """
    out = {}
    for process, pairs in trend.readings.items():
        if len(pairs) < trend.window:
            continue
        slope = growth_per_100_steps([s for s, _ in pairs], [m for _, m in pairs])
        if slope > trend.limit_mib_per_100_steps:
            out[process] = slope
    return out
