"""How Ray packs ranks that ask for a share of a GPU, and which shares a group of NCCL ranks may ask for.

Ray places an actor that asks for less than one GPU on a single device, and a
device holds actors whose shares sum to at most one, so ``floor(1 / share)``
such actors share a device. Ray accepts a share only to four decimal places.

Invariant: a share that :func:`gpu_share_problem` accepts for ``ranks`` ranks
gives each of them a device of its own (``gpus_needed(share, ranks) == ranks``
for ``ranks >= 2``), since NCCL refuses two ranks of one group on a device.
"""

from __future__ import annotations

import math

GPU_SHARE_STEP = 1e-4
"""The finest GPU share Ray accepts: a share is a multiple of it."""


def gpus_needed(per_worker: float, ranks: int) -> float:
    """The GPUs ``ranks`` actors of ``per_worker`` GPUs each take on a Ray cluster.

    Below one GPU, ``floor(1 / per_worker)`` actors share a device and the rest
    of it stays free: 3 ranks of 0.6 take 3 GPUs, not 1.8. From one GPU up, each
    actor takes its own whole devices.

    Example:
        >>> gpus_needed(0.5, 3), gpus_needed(0.6, 3), gpus_needed(1, 3), gpus_needed(0, 3)
        (2.0, 3.0, 3.0, 0.0)
    """
    if per_worker <= 0 or ranks <= 0:
        return 0.0
    if per_worker >= 1:
        return float(per_worker * ranks)
    per_device = math.floor(1.0 / per_worker + 1e-9)
    return float(math.ceil(ranks / per_device))


def gpu_share_problem(share: float, ranks: int) -> str | None:
    """Why ``ranks`` NCCL ranks cannot each ask Ray for ``share`` of a GPU (the text after ``must``), or None.

    A share must lie in ``(0, 1]``, be a multiple of :data:`GPU_SHARE_STEP`, and, for a group of two or more
    ranks, leave no two of them on one device.

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
    steps = share / GPU_SHARE_STEP
    if abs(steps - round(steps)) > 1e-6:
        return f"be a multiple of {GPU_SHARE_STEP:g} (Ray's finest GPU share)"
    if ranks >= 2 and gpus_needed(share, ranks) < ranks:
        return (
            f"exceed 0.5 for a group of {ranks} ranks (Ray puts up to {math.floor(1 / share + 1e-9)} ranks of share "
            f"{share:g} on one GPU, and NCCL refuses two ranks of a group on one device)"
        )
    return None
