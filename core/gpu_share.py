"""How Ray packs ranks that ask for a share of a GPU, and which shares a group of NCCL ranks may ask for.

Ray counts a GPU share in whole units of 0.0001 (:data:`GPU_SHARE_STEP`),
truncating: it refuses a share below one unit and silently turns 0.50009 into
0.5. It places an actor that asks for less than one GPU on a single device,
and a device holds actors whose units sum to at most 10,000, so
``10_000 // units`` such actors share a device.

Invariant: a share that :func:`gpu_share_problem` accepts is a whole number
of units up to float noise (Ray may still count it one unit short: 0.3334 is
3,333.9999... units to a float, which Ray truncates), Ray accepts it, and for
``ranks >= 2`` it gives each rank a device of its own as Ray counts
(``gpus_needed(share, ranks) == ranks``), since NCCL refuses two ranks of one
group on a device.
"""

from __future__ import annotations

import math

GPU_SHARE_STEP = 1e-4
"""The unit Ray counts GPU shares in: a share is a whole number of them."""
_UNITS_PER_GPU = 10_000


def ray_units(share: float) -> int:
    """The units of :data:`GPU_SHARE_STEP` Ray takes for ``share`` (truncated, as Ray does).

    Example:
        >>> ray_units(0.5), ray_units(0.50009), ray_units(1.0)
        (5000, 5000, 10000)
    """
    return int(share * _UNITS_PER_GPU)


def gpus_needed(per_worker: float, ranks: int) -> float:
    """The GPUs ``ranks`` actors of ``per_worker`` GPUs each take on a Ray cluster.

    Below one GPU, ``10_000 // units`` actors share a device (:func:`ray_units`) and the rest of it stays free:
    3 ranks of 0.6 take 3 GPUs, not 1.8. From one GPU up, each actor takes its own whole devices.

    Example:
        >>> gpus_needed(0.5, 3), gpus_needed(0.6, 3), gpus_needed(1, 3), gpus_needed(0, 3)
        (2.0, 3.0, 3.0, 0.0)
    """
    if per_worker <= 0 or ranks <= 0:
        return 0.0
    if per_worker >= 1:
        return float(per_worker * ranks)
    per_device = _UNITS_PER_GPU // max(1, ray_units(per_worker))
    return float(math.ceil(ranks / per_device))


def gpu_share_problem(share: float, ranks: int) -> str | None:
    """Why ``ranks`` NCCL ranks cannot each ask Ray for ``share`` of a GPU (the text after ``must``), or None.

    A share must be a number in ``(0, 1]``, a whole number of :data:`GPU_SHARE_STEP` units (a finer one Ray would
    truncate or refuse), and, for a group of two or more ranks, leave no two of them on one device.

    Example:
        >>> gpu_share_problem(0.5, 1) is None, gpu_share_problem(0.6, 4) is None
        (True, True)
        >>> gpu_share_problem(0.3, 2)
        'exceed 0.5 for a group of 2 ranks (Ray puts up to 3 ranks of share 0.3 on one GPU, and NCCL refuses two ranks of a group on one device)'
    """
    if not (isinstance(share, (int, float)) and not isinstance(share, bool)):
        return "be a number (an int or a float, not a bool)"
    if not 0.0 < share <= 1.0:
        return "be in (0, 1]"
    units = share * _UNITS_PER_GPU
    if round(units) < 1 or abs(units - round(units)) > 1e-6:
        return f"be a multiple of {GPU_SHARE_STEP:g} (the unit Ray counts GPU shares in)"
    if ranks >= 2 and gpus_needed(share, ranks) < ranks:
        return (
            f"exceed 0.5 for a group of {ranks} ranks (Ray puts up to {_UNITS_PER_GPU // ray_units(share)} ranks of "
            f"share {share!r} on one GPU, and NCCL refuses two ranks of a group on one device)"
        )
    return None
