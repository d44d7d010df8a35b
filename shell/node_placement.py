"""Where a run's actors go on a Ray cluster of several nodes: the Ray options of each rank, and where they went.

``ray.placement`` and ``ray.worker_resource`` place the policy ranks and the
rollout engine; ``data_plane.storage_units`` and ``data_plane.storage_resource``
place TransferQueue's storage units (TransferQueue itself spreads them:
round-robin over the alive nodes that have the resource), or on
``RayObjectStore`` its index (see :func:`transfer_queue_settings`). Both use
Ray's own scheduling only:

* ``pack`` leaves the choice to Ray (its default policy fills the driver's
  node first);
* ``spread`` pins rank ``i`` to node ``i mod n`` of the ``n`` eligible alive
  nodes (sorted by id, :func:`core.spread.spread_over_nodes`) with a hard
  ``NodeAffinitySchedulingStrategy``, so ``k <= n`` DP ranks never share a node;
* a worker resource ``r`` adds ``{r: RESOURCE_SHARE}`` to every actor's
  resources, so Ray schedules it only on nodes started with ``--resources``
  holding ``r``.

Invariant: with ``spread``, every rank is pinned to an alive node that has the
worker resource (when one is set), and no node gets two ranks before every
eligible node has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from adapters.node_resource import RESOURCE_SHARE, nodes_with
from core.spread import spread_over_nodes
from shell.config_error import ConfigError
from shell.config_schema import NodePlacement


def eligible_nodes(resource: str | None) -> list[str]:
    """The ids of the alive nodes of the connected cluster (those that have ``resource``, when given).

    Raises:
        RuntimeError: Ray is not initialised.
    """
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: connect to the cluster before placing actors")
    if resource is not None:
        return nodes_with(resource)
    return [node["NodeID"] for node in ray.nodes() if node.get("Alive")]


def rank_options(placement: NodePlacement, resource: str | None, count: int) -> list[dict[str, Any]]:
    """Ray actor options for each of ``count`` ranks (``WorkerGroup(..., rank_options=...)``).

    Args:
        placement: ``pack`` (Ray's default) or ``spread`` (one rank per eligible node, round-robin).
        resource: a custom node resource every rank needs (None: any node).
        count: the ranks to place.

    Raises:
        ValueError: ``spread`` and no alive node has ``resource`` (naming ``ray.worker_resource``).
        RuntimeError: Ray is not initialised (``spread`` asks the cluster for its nodes).
    """
    extra: dict[str, Any] = {"resources": {resource: RESOURCE_SHARE}} if resource is not None else {}
    if NodePlacement(placement) == NodePlacement.pack:
        return [dict(extra) for _ in range(count)]
    nodes = eligible_nodes(resource)
    if count and not nodes:
        raise ValueError(
            f"config key 'ray.worker_resource': no alive node of the cluster has the resource {resource!r}: "
            f"start worker nodes with `ray start --resources='{{\"{resource}\": 1}}'`, or set it to null"
        )
    return [
        {**extra, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}
        for node in spread_over_nodes(count, nodes)
    ]


def check_storage_resource(resource: str | None) -> None:
    """Check, before TransferQueue starts, that some alive node has ``data_plane.storage_resource`` (None: any node).

    Raises:
        ConfigError: no alive node of the cluster has ``resource`` (naming ``data_plane.storage_resource``).
        RuntimeError: Ray is not initialised.
    """
    if resource is not None and not eligible_nodes(resource):
        raise ConfigError(
            "data_plane.storage_resource",
            f"no alive node of the cluster has the resource {resource!r}, so TransferQueue's storage parts could "
            f"never be placed: start nodes with `ray start --resources='{{\"{resource}\": 1}}'`, or set it to null",
        )


def transfer_queue_settings(storage_backend: str, storage_units: int, storage_resource: str | None) -> dict[str, Any]:
    """TransferQueue settings (merged over its defaults) for ``storage_backend``.

    * On every backend, the controller on a node that has ``storage_resource`` (where Ray puts it when None:
      the driver's node, when it has a free CPU).
    * ``SimpleStorage``: ``storage_units`` units, round-robin over the alive nodes that have
      ``storage_resource`` (any node when None).
    * ``RayObjectStore``: its index (which holds every small column) on a node that has ``storage_resource``
      (where Ray puts it when None); its large columns stay in the object store of the node that wrote them,
      so ``storage_units`` does not apply.

    Example:
        >>> transfer_queue_settings("SimpleStorage", 3, "store")["backend"]["SimpleStorage"]
        {'num_data_storage_units': 3, 'required_node_resource': 'store'}
        >>> transfer_queue_settings("RayObjectStore", 3, "store")["backend"]["RayObjectStore"]
        {'required_node_resource': 'store'}
        >>> transfer_queue_settings("RayObjectStore", 3, "store")["controller"]
        {'required_node_resource': 'store'}
    """
    from adapters import tq_object_store, tq_system  # here: they import TransferQueue, which other paths never load

    settings: dict[str, Any] = {
        "controller": {tq_system.CONTROLLER_RESOURCE: storage_resource},
        "backend": {"storage_backend": storage_backend},
    }
    if storage_backend == "SimpleStorage":
        settings["backend"]["SimpleStorage"] = {
            "num_data_storage_units": storage_units, "required_node_resource": storage_resource,
        }
    elif storage_backend == tq_object_store.BACKEND:
        settings["backend"][tq_object_store.BACKEND] = {tq_object_store.INDEX_RESOURCE: storage_resource}
    return settings


def node_of(actor: Any) -> str:
    """The id of the node an actor runs on (asked of the actor itself).

    The actor runs a closure, which Ray's pickler sends by value, so it imports nothing for the question. A
    function of this module would be sent by name, and the actor would import this module and what it imports
    (the config schema, ``core``, torch): 1.7 s and about 190 MiB more in TransferQueue's object-store index,
    a process that otherwise never loads torch.
    """

    def here(_actor: Any) -> str:
        return ray.get_runtime_context().get_node_id()

    return ray.get(actor.__ray_call__.remote(here), timeout=30)


def driver_node() -> str:
    """The id of the node this driver is attached to."""
    return ray.get_runtime_context().get_node_id()


def nodes_by_role(storage_units: Mapping[str, Any], roles: Mapping[str, Any]) -> dict[str, str]:
    """``{role: node id}`` for the driver, each storage unit handle and each actor of ``roles``."""
    out = {"driver": driver_node()}
    for name, actor in {**storage_units, **roles}.items():
        out[name] = node_of(actor)
    return out
