"""Laws of the benches' CPU readings (:mod:`shell.bench.cpu`): each process's CPU per call is its readings'
difference over the calls, additive over consecutive blocks of calls; a process missing from a reading is left
out; impossible readings are refused; a nested process-id record flattens to one name per pid."""

from __future__ import annotations

import os
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.bench.cpu import _cpu_clock, cpu_per_call, cpu_seconds, named_pids, processes

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


def test_a_process_id_record_flattens_to_a_name_per_pid() -> None:
    """Nested roles join with a space; entries that are not pids (None, a bool) have no name."""
    record = {"driver": 7, "policy": {"0": 8, "1": 9}, "rollout": 10, "store": {"TransferQueue controller": 11,
              "TransferQueue storage unit 0": None}, "flag": True}
    assert named_pids(record) == {
        "driver": 7, "policy 0": 8, "policy 1": 9, "rollout": 10, "store TransferQueue controller": 11,
    }


@given(st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers(1, 10**6), max_size=6))
def test_a_flat_record_is_its_own_flattening(record: dict[str, int]) -> None:
    assert named_pids(record) == record


def test_a_reading_of_this_process_grows_with_its_work_and_leaves_out_a_gone_process() -> None:
    """This process's CPU seconds grow across some work; a pid that names no process has no reading."""
    mine = processes({"me": os.getpid(), "gone": 2**22 + 12345})
    assert set(mine) == {"me"}
    before = cpu_seconds(mine)
    sum(i * i for i in range(300_000))
    spent = cpu_per_call(before, cpu_seconds(mine), 1)
    assert set(spent) == {"me"} and spent["me"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-process CPU clock id is Linux's")
def test_the_process_clock_is_this_processs_cpu_time() -> None:
    """The clock read for this process's pid is the process's own CPU clock (``time.process_time``), not a
    fallback: the two agree within a millisecond or two, where psutil's ticks are 10 ms."""
    sum(i * i for i in range(300_000))
    clock = time.clock_gettime(_cpu_clock(os.getpid()))
    assert abs(clock - time.process_time()) < 0.002


def test_a_process_whose_pid_another_took_has_no_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """``psutil`` tells a process that is no longer the one first seen under its pid: it is left out."""
    mine = processes({"me": os.getpid()})
    monkeypatch.setattr(mine["me"], "is_running", lambda: False)
    assert cpu_seconds(mine) == {}
