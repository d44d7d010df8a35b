"""Async GRPO end to end: parity at ``max_staleness=0``, the staleness bound per row, no leaked key, a killed collector.

The parity runs call ``shell.run.main`` in this process (they join the
session's Ray and TransferQueue); the staleness and leak checks drive a
:class:`GRPOTrainer` step by step on the session's Ray memory store, watching
the rows each step trains on and the keys the store holds between steps.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
import uuid
from typing import Any

import psutil
import pytest

from adapters.ray_memory import RayMemoryStore
from adapters.transfer_queue import TransferQueueStore
from core.fields import WEIGHT_VERSION
from shell import run as shell_run
from shell.collector import RolloutCollector
from shell.grpo_trainer import GRPOTrainer
from shell.run_config import load_run_config
from shell.run_log import read_metrics
from shell.step_source import CollectorSource
from shell.worker_group import WorkerError
from shell.worker_errors import component_error

pytestmark = pytest.mark.e2e

PARITY_STEPS = 20
SMALL = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.layout.data_parallel=2",
    "policy.micro_batch_tokens=64",
    "grpo.loss.kl_coef=0.05",
    "policy.train_global_batch_size=8",
    "run.progress=off",
]
PARITY_KEYS = ("reward_mean", "reward_mean_trained", "entropy", "loss", "kl", "grad_norm", "zero_variance_group_frac")
ASYNC_METRICS = (
    "version_lag_mean", "version_lag_max", "buffer_groups", "groups_evicted", "trainer_wait_s", "collector_wait_s",
    "generated_tokens_per_s", "entropy", "zero_variance_group_frac",
)


@pytest.fixture(scope="module")
def parity_runs(tq_store_session: TransferQueueStore, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """20 steps of the synchronous trainer and of async GRPO at max_staleness=0, on TransferQueue and the memory store."""
    partition = f"async-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    for name, extra in (
        ("sync", []),
        ("async_tq", ["grpo.async.enabled=true", "grpo.async.max_staleness=0"]),
        ("async_memory", ["grpo.async.enabled=true", "grpo.async.max_staleness=0", "data_plane.backend=memory"]),
    ):
        run_dir = tmp_path_factory.mktemp(name)
        status = shell_run.main(
            [*SMALL, *extra, f"grpo.num_steps={PARITY_STEPS}", f"run.dir={run_dir}", f"data_plane.partition={partition}"]
        )
        out[name] = {"status": status, "records": read_metrics(run_dir / "metrics.jsonl")}
    out["partition"] = partition
    return out


def test_async_at_staleness_zero_equals_sync_bitwise(parity_runs: dict[str, Any]) -> None:
    """max_staleness=0: every step's rewards, losses, KL and grad norms equal the synchronous trainer's bitwise,
    on TransferQueue and on the memory store, for 20 steps."""
    sync = parity_runs["sync"]["records"]
    assert parity_runs["sync"]["status"] == 0 and len(sync) == PARITY_STEPS
    assert any(r["grad_norm"] > 0 for r in sync) and len({r["reward_mean"] for r in sync}) > 1, "the runs must train"
    for name in ("async_tq", "async_memory"):
        run = parity_runs[name]
        assert run["status"] == 0, name
        assert [r["step"] for r in run["records"]] == list(range(1, PARITY_STEPS + 1)), name
        for a, b in zip(sync, run["records"]):
            assert {k: a[k] for k in PARITY_KEYS} == {k: b[k] for k in PARITY_KEYS}, f"{name} step {a['step']}"
            assert b["version_lag_max"] == 0 and b["version_lag_mean"] == 0.0


def test_async_records_its_metrics_and_sync_records_zeros(parity_runs: dict[str, Any]) -> None:
    """Both trainers log every async metric; the synchronous one logs no lag, no buffer and no eviction."""
    for name in ("sync", "async_tq", "async_memory"):
        for record in parity_runs[name]["records"]:
            missing = [k for k in ASYNC_METRICS if k not in record]
            assert not missing, f"{name} step {record['step']}: missing {missing}"
            assert record["generated_tokens_per_s"] > 0 and record["trainer_wait_s"] >= 0
            assert 0.0 <= record["zero_variance_group_frac"] <= 1.0
    for record in parity_runs["sync"]["records"]:
        assert (record["version_lag_max"], record["buffer_groups"], record["groups_evicted"]) == (0, 0, 0)
        assert record["collector_wait_s"] == 0.0
    for name in ("sync", "async_tq", "async_memory"):  # the store time by process and call adds up to the whole
        records = parity_runs[name]["records"]
        for record in records:
            calls = record["data_plane_ms_by_call"]
            assert math.isclose(sum(calls.values()), record["data_plane_ms"], rel_tol=1e-9), (name, record["step"])
        assert all(r["data_plane_ms_by_call"].get("rollout put", 0.0) > 0 for r in records), name  # the collector's too


def test_every_tenth_record_has_each_process_resident_memory(parity_runs: dict[str, Any]) -> None:
    """``run.memory_every`` (10 by default): steps 10 and 20 carry ``rss_mib``, the resident MiB of the driver, both
    policy ranks, the source's actors (the rollout engine; async, the collector and the replay buffer) and each store
    part; no other step does."""
    for name, source in (("sync", {"rollout"}), ("async_tq", {"collector", "replay_buffer"}),
                         ("async_memory", {"collector", "replay_buffer"})):
        for record in parity_runs[name]["records"]:
            if record["step"] % 10:
                assert "rss_mib" not in record, f"{name} step {record['step']}"
                continue
            rss = record["rss_mib"]
            assert {"driver", "policy 0", "policy 1", *source} <= set(rss), f"{name} step {record['step']}: {rss}"
            assert "replay_buffer" in source or "replay_buffer" not in rss, f"{name}: {rss}"
            assert any(process.startswith("store ") for process in rss), f"{name}: {rss}"
            assert all(isinstance(mib, float) and 50 < mib < 8192 for mib in rss.values()), f"{name}: {rss}"


def test_async_parity_runs_leave_no_keys(parity_runs: dict[str, Any]) -> None:
    """After the runs, TransferQueue holds none of their keys (receipts in the buffer were cleared at shutdown)."""
    store = TransferQueueStore.attach()
    try:
        assert store.list_keys(parity_runs["partition"]) == ()
    finally:
        store.close()


# ---------------------------------------------------------------- a trainer driven step by step


def _trainer(store: RayMemoryStore, partition: str, *overrides: str) -> GRPOTrainer:
    config = load_run_config([*SMALL, "grpo.async.enabled=true", f"data_plane.partition={partition}", *overrides])
    return GRPOTrainer(config, client=RayMemoryStore.attach(store.name),
                       client_factory=functools.partial(RayMemoryStore.attach, store.name))


def _spy_trained_versions(trainer: GRPOTrainer) -> list[list[int]]:
    """Record, per train call, the ``weight_version`` tag of every row it trains on."""
    seen: list[list[int]] = []
    policy = trainer.policy
    assert policy is not None
    train = policy.train

    def spy(rows: Any, loss_fn: Any) -> Any:
        seen.append([int(v) for v in rows.meta.tag_column(WEIGHT_VERSION)])
        return train(rows, loss_fn)

    policy.train = spy  # type: ignore[method-assign]
    return seen


def _run_keys(store: RayMemoryStore, partition: str, trainer: GRPOTrainer) -> set[str]:
    return {k for k in store.list_keys(partition) if k.startswith(trainer.key_prefix)}


@pytest.fixture
def partition() -> str:
    return f"async-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("bound", [1, 2])
def test_async_staleness_bound_holds_per_row_and_no_key_leaks(
    ray_memory_session: RayMemoryStore, partition: str, bound: int
) -> None:
    """max_staleness=k: every trained row's tag is at most k versions behind the step's weights (and some row is
    behind: the collector ran ahead); after every step each stored key is buffered or in flight; after close, none."""
    steps = 6
    trainer = _trainer(ray_memory_session, partition, f"grpo.async.max_staleness={bound}", "grpo.async.buffer_groups=12")
    try:
        trainer.start()
        seen = _spy_trained_versions(trainer)
        source = trainer.source
        assert isinstance(source, CollectorSource)
        for step in range(1, steps + 1):
            record = trainer.step(step)
            lags = [(step - 1) - v for v in seen[-1]]
            assert all(0 <= lag <= bound for lag in lags), f"step {step}: lags {lags}"
            assert record["version_lag_max"] == max(lags)
            stored = _run_keys(ray_memory_session, partition, trainer)
            in_flight = set(source.group.call(RolloutCollector.in_flight_keys)[0])  # type: ignore[union-attr]
            buffered = set(source.buffer.keys())  # type: ignore[union-attr]
            assert stored <= in_flight | buffered, f"step {step}: {sorted(stored - in_flight - buffered)[:4]}"
        assert max(lag for versions, step in zip(seen, range(1, steps + 1)) for lag in [(step - 1) - v for v in versions]) >= 1
    finally:
        trainer.close()
    assert _run_keys(ray_memory_session, partition, trainer) == set()


def test_a_step_failing_right_after_it_sampled_owns_and_clears_the_sampled_keys(
    ray_memory_session: RayMemoryStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector's stats call fails right after a step took its groups out of the buffer: the step fails, and
    the sampled keys are the step's, so its abort clears them; every stored key is still buffered or in flight."""
    trainer = _trainer(ray_memory_session, partition, "grpo.async.max_staleness=1", "grpo.async.buffer_groups=8")
    try:
        trainer.start()
        trainer.step(1)
        source = trainer.source
        assert isinstance(source, CollectorSource)
        call = source._call_collector

        def failing_stats(method: Any, *args: Any) -> Any:
            if method is RolloutCollector.stats:
                raise component_error("the rollout collector", "stats", "injected")
            return call(method, *args)

        monkeypatch.setattr(source, "_call_collector", failing_stats)
        with pytest.raises(WorkerError, match="injected"):
            trainer.step(2)
        monkeypatch.undo()
        stored = _run_keys(ray_memory_session, partition, trainer)
        in_flight = set(source.group.call(RolloutCollector.in_flight_keys)[0])  # type: ignore[union-attr]
        buffered = set(source.buffer.keys())  # type: ignore[union-attr]
        assert stored <= in_flight | buffered, sorted(stored - in_flight - buffered)[:4]
    finally:
        trainer.close()
    assert _run_keys(ray_memory_session, partition, trainer) == set()


def test_async_killed_collector_fails_the_step_naming_it_and_leaves_no_key(
    ray_memory_session: RayMemoryStore, partition: str
) -> None:
    """SIGKILL of the collector's process mid-run: a later step raises a WorkerError naming the rollout
    collector; close() then leaves none of the run's keys and the collector's process is gone."""
    trainer = _trainer(ray_memory_session, partition, "grpo.async.max_staleness=1", "grpo.async.buffer_groups=8")
    try:
        trainer.start()
        trainer.step(1)
        source = trainer.source
        assert source is not None
        pid = source.process_ids()["collector"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="rollout collector"):
            for step in range(2, 12):
                trainer.step(step)
    finally:
        trainer.close()
    assert _run_keys(ray_memory_session, partition, trainer) == set()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
