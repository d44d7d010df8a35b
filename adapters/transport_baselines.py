"""Raw third-party transports, used only as benchmark baselines.

``python -m shell.bench dataplane`` compares the project's store clients with
the transports a trainer would otherwise call directly: TransferQueue's own
``kv_batch_put`` / ``kv_batch_get`` and Ray's object store (``ray.put`` /
``ray.get``, the legacy driver-to-worker path). They live here because
third-party systems are imported only in ``adapters/``.

:class:`RefsByKey` is ``ray.put`` / ``ray.get`` plus a key table in another
process: an actor that keeps each put's object ref under its keys
(borrowing it, as Ray requires of a process that keeps another's ref) and
hands it back to a get. A store on Ray's object store whose readers find
rows by key without asking their writer, as ``RayObjectStore``'s index
does, makes such a call per put and per get (unless it batches them over
several operations); what :class:`RefsByKey` adds to ``ray.put`` /
``ray.get`` is what the call costs as one Ray actor call that carries a
borrowed ref. It is a baseline, not a store: no checks, no partial reads,
no key management beyond the table.

Invariant: each baseline moves the same TensorDict it is given, with no
validation, shape restoration or metering of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

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


@ray.remote(num_cpus=0)
class _RefTable:
    """Each put's object ref by ``(partition, key)``: a dict and nothing else."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], Any] = {}

    def keep(self, partition_id: str, keys: list[str], refs: list[Any]) -> None:
        # A ref nested in a list stays a ref (a top-level one would arrive as its value): this actor borrows it.
        self._refs.update(dict.fromkeys([(partition_id, key) for key in keys], refs[0]))

    def find(self, partition_id: str, keys: list[str]) -> list[Any]:
        found = [self._refs[partition_id, key] for key in keys]
        return list({ref.hex(): ref for ref in found}.values())  # each object once, in the keys' order

    def drop(self, partition_id: str, keys: list[str]) -> None:
        for key in keys:
            self._refs.pop((partition_id, key), None)

    def pid(self) -> int:
        return os.getpid()


class RefsByKey:
    """``ray.put`` / ``ray.get`` with each put's object ref kept by key in another process (see the module doc).

    A get returns the TensorDict of the put that last wrote its first key; the
    bench puts and gets whole batches, so that is the batch it put. Needs a
    running Ray.
    """

    def __init__(self) -> None:
        self._table = _RefTable.remote()
        self.pid: int = ray.get(self._table.pid.remote())
        """The actor's process, whose CPU a bench reads."""

    def put(self, keys: Sequence[str], partition_id: str, fields: TensorDict) -> None:
        """One ``ray.put`` of ``fields``, then one call that keeps its ref under every key."""
        ray.get(self._table.keep.remote(partition_id, list(keys), [ray.put(fields)]))

    def get(self, keys: Sequence[str], partition_id: str) -> TensorDict:
        """One call that finds the keys' object ref, then one ``ray.get`` of it.

        Raises:
            KeyError: a key was never put (or was cleared).
        """
        first, *_ = ray.get(self._table.find.remote(partition_id, list(keys)))
        return ray.get(first)

    def clear(self, keys: Sequence[str], partition_id: str) -> None:
        """Drop the keys (an object goes when no key, and no caller, holds its ref)."""
        ray.get(self._table.drop.remote(partition_id, list(keys)))

    def close(self) -> None:
        """Stop the actor."""
        ray.kill(self._table)
