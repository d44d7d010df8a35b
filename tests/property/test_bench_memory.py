"""Laws of memory readings: a process's resident memory from ``/proc``, the growth slope, and the grpo bench's
resident-memory rows; and of the grpo bench's phase, store-call and CPU rows."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.proc_memory import resident_mib
from core.memory_trend import growth_per_100_steps
from shell.bench.grpo import CPU_KEY, cpu_rows, phase_rows, resident_rows, store_call_rows
from shell.run_log import MEMORY_ERROR_KEY, MEMORY_KEY


@given(
    st.lists(st.integers(0, 10_000), min_size=2, max_size=40, unique=True),
    st.floats(-50, 50), st.floats(0, 4096),
)
def test_growth_of_a_steady_series_is_its_slope(steps: list[int], per_step: float, start: float) -> None:
    """A series that grows by ``per_step`` MiB a step grows by 100 x that per 100 steps, wherever it starts."""
    mib = [start + per_step * s for s in steps]
    assert growth_per_100_steps(steps, mib) == pytest.approx(100 * per_step, abs=1e-6)


@given(st.lists(st.floats(0, 4096), min_size=2, max_size=40))
def test_growth_is_the_same_from_any_offset(mib: list[float]) -> None:
    """Adding a constant to every reading leaves the growth where it was."""
    steps = list(range(3, 3 + len(mib)))
    assert growth_per_100_steps(steps, [m + 100 for m in mib]) == pytest.approx(
        growth_per_100_steps(steps, mib), abs=1e-6
    )


def test_growth_needs_one_reading_per_step_and_two_steps() -> None:
    assert growth_per_100_steps([5], [1.0]) == 0.0
    with pytest.raises(ValueError, match=r"'mib' must have one value per step \(3\): got 2"):
        growth_per_100_steps([1, 2, 3], [1.0, 2.0])


def _run(growth: dict[str, float], steps: int, base: float) -> list[dict]:
    return [{"step": s, "rss_mib": {label: base + g * s for label, g in growth.items()}} for s in range(1, steps + 1)]


@given(st.floats(0, 2), st.floats(0, 2), st.integers(0, 3))
def test_resident_rows_give_each_process_its_growth(leak: float, driver: float, warmup: int) -> None:
    """One row per path and process (the driver once, as both paths'), reading each process's steady growth per
    100 steps, and its memory at the first step after the warm-up and at the last."""
    results = {
        "legacy": [_run({"driver": driver, "policy 0": leak}, 10, 400.0)] * 3,
        "data plane": [_run({"driver": driver, "policy 0": 0.0, "store index": leak}, 10, 300.0)] * 3,
    }
    rows = resident_rows(results, warmup)
    assert [(r[0], r[1]) for r in rows] == [
        ("legacy", "policy 0"), ("data plane", "policy 0"), ("data plane", "store index"), ("both", "driver"),
    ]
    by_process = {(r[0], r[1]): r for r in rows}
    assert float(by_process["legacy", "policy 0"][4]) == pytest.approx(100 * leak, abs=0.01)
    assert float(by_process["data plane", "policy 0"][4]) == pytest.approx(0.0, abs=0.01)
    assert float(by_process["both", "driver"][4]) == pytest.approx(100 * driver, abs=0.01)
    assert by_process["data plane", "store index"][2] == f"{300 + leak * (warmup + 1):.1f}"
    assert by_process["data plane", "store index"][3] == f"{300 + leak * 10:.1f}"


def test_resident_rows_name_a_process_that_did_not_answer() -> None:
    """A reading the trainer could not take (None) is an error naming the process and the step, not a gap."""
    run = _run({"driver": 0.0, "store index": 0.0}, 6, 300.0)
    run[4]["rss_mib"]["store index"] = None
    with pytest.raises(RuntimeError, match=r"no resident memory of 'store index' at step 5"):
        resident_rows({"data plane": [run]}, 2)


def test_resident_rows_give_the_reason_a_record_holds_instead_of_readings() -> None:
    """A step whose memory reading failed has ``rss_error`` in place of ``rss_mib``: the error quotes that reason."""
    run = _run({"driver": 0.0, "store index": 0.0}, 6, 300.0)
    del run[3][MEMORY_KEY]
    run[3][MEMORY_ERROR_KEY] = "store index: pid 4321 is gone"
    with pytest.raises(RuntimeError, match=r"'store index' at step 4: store index: pid 4321 is gone"):
        resident_rows({"data plane": [run]}, 2)


def test_resident_rows_take_the_processes_from_the_first_step_with_readings() -> None:
    """A first step without readings does not hide the processes: they come from the first step that has them, and
    that step's failure is still reported (naming the step)."""
    run = _run({"driver": 0.0, "store index": 0.0}, 6, 300.0)
    del run[0][MEMORY_KEY]
    run[0][MEMORY_ERROR_KEY] = "store index: timed out"
    assert [r[1] for r in resident_rows({"data plane": [run]}, 1)] == ["store index", "driver"]
    with pytest.raises(RuntimeError, match=r"'store index' at step 1: store index: timed out"):
        resident_rows({"data plane": [run]}, 0)
    with pytest.raises(RuntimeError, match=r"no resident memory in the run: store index: timed out"):
        resident_rows({"data plane": [run[:1]]}, 0)


def test_resident_mib_reads_this_node_and_names_a_gone_process() -> None:
    """This process's reading is its own; a child that allocated 64 MiB reads at least that; a process that has
    exited raises ``ProcessLookupError`` naming its pid."""
    assert resident_mib() == pytest.approx(resident_mib(os.getpid()), rel=0.05)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush();"
         " sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert resident_mib(child.pid) >= 64
    finally:
        child.communicate("")
    with pytest.raises(ProcessLookupError, match=rf"no process {child.pid} on this node"):
        resident_mib(child.pid)


def test_resident_mib_of_an_exited_unreaped_child_raises_process_lookup_error() -> None:
    """A child that has exited but is not reaped yet (a zombie: its status has no memory lines) is gone too."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        status = Path(f"/proc/{child.pid}/status")
        deadline = time.monotonic() + 30
        while "State:\tZ" not in status.read_text():
            assert time.monotonic() < deadline, "the child did not exit within 30 s"
            time.sleep(0.05)
        with pytest.raises(ProcessLookupError, match=rf"process {child.pid} on this node has exited"):
            resident_mib(child.pid)
    finally:
        child.wait()


def _phase_records(phases: dict[str, float], steps: int, scale: float, gap: float = 0.0) -> list[dict]:
    """Steps of the given phase seconds (times ``scale``), each taking ``gap`` seconds more than its phases."""
    return [
        {"step": i, "step_time_s": sum(phases.values()) * scale + gap, **{f"phase_{k}_s": v * scale for k, v in phases.items()}}
        for i in range(1, steps + 1)
    ]


@given(
    legacy=st.dictionaries(st.sampled_from(["rollout", "logprobs", "train", "refit"]), st.floats(0.001, 1.0), min_size=1),
    extra=st.floats(0.0, 0.05),
    warmup=st.integers(0, 3),
)
def test_phase_rows_give_each_phase_both_paths_ms_and_the_data_planes_extra(
    legacy: dict[str, float], extra: float, warmup: int
) -> None:
    """Each phase both paths time gets a row with each path's median ms and the data plane's minus legacy's, in
    the records' order, then ``other`` (each path's time outside the phases it timed, a phase only it times
    included), then the whole step; a phase the data plane does not time is left out, and warm-up steps (here
    twice as slow) do not count."""
    plane = {k: v + extra for k, v in legacy.items()}
    slow = lambda records: [{**r, **{k: v * 2 for k, v in r.items() if k != "step"}} if r["step"] <= warmup else r for r in records]  # noqa: E731
    results = {
        "legacy": [slow(_phase_records({**legacy, "dapo": 0.5}, warmup + 3, 1.0, gap=0.003)) for _ in range(3)],
        "data plane": [slow(_phase_records(plane, warmup + 3, 1.0, gap=0.005)) for _ in range(3)],
    }
    rows = phase_rows(results, warmup)
    assert [row[0] for row in rows] == [*legacy, "other", "step"]
    for row, (name, seconds) in zip(rows, legacy.items()):
        assert row[1:] == [f"{seconds * 1e3:.1f}", f"{plane[name] * 1e3:.1f}", f"{plane[name] * 1e3 - seconds * 1e3:+.1f}"]
    assert rows[-2][1:] == ["3.0", "5.0", "+2.0"]
    step_legacy, step_plane = sum(legacy.values()) + 0.5 + 0.003, sum(plane.values()) + 0.005
    assert rows[-1][1:] == [f"{step_legacy * 1e3:.1f}", f"{step_plane * 1e3:.1f}", f"{step_plane * 1e3 - step_legacy * 1e3:+.1f}"]


@given(
    phase=st.floats(0.01, 1.0),
    model=st.floats(0.0, 1.0),
    extra=st.floats(0.0, 0.05),
)
def test_phase_rows_give_each_calls_time_outside_the_model_when_every_record_has_it(
    phase: float, model: float, extra: float
) -> None:
    """With ``model_<call>_s`` in every record, the table ends with ``<call> outside the model``: the phase's time
    less the model's, per path, and the data plane's minus legacy's; a call some record lacks it for gets no row."""
    model = model * phase
    legacy = _phase_records({"logprobs": phase, "train": phase}, 3, 1.0)
    plane = _phase_records({"logprobs": phase + extra, "train": phase}, 3, 1.0)
    with_model = lambda records, calls: [{**r, **{f"model_{c}_s": model for c in calls}} for r in records]  # noqa: E731
    rows = phase_rows(
        {"legacy": [with_model(legacy, ["logprobs", "train"])], "data plane": [with_model(plane, ["logprobs"])]}, 0
    )
    assert [row[0] for row in rows] == ["logprobs", "train", "other", "step", "logprobs outside the model"]
    outside_legacy, outside_plane = (phase - model) * 1e3, (phase + extra - model) * 1e3
    assert rows[-1][1:] == [f"{outside_legacy:.1f}", f"{outside_plane:.1f}", f"{outside_plane - outside_legacy:+.1f}"]


