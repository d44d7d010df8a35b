"""The R3 bench's arithmetic: pooled routing and log-prob metrics, paired ratios, routing bytes, record checks, config."""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import random
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.routing import LogprobMismatch, logprob_mismatch, routing_bytes, routing_disagreement
from shell.bench.r3 import (
    COST_WARMUP,
    GOAL_RATIO,
    LAST,
    MISMATCH_DEFAULTS,
    R3BenchConfig,
    await_result,
    check_moe,
    check_records,
    goal_line,
    model_label,
    mean_step_time,
    paired_ratios,
    pool_disagreement,
    pool_mismatch,
    ratio,
    same_batches,
    same_values,
    step_ratios,
    step_routing_bytes,
    step_tokens,
)
from tests.property.strategies import bench_step_records, mismatch_inputs, routing_cases


@given(routing_cases(), st.data())
def test_pool_disagreement_of_row_splits_is_the_whole_batch(case: dict, data: st.DataObject) -> None:
    """Pooling the disagreements of the batch's rows, split anywhere, gives the disagreement of the whole batch."""
    routed, lengths = case["routed"], case["lengths"]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    other = torch.where(torch.rand(routed.shape, generator=gen) < 0.2, routed.flip(-1) + 1, routed)
    whole = routing_disagreement(routed, other, lengths)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=3)))
    bounds = [0, *cuts, len(lengths)]
    parts = [routing_disagreement(routed[a:b], other[a:b], lengths[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert pool_disagreement(parts) == whole


@given(mismatch_inputs(), st.integers(0, 4))
def test_pool_mismatch_of_row_splits_is_the_whole_batch(case: dict, cut: int) -> None:
    """Pooling the token-weighted means of two row splits gives the mismatch of the whole batch (bool masks)."""
    train, rollout, mask = case["train_logprobs"], case["rollout_logprobs"], case["mask"] != 0
    cut = min(cut, len(train))
    whole = logprob_mismatch(train, rollout, mask)
    pooled = pool_mismatch([logprob_mismatch(train[:cut], rollout[:cut], mask[:cut]),
                            logprob_mismatch(train[cut:], rollout[cut:], mask[cut:])])
    assert pooled.tokens == whole.tokens
    assert pooled.mean_abs_diff == pytest.approx(whole.mean_abs_diff, rel=1e-9, abs=1e-12)
    assert pooled.k3_kl == pytest.approx(whole.k3_kl, rel=1e-9, abs=1e-12)


def test_pool_rejects_no_parts() -> None:
    """Pooling nothing is refused; pooling parts of no tokens gives zeros."""
    with pytest.raises(ValueError, match="'parts' must hold at least one RoutingDisagreement: got 0"):
        pool_disagreement([])
    with pytest.raises(ValueError, match="'parts' must hold at least one LogprobMismatch: got 0"):
        pool_mismatch([])
    assert pool_mismatch([LogprobMismatch(0.0, 0.0, 0)] * 2) == LogprobMismatch(0.0, 0.0, 0)


@given(st.lists(bench_step_records(), min_size=1, max_size=4), st.lists(bench_step_records(), min_size=4, max_size=4))
def test_paired_ratios_are_per_seed_ratios_of_mean_step_times(treated: list, baseline: list) -> None:
    """Each paired ratio is the seed's mean treated step time over its mean baseline step time; a run against itself is 1."""
    treated_by_seed = {s: treated[s % len(treated)] for s in range(4)}
    baseline_by_seed = dict(enumerate(baseline))
    got = paired_ratios(treated_by_seed, baseline_by_seed)
    for s, value in enumerate(got):
        expected = (math.fsum(r["step_time_s"] for r in treated_by_seed[s]) / len(treated_by_seed[s])) / mean_step_time(baseline[s])
        assert value == pytest.approx(expected)
    assert paired_ratios(baseline_by_seed, baseline_by_seed) == pytest.approx([1.0] * 4)


def test_paired_ratios_rejects_other_seeds() -> None:
    """Both sides must hold the same seeds."""
    run = [{"step": 1, "step_time_s": 1.0}]
    with pytest.raises(ValueError, match=r"'treated' must hold the seeds of 'baseline' \(\[0, 1\]\): got \[0\]"):
        paired_ratios({0: run}, {0: run, 1: run})


@given(bench_step_records(), st.integers(1, 4), st.integers(1, 4), st.integers(4, 300))
def test_step_routing_bytes_is_routing_bytes_of_the_step_tokens(records: list, layers: int, topk: int, experts: int) -> None:
    """A step's routing bytes are routing_bytes of rows x mean length tokens: one id per token, layer and slot."""
    for record in records:
        tokens = step_tokens(record)
        assert tokens == pytest.approx(record["rows"] * record["sequence_tokens_mean"], abs=1e-6)
        got = step_routing_bytes(record, num_layers=layers, topk=topk, num_experts=experts)
        assert got == routing_bytes(tokens, layers, topk, experts) == tokens * layers * topk * (1 if experts <= 128 else 2)


@given(bench_step_records(min_steps=1), st.randoms(use_true_random=False))
def test_check_records_orders_and_accepts_whole_runs(records: list, rng: random.Random) -> None:
    """A run's records in any order come back in step order; a missing step, an extra step or a missing field is refused."""
    shuffled = records[:]
    rng.shuffle(shuffled)
    assert check_records(shuffled, len(records), "run") == records
    with pytest.raises(ValueError, match=rf"'run' must hold steps 1..{len(records) + 1} once each: got {len(records)} records"):
        check_records(records, len(records) + 1, "run")
    with pytest.raises(ValueError, match=r"'run' must hold steps 1\.\.\d+ once each"):
        check_records([*records, records[-1]], len(records), "run")
    broken = [*records[:-1], {k: v for k, v in records[-1].items() if k != "driver_bytes"}]
    with pytest.raises(ValueError, match=rf"'run' step {len(records)} must hold .*: missing \['driver_bytes'\]"):
        check_records(broken, len(records), "run")


@given(bench_step_records(min_steps=2))
def test_same_values_holds_for_a_prefix_and_fails_on_a_change(records: list) -> None:
    """A run's first steps repeat it; changing one value of one step breaks it."""
    prefix = records[: len(records) // 2 + 1]
    assert same_values(prefix, records, ("driver_bytes", "data_plane_bytes"))
    changed = [*prefix[:-1], {**prefix[-1], "driver_bytes": prefix[-1]["driver_bytes"] + 1}]
    assert not same_values(changed, records, ("driver_bytes",))
    assert same_values(changed, records, ("data_plane_bytes",))


@given(bench_step_records(min_steps=COST_WARMUP + 1), st.floats(0.5, 2.0))
def test_step_ratios_are_per_step_ratios_after_the_warm_up(baseline: list, scale: float) -> None:
    """Each ratio is one step's treated value over the same step's baseline value, the warm-up steps left out; a
    run scaled by c gives c at every step, and against itself 1."""
    treated = [{**r, "step_time_s": r["step_time_s"] * scale} for r in baseline]
    got = step_ratios(treated, baseline, "step_time_s")
    assert len(got) == len(baseline) - COST_WARMUP
    assert got == pytest.approx([scale] * len(got))
    assert step_ratios(baseline, baseline, "step_time_s", warmup=0) == [1.0] * len(baseline)


def test_step_ratios_rejects_other_steps_and_too_few() -> None:
    """Both sides must hold the same steps, more than the warm-up."""
    run = [{"step": s, "step_time_s": 1.0} for s in (1, 2, 3)]
    with pytest.raises(ValueError, match=r"'treated' must hold the steps of 'baseline' \(3 records\): got 2 records"):
        step_ratios(run[:2], run, "step_time_s")
    with pytest.raises(ValueError, match=r"the records must hold more than 3 steps \(the warm-up\): got 3"):
        step_ratios(run, run, "step_time_s", warmup=3)


@given(bench_step_records(min_steps=1), st.data())
def test_same_batches_holds_for_equal_batches_and_fails_on_any_difference(records: list, data: st.DataObject) -> None:
    """Two runs stepped the same batches when every step's reward, rows and tokens agree, whatever their times;
    one differing value or a missing step breaks it."""
    timed = [{**r, "step_time_s": r["step_time_s"] * 2} for r in records]
    assert same_batches(records, timed)
    step = data.draw(st.integers(0, len(records) - 1))
    key = data.draw(st.sampled_from(["reward_mean", "rows", "sequence_tokens_mean"]))
    changed = [*records[:step], {**records[step], key: records[step][key] + 1}, *records[step + 1 :]]
    assert not same_batches(records, changed)
    assert not same_batches(records, records[:-1])


def test_ratio_handles_zero_denominators() -> None:
    """0 / 0 is nan, x / 0 is inf, otherwise the quotient."""
    assert math.isnan(ratio(0.0, 0.0))
    assert ratio(1.0, 0.0) == math.inf
    assert ratio(1.0, 4.0) == 0.25


def test_r3_bench_config_rejects_bad_options(tmp_path: Path) -> None:
    """Counts out of range, overrides the bench sets, malformed items and a dense model are refused with the field named."""
    def make(**kwargs: object) -> R3BenchConfig:
        return R3BenchConfig(**{"seeds": 1, "steps": LAST, "runs_dir": str(tmp_path), **kwargs})

    for kwargs, pattern in (
        ({"seeds": 0}, "'seeds' must be >= 1: got 0"),
        ({"steps": LAST - 1}, f"'steps' must be >= {LAST}: got {LAST - 1}"),
        ({"batches": 0}, "'batches' must be >= 1: got 0"),
        ({"bytes_steps": LAST + 1}, rf"'bytes_steps' must be in \[1, steps \({LAST}\)\]: got {LAST + 1}"),
        ({"cost_steps": COST_WARMUP}, rf"'cost_steps' must be an int > {COST_WARMUP} \(the warm-up steps\): got {COST_WARMUP}"),
        ({"first_seed": -1}, "'first_seed' must be >= 0: got -1"),
        ({"overrides": ("grpo.num_steps",)}, "'overrides' must be key=value items"),
        ({"overrides": ("policy.model.num_experts=0",)}, "must keep an MoE model .*: got '0'"),
    ):
        with pytest.raises(ValueError, match=pattern):
            make(**kwargs)
    for bad in ("seed=3", "grpo.num_steps=5", "run.dir=x", "policy.router_replay=r3", "data_plane.enabled=false"):
        with pytest.raises(ValueError, match="must not set"):
            make(overrides=(bad,))


def test_r3_bench_config_applies_defaults_unless_overridden(tmp_path: Path) -> None:
    """The MoE bf16 memory-store setting is the default; an override replaces its key and keeps its place last."""
    cfg = R3BenchConfig(seeds=2, steps=LAST, runs_dir=str(tmp_path), first_seed=3)
    assert cfg.base_overrides == (
        "policy.model.num_experts=8", "policy.model.moe_topk=2", "rollout.precision=bf16", "data_plane.backend=memory",
    )
    assert cfg.seed_list == [3, 4]
    own = R3BenchConfig(
        seeds=1, steps=LAST, runs_dir=str(tmp_path), overrides=("data_plane.backend=transfer_queue", "policy.model.num_experts=4")
    )
    assert own.base_overrides == (
        "policy.model.moe_topk=2", "rollout.precision=bf16", "data_plane.backend=transfer_queue", "policy.model.num_experts=4",
    )


def test_r3_bench_config_rejects_bad_mismatch_overrides(tmp_path: Path) -> None:
    """The mismatch model's overrides must be key=value items of policy.model.* keys, and keep an MoE model with
    moe_topk in [1, num_experts]; each refusal names the field."""
    for mismatch, pattern in (
        (("policy.model.num_layers",), r"'mismatch_overrides' must be key=value items: got \['policy.model.num_layers'\]"),
        (("grpo.num_prompts_per_step=4",), r"'mismatch_overrides' must set policy\.model\.\* keys only .*got \['grpo"),
        (("rollout.precision=fp32",), r"'mismatch_overrides' must set policy\.model\.\* keys only"),
        (("policy.model.num_experts=0",), r"'mismatch_overrides' must keep an MoE model .*: got '0'"),
        (("policy.model.num_experts=1",), r"'mismatch_overrides' must keep an MoE model .*: got '1'"),
        (("policy.model.num_experts=many",), r"'mismatch_overrides' must keep an MoE model .*: got 'many'"),
        (("policy.model.num_experts=4",), r"'mismatch_overrides' must keep policy.model.moe_topk in \[1, num_experts \(4\)\]: got '8'"),
        (("policy.model.moe_topk=0",), r"'mismatch_overrides' must keep policy.model.moe_topk in \[1, num_experts \(64\)\]: got '0'"),
    ):
        with pytest.raises(ValueError, match=pattern):
            R3BenchConfig(seeds=1, steps=LAST, runs_dir=str(tmp_path), mismatch_overrides=mismatch)
    with pytest.raises(ValueError, match=r"'overrides' must keep policy.model.moe_topk in \[1, num_experts \(8\)\]: got '9'"):
        R3BenchConfig(seeds=1, steps=LAST, runs_dir=str(tmp_path), overrides=("policy.model.moe_topk=9",))


def test_r3_bench_config_mismatch_model_is_the_run_model_with_its_own_model_settings(tmp_path: Path) -> None:
    """By default the mismatch model is the run model's overrides then 64 experts, top-8, 4 layers; its own overrides
    replace those keys, and the run model's other overrides reach it too."""
    cfg = R3BenchConfig(seeds=1, steps=LAST, runs_dir=str(tmp_path), overrides=("grpo.num_prompts_per_step=4",))
    defaults = tuple(f"{k}={v}" for k, v in MISMATCH_DEFAULTS)
    assert defaults == ("policy.model.num_experts=64", "policy.model.moe_topk=8", "policy.model.num_layers=4")
    assert cfg.model_overrides == {"run": cfg.base_overrides, "mismatch": (*cfg.base_overrides, *defaults)}
    own = R3BenchConfig(
        seeds=1, steps=LAST, runs_dir=str(tmp_path), mismatch_overrides=("policy.model.num_layers=6", "policy.model.moe_topk=4")
    )
    assert own.mismatch_model_overrides == (
        *own.base_overrides, "policy.model.num_experts=64", "policy.model.num_layers=6", "policy.model.moe_topk=4",
    )
    assert own.mismatch_setting["policy.model.num_layers"] == "6"
    assert own.mismatch_setting["rollout.precision"] == "bf16"


@given(st.integers(2, 300))
def test_check_moe_accepts_exactly_topk_in_one_to_experts(experts: int) -> None:
    """An MoE setting passes exactly when moe_topk (if set) is in [1, num_experts]."""
    for topk in ("1", str(experts), str(experts + 1), "0", None):
        setting = {"policy.model.num_experts": str(experts), **({} if topk is None else {"policy.model.moe_topk": topk})}
        if topk is None or 1 <= int(topk) <= experts:
            check_moe(setting, "f")
        else:
            with pytest.raises(ValueError, match="'f' must keep policy.model.moe_topk"):
                check_moe(setting, "f")
    with pytest.raises(ValueError, match="'f' must keep an MoE model"):
        check_moe({}, "f")


def test_model_label_names_the_role_and_sizes() -> None:
    """The table's model column: role, experts, top-k and layers."""
    assert model_label("run", 8, 2, 2) == "run: 8 experts top-2, 2 layers"
    assert model_label("mismatch", 64, 8, 1) == "mismatch: 64 experts top-8, 1 layer"


@given(st.dictionaries(st.text("abcxyz ,:", min_size=1, max_size=6),
                       st.one_of(st.floats(0.0, 3.0), st.just(GOAL_RATIO), st.just(math.nan), st.just(math.inf)),
                       min_size=1, max_size=5))
def test_goal_line_puts_each_row_on_the_side_its_ratio_gives(ratios: dict) -> None:
    """Every row is listed once, under "met by" exactly when its ratio is <= the bound (nan never), in row order."""
    line = goal_line(ratios)
    head, rest = line.split(": met by ", 1)
    met, missed = rest.split("; not met by ", 1)
    assert head == f"goal r3 / off <= {GOAL_RATIO:g} (mean |log p_train - log p_rollout|)"
    expected_met = [f"{n} ({v:.3f})" for n, v in ratios.items() if v <= GOAL_RATIO]
    expected_missed = [f"{n} ({v:.3f})" for n, v in ratios.items() if not v <= GOAL_RATIO]
    assert met == (" and ".join(expected_met) or "none")
    assert missed == (" and ".join(expected_missed) or "none")


def test_goal_line_examples_and_empty() -> None:
    """A met and a missed row, a nan row, and no rows."""
    assert goal_line({"run, initial": 0.701, "run, trained": 1.0, "mismatch, initial": 0.299}) == (
        "goal r3 / off <= 0.5 (mean |log p_train - log p_rollout|): met by mismatch, initial (0.299); "
        "not met by run, initial (0.701) and run, trained (1.000)"
    )
    assert goal_line({"a": math.nan}, bound=1.0).endswith("met by none; not met by a (nan)")
    with pytest.raises(ValueError, match="'ratios' must hold at least one row: got 0"):
        goal_line({})


class _Worker:
    """A stand-in for a worker process: alive or exited with ``exitcode``."""

    def __init__(self, alive: bool, exitcode: int | None = None) -> None:
        self.alive, self.exitcode = alive, exitcode

    def is_alive(self) -> bool:
        return self.alive


def test_await_result_reads_a_result_and_fails_fast_on_a_dead_or_silent_worker() -> None:
    """A result put before the worker exited is returned; a worker that exited without one fails within a poll,
    naming its exit code, long before the timeout; a live worker that stays silent fails at the timeout."""
    results: queue.Queue = queue.Queue()
    results.put(("ok", 7))
    assert await_result(_Worker(alive=False, exitcode=0), results, 60.0, "w", poll_s=0.01) == ("ok", 7)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^w exited \(exit code -9\) without a result$"):
        await_result(_Worker(alive=False, exitcode=-9), queue.Queue(), 60.0, "w", poll_s=0.01)
    assert time.monotonic() - started < 5.0
    with pytest.raises(RuntimeError, match=r"^w gave no result in 0 s$"):
        await_result(_Worker(alive=True), queue.Queue(), 0.05, "w", poll_s=0.01)


def test_await_result_notices_a_real_spawned_process_that_exits_without_a_result() -> None:
    """A spawned process that exits at once (as one killed, or one that fails to start) is reported with its exit
    code instead of after the whole timeout."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=os._exit, args=(3,), daemon=True)
    worker.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited \(exit code 3\) without a result"):
        await_result(worker, results, 120.0, "the worker", poll_s=0.1)
    assert time.monotonic() - started < 60.0
    worker.join()
