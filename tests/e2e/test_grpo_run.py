"""``python -m shell.run`` end to end on the session's Ray cluster: both paths, parity, no leak, files, resume, faults.

The runs call ``shell.run.main`` in this process: Ray is already up (the
session fixture), so the run joins it and the session's TransferQueue instead
of starting its own, and leaves both running.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.transfer_queue import TransferQueueStore
from core.addition import AdditionTask
from shell import run as shell_run
from shell.grpo_trainer import GRPOTrainer, StepError, load_checkpoint
from shell.run_config import load_run_config
from shell.rollout import RolloutWorker
from shell.run_log import read_metrics
from shell.worker_group import WorkerError
from tests.e2e.grpo_faults import FAULT_MESSAGE, RaisingLoss

pytestmark = pytest.mark.e2e

STEPS = 5
SMALL = [
    f"grpo.num_steps={STEPS}",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.layout.data_parallel=2",
    "policy.micro_batch_tokens=64",
    "grpo.loss.kl_coef=0.05",
    "policy.train_global_batch_size=8",
    "run.progress=plain",
    "run.memory_every=2",
    "run.memory_rise_limit=0.001",  # any growth between two readings is "rising": the warning's path runs
    "run.memory_rise_window=2",
]
REQUIRED_KEYS = (
    "step", "reward_mean", "entropy", "loss", "kl", "grad_norm", "step_time_s", "data_plane_ms", "data_plane_bytes",
    "driver_bytes", "store_keys_outstanding", "data_plane_ms_by_call",
)
PARITY_KEYS = ("reward_mean", "entropy", "loss", "kl", "grad_norm")


def _run(args: list[str]) -> int:
    return shell_run.main(args)


@pytest.fixture(scope="module")
def partition() -> str:
    return f"grpo-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def runs(tq_store_session: TransferQueueStore, tmp_path_factory: pytest.TempPathFactory, partition: str) -> dict[str, Any]:
    """A 5-step run of each path (same seed and config), on the session's Ray and TransferQueue."""
    out: dict[str, Any] = {}
    for name, enabled in (("legacy", "false"), ("data_plane", "true")):
        run_dir = tmp_path_factory.mktemp(name)
        console = io.StringIO()
        with contextlib.redirect_stderr(console):  # the run's messages (its console writes to stderr)
            status = _run([*SMALL, f"run.dir={run_dir}", f"data_plane.enabled={enabled}", f"data_plane.partition={partition}"])
        out[name] = {
            "status": status, "dir": run_dir, "records": read_metrics(run_dir / "metrics.jsonl"), "console": console.getvalue()
        }
    return out


def test_run_both_paths_finish(runs: dict[str, Any]) -> None:
    """Both paths exit 0 and log one record per step, 1..num_steps."""
    for name, run in runs.items():
        assert run["status"] == 0, name
        assert [r["step"] for r in run["records"]] == list(range(1, STEPS + 1)), name


def test_run_paths_agree_bitwise(runs: dict[str, Any]) -> None:
    """Same seed and config: per-step rewards, losses, KL and grad norms are bitwise equal on both paths."""
    legacy, plane = runs["legacy"]["records"], runs["data_plane"]["records"]
    for a, b in zip(legacy, plane):
        assert {k: a[k] for k in PARITY_KEYS} == {k: b[k] for k in PARITY_KEYS}, f"step {a['step']}"
    assert any(r["grad_norm"] > 0 for r in plane), "the runs must actually train"
    assert any(r["kl"] != 0 for r in plane[1:]), "the reference pass must run (kl_coef > 0)"


def test_run_records_the_policys_model_seconds_within_their_phases(runs: dict[str, Any]) -> None:
    """Each step's ``model_logprobs_s`` and ``model_train_s`` (the slowest rank's time in the model) are positive and
    inside their phases, ``phase_logprobs_s`` and ``phase_train_s``, on both paths."""
    for name, run in runs.items():
        for record in run["records"]:
            for call in ("logprobs", "train"):
                model, phase = record[f"model_{call}_s"], record[f"phase_{call}_s"]
                assert 0.0 < model < phase, f"{name} step {record['step']}: {call} model {model} s, phase {phase} s"


def test_run_records_policy_entropy_within_bounds(runs: dict[str, Any]) -> None:
    """Each step's ``entropy`` is finite and in [0, log V], V the task's vocabulary (the ids sampling may draw)."""
    bound = math.log(AdditionTask().tokenizer.vocab_size)
    for name, run in runs.items():
        for record in run["records"]:
            entropy = record["entropy"]
            assert isinstance(entropy, float) and math.isfinite(entropy), f"{name} step {record['step']}: {entropy!r}"
            assert 0.0 <= entropy <= bound + 1e-6, f"{name} step {record['step']}: {entropy} not in [0, {bound}]"


