"""``NamedSharding``: the layout of ranks over named parallelism axes.

Ranks are laid out row-major over ``AXES`` = (pipeline_parallel, data_parallel,
context_parallel, tensor_parallel), slowest to fastest varying, so

    rank = ((pp * DP + dp) * CP + cp) * TP + tp.

A *replica group* is the TP x CP x PP ranks that share one data-parallel index:
they hold the same rows, and exactly one of them, the *replica leader* (tp = cp
= pp = 0), talks to the key/value store on the group's behalf.

Invariants (checked on construction): every axis has a positive int size, an
axis left out has size 1, and unknown axis names are rejected.

Laws (see ``tests/property/test_topology.py``):
  * ``s.rank(**s.coords(r)) == r`` for every ``r in range(s.world_size)``;
  * the replica groups ``s.dp_shard_ranks(d)`` partition ``range(s.world_size)``;
  * each replica group holds exactly one leader, ``s.dp_leaders()[d]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from core.checks import check_int
from core.frozen import FrozenDict

AxisName = str
AxisNames = tuple[AxisName, ...]
Rank = int
Ranks = tuple[Rank, ...]
Coords = FrozenDict  # axis name -> coordinate, over all of ``AXES`` in order

AXES: AxisNames = ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")
_DP = "data_parallel"
_REPLICA_AXES: AxisNames = ("pipeline_parallel", "context_parallel", "tensor_parallel")


def _check_axis(name: str, axis: Any) -> AxisName:
    if axis not in AXES:
        raise ValueError(f"{name} {axis!r} is not a known axis: expected one of {list(AXES)}")
    return axis


def _to_sizes(value: Any) -> FrozenDict:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"'sizes' must be a mapping of axis name -> size: got {type(value).__name__}; "
            f"e.g. NamedSharding({{'data_parallel': 4, 'tensor_parallel': 2}})"
        )
    for axis in value:
        _check_axis("'sizes' key", axis)
    sizes: dict[AxisName, int] = {}
    for axis in AXES:
        size = check_int(f"sizes[{axis!r}]", value.get(axis, 1))
        if size < 1:
            raise ValueError(f"'sizes[{axis!r}]' must be a positive int: got {size}")
        sizes[axis] = size
    return FrozenDict(sizes)


@attrs.frozen
class NamedSharding:
    """Sizes of the four parallelism axes and the rank layout they imply.

    Args:
        sizes: axis name -> size; axes left out have size 1.

    Raises:
        TypeError: ``sizes`` is not a mapping, or a size is not an int.
        ValueError: an axis name is unknown, or a size is not positive.

    Example:
        >>> s = NamedSharding({"data_parallel": 2, "tensor_parallel": 2})
        >>> s.world_size, s.dp_shard_ranks(1), s.dp_leaders()
        (4, (2, 3), (0, 2))
    """

    sizes: FrozenDict = attrs.field(factory=FrozenDict, converter=_to_sizes)

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the axis sizes."""
        return math.prod(self.sizes.values())

    def axis_size(self, name: AxisName) -> int:
        """The size of axis ``name``.

        Raises:
            ValueError: ``name`` is not one of ``AXES``.
        """
        return self.sizes[_check_axis("axis", name)]

    def _stride(self, axis: AxisName) -> int:
        return math.prod(self.sizes[a] for a in AXES[AXES.index(axis) + 1 :])

    def _check_rank(self, rank: Any) -> Rank:
        value = check_int("rank", rank)
        if not 0 <= value < self.world_size:
            raise ValueError(f"'rank' must be in range({self.world_size}): got {value}")
        return value

    def coords(self, rank: Rank) -> Coords:
        """The coordinate of ``rank`` on every axis, in ``AXES`` order.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not in ``range(world_size)``.

        Example:
            >>> NamedSharding({"data_parallel": 2, "tensor_parallel": 2}).coords(3)["data_parallel"]
            1
        """
        value = self._check_rank(rank)
        return FrozenDict({axis: (value // self._stride(axis)) % self.sizes[axis] for axis in AXES})

    def rank(self, **coords: int) -> Rank:
        """The rank at ``coords``; an axis left out has coordinate 0.

        Raises:
            TypeError: a coordinate is not an int.
            ValueError: an axis name is unknown, or a coordinate is not in
                ``range(axis_size(axis))``.

        Example:
            >>> NamedSharding({"data_parallel": 2, "tensor_parallel": 2}).rank(data_parallel=1, tensor_parallel=1)
            3
        """
        for axis in coords:
            _check_axis("coordinate", axis)
        total = 0
        for axis in AXES:
            coordinate = check_int(axis, coords.get(axis, 0))
            size = self.sizes[axis]
            if not 0 <= coordinate < size:
                raise ValueError(f"'{axis}' must be in range({size}) (its axis size): got {coordinate}")
            total = total * size + coordinate
        return total

    def dp_index(self, rank: Rank) -> int:
        """The data-parallel coordinate of ``rank``.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not in ``range(world_size)``.
        """
        return self.coords(rank)[_DP]

    def _check_dp(self, dp_index: Any) -> int:
        value = check_int("dp_index", dp_index)
        dp_size = self.sizes[_DP]
        if not 0 <= value < dp_size:
            raise ValueError(f"'dp_index' must be in range({dp_size}) (the data_parallel size): got {value}")
        return value

    def dp_shard_ranks(self, dp_index: int) -> Ranks:
        """The replica group of data-parallel index ``dp_index``: its TP x CP x PP ranks, ascending.

        Raises:
            TypeError: ``dp_index`` is not an int.
            ValueError: ``dp_index`` is not in ``range(axis_size('data_parallel'))``.
        """
        dp = self._check_dp(dp_index)
        return tuple(
            sorted(
                self.rank(pipeline_parallel=pp, data_parallel=dp, context_parallel=cp, tensor_parallel=tp)
                for pp in range(self.sizes["pipeline_parallel"])
                for cp in range(self.sizes["context_parallel"])
                for tp in range(self.sizes["tensor_parallel"])
            )
        )

    def is_replica_leader(self, rank: Rank) -> bool:
        """Whether ``rank`` leads its replica group (coordinate 0 on tensor, context and pipeline axes).

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not in ``range(world_size)``.
        """
        at = self.coords(rank)
        return all(at[axis] == 0 for axis in _REPLICA_AXES)

    def dp_leaders(self) -> Ranks:
        """The leader rank of each replica group, in data-parallel order."""
        return tuple(self.rank(data_parallel=dp) for dp in range(self.sizes[_DP]))
