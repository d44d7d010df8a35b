"""Laws of the dataplane bench's CPU readings (:func:`shell.bench.dataplane.cpu_per_call`): each process's CPU per
call is its readings' difference over the calls, additive over consecutive blocks of calls; a process missing from
a reading is left out; impossible readings are refused. And of how many calls the CPU table times
(:func:`shell.bench.dataplane.cpu_calls`): whole blocks, bounded, fewer for larger payloads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.bench.dataplane import CPU_BLOCK, CPU_BYTES, cpu_calls, cpu_per_call

_NAMES = st.sampled_from(["caller", "controller", "index", "raylet"])
_SECONDS = st.floats(0, 1e5, allow_nan=False)


@given(st.dictionaries(_NAMES, st.tuples(_SECONDS, st.floats(0, 100), st.floats(0, 100))), st.integers(1, 1000))
def test_blocks_of_calls_add_up_to_the_whole(readings: dict[str, tuple[float, float, float]], calls: int) -> None:
    """Two blocks of ``calls`` calls each cost, summed, what the ``2 x calls`` calls cost together (per call, twice)."""
    before = {name: start for name, (start, _, _) in readings.items()}
    middle = {name: start + a for name, (start, a, _) in readings.items()}
    after = {name: start + a + b for name, (start, a, b) in readings.items()}
    first, second = cpu_per_call(before, middle, calls), cpu_per_call(middle, after, calls)
    whole = cpu_per_call(before, after, 2 * calls)
    assert set(whole) == set(readings)
    for name in readings:
        assert first[name] + second[name] == pytest.approx(2 * whole[name], rel=1e-9, abs=1e-6)
        assert whole[name] == pytest.approx((after[name] - before[name]) * 1e3 / (2 * calls), rel=1e-9, abs=1e-9)
        assert whole[name] >= 0


def test_a_process_missing_from_a_reading_is_left_out() -> None:
    """A process that died before the second reading (or started after the first) has no figure."""
    assert cpu_per_call({"caller": 1.0, "index": 2.0}, {"caller": 1.5, "raylet": 9.0}, 10) == {"caller": 50.0}


@pytest.mark.parametrize(
    ("before", "after", "calls", "message"),
    [
        ({"caller": 1.0}, {"caller": 2.0}, 0, "'calls' must be >= 1: got 0"),
        ({"index": 3.0}, {"index": 2.5}, 10, "CPU time of 'index' went down between the readings: 3.0 s then 2.5 s"),
    ],
)
def test_impossible_readings_are_refused(before: dict[str, float], after: dict[str, float], calls: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_per_call(before, after, calls)


@given(st.integers(1, 1 << 40), st.integers(1, 1 << 40))
def test_the_cpu_table_times_whole_blocks_and_fewer_calls_for_larger_payloads(small: int, large: int) -> None:
    """Whole blocks, 2 blocks to 200 calls, never more calls for a larger payload, and at most about
    :data:`CPU_BYTES` moved once the 2-block floor is passed."""
    small, large = min(small, large), max(small, large)
    for size in (small, large):
        calls = cpu_calls(size)
        assert calls % CPU_BLOCK == 0 and 2 * CPU_BLOCK <= calls <= 200
        assert calls == 2 * CPU_BLOCK or calls * size <= CPU_BYTES
    assert cpu_calls(large) <= cpu_calls(small)


def test_the_issues_payloads_get_200_and_20_calls() -> None:
    """The bench's 3 MB payload gets 200 calls of each operation, its 64 MB one 20."""
    assert (cpu_calls(3_000_000), cpu_calls(64_000_000)) == (200, 20)
