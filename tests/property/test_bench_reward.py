"""The reward bench's pure parts: per-seed headline figures, the spread over seeds, the step windows, the figure."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.bench.__main__ import main as bench_main
from shell.bench.report import Report
from shell.bench.reward import (
    LAST,
    RewardBenchConfig,
    check_run_bench,
    curve_digest,
    plot_seeds,
    run,
    spread,
    summarize,
    unset_defaults,
    window_mean,
    windows,
)


def _records(rewards: list[float], *, entropy: float = 1.0) -> list[dict[str, float]]:
    return [
        {"step": i + 1, "reward_mean": r, "entropy": entropy - 0.001 * i, "step_time_s": 0.5 + 0.01 * (i % 3)}
        for i, r in enumerate(rewards)
    ]


@given(st.lists(st.floats(0.0, 1.0), min_size=LAST, max_size=60))
def test_summarize_reads_last_rewards_final_entropy_and_median_step(rewards: list[float]) -> None:
    """The headline is the mean of the last 10 rewards, the last step's entropy and the median step time."""
    records = _records(rewards)
    summary = summarize(7, records, wall_s=12.0)
    assert summary.seed == 7 and summary.wall_s == 12.0
    assert summary.last_reward == pytest.approx(sum(rewards[-LAST:]) / LAST)
    assert summary.final_entropy == records[-1]["entropy"]
    assert summary.median_step_s == statistics.median(r["step_time_s"] for r in records)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30), st.data())
def test_curve_digest_changes_with_any_bit_of_any_value(rewards: list[float], data: st.DataObject) -> None:
    """Equal records give equal digests; changing one reward to any other float changes it; timings do not count."""
    records = _records(rewards)
    assert curve_digest(records) == curve_digest(_records(rewards))
    retimed = [{**r, "step_time_s": 9.0} for r in records]
    assert curve_digest(retimed) == curve_digest(records)
    i = data.draw(st.integers(0, len(rewards) - 1))
    other = data.draw(st.floats(0.0, 1.0).filter(lambda x: x != rewards[i]))
    changed = [dict(r) for r in records]
    changed[i]["reward_mean"] = other
    assert curve_digest(changed) != curve_digest(records)


def test_summarize_rejects_short_runs_and_missing_entropy() -> None:
    """Fewer than 10 steps, or a step without entropy (a run of older code), are ValueErrors naming the seed."""
    with pytest.raises(ValueError, match="'records' of seed 3 must hold at least 10 steps: got 9"):
        summarize(3, _records([0.0] * 9))
    records = _records([0.0] * 12)
    del records[4]["entropy"]
    with pytest.raises(ValueError, match="must all have 'entropy': missing at steps \\[5\\]"):
        summarize(3, records)


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=10))
def test_spread_brackets_the_mean(values: list[float]) -> None:
    """min <= mean <= max, and std is the sample std (0 for one value)."""
    mean, low, high, std = spread(values)
    assert low - 1e-9 <= mean <= high + 1e-9 and (low, high) == (min(values), max(values))
    assert std == (statistics.stdev(values) if len(values) > 1 else 0.0)


@given(st.integers(LAST, 1000))
def test_windows_cover_every_step_once_with_the_first_and_last_ten(steps: int) -> None:
    """Windows are distinct spans in 1..steps, start with steps 1-10, end with the last 10, and cover every step."""
    spans = windows(steps)
    assert spans[0] == (1, LAST) and (spans[-1] == (steps - LAST + 1, steps) or steps == LAST)
    assert len(set(spans)) == len(spans) and all(1 <= a <= b <= steps for a, b in spans)
    assert {step for a, b in spans for step in range(a, b + 1)} == set(range(1, steps + 1))


def test_window_mean_averages_the_steps_inside() -> None:
    """The window mean is over the records whose step lies in the span; an empty span is a ValueError."""
    records = _records([0.0, 1.0, 0.5, 0.5] + [0.0] * 8)
    assert window_mean(records, (2, 4)) == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError, match="'span' must cover at least one step: got \\(20, 30\\)"):
        window_mean(records, (20, 30))


def test_reward_bench_config_rejects_what_the_bench_sets_itself(tmp_path: Path) -> None:
    """Seeds < 1, steps < 10, and overrides of seed / num_steps / run.dir are ValueErrors."""
    with pytest.raises(ValueError, match="'seeds' must be >= 1: got 0"):
        RewardBenchConfig(seeds=0, steps=20, runs_dir=tmp_path)
    with pytest.raises(ValueError, match="'steps' must be >= 10"):
        RewardBenchConfig(seeds=1, steps=5, runs_dir=tmp_path)
    with pytest.raises(ValueError, match="must not set seed, grpo.num_steps or run.dir"):
        RewardBenchConfig(seeds=1, steps=20, runs_dir=tmp_path, overrides=("seed=3",))
    cfg = RewardBenchConfig(seeds=3, steps=20, runs_dir=tmp_path, first_seed=5)
    assert cfg.seed_list == [5, 6, 7] and cfg.runs_dir.is_absolute()
    assert cfg.plot_path == cfg.runs_dir / "reward_curve.png"


