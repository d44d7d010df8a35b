"""Laws and error paths of ``core.topology.NamedSharding``."""

from __future__ import annotations

import math
import pickle

import attrs
import pytest
from hypothesis import given, settings

from core.topology import AXES, NamedSharding
from tests.property.strategies import named_shardings, sharding_sizes


@given(sharding_sizes)
def test_world_size_is_product_of_sizes(sizes: dict[str, int]) -> None:
    """world_size is the product of the given sizes; axes left out count as 1."""
    sharding = NamedSharding(sizes)
    assert sharding.world_size == math.prod(sizes.values())
    assert all(sharding.axis_size(axis) == sizes.get(axis, 1) for axis in AXES)


@settings(max_examples=50)
@given(named_shardings)
def test_coords_rank_round_trip(sharding: NamedSharding) -> None:
    """rank(**coords(r)) == r for every rank, and coords name all four axes in order."""
    for r in range(sharding.world_size):
        at = sharding.coords(r)
        assert tuple(at) == AXES
        assert sharding.rank(**at) == r


@settings(max_examples=50)
@given(named_shardings)
def test_rank_matches_row_major_formula(sharding: NamedSharding) -> None:
    """rank == ((pp * DP + dp) * CP + cp) * TP + tp: tensor_parallel varies fastest."""
    dp_size, cp_size, tp_size = (sharding.axis_size(a) for a in AXES[1:])
    for r in range(sharding.world_size):
        at = sharding.coords(r)
        pp, dp, cp, tp = (at[a] for a in AXES)
        assert ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp == r
        assert sharding.dp_index(r) == dp


@settings(max_examples=50)
@given(named_shardings)
def test_dp_shard_ranks_partition_world(sharding: NamedSharding) -> None:
    """The replica groups over all dp indices partition range(world_size), each ascending and of size TP*CP*PP."""
    groups = [sharding.dp_shard_ranks(d) for d in range(sharding.axis_size("data_parallel"))]
    flat = [r for group in groups for r in group]
    assert sorted(flat) == list(range(sharding.world_size))
    replica = sharding.world_size // sharding.axis_size("data_parallel")
    for d, group in enumerate(groups):
        assert list(group) == sorted(group) and len(group) == replica
        assert all(sharding.dp_index(r) == d for r in group)


@settings(max_examples=50)
@given(named_shardings)
def test_dp_leaders_one_per_replica_group(sharding: NamedSharding) -> None:
    """Each replica group has exactly one leader, and it is dp_leaders()[dp]."""
    leaders = sharding.dp_leaders()
    assert len(leaders) == sharding.axis_size("data_parallel")
    for d, leader in enumerate(leaders):
        in_group = [r for r in sharding.dp_shard_ranks(d) if sharding.is_replica_leader(r)]
        assert in_group == [leader]
    assert sum(sharding.is_replica_leader(r) for r in range(sharding.world_size)) == len(leaders)


@given(named_shardings)
def test_named_sharding_pickle_round_trip(sharding: NamedSharding) -> None:
    """A sharding survives pickling (it is shipped to workers) and equals one built from its own sizes."""
    assert pickle.loads(pickle.dumps(sharding)) == sharding
    assert NamedSharding(sharding.sizes) == sharding
    assert hash(NamedSharding(dict(sharding.sizes))) == hash(sharding)


def test_named_sharding_concrete_layout() -> None:
    """TP=2, DP=2, PP=2: the layout that megatron uses (tp fastest, pp slowest)."""
    s = NamedSharding({"tensor_parallel": 2, "data_parallel": 2, "pipeline_parallel": 2})
    assert s.world_size == 8
    assert s.dp_shard_ranks(0) == (0, 1, 4, 5)
    assert s.dp_shard_ranks(1) == (2, 3, 6, 7)
    assert s.dp_leaders() == (0, 2)
    assert s.coords(6) == {"pipeline_parallel": 1, "data_parallel": 1, "context_parallel": 0, "tensor_parallel": 0}
    assert s.rank(pipeline_parallel=1, tensor_parallel=1) == 5
    assert NamedSharding().world_size == 1


