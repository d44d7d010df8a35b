"""Bindings to external systems (stores, model backends) behind small ports.

The ports and the in-process store are re-exported here (they load no
external runtime). The adapters that bind a runtime are imported from their
own module, so that importing a port never starts Ray, TransferQueue or
megatron-core: ``adapters.transfer_queue.TransferQueueStore`` (the default
store), ``adapters.ray_memory.RayMemoryStore`` and
``adapters.megatron.MegatronGPTBackend``.
"""

from adapters.memory import MemoryStore
from adapters.model_port import Generation, PolicyBackend
from adapters.store_port import (
    RESERVED_TAG_PREFIX,
    DataPlaneClient,
    ReservedTagPutClient,
    TaggedGetClient,
)

__all__ = [
    "RESERVED_TAG_PREFIX",
    "DataPlaneClient",
    "Generation",
    "MemoryStore",
    "PolicyBackend",
    "ReservedTagPutClient",
    "TaggedGetClient",
]
