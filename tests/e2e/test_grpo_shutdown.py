"""``python -m shell.run`` as a separate process: a killed policy worker and Ctrl-C both end the run cleanly.

Each test starts the real command (its own embedded Ray cluster), waits for a
finished step, then kills a policy rank (SIGKILL) or interrupts the driver
(SIGINT). It checks the exit status, the message, the time to exit, and that
no process of the run survives it: every process that descended from the
driver while it ran (Ray's GCS and raylet, the workers, the store actor) must
be gone once the driver has exited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

START_TIMEOUT_S = 240.0  # Ray, the store and three megatron workers on 2 cores
EXIT_BOUND_S = 60.0  # from the fault to the driver's exit, shutdown included
ORPHAN_GRACE_S = 15.0  # Ray's processes exit asynchronously after ray.shutdown()


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "shell.run",
        f"run.dir={run_dir}", "run.progress=plain",
        "grpo.num_steps=200", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
        "policy.layout.data_parallel=2", "policy.train_global_batch_size=8", "data_plane.backend=memory", *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen[str], run_dir: Path, steps: int) -> dict[str, object]:
    """Wait until the run logged ``steps`` steps; return its processes.json."""
    deadline = time.monotonic() + START_TIMEOUT_S
    metrics, processes = run_dir / "metrics.jsonl", run_dir / "processes.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run exited early with {proc.returncode}:\n{out}\n{err}")
        if processes.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return json.loads(processes.read_text())
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"the run logged no {steps} steps within {START_TIMEOUT_S} s")


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _assert_no_orphans(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + ORPHAN_GRACE_S
    alive = processes
    while time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.5)
    names = [f"{p.pid} {' '.join(p.cmdline()[:3])}" for p in alive]
    pytest.fail(f"{len(alive)} processes of the run outlived it: {names}")


def _finish(proc: subprocess.Popen[str], since: float) -> tuple[int, str, float]:
    try:
        _, err = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run did not exit within {EXIT_BOUND_S} s of the fault:\n{err}")
    return proc.returncode, err, time.monotonic() - since


def test_run_killed_policy_worker_stops_with_its_rank(tmp_path: Path) -> None:
    """SIGKILL of policy rank 1 mid-run: exit 1 within the bound, the message names rank 1, no process survives."""
    proc = _start(tmp_path)
    info = _wait_for_steps(proc, tmp_path, 2)
    tree = _descendants(proc.pid)
    victim = int(info["policy"]["1"])  # type: ignore[index]
    assert victim in {p.pid for p in tree}
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    status, err, took = _finish(proc, killed_at)
    assert status == 1, err
    assert "run failed" in err and "rank 1" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(tree)


def test_run_ctrl_c_shuts_down_cleanly(tmp_path: Path) -> None:
    """SIGINT mid-run: exit 130 within the bound, 'interrupted' is reported, no process survives."""
    proc = _start(tmp_path)
    _wait_for_steps(proc, tmp_path, 2)
    tree = _descendants(proc.pid)
    interrupted_at = time.monotonic()
    proc.send_signal(signal.SIGINT)
    status, err, took = _finish(proc, interrupted_at)
    assert status == 130, err
    assert "interrupted" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(tree)
    assert (tmp_path / "reward.png").exists(), "an interrupted run still plots what it logged"


def test_run_killed_collector_exits_1_naming_it(tmp_path: Path) -> None:
    """Async GRPO, SIGKILL of the rollout collector mid-run: exit 1 within the bound, the message names the
    collector, no process survives."""
    proc = _start(tmp_path, "grpo.async.enabled=true", "grpo.async.max_staleness=1")
    info = _wait_for_steps(proc, tmp_path, 2)
    tree = _descendants(proc.pid)
    victim = int(info["collector"])  # type: ignore[arg-type]
    assert victim in {p.pid for p in tree}
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    status, err, took = _finish(proc, killed_at)
    assert status == 1, err
    assert "run failed" in err and "rollout collector" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(tree)