@given(
    legacy=st.dictionaries(st.sampled_from(["driver", "policy 0", "rollout"]), st.floats(0.5, 500.0), min_size=1),
    store=st.dictionaries(st.sampled_from(["store controller", "store index"]), st.floats(0.5, 50.0)),
    extra=st.floats(0.0, 50.0),
    warmup=st.integers(0, 3),
)
def test_cpu_rows_give_each_process_both_paths_ms_and_the_data_planes_extra(
    legacy: dict[str, float], store: dict[str, float], extra: float, warmup: int
) -> None:
    """A process both paths run gets each path's median ms and the difference; one only the data plane runs gets
    ``-`` for legacy and its whole ms as the extra; the last row sums every process per step; warm-up steps (here
    ten times as costly, before the one step that counts) do not count."""
    plane = {**{name: ms + extra for name, ms in legacy.items()}, **store}

    def run(per_step: dict[str, float]) -> list[dict[str, object]]:
        return [{"step": s, CPU_KEY: {n: ms * (10 if s <= warmup else 1) for n, ms in per_step.items()}}
                for s in range(1, warmup + 2)]

    rows = cpu_rows({"legacy": [run(legacy)] * 3, "data plane": [run(plane)] * 3}, warmup)
    assert [row[0] for row in rows] == [*legacy, *store, "all processes"]
    for row in rows[: len(legacy)]:
        ms = legacy[row[0]]
        assert row[1:] == [f"{ms:.1f}", f"{ms + extra:.1f}", f"{ms + extra - ms:+.1f}"]
    for row in rows[len(legacy):-1]:
        assert row[1:] == ["-", f"{store[row[0]]:.1f}", f"{store[row[0]]:+.1f}"]
    total_legacy, total_plane = sum(legacy.values()), sum(plane.values())
    assert rows[-1][1:] == [f"{total_legacy:.1f}", f"{total_plane:.1f}", f"{total_plane - total_legacy:+.1f}"]