def test_run_records_each_process_resident_memory_every_memory_every_steps(runs: dict[str, Any]) -> None:
    """``run.memory_every=2``: steps 2 and 4 carry ``rss_mib``, the resident MiB of the driver, both policy ranks and
    the rollout engine, and on the data plane each TransferQueue part; the others carry none."""
    for name, run in runs.items():
        for record in run["records"]:
            if record["step"] % 2:
                assert "rss_mib" not in record, f"{name} step {record['step']}"
                continue
            rss = record["rss_mib"]
            assert {"driver", "policy 0", "policy 1", "rollout"} <= set(rss), f"{name} step {record['step']}: {rss}"
            store = {process for process in rss if process.startswith("store ")}
            assert ("store TransferQueue controller" in store) == (name == "data_plane"), f"{name}: {rss}"
            assert len(rss) == 4 + len(store), f"{name}: {rss}"
            assert all(isinstance(mib, float) and 50 < mib < 8192 for mib in rss.values()), f"{name}: {rss}"


def test_run_warns_once_for_each_process_whose_memory_rises_past_the_limit(runs: dict[str, Any]) -> None:
    """``run.memory_rise_limit=0.001`` over ``run.memory_rise_window=2`` readings: step 4 carries ``rss_rising``
    naming exactly the processes whose readings of steps 2 and 4 grow faster than 0.001 MiB per 100 steps, each with
    that growth; no other step carries it (step 2 has one reading, too few); the console warns once, naming them."""
    for name, run in runs.items():
        records = {record["step"]: record for record in run["records"]}
        assert all("rss_rising" not in record for step, record in records.items() if step != 4), name
        before, after = records[2]["rss_mib"], records[4]["rss_mib"]
        growth = {p: (after[p] - before[p]) / 2 * 100 for p in after if after[p] is not None and before.get(p) is not None}
        expected = {p: g for p, g in growth.items() if g > 0.001}
        rising = records[4].get("rss_rising", {})
        assert set(rising) == set(expected), f"{name}: {rising} vs growth {growth}"
        assert all(rising[p] == pytest.approx(expected[p], abs=1e-3) for p in expected), f"{name}: {rising}"
        warnings = [line for line in run["console"].splitlines() if "resident memory rising" in line]
        assert len(warnings) == (1 if expected else 0), f"{name}: {run['console']}"
        assert all(f"{p} +" in warnings[0] for p in expected), f"{name}: {warnings}"


def test_run_data_plane_leaves_no_keys(runs: dict[str, Any], partition: str) -> None:
    """After every step the store holds none of the run's keys."""
    assert [r["store_keys_outstanding"] for r in runs["data_plane"]["records"]] == [0] * STEPS
    store = TransferQueueStore.attach()
    try:
        assert store.list_keys(partition) == ()
    finally:
        store.close()


def test_run_data_plane_moves_bulk_off_the_driver(runs: dict[str, Any]) -> None:
    """Per step the driver moves at most 10% of the legacy path's bytes, and the store carries the bulk."""
    for a, b in zip(runs["legacy"]["records"], runs["data_plane"]["records"]):
        assert b["driver_bytes"] <= 0.10 * a["driver_bytes"], f"step {a['step']}: {b['driver_bytes']} vs {a['driver_bytes']}"
        assert b["data_plane_bytes"] > 2 * b["driver_bytes"]  # the rows went through the store, not the driver
        assert a["data_plane_bytes"] == 0 and a["data_plane_ms"] == 0


def test_run_data_plane_splits_its_store_time_by_process_and_call(runs: dict[str, Any]) -> None:
    """Each data-plane step's store time is split by process and operation, and the parts add up to the whole: the
    engine's put, the ranks' gets and the driver's clear each took some of it, and the ranks put nothing (DP=2: the
    log-prob call is sharded as the train call, so each rank keeps the log-probs it trains on); the legacy path
    reports no split."""
    for a, b in zip(runs["legacy"]["records"], runs["data_plane"]["records"]):
        calls = b["data_plane_ms_by_call"]
        assert {"rollout put", "policy get", "driver clear"} <= {c for c, ms in calls.items() if ms > 0}
        assert calls.get("policy put", 0.0) == 0.0
        assert set(calls) <= {f"{p} {op}" for p in ("rollout", "policy", "driver") for op in ("put", "get", "clear")}
        assert math.isclose(sum(calls.values()), b["data_plane_ms"], rel_tol=1e-9), (calls, b["data_plane_ms"])
        assert a["data_plane_ms_by_call"] == {}


