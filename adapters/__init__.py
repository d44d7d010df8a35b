"""Bindings to external systems (stores, model backends) behind small ports.

The ports and the in-process store are re-exported here (they load no
external runtime). The adapters that bind a runtime are imported from their
own module, so that importing a port never starts Ray, TransferQueue or
megatron-core: ``adapters.transfer_queue.TransferQueueStore`` (the default
store), ``adapters.ray_memory.RayMemoryStore`` and
``adapters.megatron.MegatronGPTBackend``. The names here load on first
access, so a light module of the package (``adapters.tq_row_index``) loads
no more than it imports itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters.memory import MemoryStore
    from adapters.model_port import Generation, PolicyBackend
    from adapters.store_port import RESERVED_TAG_PREFIX, DataPlaneClient, ReservedTagPutClient, TaggedGetClient

_HOMES = {
    "RESERVED_TAG_PREFIX": "adapters.store_port",
    "DataPlaneClient": "adapters.store_port",
    "Generation": "adapters.model_port",
    "MemoryStore": "adapters.memory",
    "PolicyBackend": "adapters.model_port",
    "ReservedTagPutClient": "adapters.store_port",
    "TaggedGetClient": "adapters.store_port",
}
"""Where each exported name lives. They load on first access (PEP 562), so that importing a light module of this
package (``adapters.tq_row_index``, the index actor's) does not load torch and tensordict with the ports."""

__all__ = [
    "RESERVED_TAG_PREFIX",
    "DataPlaneClient",
    "Generation",
    "MemoryStore",
    "PolicyBackend",
    "ReservedTagPutClient",
    "TaggedGetClient",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'adapters' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
