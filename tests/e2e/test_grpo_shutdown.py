"""``python -m shell.run`` as a separate process: killed components and signals all end the run cleanly.

Each test starts the real command (its own embedded Ray cluster, or a
``ray start`` cluster it joins), waits for a finished step, then kills a
component by its pid from ``processes.json`` (SIGKILL: a policy rank, the
rollout engine, the async collector) or signals the driver (SIGINT, SIGTERM).
It checks the exit status, that the message names what failed, the time to
exit, and that no process of the run survives it: every process that
descended from the driver while it ran (Ray's GCS and raylet, the workers, the
store actor) must be gone once the driver has exited; on a joined cluster, the
run's actors must be gone and the cluster must still run. An unreachable
``ray.address`` must fail within 30 s with exit 2.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import ROOT
from tests.e2e.test_ray_cluster import _env as _cluster_env
from tests.e2e.test_ray_cluster import ray_head

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

START_TIMEOUT_S = 240.0  # Ray, the store and three megatron workers on 2 cores
EXIT_BOUND_S = 60.0  # from the fault to the driver's exit, shutdown included
ORPHAN_GRACE_S = 15.0  # Ray's processes exit asynchronously after ray.shutdown()
_FIXTURES = (ray_head,)  # used by name: one `ray start --head` cluster for this module
FAULT_BOUND_S = 30.0  # the bound: a dead engine, or an unreachable address, ends the run within it


def _start(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "shell.run",
        f"run.dir={run_dir}", "run.progress=plain",
        "grpo.num_steps=200", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
        "policy.layout.data_parallel=2", "policy.train_global_batch_size=8", "data_plane.backend=memory", *extra,
    ]
    if env is None:
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
    names = []
    for p in alive:
        try:
            names.append(f"{p.pid} {' '.join(p.cmdline()[:3])}")
        except psutil.Error:
            names.append(str(p.pid))
    pytest.fail(f"{len(alive)} processes of the run outlived it: {names}")


def _pids(info: object) -> list[int]:
    """Every worker pid of a processes.json record (roles may nest), the driver's excepted."""
    if isinstance(info, dict):
        return [pid for key, value in info.items() if key != "driver" for pid in _pids(value)]
    return [info] if isinstance(info, int) else []


def _cluster_actors(ray_tmp: str) -> list[psutil.Process]:
    """The ``ray::<Class>`` processes (actors and the cluster's agents, not idle workers) under the raylets of the
    cluster whose RAY_TMPDIR is ``ray_tmp`` (other Ray clusters on the machine are not looked at)."""
    actors = []
    for raylet in psutil.process_iter(["cmdline"]):
        cmdline = raylet.info["cmdline"] or []
        if not (cmdline and cmdline[0].endswith("/raylet") and any(ray_tmp in arg for arg in cmdline)):
            continue
        for child in raylet.children(recursive=True):
            try:
                title = child.cmdline()[0] if child.cmdline() else ""
            except psutil.Error:
                continue
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                actors.append(child)
    return actors


def _finish(proc: subprocess.Popen[str], since: float, bound_s: float = EXIT_BOUND_S) -> tuple[int, str, float]:
    try:
        _, err = proc.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run did not exit within {bound_s} s of the fault:\n{err}")
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
    assert "run failed" in err and "policy rank 1" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(tree)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_signal_mid_run_exits_130_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGINT (Ctrl-C) or SIGTERM to the driver mid-run (embedded Ray): exit 130 within the bound (not Ray's own
    SIGTERM exit), 'interrupted (<signal>)' is reported, no process survives, and what was logged is plotted."""
    proc = _start(tmp_path)
    _wait_for_steps(proc, tmp_path, 1)
    tree = _descendants(proc.pid)
    interrupted_at = time.monotonic()
    proc.send_signal(sig)
    status, err, took = _finish(proc, interrupted_at)
    assert status == 130, err
    assert f"interrupted ({sig.name})" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(tree)
    assert (tmp_path / "reward.png").exists(), "an interrupted run still plots what it logged"


def _kill_mid_run(tmp_path: Path, role: str, steps: int, bound_s: float, *extra: str) -> str:
    """Start a run, SIGKILL its ``role`` process (from processes.json) after ``steps`` steps; assert exit 1 within
    ``bound_s`` and no process left; return the driver's stderr."""
    proc = _start(tmp_path, *extra)
    info = _wait_for_steps(proc, tmp_path, steps)
    tree = _descendants(proc.pid)
    victim = int(info[role])  # type: ignore[arg-type]
    assert victim in {p.pid for p in tree}
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    status, err, took = _finish(proc, killed_at, bound_s)
    assert status == 1, err
    assert took < bound_s
    _assert_no_orphans(tree)
    return err


