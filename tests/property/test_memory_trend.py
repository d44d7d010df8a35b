"""Laws of the resident-memory trend: a window of the latest readings per process, and a process is rising exactly
when its full window's slope is above the limit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.memory_trend import MemoryTrend, growth_per_100_steps, observe, rising

PROCESSES = ("driver", "policy 0", "store TransferQueue controller")
mib = st.floats(0, 65536, allow_nan=False)
reading = st.one_of(st.none(), mib)


@given(
    st.integers(2, 8),
    st.floats(0.01, 500),
    st.lists(st.tuples(st.integers(1, 50), st.fixed_dictionaries({p: reading for p in PROCESSES})), max_size=30),
)
def test_a_trend_keeps_each_process_latest_window_of_answered_readings(
    window: int, limit: float, series: list[tuple[int, dict[str, float | None]]]
) -> None:
    """Each process holds its last ``window`` answered readings, in step order; a ``None`` reading is skipped."""
    trend, step = MemoryTrend(window, limit), 0
    for gap, readings in series:
        step += gap
        trend = observe(trend, step, readings)
    step, expected = 0, {p: [] for p in PROCESSES}
    for gap, readings in series:
        step += gap
        for process, value in readings.items():
            if value is not None:
                expected[process].append((step, value))
    for process in PROCESSES:
        assert list(trend.readings.get(process, ())) == expected[process][-window:], process


@given(
    st.integers(2, 8),
    st.floats(0.01, 500),
    st.lists(st.fixed_dictionaries({p: mib for p in PROCESSES}), max_size=20),
    st.integers(1, 20),
)
def test_a_process_is_rising_exactly_when_its_full_window_grows_past_the_limit(
    window: int, limit: float, series: list[dict[str, float]], every: int
) -> None:
    """``rising`` names a process, with its slope, iff it holds ``window`` readings whose slope per 100 steps is above
    the limit."""
    trend = MemoryTrend(window, limit)
    for i, readings in enumerate(series, start=1):
        trend = observe(trend, i * every, readings)
    expected = {}
    for process in PROCESSES:
        pairs = [(i * every, r[process]) for i, r in enumerate(series, start=1)][-window:]
        if len(pairs) == window:
            slope = growth_per_100_steps([s for s, _ in pairs], [m for _, m in pairs])
            if slope > limit:
                expected[process] = slope
    assert rising(trend) == expected


@given(st.integers(2, 12), st.floats(0.1, 50), st.floats(0, 4096), st.integers(1, 20))
def test_a_steady_leak_above_the_limit_is_rising_and_one_below_is_not(
    window: int, per_step: float, start: float, every: int
) -> None:
    """A process that grows by ``per_step`` MiB a step rises at ``100 * per_step`` per 100 steps: named by a limit below
    that, not by one above it, and not before its window is full."""
    low, high = MemoryTrend(window, 50 * per_step), MemoryTrend(window, 200 * per_step)
    for i in range(1, window + 1):
        assert rising(low) == {}, "judged before its window was full"
        readings = {"policy 0": start + per_step * i * every}
        low, high = observe(low, i * every, readings), observe(high, i * every, readings)
    assert rising(low) == {"policy 0": pytest.approx(100 * per_step, rel=1e-6)}
    assert rising(high) == {}


def test_the_example_leak_reads_its_slope() -> None:
    trend = MemoryTrend(window=3, limit_mib_per_100_steps=50.0)
    for step in (10, 20, 30):
        trend = observe(trend, step, {"policy 0": 400.0 + step, "driver": 300.0})
    assert rising(trend) == {"policy 0": pytest.approx(100.0)}


@pytest.mark.parametrize(
    ("window", "limit", "error", "match"),
    [
        (1, 10.0, ValueError, r"'window' must be >= 2: got 1"),
        (2.5, 10.0, TypeError, r"'window' must be an int"),
        (3, 0.0, ValueError, r"'limit_mib_per_100_steps' must be a finite number of MiB > 0: got 0.0"),
        (3, math.inf, ValueError, r"'limit_mib_per_100_steps' must be a finite number of MiB > 0: got inf"),
        (3, True, ValueError, r"'limit_mib_per_100_steps' must be a finite number of MiB > 0: got True"),
    ],
)
def test_a_trend_refuses_a_bad_window_or_limit(window: object, limit: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MemoryTrend(window, limit)  # type: ignore[arg-type]


def test_a_step_not_later_than_a_process_last_reading_starts_its_readings_over() -> None:
    """Steps that start over (a trainer stepped from 1 again) start over the readings of each process they read;
    a process not read at that step keeps its own."""
    trend = MemoryTrend(3, 10.0)
    for step in (10, 20, 30):
        trend = observe(trend, step, {"driver": 300.0 + step, "policy 0": 400.0 + 10 * step})
    assert set(rising(trend)) == {"driver", "policy 0"}
    again = observe(trend, 10, {"driver": 500.0})
    assert again.readings["driver"] == ((10, 500.0),) and again.readings["policy 0"] == trend.readings["policy 0"]
    assert set(rising(again)) == {"policy 0"}, "one reading since the restart: not judged"
    assert observe(trend, 30, {"driver": 1.0}).readings["driver"] == ((30, 1.0),)


def test_observe_refuses_a_bad_reading_naming_the_process() -> None:
    trend = observe(MemoryTrend(3, 10.0), 20, {"driver": 300.0})
    for bad in (-1.0, math.nan, "300", True):
        with pytest.raises(ValueError, match=r"'rss_mib\['policy 0'\]' must be a finite number of MiB >= 0"):
            observe(trend, 30, {"policy 0": bad})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"'rss_mib' must be a mapping of process to MiB: got list"):
        observe(trend, 30, [300.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'step' must be >= 0: got -1"):
        observe(trend, -1, {})
    assert observe(trend, 30, {"driver": None}) == trend, "a process that did not answer adds nothing"


def test_growth_refuses_readings_that_share_a_step() -> None:
    with pytest.raises(ValueError, match=r"'steps' must be distinct: got \[1, 1\]"):
        growth_per_100_steps([1, 1], [1.0, 2.0])