def test_cpu_rows_leave_out_the_steps_that_could_not_read_a_process() -> None:
    """A process missing from some steps' readings gets the median of the steps that read it, not zeros for the
    others; a run that never read it does not count."""
    def record(step: int, cpu: dict[str, float]) -> dict[str, object]:
        return {"step": step, CPU_KEY: cpu}

    legacy = [[record(1, {"driver": 5.0, "policy 0": 9.0}), record(2, {"driver": 5.0}),
               record(3, {"driver": 5.0, "policy 0": 9.0})], [record(1, {"driver": 7.0})]]
    plane = [[record(1, {"driver": 6.0, "policy 0": 11.0}) for _ in range(3)]]
    rows = cpu_rows({"legacy": legacy, "data plane": plane}, 0)
    assert rows[:2] == [["driver", "6.0", "6.0", "+0.0"], ["policy 0", "9.0", "11.0", "+2.0"]]


def test_cpu_rows_need_records_past_the_warm_up_on_both_paths() -> None:
    records = [{"step": 1, CPU_KEY: {"driver": 1.0}}]
    with pytest.raises(ValueError, match="must have a step after the 1 warm-up steps"):
        cpu_rows({"legacy": [records], "data plane": [records]}, 1)
    with pytest.raises(ValueError, match="must hold runs of path 'data plane'"):
        cpu_rows({"legacy": [records]}, 0)


