"""Laws and error paths of ``shell.run_plot``: the run's figure, the comparison of runs, and the wall clock."""

from __future__ import annotations

import copy
import math
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from shell.run_log import phase_fields
from shell.run_plot import plot_compare, plot_run, wall_clock
from tests.property.strategies import timed_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(n: int) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "reward_mean": step / (n + 1),
            "loss": -0.001 * step,
            **phase_fields({"rollout": 1.0 + step % 3, "train": 0.5}),
            "step_time_s": 4.0,
        }
        for step in range(1, n + 1)
    ]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">II", data[16:24])


def _shuffled(records: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    out = list(records)
    random.Random(seed).shuffle(out)
    return out


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    """The plot is a PNG of 900 x 800 pixels (9 x 8 inches at 100 dpi: three panels) with real content."""
    path = plot_run(_records(30), tmp_path / "plots" / "run.png", title="gsm8k-demo")
    data = path.read_bytes()
    assert path == tmp_path / "plots" / "run.png"
    assert data[:8] == PNG_SIGNATURE
    assert struct.unpack(">II", data[16:24]) == (900, 800)
    assert len(data) > 10_000


def test_plot_run_draws_gaps_and_records_without_phases(tmp_path: Path) -> None:
    """Null rewards, a single record, or records without phase keys still give a PNG."""
    records = [{"step": 3, "reward_mean": None}, {"step": 1, "reward_mean": 0.5}, {"step": 7, "reward_mean": 1.5, "step_time_s": 2.0}]
    assert plot_run(records, tmp_path / "gaps.png").read_bytes()[:8] == PNG_SIGNATURE
    assert plot_run([{"step": 0, "reward_mean": -0.5}], tmp_path / "one.png").read_bytes()[:8] == PNG_SIGNATURE
    untimed = [{"step": s, "reward_mean": 0.1 * s, "step_time_s": None} for s in range(1, 4)]  # no wall clock at all
    assert plot_run(untimed, tmp_path / "untimed.png").read_bytes()[:8] == PNG_SIGNATURE


def test_plot_run_depends_only_on_the_records_as_a_set(tmp_path: Path) -> None:
    """Shuffled records give the same bytes (drawn in step order, wall clock included), and no record is changed."""
    records = _records(12)
    records[4]["step_time_s"] = None  # a gap in the wall clock
    del records[7]["step_time_s"]
    before = copy.deepcopy(records)
    shuffled = _shuffled(records)
    first = plot_run(records, tmp_path / "a.png").read_bytes()
    assert plot_run(shuffled, tmp_path / "b.png").read_bytes() == first
    assert records == before and sorted(shuffled, key=lambda r: r["step"]) == before


def test_plot_run_draws_the_wall_clock_from_step_times(tmp_path: Path) -> None:
    """The wall-clock panel follows ``step_time_s``: other step times give another figure, the same ones the same."""
    records = _records(8)
    slower = [{**record, "step_time_s": 3 * record["step_time_s"]} for record in records]
    same = plot_run(records, tmp_path / "a.png").read_bytes()
    assert plot_run(records, tmp_path / "b.png").read_bytes() == same
    assert plot_run(slower, tmp_path / "c.png").read_bytes() != same


def _with_memory(records: list[dict[str, Any]], every: int = 3) -> list[dict[str, Any]]:
    """Every ``every``-th record with ``rss_mib``: a driver, a leaking rank and a store part that once reads None."""
    out = []
    for record in records:
        step = record["step"]
        if step % every == 0:
            record = {**record, "rss_mib": {"driver": 420.0, "policy 0": 450.0 + 2 * step,
                                            "store index": None if step == every else 370.0}}
        out.append(record)
    return out


def test_plot_run_adds_a_memory_panel_when_records_carry_rss_mib(tmp_path: Path) -> None:
    """Records with ``rss_mib`` add a panel of each process's resident MiB (the figure grows to 9 x 10.5 inches);
    without it the figure is the three panels; other readings give another figure."""
    records = _records(30)
    plain = plot_run(records, tmp_path / "plain.png").read_bytes()
    with_memory = plot_run(_with_memory(records), tmp_path / "memory.png").read_bytes()
    assert _png_size(plain) == (900, 800) and _png_size(with_memory) == (900, 1050)
    flat = [{**r, "rss_mib": {**r["rss_mib"], "policy 0": 450.0}} if "rss_mib" in r else r for r in _with_memory(records)]
    assert plot_run(flat, tmp_path / "flat.png").read_bytes() != with_memory


def test_plot_run_memory_panel_depends_only_on_the_records_as_a_set(tmp_path: Path) -> None:
    """Shuffled records with memory readings, some None and some steps without any, give the same bytes."""
    records = _with_memory(_records(12))
    first = plot_run(records, tmp_path / "a.png").read_bytes()
    assert plot_run(_shuffled(records, seed=3), tmp_path / "b.png").read_bytes() == first


def test_plot_run_rejects_memory_that_is_not_a_mapping_of_numbers(tmp_path: Path) -> None:
    """A malformed ``rss_mib`` is a TypeError naming the record (and the process)."""
    with pytest.raises(TypeError, match=r"'records\[1\]\['rss_mib'\]' must map each process to its MiB: got list"):
        plot_run([{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.5, "rss_mib": [1.0]}], tmp_path / "r.png")
    with pytest.raises(TypeError, match=r"'records\[0\]\['rss_mib'\]\['driver'\]' must be a number: got str"):
        plot_run([{"step": 1, "reward_mean": 0.5, "rss_mib": {"driver": "big"}}], tmp_path / "r.png")


def test_plot_run_rejects_empty_records(tmp_path: Path) -> None:
    """An empty run has nothing to plot and writes no file."""
    with pytest.raises(ValueError, match="'records' must hold at least one record to plot: got 0"):
        plot_run([], tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


def test_plot_run_rejects_records_without_step_or_reward(tmp_path: Path) -> None:
    """Every record needs step and reward_mean; the message names the record."""
    with pytest.raises(ValueError, match=r"'records\[1\]' must have a 'reward_mean' key"):
        plot_run([{"step": 1, "reward_mean": 0.5}, {"step": 2}], tmp_path / "run.png")
    with pytest.raises(ValueError, match=r"'records\[0\]' must have a 'step' key"):
        plot_run([{"reward_mean": 0.5}], tmp_path / "run.png")
    with pytest.raises(TypeError, match=r"'records\[0\]\['reward_mean'\]' must be a number: got str"):
        plot_run([{"step": 1, "reward_mean": "high"}], tmp_path / "run.png")
    with pytest.raises(ValueError, match="'window' must be >= 1 step: got 0"):
        plot_run(_records(3), tmp_path / "run.png", window=0)
    with pytest.raises(TypeError, match="'window' must be an int number of steps: got float"):
        plot_run(_records(3), tmp_path / "run.png", window=2.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the wall clock


def _reference_clock(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """A plain loop: in step order, add each finite step_time_s; a record without one is NaN."""
    total, out = 0.0, []
    for record in sorted(records, key=lambda r: r["step"]):
        seconds = record.get("step_time_s")
        if seconds is None or not math.isfinite(seconds):
            out.append((record["step"], math.nan))
        else:
            total += seconds
            out.append((record["step"], total))
    return out


def _nan_as_none(clock: list[tuple[int, float]]) -> list[tuple[int, float | None]]:
    return [(step, None if math.isnan(seconds) else seconds) for step, seconds in clock]


@given(timed_records())
def test_wall_clock_is_the_running_sum_of_step_times_in_step_order(records: list[dict[str, Any]]) -> None:
    """``wall_clock`` is the cumulative step_time_s in step order (whatever the input order), NaN where one is
    missing, non-decreasing elsewhere, and it changes no record."""
    before = copy.deepcopy(records)
    got = _nan_as_none(wall_clock(records))
    assert records == before
    assert got == _nan_as_none(_reference_clock(records))
    assert got == _nan_as_none(wall_clock(_shuffled(records)))
    finite = [seconds for _, seconds in got if seconds is not None]
    assert finite == sorted(finite)


def test_wall_clock_rejects_bad_records() -> None:
    """No records, a record without a step, or a step time that is not a number is an error naming the record."""
    with pytest.raises(ValueError, match="'records' must hold at least one record to plot: got 0"):
        wall_clock([])
    with pytest.raises(ValueError, match=r"'records\[1\]' must have a 'step' key"):
        wall_clock([{"step": 1}, {"step_time_s": 1.0}])
    with pytest.raises(TypeError, match=r"'records\[0\]\['step_time_s'\]' must be a number: got str"):
        wall_clock([{"step": 1, "step_time_s": "1s"}])
    assert _nan_as_none(wall_clock([{"step": 1}])) == [(1, None)]


# ---------------------------------------------------------------- comparing runs


def _runs() -> dict[str, list[dict[str, Any]]]:
    sync = _records(20)
    faster = [{**record, "reward_mean": record["reward_mean"] * 0.9, "step_time_s": 2.5} for record in _records(20)]
    return {"sync": sync, "async": faster}


def test_plot_compare_writes_a_png(tmp_path: Path) -> None:
    """The comparison is a PNG of 900 x 700 pixels (9 x 7 inches at 100 dpi) with real content."""
    path = plot_compare(_runs(), tmp_path / "img" / "compare.png", title="sync vs async")
    assert path == tmp_path / "img" / "compare.png"
    data = path.read_bytes()
    assert _png_size(data) == (900, 700)
    assert len(data) > 10_000


def test_plot_compare_is_deterministic_and_independent_of_record_order(tmp_path: Path) -> None:
    """The same runs give the same bytes, also with each run's records shuffled; no record is changed."""
    runs = _runs()
    before = copy.deepcopy(runs)
    first = plot_compare(runs, tmp_path / "a.png").read_bytes()
    assert plot_compare(runs, tmp_path / "b.png").read_bytes() == first
    shuffled = {label: _shuffled(records, seed) for seed, (label, records) in enumerate(runs.items())}
    assert plot_compare(shuffled, tmp_path / "c.png").read_bytes() == first
    assert runs == before


def test_plot_compare_draws_one_run_gaps_and_untimed_runs(tmp_path: Path) -> None:
    """One run, null rewards, and runs without any step_time_s still give a PNG."""
    gaps = [{"step": 2, "reward_mean": None}, {"step": 1, "reward_mean": 0.5, "step_time_s": 1.0}, {"step": 3, "reward_mean": 1.5}]
    untimed = [{"step": s, "reward_mean": 0.1 * s} for s in range(5)]
    assert _png_size(plot_compare({"only": gaps}, tmp_path / "a.png").read_bytes()) == (900, 700)
    assert _png_size(plot_compare({"x": untimed, "y": untimed}, tmp_path / "b.png", window=1).read_bytes()) == (900, 700)


def test_plot_compare_rejects_empty_or_malformed_runs(tmp_path: Path) -> None:
    """No runs, a non-mapping, a bad label, an empty run or a bad record is an error naming it, and writes no file."""
    path = tmp_path / "compare.png"
    with pytest.raises(ValueError, match="'runs' must hold at least one run to plot: got 0"):
        plot_compare({}, path)
    with pytest.raises(TypeError, match="'runs' must be a mapping of run label to records: got list"):
        plot_compare([_records(2)], path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'runs' labels must be str: got int 1"):
        plot_compare({1: _records(2)}, path)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'runs' labels must be non-empty: got ''"):
        plot_compare({"": _records(2)}, path)
    with pytest.raises(ValueError, match=r"'runs\['async'\]' must hold at least one record to plot: got 0"):
        plot_compare({"sync": _records(2), "async": []}, path)
    with pytest.raises(ValueError, match=r"'runs\['sync'\]\[1\]' must have a 'reward_mean' key"):
        plot_compare({"sync": [{"step": 1, "reward_mean": 0.5}, {"step": 2}]}, path)
    with pytest.raises(ValueError, match="'window' must be >= 1 step: got 0"):
        plot_compare(_runs(), path, window=0)
    assert not path.exists()


def test_memory_series_break_where_a_process_did_not_answer_and_bridge_steps_without_readings() -> None:
    """A reading step where a process read None, or is missing, is NaN in its series (its line breaks); steps that
    carry no readings at all are not in any series (readings every N steps join up)."""
    from shell.run_plot import _memory, _ordered

    records = [
        {"step": 1, "reward_mean": 0.0},
        {"step": 2, "reward_mean": 0.0, "rss_mib": {"driver": 300.0, "store index": 370.0}},
        {"step": 3, "reward_mean": 0.0},
        {"step": 4, "reward_mean": 0.0, "rss_mib": {"driver": 301.0, "store index": None}},
        {"step": 6, "reward_mean": 0.0, "rss_mib": {"driver": 302.0}},
        {"step": 8, "reward_mean": 0.0, "rss_mib": {"driver": 303.0, "store index": 371.0, "policy 0": 450.0}},
    ]
    series = _memory(_ordered(records, "records", ("reward_mean",)))
    assert list(series) == ["driver", "store index", "policy 0"]
    assert series["driver"] == ([2, 4, 6, 8], [300.0, 301.0, 302.0, 303.0])
    steps, values = series["store index"]
    assert steps == [2, 4, 6, 8] and values[0] == 370.0 and math.isnan(values[1]) and math.isnan(values[2])
    assert values[3] == 371.0
    assert series["policy 0"] == ([8], [450.0])