def test_run_writes_metrics_plot_samples_and_checkpoint(runs: dict[str, Any]) -> None:
    """Each run leaves metrics with the required keys and phases, a PNG plot, samples, a checkpoint and its config."""
    for name, run in runs.items():
        run_dir: Path = run["dir"]
        for record in run["records"]:
            missing = [k for k in REQUIRED_KEYS if k not in record]
            assert not missing, f"{name} step {record['step']}: missing {missing}"
            phases = [k for k in record if k.startswith("phase_")]
            assert {"phase_rollout_s", "phase_logprobs_s", "phase_train_s", "phase_refit_s"} <= set(phases)
            assert sum(record[k] for k in phases) <= record["step_time_s"] + 1e-6
        assert (run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert {s["step"] for s in samples} == set(range(1, STEPS + 1))
        checkpoint = load_checkpoint(run_dir)
        assert checkpoint["step"] == STEPS and checkpoint["weights"]
        assert load_run_config(config_file=run_dir / "config.yaml").grpo.num_steps == STEPS


def test_run_resume_continues_from_checkpoint(runs: dict[str, Any], tmp_path: Path, partition: str) -> None:
    """``--resume`` appends steps num_steps+1.. to the same metrics and samples files, starting from the saved
    weights; records a crashed run logged after its checkpoint are dropped first, so every step appears once."""
    run_dir = tmp_path / "resumed"
    source = runs["data_plane"]["dir"]
    run_dir.mkdir()
    for name in ("metrics.jsonl", "checkpoint.pt", "samples.jsonl"):
        (run_dir / name).write_bytes((source / name).read_bytes())
    for name in ("metrics.jsonl", "samples.jsonl"):  # a step logged after the checkpoint, before a crash
        with (run_dir / name).open("a") as file:
            file.write(json.dumps({"step": STEPS + 1, "crashed": True}) + "\n")
    status = _run([*SMALL, f"grpo.num_steps={STEPS + 2}", f"data_plane.partition={partition}", "--resume", str(run_dir)])
    assert status == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 3))
    assert load_checkpoint(run_dir)["step"] == STEPS + 2
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    per_step = [s["step"] for s in samples]
    assert per_step == sorted(per_step) and set(per_step) == set(range(1, STEPS + 3))
    assert not any(r.get("crashed") for r in records + samples)
    assert per_step.count(STEPS + 1) == per_step.count(1)


