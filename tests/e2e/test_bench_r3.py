"""The R3 bench's mismatch measurement on a tiny setting: one real worker process, megatron MoE on CPU."""

from __future__ import annotations

import math

import pytest

from shell.bench.r3 import COST_KEYS, MODELS, VARIANTS, R3BenchConfig, measure_mismatch, measure_same_batch_cost, same_batches, step_ratios

pytestmark = pytest.mark.e2e

TINY = ("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=8")


@pytest.mark.parametrize("model", MODELS)
def test_measure_mismatch_replay_agrees_on_every_token_and_gives_finite_numbers(tmp_path: object, model: str) -> None:
    """On the run model and on the routing-heavy mismatch model, over small bf16 batches, the trainer replaying the
    recorded routing disagrees with it on no token and no decision; both variants score the same tokens and give
    finite, non-negative mismatches."""
    cfg = R3BenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), overrides=TINY)
    measured = measure_mismatch(cfg.model_overrides[model], seed=0, batches=2 if model == "run" else 1, timeout_s=120.0)
    assert set(measured) == {("initial", name) for name in VARIANTS}
    off_routing, off_logprobs = measured["initial", "off"]
    r3_routing, r3_logprobs = measured["initial", "r3"]
    assert r3_routing.tokens == off_routing.tokens > 0
    assert r3_routing.differing_tokens == r3_routing.differing_decisions == 0
    assert r3_logprobs.tokens == off_logprobs.tokens > 0
    for value in (off_logprobs.mean_abs_diff, off_logprobs.k3_kl, r3_logprobs.mean_abs_diff, r3_logprobs.k3_kl):
        assert math.isfinite(value) and value >= 0.0


def test_same_batch_cost_steps_two_trainers_in_one_process_on_the_same_batches(tmp_path: object) -> None:
    """An off and an r3 trainer stepped side by side in one process (one Ray) at the frozen learning rate sample
    the same batches, step for step, and every compared time is a positive, finite ratio."""
    cfg = R3BenchConfig(seeds=1, steps=10, runs_dir=str(tmp_path), overrides=TINY)
    records = measure_same_batch_cost(cfg.base_overrides, seed=0, steps=3, timeout_s=300.0)
    assert set(records) == set(VARIANTS)
    assert [r["step"] for r in records["off"]] == [r["step"] for r in records["r3"]] == [1, 2, 3]
    assert same_batches(records["off"], records["r3"])
    for key in COST_KEYS:
        (value,) = step_ratios(records["r3"], records["off"], key)
        assert math.isfinite(value) and value > 0.0