def test_run_killed_collector_exits_1_naming_it(tmp_path: Path) -> None:
    """Async GRPO, SIGKILL of the rollout collector mid-run: exit 1 within the bound, the message names the
    collector, no process survives."""
    err = _kill_mid_run(tmp_path, "collector", 2, EXIT_BOUND_S, "grpo.async.enabled=true", "grpo.async.max_staleness=1")
    assert "run failed" in err and "rollout collector" in err, err


def test_run_killed_rollout_engine_exits_1_naming_it(tmp_path: Path) -> None:
    """SIGKILL of the rollout engine mid-run: exit 1 within 30 s, the message names the rollout engine (not the
    policy rank that was pushing weights to it), no process survives."""
    err = _kill_mid_run(tmp_path, "rollout", 1, FAULT_BOUND_S)
    assert re.search(r"^run failed at step \d+: the rollout engine failed in '\w+': ", err, re.MULTILINE), err


def test_run_sigterm_during_start_up_exits_130(tmp_path: Path) -> None:
    """SIGTERM as soon as the embedded Ray cluster's first process exists (ray.init, whose own SIGTERM handler
    would exit 15, is then usually still running): exit 130, no process survives."""
    proc = _start(tmp_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    tree: list[psutil.Process] = []
    while not tree:
        assert proc.poll() is None and time.monotonic() < deadline, "the run started no process"
        time.sleep(0.1)
        tree = _descendants(proc.pid)
    _sigterm_during_start_up(proc, tree, "interrupted (SIGTERM)")


def test_run_sigterm_while_the_store_starts_exits_130(tmp_path: Path) -> None:
    """SIGTERM while TransferQueue starts (its ``init`` runs on a thread of the driver, under a deadline): the
    interrupt ends the wait at once, the parts started so far are stopped, exit 130, no process survives."""
    proc = _start(tmp_path, "data_plane.backend=tq_object_store")
    deadline = time.monotonic() + START_TIMEOUT_S
    line = ""
    while "starting the store" not in line:
        assert proc.poll() is None and time.monotonic() < deadline, "the run never started its store"
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)  # the run's console writes to stderr
        if ready:
            line = proc.stderr.readline()  # type: ignore[union-attr]
    time.sleep(1.0)  # TransferQueue's controller and the index are booting
    _sigterm_during_start_up(proc, _descendants(proc.pid), "interrupted (SIGTERM) during start-up")


def _sigterm_during_start_up(proc: subprocess.Popen[str], tree: list[psutil.Process], message: str) -> None:
    """SIGTERM the starting run: it exits 130 within the bound, saying ``message``, and no process it had under way
    (``tree``, and whatever it started until it exited) survives it."""
    interrupted_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    seen = set(tree)
    while proc.poll() is None and time.monotonic() - interrupted_at < EXIT_BOUND_S:
        seen.update(_live_descendants(proc.pid))  # what start-up had under way when the signal came
        time.sleep(0.1)
    status, err, took = _finish(proc, interrupted_at)
    assert status == 130, err
    assert message in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(list(seen))


def _live_descendants(pid: int) -> list[psutil.Process]:
    try:
        return _descendants(pid)
    except psutil.Error:  # the driver just exited
        return []


def test_run_sigterm_on_a_joined_cluster_exits_130_and_stops_its_actors(ray_head: tuple[str, str], tmp_path: Path) -> None:
    """SIGTERM to a driver that joined a `ray start` cluster: exit 130, every actor process on the cluster (the
    run's: processes.json's and the store's) is gone within the orphan grace, and the cluster itself still runs."""
    address, head_tmp = ray_head
    cluster_own = {p.pid for p in _cluster_actors(head_tmp)}  # its agents, before the run
    proc = _start(tmp_path, f"ray.address={address}", env=_cluster_env())
    info = _wait_for_steps(proc, tmp_path, 1)
    actors = [p for p in _cluster_actors(head_tmp) if p.pid not in cluster_own]
    assert set(_pids(info)) <= {p.pid for p in actors}  # processes.json: the policy ranks, the engine, the store's actor
    interrupted_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    status, err, took = _finish(proc, interrupted_at)
    assert status == 130, err
    assert "interrupted (SIGTERM)" in err, err
    assert took < EXIT_BOUND_S
    _assert_no_orphans(actors)
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5):  # the cluster's GCS still answers
        pass


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (not a Ray GCS), on every interface."""
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_run_unreachable_ray_address_exits_2_within_30_s(silent_port: int, tmp_path: Path) -> None:
    """ray.address naming a port that accepts connections but is no Ray cluster: exit 2 within 30 s with one line
    naming ray.address (Ray itself would retry for minutes); nothing is started."""
    started = time.monotonic()
    proc = _start(tmp_path / "run", f"ray.address=127.0.0.1:{silent_port}", env=_cluster_env())
    status, err, took = _finish(proc, started, FAULT_BOUND_S)
    assert status == 2, err
    assert f"config key 'ray.address': no Ray cluster answers at 127.0.0.1:{silent_port}" in err, err
    assert took < FAULT_BOUND_S
    assert not (tmp_path / "run" / "processes.json").exists()
