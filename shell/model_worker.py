"""``ModelWorker``: a worker that holds one model backend and, on the data plane, its own store client.

Both engines of a run are built this way: the policy ranks
(:class:`shell.policy_worker.PolicyWorker`) and the rollout engine
(:class:`shell.rollout.RolloutWorker`). ``__init__`` only checks and keeps the
typed config and the client factory (a worker has no rank yet); the
subclass's ``@on_all_ranks`` ``setup`` calls :meth:`ModelWorker.set_up`,
which sets torch's thread count, builds the backend (the subclass's
``_build_backend``) and opens the store client.

Invariant: a worker opens at most one store client, whatever the number of
``set_up`` calls; and ``backend`` raises ``RuntimeError`` naming ``setup``
until the backend is built, never hands out ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from adapters.model_port import PolicyBackend
from adapters.store_port import DataPlaneClient
from shell.worker import Worker

ClientFactory = Callable[[], DataPlaneClient]


class ModelWorker(Worker):
    """Base of a worker with a model backend and an optional store client (see the module docstring).

    Args:
        config: the worker's settings, an instance of the subclass's ``CONFIG``
            (it has a ``torch_threads`` field).
        client_factory: builds this worker's store client in ``set_up`` (data
            plane; None on the legacy path); must be picklable.

    Raises:
        TypeError: ``config`` is not a ``CONFIG``.
    """

    CONFIG: ClassVar[type]
    """The config class ``__init__`` accepts."""

    def __init__(self, config: Any, client_factory: ClientFactory | None = None) -> None:
        if not isinstance(config, self.CONFIG):
            raise TypeError(f"'config' must be a {self.CONFIG.__name__}: got {type(config).__name__}")
        self.config = config
        self._client_factory = client_factory
        self._client: DataPlaneClient | None = None
        self._backend: PolicyBackend | None = None

    def set_up(self) -> PolicyBackend:
        """Set torch's intra-op threads, (re)build the backend, and open the store client if none is open yet."""
        torch.set_num_threads(self.config.torch_threads)
        self._backend = self._build_backend()
        if self._client_factory is not None and self._client is None:
            self._client = self._client_factory()
        return self._backend

    def _build_backend(self) -> PolicyBackend:
        """A new backend from ``self.config`` and this worker's place in its group; the subclass's own."""
        raise NotImplementedError(f"{type(self).__name__} must implement _build_backend")

    @property
    def backend(self) -> PolicyBackend:
        """The worker's model.

        Raises:
            RuntimeError: ``setup`` has not run.
        """
        if self._backend is None:
            raise RuntimeError(
                f"rank {self.rank}: the backend is not built; call group.call({type(self).__name__}.setup) first"
            )
        return self._backend
