"""GRPO across Ray nodes: a head and two worker nodes (``ray.cluster_utils.Cluster``), each a real raylet with its
own object store, hosted by ``python -m shell.bench.nodes`` in a process of its own.

The legacy path and the data plane on two TransferQueue backends run as ``python -m shell.run
ray.address=<the cluster>`` (side by side, in subprocesses: this process keeps the session's own Ray), with the
policy ranks and the rollout engine spread over the worker nodes (``ray.placement=spread``,
``ray.worker_resource``); the storage units (SimpleStorage) and the index (RayObjectStore) go to the worker nodes
too (``data_plane.storage_resource``). One cluster serves the whole module.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from shell.bench.nodes import NODE_RESOURCE
from shell.run_log import read_metrics
from tests.e2e.conftest import SMALL_DP2_RUN
from tests.e2e.test_grpo_shutdown import _assert_no_orphans, _pids

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
RUN = [
    f"grpo.num_steps={STEPS}",
    *SMALL_DP2_RUN,
    "grpo.loss.kl_coef=0.05",
    "run.progress=off",
    "ray.placement=spread",
    f"ray.worker_resource={NODE_RESOURCE}",
]
PATHS = {
    "legacy": ["data_plane.enabled=false"],
    "data_plane": ["data_plane.backend=transfer_queue", f"data_plane.storage_resource={NODE_RESOURCE}"],
    "object_store": ["data_plane.backend=tq_object_store", f"data_plane.storage_resource={NODE_RESOURCE}"],
}
"""The three runs: legacy, TransferQueue's SimpleStorage units on the worker nodes, and TransferQueue on Ray's
object store (large columns in the object store of the node that wrote them, the index with the small ones on a
worker node)."""
PARITY_KEYS = ("reward_mean", "entropy", "loss", "kl", "grad_norm")
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 3-node local cluster for the module: its address and nodes (the head first); stopped afterwards."""
    log = tmp_path_factory.mktemp("nodes") / "host.log"
    with open(log, "w") as errors:
        host = subprocess.Popen(
            [sys.executable, "-m", "shell.bench.nodes", "--nodes", "3"],
            cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
        )
    try:
        ready, _, _ = select.select([host.stdout], [], [], START_TIMEOUT_S)
        line = host.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if not line:
            pytest.fail(f"the local cluster did not start within {START_TIMEOUT_S:.0f} s: {log.read_text()[-2000:]}")
        yield json.loads(line)
    finally:
        host.stdin.close()  # type: ignore[union-attr]  # end of input: the host shuts the cluster down
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
        host.stdout.close()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def runs(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of each path on the cluster; their status, output, records and processes.

    A cluster runs one TransferQueue at a time (its controller is a named actor), and a run that finds one
    running joins it, so the two data-plane runs go one after the other; the legacy run goes beside the first.
    """
    out: dict[str, Any] = {}
    for wave in (("legacy", "data_plane"), ("object_store",)):
        out.update(_run_side_by_side(cluster, tmp_path_factory, wave))
    return out


def _run_side_by_side(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, names: tuple[str, ...]) -> dict[str, Any]:
    started = {}
    for name in names:
        run_dir = tmp_path_factory.mktemp(f"multinode-{name}")
        command = [sys.executable, "-m", "shell.run", *RUN, f"ray.address={cluster['address']}",
                   f"run.dir={run_dir}", *PATHS[name]]
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started[name] = (process, run_dir)
    out: dict[str, Any] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for name, (process, run_dir) in started.items():
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        metrics = run_dir / "metrics.jsonl"
        out[name] = {
            "status": process.returncode,
            "output": output,
            "records": read_metrics(metrics) if metrics.exists() else [],
            "processes": json.loads((run_dir / "processes.json").read_text()) if (run_dir / "processes.json").exists() else {},
        }
    return out


def test_multinode_runs_finish(runs: dict[str, Any]) -> None:
    """Every run exits 0 on the 3-node cluster and logs one record per step."""
    for name, run in runs.items():
        assert run["status"] == 0, f"{name}: {run['output'][-3000:]}"
        assert [r["step"] for r in run["records"]] == list(range(1, STEPS + 1)), name


def test_multinode_paths_agree_bitwise(runs: dict[str, Any]) -> None:
    """Across nodes, per-step rewards, entropies, losses, KL and grad norms are bitwise equal on every path."""
    legacy = runs["legacy"]["records"]
    assert len(legacy) == STEPS
    for name in ("data_plane", "object_store"):
        plane = runs[name]["records"]
        assert len(plane) == STEPS, name
        for a, b in zip(legacy, plane):
            assert {k: a[k] for k in PARITY_KEYS} == {k: b[k] for k in PARITY_KEYS}, f"{name} step {a['step']}"
    assert any(r["grad_norm"] > 0 for r in legacy), "the runs must actually train"


def test_multinode_data_plane_leaves_no_keys(runs: dict[str, Any]) -> None:
    """After every step of the data-plane runs the store holds none of their keys."""
    for name in ("data_plane", "object_store"):
        assert [r["store_keys_outstanding"] for r in runs[name]["records"]] == [0] * STEPS, name


def test_multinode_places_ranks_and_storage_units_on_different_worker_nodes(
    runs: dict[str, Any], cluster: dict[str, Any]
) -> None:
    """The DP ranks sit on two different nodes, the storage units on more than one node, and none of them
    (nor the rollout engine, nor TransferQueue's controller, nor the object store's index) on the driver's node,
    the head: only worker nodes have the resource."""
    head = next(n["node_id"] for n in cluster["nodes"] if n["head"])
    workers = {n["node_id"] for n in cluster["nodes"] if not n["head"]}
    for name, run in runs.items():
        nodes = run["processes"]["nodes"]
        assert nodes["driver"] == head, name
        ranks = [nodes["policy"][str(r)] for r in range(2)]
        assert len(set(ranks)) == 2 and set(ranks) <= workers, f"{name}: {ranks}"
        assert nodes["rollout"] in workers, name
    storage = runs["data_plane"]["processes"]["nodes"]["storage"]
    assert len(storage) == 2 and set(storage.values()) == workers, storage
    assert "storage" not in runs["legacy"]["processes"]["nodes"]  # the legacy path starts no store
    assert runs["object_store"]["processes"]["nodes"].get("storage", {}) == {}  # no storage units there
    assert runs["object_store"]["processes"]["nodes"]["store_index"] in workers  # its index (small columns)
    assert "store_index" not in runs["data_plane"]["processes"]["nodes"]
    for name in ("data_plane", "object_store"):  # TransferQueue's controller (every call's metadata)
        assert runs[name]["processes"]["nodes"]["store_controller"] in workers, name


def test_multinode_data_plane_moves_bulk_off_the_driver(runs: dict[str, Any]) -> None:
    """Per step the driver moves at most 10% of the legacy path's bytes across nodes too."""
    for name in ("data_plane", "object_store"):
        for a, b in zip(runs["legacy"]["records"], runs[name]["records"]):
            assert b["driver_bytes"] <= 0.10 * a["driver_bytes"], f"{name} step {a['step']}"


def test_a_storage_resource_no_node_has_ends_the_run_before_the_store_starts(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    """A ``data_plane.storage_resource`` that no alive node of the cluster has ends the run with exit 2 and a
    message naming the key and the resource, before anything waits for a part that could never be placed."""
    command = [
        sys.executable, "-m", "shell.run", f"ray.address={cluster['address']}", "grpo.num_steps=1",
        "run.progress=plain", "data_plane.storage_resource=rldp_absent_resource", f"run.dir={tmp_path}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "config key 'data_plane.storage_resource'" in output and "'rldp_absent_resource'" in output, output[-3000:]


# ---------------------------------------------------------------- losing a whole node (runs last: it kills one)


def test_multinode_losing_a_storage_node_fails_the_run_naming_the_store(
    runs: dict[str, Any], cluster: dict[str, Any], tmp_path: Path
) -> None:
    """Killing the raylet of a worker node that holds only a storage unit (the policy and the rollout are packed
    on the head) ends a data-plane run within 30 s with exit 1 and a message naming the store's part; no process
    of the run (policy, rollout, TransferQueue's parts) outlives it.

    The node's workers exit with their raylet, as on a real node (the cluster's host reaps the killed raylet:
    ``shell.bench.nodes.reaping``), so the storage unit there is gone and the run's store calls that need it stall
    until a probe finds it dead."""
    command = [
        sys.executable, "-m", "shell.run", f"ray.address={cluster['address']}", "grpo.num_steps=500",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.micro_batch_tokens=64",
        "policy.train_global_batch_size=8", "run.progress=plain", "data_plane.backend=transfer_queue",
        f"data_plane.storage_resource={NODE_RESOURCE}",
        f"run.dir={tmp_path}",
    ]
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        metrics, processes = tmp_path / "metrics.jsonl", tmp_path / "processes.json"
        while not (processes.exists() and metrics.exists() and metrics.read_text().strip()):
            assert process.poll() is None and time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.2)
        info = json.loads(processes.read_text())
        nodes = info["nodes"]
        ours = [psutil.Process(pid) for pid in _pids(info) if psutil.pid_exists(pid)]
        busy = {nodes["driver"], nodes["rollout"], nodes["store_controller"], *nodes["policy"].values()}
        target = next(n for n in cluster["nodes"] if n["node_id"] in set(nodes["storage"].values()) - busy)
        rank = next(name.split("#")[1] for name, node in nodes["storage"].items() if node == target["node_id"])
        lost = f"TransferQueue storage unit {rank} (pid {info['store'][f'TransferQueue storage unit {rank}']})"
        os.kill(target["raylet_pid"], signal.SIGKILL)
        killed = time.monotonic()
        output, _ = process.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, output[-3000:]
    assert took <= 30.0, f"the run took {took:.1f} s to end after the node died"
    assert f"the store failed: {lost}" in output, output[-3000:]  # the unit on the lost node, by rank and pid
    _assert_no_orphans(ours)
