"""Placing a store actor on the nodes that have a custom resource (``ray start --resources``).

A Ray actor that asks for a resource no alive node has stays pending for
ever, and whoever waits on it hangs. :func:`resource_options` therefore
checks the cluster's alive nodes first and raises, naming the setting that
asked for the resource.

Invariant: the options ask for a token share (:data:`RESOURCE_SHARE`) of
the resource, so any number of such actors fit on one node that has it, and
an actor placed with them runs only on such a node.
"""

from __future__ import annotations

from typing import Any

import ray

RESOURCE_SHARE = 0.001
"""How much of the resource an actor asks for: a token amount, so the node's count never limits the actors."""


def nodes_with(resource: str) -> list[str]:
    """The ids of the alive nodes of this process's Ray cluster that have ``resource``."""
    return [
        node["NodeID"]
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources", {}).get(resource, 0) > 0
    ]


def resource_options(resource: str | None, setting: str) -> dict[str, Any]:
    """Ray actor options that place an actor on a node with ``resource`` (``{}`` for None: anywhere).

    Args:
        resource: the custom node resource, or None.
        setting: the name of the setting that gave it, for the error.

    Raises:
        ValueError: no alive node has ``resource`` (naming ``setting`` and the resource).

    Example:
        >>> resource_options(None, "backend.RayObjectStore.required_node_resource")
        {}
    """
    if resource is None:
        return {}
    if not nodes_with(resource):
        raise ValueError(
            f"{setting}: no alive node of the Ray cluster has the resource {resource!r}: start a node with "
            f"`ray start --resources='{{\"{resource}\": 1}}'`, or set it to null"
        )
    return {"resources": {resource: RESOURCE_SHARE}}
