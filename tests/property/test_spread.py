"""Laws and error paths of ``core.spread.spread_over_nodes``."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given

from core.spread import spread_over_nodes
from tests.property.strategies import actor_counts, node_id_lists


@given(actor_counts, node_id_lists)
def test_spread_over_nodes_places_every_actor_on_an_eligible_node(count: int, nodes: list[str]) -> None:
    """One node per actor, each of them eligible."""
    assume(nodes or count == 0)
    placed = spread_over_nodes(count, nodes)
    assert len(placed) == count
    assert set(placed) <= set(nodes)


@given(actor_counts, node_id_lists)
def test_spread_over_nodes_balances_counts(count: int, nodes: list[str]) -> None:
    """Actors per node differ by at most one, over every eligible node (unused ones count 0)."""
    assume(nodes)
    counts = Counter(spread_over_nodes(count, nodes))
    per_node = [counts.get(node, 0) for node in set(nodes)]
    assert max(per_node) - min(per_node) <= 1


@given(actor_counts, node_id_lists)
def test_spread_over_nodes_first_actors_on_distinct_nodes(count: int, nodes: list[str]) -> None:
    """The first min(count, n) actors sit on distinct nodes; the order ignores how nodes are listed."""
    assume(nodes)
    placed = spread_over_nodes(count, nodes)
    head = placed[: len(set(nodes))]
    assert len(set(head)) == len(head)
    assert placed == spread_over_nodes(count, list(reversed(nodes)))


def test_spread_over_nodes_example() -> None:
    """Round-robin over the sorted ids."""
    assert spread_over_nodes(5, ["n2", "n1", "n1"]) == ("n1", "n2", "n1", "n2", "n1")
    assert spread_over_nodes(0, []) == ()


def test_spread_over_nodes_rejects_bad_input() -> None:
    """No eligible node, a negative count, a bare string or a non-str id raise naming the argument."""
    with pytest.raises(ValueError, match="'nodes' must name at least one eligible node to place 2 actors"):
        spread_over_nodes(2, [])
    with pytest.raises(ValueError, match="'count' must be >= 0: got -1"):
        spread_over_nodes(-1, ["a"])
    with pytest.raises(TypeError, match="'nodes' must be a sequence of node ids"):
        spread_over_nodes(1, "abc")
    with pytest.raises(TypeError, match="'nodes' entries must be str: got int at index 1"):
        spread_over_nodes(1, ["a", 3])