def test_run_refuses_to_reuse_a_run_dir_and_resume_to_no_new_step(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished run's folder is refused without --resume (naming --resume), and --resume with
    grpo.num_steps at the checkpoint's step is an error (exit 2), not 'done'; its files are untouched."""
    source = runs["legacy"]["dir"]
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    assert _run([*SMALL, f"run.dir={source}"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert _run([*SMALL, "--resume", str(source)]) == 2
    assert "must exceed the checkpoint's step" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_run_rejects_bad_config_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown key or an impossible value exits 2 naming the key, and creates no run folder."""
    for override, key in (("grpo.nope=1", "grpo.nope"), ("policy.layout.tensor_parallel=3", "policy.layout.tensor_parallel")):
        assert _run([override, f"run.dir={tmp_path / 'never'}"]) == 2
        assert key in capsys.readouterr().err
        assert not (tmp_path / "never").exists()


def test_run_policy_on_cuda_without_the_gpus_exits_2_naming_policy_device(
    tq_store_session: TransferQueueStore, tmp_path: Path, partition: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """policy.device=cuda on a cluster with fewer GPUs than policy ranks exits 2 at start-up, naming the key and
    both counts, before any policy rank starts; the rollout engine that started beside it is stopped, no key stays,
    and the run folder keeps no config.yaml, so the corrected run can take the same run.dir."""
    import ray

    def free_cpus() -> float:
        return ray.available_resources().get("CPU", 0.0)

    have = ray.cluster_resources().get("GPU", 0.0)
    if have >= 2:
        pytest.skip(f"this cluster has {have:g} GPUs: one for each of the two policy ranks")
    before = free_cpus()
    status = _run([*SMALL, f"run.dir={tmp_path}", f"data_plane.partition={partition}", "policy.device=cuda"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "config key 'policy.device'" in err and "got cuda" in err, err
    assert f"2 policy ranks need 2 GPUs at policy.gpus_per_rank=1, the cluster has {have:g}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    deadline = time.monotonic() + 30
    while free_cpus() < before and time.monotonic() < deadline:  # a killed actor's CPUs come back a little later
        time.sleep(0.5)
    assert free_cpus() == before  # the rollout engine that started beside the policy is gone
    store = TransferQueueStore.attach()
    try:
        assert store.list_keys(partition) == ()
    finally:
        store.close()


def test_run_rollout_failure_ends_run_and_clears_store(
    tq_store_session: TransferQueueStore, tmp_path: Path, partition: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reward that raises in the rollout engine at step 2 exits 1 naming the step and the call; no key stays.
    Before step 1 the run says how long each part of its start took."""
    status = _run([
        *SMALL, f"run.dir={tmp_path}", f"data_plane.partition={partition}",
        "task.name=tests.e2e.grpo_faults:RewardFailsOnCall", "task.kwargs.fail_on_call=2",
    ])
    err = capsys.readouterr().err
    assert status == 1
    assert "step 2" in err and "generate" in err and FAULT_MESSAGE in err
    assert re.search(r"ready in [\d.]+ s \(Ray [\d.]+ s, store [\d.]+ s, workers [\d.]+ s\)", err), err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    store = TransferQueueStore.attach()
    try:
        assert store.list_keys(partition) == ()
    finally:
        store.close()


def test_trainer_worker_failure_mid_step_clears_store(tq_store_session: TransferQueueStore, partition: str) -> None:
    """A loss that raises in the policy workers (after the rollout wrote and logprobs wrote back) raises
    WorkerError naming a rank, and the step's keys are cleared."""
    config = load_run_config([*SMALL, f"data_plane.partition={partition}"])
    with GRPOTrainer(config) as trainer:
        trainer.loss = RaisingLoss(sample_mask=True)
        with pytest.raises(WorkerError, match=rf"rank \d .*{FAULT_MESSAGE}"):
            trainer.step(1)
        assert trainer.client is not None
        assert trainer.client.list_keys(partition) == ()


def test_trainer_step_whose_memory_reading_fails_finishes_with_the_reason_in_its_record(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory reading that fails after a step finished (a process that died then) does not fail the step: its
    record has ``rss_error`` in place of ``rss_mib``, its keys are cleared, and the next reading is taken again."""
    config = load_run_config(
        [*SMALL, f"data_plane.partition={partition}", "policy.layout.data_parallel=1", "run.memory_every=1"]
    )
    with GRPOTrainer(config) as trainer:
        reading = trainer.resident_memory

        def dead() -> dict[str, float | None]:
            message = f"policy rank 0 failed in 'resident_mib': {FAULT_MESSAGE}"
            raise WorkerError(message, rank=0, coords={}, method="resident_mib")

        monkeypatch.setattr(trainer, "resident_memory", dead)
        record = trainer.step(1)
        assert record["rss_error"] == f"WorkerError: policy rank 0 failed in 'resident_mib': {FAULT_MESSAGE}"
        assert "rss_mib" not in record and record["store_keys_outstanding"] == 0
        monkeypatch.setattr(trainer, "resident_memory", reading)
        record = trainer.step(2)
        assert "rss_error" not in record and record["rss_mib"]["policy 0"] > 0


def test_trainer_refit_keeps_rollout_in_sync(tq_store_session: TransferQueueStore, partition: str) -> None:
    """After a step, the rollout engine's weights equal the policy's (the refit reached it); the start timed its
    parts."""
    config = load_run_config([*SMALL, f"data_plane.partition={partition}", "policy.layout.data_parallel=1"])
    with GRPOTrainer(config) as trainer:
        assert list(trainer.start_seconds) == ["ray", "store", "workers"]
        assert all(seconds >= 0 for seconds in trainer.start_seconds.values())
        trainer.step(1)
        policy = trainer.policy_state()
        (rollout,) = trainer.source.group.call(RolloutWorker.weights)  # type: ignore[union-attr]
        assert policy.keys() == rollout.keys()
        assert all(torch.equal(policy[k], rollout[k]) for k in policy)


def test_trainer_dapo_past_its_batch_limit_raises_and_clears_store(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """DAPO that cannot fill the step within max_generation_batches raises StepError naming the limit's key,
    and the kept rows' keys are cleared."""
    config = load_run_config([
        *SMALL, f"data_plane.partition={partition}", "policy.layout.data_parallel=1",
        "grpo.dapo.enabled=true", "grpo.dapo.max_generation_batches=1",
    ])
    with GRPOTrainer(config) as trainer:
        with pytest.raises(StepError, match=r"step 1: DAPO .* grpo\.dapo\.max_generation_batches"):
            trainer.step(1)
        assert trainer.client is not None and trainer.client.list_keys(partition) == ()
