"""Dispatch plans of a worker group: which data-parallel shard each rank gets, and which results to keep.

A worker group runs one actor per rank of a ``NamedSharding``. Sending data
parallel work to it is split in three (split, execute, merge):

* split (here): ``shard_for_ranks`` names, for every rank, the index of the
  shard it must receive: the shard of its data-parallel index, so a shard is
  replicated along the tensor, context and pipeline axes of its replica group;
* execute (``shell.worker_group``): call every rank with its shard;
* merge (here): ``dp_results`` keeps the result of each replica group's leader,
  one per data-parallel index in dp order, dropping the replicas' copies.

``replica_groups`` is the split step of building process groups: every rank
must create every replica group, in this order, for the collective library to
agree on them.

Laws (see ``tests/property/test_dispatch.py``):
  * ``shard_for_ranks(s, shards)[r] == s.dp_index(r)`` for every rank ``r``;
  * ``dp_results(s, [shards[i] for i in shard_for_ranks(s, shards)]) == tuple(shards)``
    (replicate, then deduplicate, is the identity);
  * ``replica_groups(s)`` partitions ``range(s.world_size)`` and its ``d``-th
    group is ``s.dp_shard_ranks(d)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from core.topology import NamedSharding, Ranks

T = TypeVar("T")
ShardIndices = tuple[int, ...]
"""One shard index (a data-parallel index) per rank, in rank order."""


def _check_sharding(sharding: Any) -> NamedSharding:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"'sharding' must be a NamedSharding: got {type(sharding).__name__}")
    return sharding


def _check_sequence(name: str, value: Any, expected: int, unit: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"'{name}' must be a sequence with one entry per {unit}: got {type(value).__name__}")
    if len(value) != expected:
        raise ValueError(f"'{name}' must have {expected} entries (one per {unit}): got {len(value)}")
    return value


def shard_for_ranks(sharding: NamedSharding, shards: Sequence[Any]) -> ShardIndices:
    """The index into ``shards`` that each rank receives: its data-parallel index.

    Args:
        sharding: the rank layout.
        shards: one entry per data-parallel index (only its length is used).

    Returns:
        ``indices`` with ``indices[r] == sharding.dp_index(r)``, one per rank.

    Raises:
        TypeError: ``sharding`` is not a ``NamedSharding``, or ``shards`` is not a sequence.
        ValueError: ``shards`` does not have one entry per data-parallel index.

    Example:
        >>> shard_for_ranks(NamedSharding({"data_parallel": 2, "tensor_parallel": 2}), ["a", "b"])
        (0, 0, 1, 1)
    """
    s = _check_sharding(sharding)
    _check_sequence("shards", shards, s.axis_size("data_parallel"), "data_parallel index")
    return tuple(s.dp_index(r) for r in range(s.world_size))


def dp_results(sharding: NamedSharding, per_rank_results: Sequence[T]) -> tuple[T, ...]:
    """The result of each replica group's leader, in data-parallel order.

    Args:
        sharding: the rank layout.
        per_rank_results: one result per rank, in rank order.

    Returns:
        ``(per_rank_results[leader_0], per_rank_results[leader_1], ...)`` with
        ``leader_d == sharding.dp_leaders()[d]``.

    Raises:
        TypeError: ``sharding`` is not a ``NamedSharding``, or ``per_rank_results`` is not a sequence.
        ValueError: ``per_rank_results`` does not have one entry per rank.

    Example:
        >>> dp_results(NamedSharding({"pipeline_parallel": 2, "data_parallel": 2}), ["r0", "r1", "r2", "r3"])
        ('r0', 'r1')
    """
    s = _check_sharding(sharding)
    results = _check_sequence("per_rank_results", per_rank_results, s.world_size, "rank")
    return tuple(results[leader] for leader in s.dp_leaders())


def replica_groups(sharding: NamedSharding) -> tuple[Ranks, ...]:
    """Every replica group's ranks, in data-parallel order: the order in which ranks create them.

    Raises:
        TypeError: ``sharding`` is not a ``NamedSharding``.

    Example:
        >>> replica_groups(NamedSharding({"pipeline_parallel": 2, "data_parallel": 2}))
        ((0, 2), (1, 3))
    """
    s = _check_sharding(sharding)
    return tuple(s.dp_shard_ranks(d) for d in range(s.axis_size("data_parallel")))