def test_plot_seeds_writes_a_png(tmp_path: Path) -> None:
    """The figure of two seeds is a PNG file."""
    runs = {0: _records([math.sin(i) ** 2 for i in range(30)]), 1: _records([0.1] * 30)}
    path = plot_seeds(runs, tmp_path / "img" / "curve.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_runs(root: Path, seeds: list[int], steps: int) -> None:
    for seed in seeds:
        folder = root / f"seed{seed}"
        folder.mkdir(parents=True)
        lines = [json.dumps(r) for r in _records([0.1 * seed + 0.01 * i for i in range(steps)])]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_reward_bench_reuse_reports_every_seed_and_the_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --reuse the bench reads the runs (and a wall time it measured), prints one row per seed, the spread and a PNG."""
    _write_runs(tmp_path, [0, 1], 12)
    (tmp_path / "seed1.wall_s").write_text("42.0\n")
    plot = tmp_path / "curve.png"
    argv = ["reward", "--seeds", "2", "--steps", "12", "--reuse", "--runs-dir", str(tmp_path), "--plot", str(plot)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    last = [sum(0.1 * seed + 0.01 * i for i in range(2, 12)) / LAST for seed in (0, 1)]
    assert f"| 0 | {last[0]:.3f} |" in out and f"| 1 | {last[1]:.3f} |" in out
    seed1_row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert "| 42 |" in seed1_row
    assert f"| min-max | {last[0]:.3f}-{last[1]:.3f} |" in out and "| std |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reward_bench_refuses_to_overwrite_runs_or_to_reuse_missing_ones(tmp_path: Path) -> None:
    """Existing runs without --reuse are a FileExistsError, a step count other than --steps a ValueError."""
    _write_runs(tmp_path, [0], 12)
    with pytest.raises(FileExistsError, match="pass --reuse to read them"):
        run(RewardBenchConfig(seeds=1, steps=12, runs_dir=tmp_path, plot=tmp_path / "c.png"), Report(markdown=True))
    with pytest.raises(ValueError, match="must hold 20 steps: got 12"):
        run(RewardBenchConfig(seeds=1, steps=20, runs_dir=tmp_path, reuse=True, plot=tmp_path / "c.png"), Report(markdown=True))
    with pytest.raises(SystemExit):
        bench_main(["reward", "--reuse"])


def test_check_run_bench_names_each_bad_option_and_the_reserved_keys() -> None:
    """The checks every run bench shares: counts, key=value items, and the keys and prefixes the bench sets."""
    ok = {"seeds": 1, "steps": 10, "first_seed": 0, "overrides": ("policy.learning_rate=0.01",)}
    check_run_bench(**ok)
    for change, message in (
        ({"seeds": 0}, "'seeds' must be >= 1: got 0"),
        ({"steps": 9}, "'steps' must be >= 10: got 9"),
        ({"first_seed": -2}, "'first_seed' must be >= 0: got -2"),
        ({"overrides": ("seed",)}, "'overrides' must be key=value items: got ['seed']"),
        ({"overrides": ("run.dir=x",)}, "'overrides' must not set seed, grpo.num_steps or run.dir (the bench sets them): got ['run.dir=x']"),
    ):
        with pytest.raises(ValueError) as info:
            check_run_bench(**{**ok, **change})
        assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        check_run_bench(**{**ok, "overrides": ("grpo.async.enabled=true",)}, reserved=("seed",), reserved_prefixes=("grpo.async.",))
    assert str(info.value) == "'overrides' must not set seed or grpo.async.* (the bench sets them): got ['grpo.async.enabled=true']"


@given(st.lists(st.sampled_from("abc"), unique=True), st.lists(st.sampled_from("abcd"), unique=True))
def test_unset_defaults_keeps_exactly_the_defaults_no_override_sets(defaults: list[str], overridden: list[str]) -> None:
    """Partition law: a default survives iff no override sets its key, and the survivors keep their order."""
    kept = unset_defaults([f"{k}=1" for k in defaults], [f"{k}=2" for k in overridden])
    assert kept == tuple(f"{k}=1" for k in defaults if k not in overridden)
