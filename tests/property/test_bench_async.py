"""The async bench's arithmetic: throughput, time to reward, final reward, and its config checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.bench.async_grpo import AsyncBenchConfig, final_reward, per_seed, steps_per_second, time_to_reward


def _records(rewards: list[float], times: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, "reward_mean": r, "step_time_s": t} for i, (r, t) in enumerate(zip(rewards, times))]


runs = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n), st.lists(st.floats(0.01, 5.0), min_size=n, max_size=n)
    )
)


@given(runs)
def test_steps_per_second_is_steps_over_training_seconds(run: tuple[list[float], list[float]]) -> None:
    """Throughput is the step count over the summed step times."""
    rewards, times = run
    assert steps_per_second(_records(rewards, times)) == pytest.approx(len(times) / math.fsum(times))


@given(runs, st.floats(0.0, 1.0), st.integers(1, 10))
def test_time_to_reward_is_the_first_crossing_of_the_trailing_mean(run: tuple[list[float], list[float]], target: float, window: int) -> None:
    """The answer is the cumulative time at the first step whose trailing mean reaches the target, else None
    (checked against a plain loop); a lower target is never reached later."""
    rewards, times = run
    records = _records(rewards, times)
    expected = None
    for i in range(window - 1, len(rewards)):
        if math.fsum(rewards[i - window + 1 : i + 1]) / window >= target:
            expected = math.fsum(times[: i + 1])
            break
    got = time_to_reward(list(reversed(records)), target, window)
    assert got == (None if expected is None else pytest.approx(expected))
    lower = time_to_reward(records, target / 2, window)
    if got is not None:
        assert lower is not None and lower <= got + 1e-9


def test_final_reward_averages_the_last_ten_steps() -> None:
    """The final reward is the mean of the last 10 steps, in step order whatever the record order."""
    records = _records([0.0] * 5 + [1.0] * 10, [1.0] * 15)
    assert final_reward(list(reversed(records))) == 1.0


def test_async_bench_config_rejects_what_the_bench_sets(tmp_path: object) -> None:
    """Overrides may not set the seed, steps, run folder or async keys; the variants are sync then each bound."""
    for bad in ("seed=3", "grpo.num_steps=5", "run.dir=x", "grpo.async.max_staleness=3"):
        with pytest.raises(ValueError, match="must not set"):
            AsyncBenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), overrides=(bad,))
    with pytest.raises(ValueError, match="'steps' must be >= 10"):
        AsyncBenchConfig(seeds=1, steps=5, runs_dir=str(tmp_path))
    cfg = AsyncBenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), staleness=(1, 2))
    assert list(cfg.variants) == ["sync", "async-k1", "async-k2"]
    assert cfg.base_overrides == (
        "task.name=reverse", "task.kwargs.length=10", "task.kwargs.digits=4", "policy.micro_batch_tokens=0",
    )
    assert AsyncBenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), overrides=("task.name=addition",)).base_overrides == (
        "policy.micro_batch_tokens=0", "task.name=addition",
    )
    own = ("policy.micro_batch_tokens=256", "data_plane.backend=memory")
    assert AsyncBenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), overrides=own).base_overrides == (
        "task.name=reverse", "task.kwargs.length=10", "task.kwargs.digits=4", *own,
    )


def test_per_seed_gives_mean_range_and_every_seed_in_order() -> None:
    """The final-reward column: the mean, the range, then each seed's value in seed order."""
    assert per_seed([0.5, 0.25, 0.75]) == "0.500 (0.250-0.750; per seed 0.500 / 0.250 / 0.750)"
    assert per_seed([0.125]) == "0.125 (0.125-0.125; per seed 0.125)"
