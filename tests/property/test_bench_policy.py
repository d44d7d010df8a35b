"""Laws of the policy bench's workload (pure in its config, rows within their bounds, the mask inside each row), of
its config (every config it accepts builds a policy; what cannot run is refused naming the field), and of its
summary of the timed repeats (each ratio paired within its repeat; the time outside the model is wall less model)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shell.bench.policy import PolicyBenchConfig, describe_ranks, describe_workload, policy_config, summarize, workload
from shell.policy_worker import slowest_compute


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20).map(lambda n: 4 * n),
    seed=st.integers(0, 2**31 - 1),
    lengths=st.sampled_from(["lognormal", "short"]),
    max_len=st.integers(16, 2048),
)
def test_workload_is_pure_and_its_rows_fit(rows: int, seed: int, lengths: str, max_len: int) -> None:
    cfg = PolicyBenchConfig(rows=rows, seed=seed, lengths=lengths, max_len=max_len)
    batch, again = workload(cfg), workload(cfg)
    for name in ("input_ids", "token_mask", "advantages", "lengths"):
        assert torch.equal(batch[name], again[name])
    n = batch["lengths"]
    low, high = (16, max_len) if lengths == "lognormal" else (8, 64)
    assert batch.batch_size == torch.Size([rows])
    assert int(n.min()) >= min(low, high) and int(n.max()) <= high
    assert batch["input_ids"].shape[1] >= int(n.max())
    positions = torch.arange(batch["token_mask"].shape[1])[None, :]
    assert torch.equal(batch["token_mask"], (positions >= 4) & (positions < n[:, None]))  # response tokens only


def test_lognormal_rows_have_the_issues_median() -> None:
    """Issue 13's realistic rows: lognormal lengths of median 700 (clipped only above max_len)."""
    n = workload(PolicyBenchConfig(rows=4096, max_len=8192))["lengths"].float()
    assert 650 <= float(n.median()) <= 750
    assert "median 700, <= 1024" in describe_workload(PolicyBenchConfig())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": 3}, r"'rows' must be a multiple of 2 \* dp = 4 \(two optimizer steps, each split over 2 DP ranks\): got 3"),
        ({"rows": 6}, r"'rows' must be a multiple of 2 \* dp = 4 .*: got 6"),
        ({"rows": 8, "dp": 3}, r"'rows' must be a multiple of 2 \* dp = 6 .*: got 8"),
        ({"rows": 0}, r"'rows' must be >= 2: got 0"),
        ({"dp": 0}, r"'dp' must be >= 1: got 0"),
        ({"device": "tpu"}, r"'device' must be in"),
        ({"repeats": 0}, r"'repeats' must be >= 1: got 0"),
        ({"max_len": 8}, r"'max_len' must be >= 16: got 8"),
        ({"lengths": "uniform"}, r"'lengths' must be in"),
    ],
)
def test_config_rejects_what_cannot_run(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyBenchConfig(**kwargs)


@settings(max_examples=25, deadline=None)
@given(
    dp=st.integers(1, 4),
    steps=st.integers(1, 8),
    lengths=st.sampled_from(["lognormal", "short"]),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_every_accepted_config_builds_its_policy(dp: int, steps: int, lengths: str, device: str) -> None:
    """A config the bench accepts gives a policy of its DP size and device whose two optimizer steps split evenly."""
    cfg = PolicyBenchConfig(rows=2 * dp * steps, dp=dp, lengths=lengths, device=device)
    policy = policy_config(cfg)
    assert policy.sharding.world_size == dp and policy.device == device
    assert policy.worker_config().device == device
    assert policy.num_gpus_per_worker == (1.0 if device == "cuda" else 0.0)
    assert policy.layout.train_global_batch_size * 2 == cfg.rows
    assert describe_ranks(cfg) == (f"DP={dp}" if device == "cpu" else f"DP={dp} on cuda")


def test_cli_refuses_what_cannot_run_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    """A config error, or ``--device cuda`` with fewer GPUs than ranks, is a usage error (exit 2) naming the problem,
    raised before any cluster starts."""
    from shell.bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exit_:
        bench_main(["policy", "--rows", "6"])
    assert exit_.value.code == 2
    assert "'rows' must be a multiple of 2 * dp = 4" in capsys.readouterr().err
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit) as exit_:
            bench_main(["policy", "--device", "cuda", "--dp", "2"])
        assert exit_.value.code == 2
        assert f"--device cuda needs a GPU per rank: --dp 2, torch sees {torch.cuda.device_count()}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpus", "overrides", "refused"),
    [
        (0, ["policy.device=cuda"], "2 policy ranks at policy.gpus_per_rank=1 need 2 GPUs, torch sees 0"),
        (1, ["policy.device=cuda"],
         "2 policy ranks at policy.gpus_per_rank=1 need 2 GPUs, torch sees 1; on one GPU pass policy.gpus_per_rank=0.5"),
        (1, ["policy.device=cuda", "policy.gpus_per_rank=0.5"], None),
        (2, ["policy.device=cuda"], None),
        (3, ["policy.device=cuda", "policy.layout.data_parallel=2"],
         "4 policy ranks at policy.gpus_per_rank=1 need 4 GPUs, torch sees 3"),
        (0, ["policy.gpus_per_rank=0.5"], None),  # a CPU policy needs no GPU
    ],
)
def test_grpo_bench_cuda_shortage_counts_both_paths_ranks(
    monkeypatch: pytest.MonkeyPatch, gpus: int, overrides: list[str], refused: str | None
) -> None:
    """``shell.bench grpo`` runs the two paths' trainers at once: on CUDA it needs the GPUs of both groups of
    ranks, as Ray packs them (half a GPU each fits two one-rank groups on one device)."""
    from shell.bench.grpo import cuda_shortage

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    problem = cuda_shortage(overrides)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and problem.endswith(refused), problem


