"""A benchmark's own Ray cluster with TransferQueue on it, both stopped when the benchmark ends.

The benchmarks that drive workers (``policy``, ``grpo``) measure on a cluster
of their own: a new local Ray cluster (``address="local"``, as a run's embedded
cluster, see :mod:`shell.ray_cluster`) with logical CPUs (at least 8:
TransferQueue's controller and storage units take one each), the repository on
its workers' path, no dashboard and no worker logs on the driver; and one
TransferQueue, quiet but for errors, started on it.

Invariant: whatever the benchmark raises, the store is closed and Ray is shut
down before :func:`bench_cluster` returns.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray

from adapters import tq_system
from adapters.transfer_queue import TransferQueueStore

ROOT = Path(__file__).resolve().parents[2]
"""The repository root, put on the path of the cluster's workers."""


@contextlib.contextmanager
def bench_cluster(name: str, storage: str = "RayObjectStore") -> Iterator[TransferQueueStore]:
    """Start a Ray cluster and TransferQueue for the benchmark ``name``; yield the owning store.

    Args:
        name: the benchmark, in the Ray namespace (``f"{name}-bench-<random>"``).
        storage: TransferQueue's storage backend (the default run's, ``RayObjectStore``, unless told).

    Example:
        >>> with bench_cluster("policy") as store:  # doctest: +SKIP
        ...     group = build_group(config, client_factory=TransferQueueStore.attach)
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"{name}-bench-{uuid.uuid4().hex[:6]}",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        store = TransferQueueStore.start({"backend": {"storage_backend": storage}})
        tq_system.quiet_logs()
        try:
            yield store
        finally:
            store.close()
    finally:
        ray.shutdown()
