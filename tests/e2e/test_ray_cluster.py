"""How a run finds Ray (``shell.ray_cluster``), against a real ``ray start --head`` cluster.

These tests start Ray in subprocesses, never in the test process: what they
check is how a *new* process finds, joins or ignores a cluster, which the
session's in-process cluster would hide. The head runs with its own
``RAY_TMPDIR``, so the ``ray_current_cluster`` file it writes never reaches
other Ray users of the machine, and it is stopped by terminating its
``ray start --block`` process (never ``ray stop``, which stops every cluster on
the machine). It starts as the README's recipe says, with this machine's
settings: where ``~/.ray/auth_token`` exists, ``ray start`` turns token
authentication on, and the run must present the token by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shell.ray_cluster import resolve_address

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HEAD_CPUS = 8
TINY_RUN = [
    "grpo.num_steps=1", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=null", "policy.micro_batch_tokens=0", "run.progress=plain",
    "run.samples_to_log=0",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's address and auth settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_TMPDIR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, str]]:
    """A ``ray start --head`` cluster on a free port; yields (its address, its RAY_TMPDIR)."""
    tmp = tempfile.mkdtemp(prefix="rldp-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         f"--num-cpus={HEAD_CPUS}", "--include-dashboard=false", "--disable-usage-stats"],
        env=_env(RAY_TMPDIR=tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not (Path(tmp) / "ray" / "ray_current_cluster").is_file():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not come up (exit {head.poll()})")
            time.sleep(0.5)
        yield address, tmp
    finally:
        head.terminate()  # --block: stops the head's processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_run_joins_a_ray_start_cluster_by_address(ray_head: tuple[str, str], tmp_path: Path) -> None:
    """The README recipe as written: ``ray start --head``, then ``python -m shell.run ray.address=HOST:PORT``
    (no RAY_AUTH_MODE set) joins the cluster, runs, and exits 0."""
    address, _ = ray_head
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "shell.run", f"ray.address={address}", f"run.dir={run_dir}", *TINY_RUN],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"joining Ray at {address}" in done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]


_CONNECT = """
import ray
from shell.config_schema import NodePlacement, RaySection
from shell.ray_cluster import connect
connect(RaySection(address=None, num_cpus=2, placement=NodePlacement.pack, worker_resource=None), lambda message: None)
print("GCS", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.mark.parametrize("case", ["running cluster", "stale address file"])
def test_connect_embedded_starts_its_own_cluster_whatever_runs(ray_head: tuple[str, str], case: str) -> None:
    """``ray.address: null`` starts a new cluster even with a ``ray start`` cluster running (its address in
    RAY_ADDRESS and in the address file), or with a stale address file of a cluster that is gone."""
    address, head_tmp = ray_head
    if case == "running cluster":
        env = _env(RAY_TMPDIR=head_tmp, RAY_ADDRESS=address)
    else:
        stale = tempfile.mkdtemp(prefix="rldp-", dir="/tmp")  # short: Ray's socket paths live under it
        (Path(stale) / "ray").mkdir()
        (Path(stale) / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")
        env = _env(RAY_TMPDIR=stale)
    try:
        done = subprocess.run([sys.executable, "-c", _CONNECT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        if case != "running cluster":
            shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (gcs,) = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("GCS ")]
    assert gcs.rpartition(":")[2] != address.rpartition(":")[2], "the embedded run joined the running cluster"


def test_resolve_address_auto_is_the_recorded_cluster(ray_head: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.address=auto`` is the address ``ray start`` recorded (RAY_ADDRESS, when set, wins)."""
    address, head_tmp = ray_head
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", head_tmp)
    assert resolve_address("auto").rpartition(":")[2] == address.rpartition(":")[2]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert resolve_address("auto") == "10.0.0.9:6379"