def test_named_sharding_is_immutable() -> None:
    """Neither the sharding nor its sizes can be changed after construction."""
    s = NamedSharding({"data_parallel": 2})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.sizes = {"data_parallel": 4}  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.sizes["data_parallel"] = 4  # type: ignore[index]
    assert attrs.evolve(s, sizes={"data_parallel": 4}).world_size == 4
    assert s.world_size == 2


def test_named_sharding_rejects_unknown_axis() -> None:
    """An unknown axis name raises ValueError listing the valid ones."""
    with pytest.raises(ValueError, match=r"'sizes' key 'dp' is not a known axis: expected one of \['pipeline_parallel'"):
        NamedSharding({"dp": 2})


def test_named_sharding_rejects_bad_sizes() -> None:
    """Sizes must be positive ints, and sizes must be a mapping."""
    with pytest.raises(ValueError, match=r"'sizes\['data_parallel'\]' must be a positive int: got 0"):
        NamedSharding({"data_parallel": 0})
    with pytest.raises(TypeError, match=r"'sizes\['tensor_parallel'\]' must be an int: got float"):
        NamedSharding({"tensor_parallel": 2.0})
    with pytest.raises(TypeError, match=r"must be an int: got bool"):
        NamedSharding({"tensor_parallel": True})
    with pytest.raises(TypeError, match=r"'sizes' must be a mapping .* got list; e.g. NamedSharding\(\{"):
        NamedSharding([("data_parallel", 2)])  # type: ignore[arg-type]


def test_coords_rejects_out_of_range_rank() -> None:
    """coords, dp_index and is_replica_leader reject a rank outside range(world_size)."""
    s = NamedSharding({"data_parallel": 4, "tensor_parallel": 2})
    with pytest.raises(ValueError, match=r"'rank' must be in range\(8\): got 9"):
        s.coords(9)
    with pytest.raises(ValueError, match=r"'rank' must be in range\(8\): got -1"):
        s.dp_index(-1)
    with pytest.raises(ValueError, match=r"'rank' must be in range\(8\): got 8"):
        s.is_replica_leader(8)
    with pytest.raises(TypeError, match=r"'rank' must be an int: got str"):
        s.coords("3")  # type: ignore[arg-type]


def test_rank_rejects_bad_coords() -> None:
    """rank names the axis, its size and the value for an out-of-range coordinate, and rejects unknown axes."""
    s = NamedSharding({"data_parallel": 4, "tensor_parallel": 2})
    with pytest.raises(ValueError, match=r"'tensor_parallel' must be in range\(2\) \(its axis size\): got 2"):
        s.rank(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"coordinate 'tp' is not a known axis: expected one of"):
        s.rank(tp=1)
    with pytest.raises(TypeError, match=r"'data_parallel' must be an int: got float"):
        s.rank(data_parallel=1.0)  # type: ignore[arg-type]


def test_axis_size_rejects_unknown_axis() -> None:
    """axis_size raises ValueError listing the valid axis names."""
    with pytest.raises(ValueError, match=r"axis 'expert_parallel' is not a known axis: expected one of"):
        NamedSharding().axis_size("expert_parallel")


def test_dp_shard_ranks_rejects_out_of_range_dp_index() -> None:
    """dp_shard_ranks names the data_parallel size for an out-of-range index."""
    s = NamedSharding({"data_parallel": 2, "context_parallel": 2})
    with pytest.raises(ValueError, match=r"'dp_index' must be in range\(2\) \(the data_parallel size\): got 2"):
        s.dp_shard_ranks(2)
    with pytest.raises(TypeError, match=r"'dp_index' must be an int: got bool"):
        s.dp_shard_ranks(True)  # type: ignore[arg-type]
