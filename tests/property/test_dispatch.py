"""Laws and error paths of ``core.dispatch``: replicate shards to ranks, deduplicate results to dp order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from core.dispatch import dp_results, replica_groups, shard_for_ranks
from core.topology import NamedSharding
from tests.property.strategies import named_shardings


def _shards(sharding: NamedSharding) -> list[str]:
    return [f"shard-{d}" for d in range(sharding.axis_size("data_parallel"))]


@settings(max_examples=50)
@given(named_shardings)
def test_shard_for_ranks_gives_every_rank_its_dp_shard(sharding: NamedSharding) -> None:
    """Every rank receives the shard of its data-parallel index, so each replica group shares one shard."""
    indices = shard_for_ranks(sharding, _shards(sharding))
    assert len(indices) == sharding.world_size
    assert all(indices[r] == sharding.dp_index(r) for r in range(sharding.world_size))
    for d, group in enumerate(replica_groups(sharding)):
        assert {indices[r] for r in group} == {d}


@settings(max_examples=50)
@given(named_shardings)
def test_dp_results_inverts_replication(sharding: NamedSharding) -> None:
    """Replicating shards to ranks and then deduplicating the per-rank copies gives back the shards in dp order."""
    shards = _shards(sharding)
    per_rank = [shards[i] for i in shard_for_ranks(sharding, shards)]
    assert dp_results(sharding, per_rank) == tuple(shards)


@settings(max_examples=50)
@given(named_shardings)
def test_dp_results_keeps_one_leader_result_per_dp_rank(sharding: NamedSharding) -> None:
    """dp_results keeps exactly the replica leaders' results, one per data-parallel index, in dp order."""
    per_rank = [("rank", r) for r in range(sharding.world_size)]
    kept = dp_results(sharding, per_rank)
    assert kept == tuple(("rank", leader) for leader in sharding.dp_leaders())
    assert all(sharding.is_replica_leader(r) for _, r in kept)
    assert [sharding.dp_index(r) for _, r in kept] == list(range(sharding.axis_size("data_parallel")))


@settings(max_examples=50)
@given(named_shardings)
def test_replica_groups_partition_world_in_dp_order(sharding: NamedSharding) -> None:
    """replica_groups partitions range(world_size), its d-th group being dp_shard_ranks(d)."""
    groups = replica_groups(sharding)
    assert sorted(r for g in groups for r in g) == list(range(sharding.world_size))
    assert groups == tuple(sharding.dp_shard_ranks(d) for d in range(sharding.axis_size("data_parallel")))


def test_shard_for_ranks_rejects_wrong_shard_count() -> None:
    """shard_for_ranks needs one shard per data-parallel index."""
    sharding = NamedSharding({"data_parallel": 2, "tensor_parallel": 2})
    with pytest.raises(ValueError, match=r"'shards' must have 2 entries \(one per data_parallel index\): got 4"):
        shard_for_ranks(sharding, ["a", "b", "c", "d"])


def test_shard_for_ranks_rejects_non_sequence() -> None:
    """shard_for_ranks rejects a string or a non-sequence for shards, and a non-NamedSharding layout."""
    sharding = NamedSharding({"data_parallel": 2})
    with pytest.raises(TypeError, match=r"'shards' must be a sequence .*: got str"):
        shard_for_ranks(sharding, "ab")
    with pytest.raises(TypeError, match=r"'shards' must be a sequence .*: got set"):
        shard_for_ranks(sharding, {"a", "b"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'sharding' must be a NamedSharding: got dict"):
        shard_for_ranks({"data_parallel": 2}, ["a", "b"])  # type: ignore[arg-type]


def test_dp_results_rejects_wrong_result_count() -> None:
    """dp_results needs one result per rank."""
    sharding = NamedSharding({"pipeline_parallel": 2, "data_parallel": 2})
    with pytest.raises(ValueError, match=r"'per_rank_results' must have 4 entries \(one per rank\): got 2"):
        dp_results(sharding, ["r0", "r1"])


def test_replica_groups_rejects_non_sharding() -> None:
    """replica_groups takes a NamedSharding, not its sizes."""
    with pytest.raises(TypeError, match=r"'sharding' must be a NamedSharding: got dict"):
        replica_groups({"data_parallel": 2})  # type: ignore[arg-type]
