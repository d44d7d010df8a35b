"""The R3 bench's mismatch measurement on a tiny setting: one real worker process, megatron MoE on CPU."""

from __future__ import annotations

import math

import pytest

from shell.bench.r3 import MODELS, VARIANTS, R3BenchConfig, measure_mismatch

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
