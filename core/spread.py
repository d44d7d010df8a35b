"""Spreading actors over cluster nodes: actor ``i`` goes to node ``i mod n`` of the eligible nodes, in a fixed order.

This is the decision behind ``ray.placement=spread`` (the shell turns each
chosen node into a hard node-affinity scheduling strategy). The eligible
nodes are sorted first, so the same cluster always gives the same placement,
whatever order the cluster lists its nodes in.

Laws (see ``tests/property/test_spread.py``):
  * every actor gets exactly one node, and it is one of the eligible nodes;
  * the counts per node differ by at most one (balance);
  * the first ``min(count, n)`` actors sit on distinct nodes (so ``k <= n``
    data-parallel ranks never share a node).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.checks import check_int

NodeId = str
NodeIds = tuple[NodeId, ...]


def spread_over_nodes(count: int, nodes: Sequence[NodeId]) -> NodeIds:
    """The node of each of ``count`` actors: round-robin over ``sorted(set(nodes))``.

    Args:
        count: actors to place (>= 0).
        nodes: the ids of the eligible nodes (duplicates count once).

    Raises:
        TypeError: ``count`` is not an int, or a node id is not a str.
        ValueError: ``count < 0``, or ``count > 0`` and there is no eligible node.

    Example:
        >>> spread_over_nodes(3, ["b", "a"])
        ('a', 'b', 'a')
    """
    count = check_int("count", count, minimum=0)
    if isinstance(nodes, str) or not isinstance(nodes, Sequence):
        raise TypeError(f"'nodes' must be a sequence of node ids (str): got {type(nodes).__name__}")
    for i, node in enumerate(nodes):
        if not isinstance(node, str):
            raise TypeError(f"'nodes' entries must be str: got {type(node).__name__} at index {i}")
    order = sorted(set(nodes))
    if count and not order:
        raise ValueError(f"'nodes' must name at least one eligible node to place {count} actors on: got none")
    return tuple(order[i % len(order)] for i in range(count))
