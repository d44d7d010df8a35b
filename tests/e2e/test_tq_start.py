"""Starting TransferQueue where a part cannot be placed: ``adapters.tq_system.start``'s deadline.

Ray leaves an actor that no node can take pending for ever, and TransferQueue's ``init`` waits on it. Here the
only node with the controller's resource has no CPU for it, so the start must end at its deadline, name the part
that never started, and leave none of TransferQueue's actors behind. The cluster (``ray.cluster_utils.Cluster``: a
head with CPUs and a worker node with the resource and no CPU) runs in a subprocess, apart from the session's Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e

DEADLINE_S = 5.0

SCRIPT = textwrap.dedent(
    f"""
    import json, time
    import ray
    from ray.cluster_utils import Cluster
    from adapters import tq_system

    cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 2}})
    cluster.add_node(num_cpus=0, resources={{"rldp_store": 1}})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    began = time.monotonic()
    message = None
    try:
        tq_system.start(
            {{"controller": {{"required_node_resource": "rldp_store"}},
              "backend": {{"storage_backend": "RayObjectStore", "RayObjectStore": {{"required_node_resource": "rldp_store"}}}}}},
            start_timeout_s={DEADLINE_S},
        )
    except RuntimeError as error:
        message = str(error)
    took = time.monotonic() - began
    names = ("TransferQueueController", "TransferQueueObjectStoreIndex")
    deadline = time.monotonic() + 20
    while True:  # a killed actor's name is released shortly after
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] in names]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps({{"message": message, "took": took, "left": left, "running": tq_system.is_running()}}))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_a_controller_no_node_can_take_ends_the_start_at_its_deadline_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["message"] is not None, "the start did not fail"
    assert "did not start within 5 s" in result["message"]
    assert "not answering: TransferQueue controller;" in result["message"]  # the index (no CPU) started
    assert "placed by controller.required_node_resource='rldp_store'" in result["message"]
    assert "backend.RayObjectStore.required_node_resource='rldp_store'" in result["message"]
    assert DEADLINE_S <= result["took"] <= DEADLINE_S + 45, result["took"]
    assert result["left"] == [] and result["running"] is False, result
    print(result["message"], f"({result['took']:.1f} s)")
