"""A Ray cluster of several nodes on one machine (``ray.cluster_utils.Cluster``), for the scale bench and the tests.

Each node is a real raylet with its own object store, so objects that move
between nodes go through Ray's object transfer, and actors on different nodes
talk over TCP, as on a real cluster. The head node has no custom resource; every
worker node has :data:`NODE_RESOURCE`, so a run that sets
``ray.worker_resource`` and ``data_plane.storage_resource`` to it keeps its
policy ranks, rollout engine and storage units off the driver's node.

``python -m shell.bench.nodes --nodes 3`` hosts such a cluster for other
processes: it prints one JSON line (``address``, and per node its ``node_id``,
``head`` flag and ``raylet_pid``), then keeps the cluster until its standard
input closes or it gets SIGTERM / SIGINT, and shuts it down. Its Ray files go to
a private temporary folder (``RAY_TMPDIR``), so the cluster is never found by
``ray.address=auto`` or by ``ray.init()`` elsewhere on the machine. While it
hosts the cluster it reaps the node processes that exit (:func:`reaping`): a
raylet killed from outside then disappears as on a real node, where its
workers see it gone and exit within about a second (Ray's workers check their
raylet's pid; a dead raylet left unreaped as a zombie would keep them serving).

Invariant: :func:`local_nodes` shuts down every node it started, whatever the
body raises.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import psutil

NODE_RESOURCE = "rldp_node"
"""The custom resource every worker node has (one unit), and the head node lacks."""


@attrs.frozen
class NodesConfig:
    """The shape of a local cluster: ``nodes`` nodes (the head and ``nodes - 1`` workers), each with
    ``num_cpus`` logical CPUs and an object store of ``object_store_mb`` MiB.

    Raises:
        ValueError: fewer than 1 node or CPU, or an object store under Ray's 75 MiB minimum.
    """

    nodes: int = 3
    num_cpus: int = 4
    object_store_mb: int = 128

    def __attrs_post_init__(self) -> None:
        for name, low in (("nodes", 1), ("num_cpus", 1), ("object_store_mb", 75)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"'{name}' must be an int >= {low}: got {value!r}")


@attrs.frozen
class NodeInfo:
    """One node of a local cluster: its Ray id, whether it is the head, and its raylet's pid."""

    node_id: str
    head: bool
    raylet_pid: int


def _token_auth_like_ray_start() -> None:
    """Turn Ray token authentication on when this machine has a token, as ``ray start`` does, so that
    drivers joining with ``ray.address`` (which present the token, :mod:`shell.ray_cluster`) are understood."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def start_cluster(config: NodesConfig) -> Any:
    """Start the head and the worker nodes; return the ``ray.cluster_utils.Cluster`` (not connected).

    Token authentication is on when this machine has a Ray token (``~/.ray/auth_token``), as with ``ray start``.
    """
    from ray.cluster_utils import Cluster

    _token_auth_like_ray_start()

    store = config.object_store_mb << 20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": config.num_cpus, "object_store_memory": store, "include_dashboard": False},
    )
    try:
        for _ in range(config.nodes - 1):
            cluster.add_node(
                num_cpus=config.num_cpus, object_store_memory=store, resources={NODE_RESOURCE: 1}, wait=False
            )
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def describe(cluster: Any) -> list[NodeInfo]:
    """The cluster's nodes, the head first."""
    nodes = [cluster.head_node, *sorted(cluster.worker_nodes, key=lambda n: n.node_id)]
    return [
        NodeInfo(node_id=n.node_id, head=n is cluster.head_node, raylet_pid=n.all_processes["raylet"][0].process.pid)
        for n in nodes
    ]


def node_pids(cluster: Any) -> dict[str, set[int]]:
    """The pids of each node's processes: its raylet and every process under it (the node's workers),
    plus, on the head, the other processes Ray started for it (the GCS server and such)."""
    out: dict[str, set[int]] = {}
    for node in [cluster.head_node, *cluster.worker_nodes]:
        pids: set[int] = set()
        for infos in node.all_processes.values():
            for info in infos:
                pids.add(info.process.pid)
                with contextlib.suppress(psutil.Error):
                    pids.update(child.pid for child in psutil.Process(info.process.pid).children(recursive=True))
        out[node.node_id] = pids
    return out


@contextlib.contextmanager
def reaping(cluster: Any, every_s: float = 0.2) -> Iterator[None]:
    """Reap the cluster's node processes that exit, every ``every_s`` seconds, while the body runs.

    ``ray.cluster_utils.Cluster`` starts each node's processes (its raylet among them) as children of this
    process and waits for them only at shutdown, so one killed from outside stays a zombie: its pid still
    exists, and Ray's workers on that node, which exit when their raylet's pid is gone, keep running. Reaping
    gives the death that a real node has: the raylet is gone and its workers follow it.
    """
    stop = threading.Event()

    def reap() -> None:
        while not stop.wait(every_s):
            for node in [cluster.head_node, *cluster.worker_nodes]:
                with contextlib.suppress(Exception):  # a node being removed: the next round sees it settled
                    node.live_processes()  # polls every process, so the exited ones are reaped

    thread = threading.Thread(target=reap, name="reap-node-processes", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def local_nodes(config: NodesConfig) -> Iterator[Any]:
    """A started local cluster for the body; shut down afterwards."""
    cluster = start_cluster(config)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Host a local cluster until stdin closes (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m shell.bench.nodes", description="host a local multi-node Ray cluster")
    parser.add_argument("--nodes", type=int, default=3, help="nodes, the head included (default 3)")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs per node (default 4)")
    parser.add_argument("--object-store-mb", type=int, default=128, help="object store per node, MiB (default 128)")
    args = parser.parse_args(argv)
    try:
        config = NodesConfig(nodes=args.nodes, num_cpus=args.num_cpus, object_store_mb=args.object_store_mb)
    except ValueError as error:
        parser.error(str(error))
    folder = tempfile.mkdtemp(prefix="rldp-")
    os.environ["RAY_TMPDIR"] = folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with local_nodes(config) as cluster, reaping(cluster):
            info = {"address": cluster.address, "nodes": [attrs.asdict(n) for n in describe(cluster)]}
            print(json.dumps(info), flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                sys.stdin.read()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
