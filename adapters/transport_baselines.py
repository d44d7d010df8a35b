"""Raw third-party transports, used only as benchmark baselines.

``python -m shell.bench dataplane`` compares the project's store clients with
the transports a trainer would otherwise call directly: TransferQueue's own
``kv_batch_put`` / ``kv_batch_get`` and Ray's object store (``ray.put`` /
``ray.get``, the legacy driver-to-worker path). They live here because
third-party systems are imported only in ``adapters/``.

Invariant: each baseline moves the same TensorDict it is given, with no
validation, shape restoration or metering of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import transfer_queue as tq
from tensordict import TensorDict


def raw_tq_put(keys: Sequence[str], partition_id: str, fields: TensorDict) -> None:
    """TransferQueue's ``kv_batch_put`` as it is (needs a running TransferQueue in this process)."""
    tq.kv_batch_put(keys=list(keys), partition_id=partition_id, fields=fields)


def raw_tq_get(keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> TensorDict:
    """TransferQueue's ``kv_batch_get`` as it is (rectangular fields come back jagged)."""
    return tq.kv_batch_get(keys=list(keys), partition_id=partition_id, select_fields=list(select_fields))


def raw_tq_clear(keys: Sequence[str], partition_id: str) -> None:
    """TransferQueue's ``kv_clear`` as it is."""
    tq.kv_clear(keys=list(keys), partition_id=partition_id)


def ray_put(fields: TensorDict) -> ray.ObjectRef:
    """Put a TensorDict into Ray's object store (the legacy path's transport)."""
    return ray.put(fields)


def ray_get(ref: ray.ObjectRef) -> TensorDict:
    """Get it back."""
    return ray.get(ref)