def test_phase_rows_need_steps_after_the_warm_up() -> None:
    records = _phase_records({"train": 0.1}, 2, 1.0)
    with pytest.raises(ValueError, match="must have a step after the 2 warm-up steps"):
        phase_rows({"legacy": [records], "data plane": [records]}, 2)
    with pytest.raises(ValueError, match="must hold runs of path 'data plane'"):
        phase_rows({"legacy": [records]}, 0)


@given(
    calls=st.dictionaries(
        st.sampled_from(["rollout put", "policy get", "policy put", "driver clear", "driver get"]),
        st.lists(st.floats(0.0, 50.0), min_size=4, max_size=4),
        min_size=1,
    ),
    warmup=st.integers(0, 2),
)
def test_store_call_rows_give_each_calls_median_busiest_first_then_all(calls: dict[str, list[float]], warmup: int) -> None:
    """Each process and call that some step after the warm-up spent time in gets its median ms per step (one run
    here) and its median share of the step, busiest first, then ``all``; a call that a step does not name, or names
    with 0 ms, counts 0 there, and one that no step spent time in gets no row."""
    steps = [
        {"step": s, "step_time_s": 0.5, "data_plane_ms": sum(ms[s - 1] for ms in calls.values()),
         "data_plane_ms_by_call": {c: ms[s - 1] for c, ms in calls.items() if ms[s - 1] > 0 or s % 2}}
        for s in range(1, 5)
    ]
    warm = [{**steps[0], "step": 0, "step_time_s": 9.0, "data_plane_ms": 1e6,
             "data_plane_ms_by_call": dict.fromkeys(calls, 1e6)}] * warmup
    rows = store_call_rows([[*warm, *steps]], warmup)
    named = {c for c, ms in calls.items() if any(ms)}
    medians = {c: statistics.median(calls[c]) for c in named}
    assert [row[0] for row in rows[:-1]] == sorted(named, key=lambda c: (-medians[c], c))
    for row, ms in zip(rows, [*(medians[row[0]] for row in rows[:-1]), statistics.median(s["data_plane_ms"] for s in steps)]):
        assert float(row[1]) == pytest.approx(ms, abs=0.051)
        assert row[2].endswith("%") and float(row[2][:-1]) == pytest.approx(100 * ms / 500, abs=0.051)
    assert rows[-1][0] == "all"


def test_store_call_rows_need_steps_after_the_warm_up() -> None:
    with pytest.raises(ValueError, match="each with a step after the 2 warm-up steps"):
        store_call_rows([[{"step": 1, "step_time_s": 1.0, "data_plane_ms": 1.0, "data_plane_ms_by_call": {}}]], 2)
    with pytest.raises(ValueError, match="at least one run"):
        store_call_rows([], 0)
