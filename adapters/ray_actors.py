"""Named Ray actors: whether one is registered, asked without ever starting Ray.

The Ray-hosted adapters find their actors by name: the memory store's actor in
:data:`adapters.ray_memory.NAMESPACE`, TransferQueue's controller in
:data:`adapters.tq_system.CONTROLLER_NAMESPACE`. This is their one lookup.

Invariant: :func:`named_actor_exists` never starts Ray or connects to a
cluster; in a process without an initialised Ray it answers False.
"""

from __future__ import annotations

import ray


def named_actor_exists(name: str, namespace: str) -> bool:
    """Whether an actor named ``name`` is registered in ``namespace`` of this process's Ray cluster.

    False when Ray is not initialised in this process (there is no cluster to look in).

    Example:
        >>> named_actor_exists("TransferQueueController", "transfer_queue")  # doctest: +SKIP
        True
    """
    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
