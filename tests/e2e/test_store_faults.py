"""Faults in the store, with ``python -m shell.run`` as a separate process: real store processes killed by pid.

* A killed TransferQueue storage unit or controller ends the run with exit 1
  within 30 s, naming the part that died; no process of the run survives.
* Ctrl-C while the rollout scores (a task whose reward sleeps) leaves none of
  the run's keys in a TransferQueue the run shares (the session's), and the
  run's ``store_keys_outstanding`` never counts another run's keys in the
  same partition, which stay untouched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from tensordict import TensorDict

from adapters.transfer_queue import TransferQueueStore
from tests.e2e.conftest import ROOT
from tests.e2e.test_grpo_shutdown import _assert_no_orphans, _descendants, _wait_for_steps

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SLOW_REWARD_S = 3.0  # how long the rollout of step 3 scores in the Ctrl-C test
STORE_EXIT_BOUND_S = 30.0  # from the kill of a store part to the driver's exit, shutdown included
TINY = (
    "run.progress=plain", "grpo.num_steps=200", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
)


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "shell.run", f"run.dir={run_dir}", *TINY, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _exit_after(proc: subprocess.Popen[str], since: float, bound_s: float) -> tuple[int, str, float]:
    try:
        _, err = proc.communicate(timeout=bound_s + 30.0)  # wait past the bound, so a slow exit is measured
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run did not exit within {bound_s + 30.0} s of the fault:\n{err}")
    return proc.returncode, err, time.monotonic() - since


@pytest.mark.parametrize(
    ("backend", "part"),
    [
        ("transfer_queue", "TransferQueue storage unit 1"),
        ("tq_object_store", "TransferQueue controller"),
        ("tq_object_store", "TransferQueue object-store index"),
    ],
)
def test_run_killed_store_part_exits_1_naming_it(tmp_path: Path, backend: str, part: str) -> None:
    """SIGKILL of a part of TransferQueue mid-run (a SimpleStorage unit, the controller, the object-store backend's
    index): exit 1 within 30 s, the message names the part and its pid, no process of the run survives."""
    proc = _start(tmp_path, f"data_plane.backend={backend}")
    info = _wait_for_steps(proc, tmp_path, 2)
    tree = _descendants(proc.pid)
    victim = int(info["store"][part])  # type: ignore[index]
    assert victim in {p.pid for p in tree}
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    status, err, took = _exit_after(proc, killed_at, STORE_EXIT_BOUND_S)
    assert status == 1, err
    assert f"the store failed: {part} (pid {victim}) died" in err, err
    assert "warning: shutdown" not in err, err  # the clean-up does not report the same failure again
    assert took < STORE_EXIT_BOUND_S, f"exit took {took:.1f} s:\n{err}"
    _assert_no_orphans(tree)


def test_run_ctrl_c_during_rollout_leaves_no_keys_in_shared_store(
    tq_store_session: TransferQueueStore, partition: str, tmp_path: Path
) -> None:
    """A run joins the session's cluster and TransferQueue, sharing a partition with another run's keys: its
    ``store_keys_outstanding`` is 0, and Ctrl-C while its rollout scores step 3 (pressed twice) exits 130 leaving
    none of its keys and the other run's keys intact."""
    store = TransferQueueStore.attach()
    other = ["other-run-s1b0p0_g0", "other-run-s1b0p0_g1"]
    store.put(other, partition, TensorDict({"x": torch.tensor([5, 6])}, batch_size=[2]))
    marker = tmp_path / "scoring"
    address = ray.get_runtime_context().gcs_address
    proc = _start(
        tmp_path / "run", f"ray.address={address}", f"data_plane.partition={partition}",
        "task.name=tests.e2e.grpo_faults:RewardSlowOnCall", f"task.kwargs.marker={marker}",
        "task.kwargs.slow_on_call=3", f"task.kwargs.sleep_s={SLOW_REWARD_S}",
    )
    try:
        _wait_for_steps(proc, tmp_path / "run", 2)
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len(records) >= 2 and all(r["store_keys_outstanding"] == 0 for r in records), records
        deadline = time.monotonic() + 60.0
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the rollout of step 3 never scored"
        proc.send_signal(signal.SIGINT)
        # The first Ctrl-C's clean-up waits for the rollout, which writes its rows when its reward returns (after
        # the driver stopped waiting for it). A second Ctrl-C as soon as they are stored lands in that clean-up
        # (a user pressing again): it must neither skip the sweep nor exit with another status than 130.
        deadline = time.monotonic() + 30.0
        while proc.poll() is None and time.monotonic() < deadline and set(store.list_keys(partition)) <= set(other):
            time.sleep(0.02)
        assert proc.poll() is None, "the run exited before its rollout stored the rows of step 3"
        proc.send_signal(signal.SIGINT)
        status, err, _ = _exit_after(proc, time.monotonic(), 60.0)
        assert sorted(store.list_keys(partition)) == other, err
        assert status == 130, err
        assert store.get(other, partition, ["x"])["x"].tolist() == [5, 6]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        store.clear(list(store.list_keys(partition)), partition)
        store.close()