def test_grpo_bench_cli_refuses_a_gpu_shortage_and_a_bad_override_before_starting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both are usage errors (exit 2) naming the problem, raised before any cluster starts."""
    from shell.bench.__main__ import main as bench_main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exit_:
        bench_main(["grpo", "--steps", "3", "--repeats", "1", "policy.device=cuda"])
    assert exit_.value.code == 2
    assert "need 2 GPUs, torch sees 1; on one GPU pass policy.gpus_per_rank=0.5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench_main(["grpo", "--steps", "3", "policy.device=gpu"])
    assert exit_.value.code == 2
    assert "config key 'policy.device'" in capsys.readouterr().err


@settings(max_examples=50, deadline=None)
@given(seconds=st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=8))
def test_a_calls_model_time_is_its_slowest_ranks(seconds: list[float]) -> None:
    """Law: the model time of a call is the largest of its ranks' ``compute_s`` (the ranks run at once)."""
    assert slowest_compute([{"compute_s": s, "rank": i} for i, s in enumerate(seconds)]) == max(seconds)


def test_a_result_without_model_time_is_refused_naming_the_key() -> None:
    with pytest.raises(KeyError, match="compute_s"):
        slowest_compute([{"compute_s": 1.0}, {"rank": 1}])


_repeat = st.tuples(st.floats(1e-3, 1e3), st.floats(0.0, 1.0), st.floats(1e-3, 1e3), st.floats(0.0, 1.0)).filter(
    lambda r: r[0] * (1 - r[1]) > 1e-6  # legacy spends some time outside the model
)


@settings(max_examples=100, deadline=None)
@given(repeats=st.lists(_repeat, min_size=1, max_size=9))
def test_summarize_pairs_each_repeat_and_takes_the_model_out_of_the_wall_time(
    repeats: list[tuple[float, float, float, float]],
) -> None:
    """Law: per repeat i, ratio = data plane wall / legacy wall, floor = legacy model / legacy wall, and the ratio
    outside the model = (data plane wall - model) / (legacy wall - model); each path's ``outside_s`` is the median
    of its calls' wall less model time, and its bytes are what it was given."""
    times = {"legacy": [w for w, _, _, _ in repeats], "data plane": [w for _, _, w, _ in repeats]}
    computes = {"legacy": [w * s for w, s, _, _ in repeats], "data plane": [w * s for _, _, w, s in repeats]}
    measured, paired = summarize(times, computes, {"legacy": (10, 20), "data plane": (1, 2)})
    outside = {name: [w - c for w, c in zip(times[name], computes[name])] for name in times}
    for name in times:
        assert measured[name].wall_s == statistics.median(times[name])
        assert measured[name].compute_s == statistics.median(computes[name])
        assert measured[name].outside_s == pytest.approx(statistics.median(outside[name]))
    assert (measured["legacy"].sent, measured["legacy"].received) == (10, 20)
    assert (measured["data plane"].sent, measured["data plane"].received) == (1, 2)
    assert len(paired.ratios) == len(paired.floors) == len(paired.outside_ratios) == len(repeats)
    for i in range(len(repeats)):
        assert paired.ratios[i] == pytest.approx(times["data plane"][i] / times["legacy"][i])
        assert paired.floors[i] == pytest.approx(computes["legacy"][i] / times["legacy"][i])
        assert 0.0 <= paired.floors[i] <= 1.0
        assert paired.outside_ratios[i] == pytest.approx(outside["data plane"][i] / outside["legacy"][i])


@pytest.mark.parametrize(
    ("times", "computes", "match"),
    [
        ({"legacy": [1.0, 1.0], "data plane": [1.0]}, {"legacy": [0.5, 0.5], "data plane": [0.5]},
         r"one wall and one model time per repeat, at least one repeat and as many for each: got \{'legacy wall': 2, 'legacy model': 2, "
         r"'data plane wall': 1, 'data plane model': 1\}"),
        ({"legacy": [], "data plane": []}, {"legacy": [], "data plane": []}, r"at least one repeat and as many for each: got .*'legacy wall': 0"),
        ({"legacy": [1.0], "data plane": [1.0]}, {"legacy": [0.5], "data plane": [1.5]},
         r"model time must be within the call's wall time: got 'data plane' repeat 0 model 1.500000 s, wall 1.000000 s"),
    ],
)
def test_summarize_refuses_unpaired_repeats_and_a_model_time_beyond_its_call(
    times: dict[str, list[float]], computes: dict[str, list[float]], match: str
) -> None:
    """No repeat, repeats that do not pair, or a model time beyond its call's wall time: refused naming the counts,
    or the path, repeat and both times."""
    with pytest.raises(ValueError, match=match):
        summarize(times, computes, {"legacy": (1, 1), "data plane": (1, 1)})


def test_summarize_gives_inf_or_nan_where_legacy_spent_no_time_outside_the_model() -> None:
    """A legacy call all model (model time equal to its wall time) has no time outside the model to divide by."""
    times = {"legacy": [1.0, 1.0], "data plane": [1.0, 1.0]}
    computes = {"legacy": [1.0, 1.0], "data plane": [0.5, 1.0]}
    _, paired = summarize(times, computes, {"legacy": (1, 1), "data plane": (1, 1)})
    assert paired.outside_ratios[0] == math.inf
    assert math.isnan(paired.outside_ratios[1])
