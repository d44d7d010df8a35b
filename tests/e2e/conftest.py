"""Fixtures of the e2e lane: a ``store`` per adapter, a fresh partition per test, the session's Ray and TransferQueue.

``STORE_FACTORIES`` maps an adapter name to a factory that takes the pytest
request and returns a new client. The ``store`` fixture is parametrized over its
names (with the marks in ``STORE_MARKS``), so every contract test runs once per
adapter. An adapter that needs a session resource gets it through the request:
the TransferQueue factory calls ``request.getfixturevalue("tq_store_session")``,
so Ray and TransferQueue start once per session (``ray_cluster``,
``tq_store_session``) and never inside a test body. Each test gets its own
attached handle, whose ``close()`` leaves TransferQueue running. The Ray memory
store works the same way: one store actor per session (``ray_memory_session``),
one attached client per test.

Tests use their own ``partition`` (a fresh uuid) so a store shared across tests
never mixes their keys.

``RLDP_TEST_TQ_BACKEND=MooncakeStore`` runs the session's TransferQueue on the
Mooncake backend (TCP, small segments) instead of RayObjectStore, so every test
that uses the session's store checks that backend too (the GRPO runs that join
it stop at their config check: ``shell.run`` has no Mooncake backend); it needs
the ``mooncake`` package (``mooncake-transfer-engine-non-cuda`` on CPU machines,
see docs/dataplane.md).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from adapters.memory import MemoryStore
from adapters.ray_memory import RayMemoryStore
from adapters.ray_memory import is_running as ray_memory_is_running
from adapters.store_port import DataPlaneClient
from adapters.transfer_queue import TransferQueueStore, is_running

StoreFactory = Callable[[pytest.FixtureRequest], DataPlaneClient]

SMALL_DP2_RUN: tuple[str, ...] = (
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.layout.data_parallel=2",
    "policy.micro_batch_tokens=64",
    "policy.train_global_batch_size=8",
)
"""Overrides of a short e2e GRPO run: 16 rows a step on two policy replicas (add the step count and the rest)."""

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: put on the path of Ray workers so actors import the project."""


def _memory_store(request: pytest.FixtureRequest) -> DataPlaneClient:
    return MemoryStore()


def _transfer_queue_store(request: pytest.FixtureRequest) -> DataPlaneClient:
    request.getfixturevalue("tq_store_session")
    return TransferQueueStore.attach()


def _ray_memory_store(request: pytest.FixtureRequest) -> DataPlaneClient:
    session: RayMemoryStore = request.getfixturevalue("ray_memory_session")
    return RayMemoryStore.attach(session.name)


STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": _memory_store,
    "transfer_queue": _transfer_queue_store,
    "ray_memory": _ray_memory_store,
}

STORE_MARKS: dict[str, tuple[pytest.MarkDecorator, ...]] = {
    "transfer_queue": (pytest.mark.e2e,),
    "ray_memory": (pytest.mark.e2e,),
}
"""Marks of each adapter's params (TransferQueue and the Ray memory store need real Ray: ``e2e``)."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the session, shut down at the end.

    CPUs are logical (at least 8): TransferQueue's controller and storage units
    take one each, which a 2-core machine could not schedule otherwise.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",  # a cluster of our own, even beside a `ray start` one (see shell/ray_cluster.py)
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        namespace="rl-dataplane-tests",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        yield
    finally:
        ray.shutdown()


TQ_BACKEND = os.environ.get("RLDP_TEST_TQ_BACKEND", "RayObjectStore")
"""The storage backend of the session's TransferQueue (see the module docstring)."""

TQ_TEST_CONFIGS: dict[str, dict[str, Any]] = {
    "SimpleStorage": {},
    "RayObjectStore": {"backend": {"storage_backend": "RayObjectStore"}},
    "MooncakeStore": {
        "backend": {
            "storage_backend": "MooncakeStore",
            "MooncakeStore": {"protocol": "tcp", "global_segment_size": 256 << 20, "local_buffer_size": 128 << 20},
        }
    },
}
"""TransferQueue settings per backend for the test session (Mooncake: segments sized for a 24 GiB machine)."""


PUT_STEPS = ("columns", "tags", "notice")
"""The steps of the adapter's TransferQueue put that :func:`fail_put_step` can make fail."""


def fail_put_step(monkeypatch: pytest.MonkeyPatch, step: str) -> tuple[type[Exception], str]:
    """Make one step of every adapter put in this process fail until ``monkeypatch`` is undone: ``"columns"`` (the
    rows' write to storage), ``"tags"`` (the keys' tags) or ``"notice"`` (the controller's notice that the fields
    are produced). Returns the exception type and the message pattern the put then raises.

    On RayObjectStore the tags and the notice go on the store's line to the controller
    (:mod:`adapters.tq_controller_line`): the request is swapped for one the controller answers with another reply,
    so it is not applied, and the put's wait for its reply raises ``RuntimeError``, as for a request the controller
    refuses. The columns' index call raises ``ConnectionError``. On the other backends TQ's client or storage
    manager method raises ``ConnectionError``.
    """
    import transfer_queue as tq
    from transfer_queue.utils.zmq_utils import ZMQRequestType

    from adapters.tq_controller_line import Exchange

    if step not in PUT_STEPS:
        raise ValueError(f"'step' must be one of {PUT_STEPS}: got {step!r}")
    client = tq.get_client()
    if TQ_BACKEND == "RayObjectStore" and step != "columns":
        request, reply = {
            "tags": (ZMQRequestType.SET_CUSTOM_META, ZMQRequestType.SET_CUSTOM_META_RESPONSE),
            "notice": (ZMQRequestType.NOTIFY_DATA_UPDATE, ZMQRequestType.NOTIFY_DATA_UPDATE_ACK),
        }[step]
        send = Exchange.send

        def swapped(self: Exchange, request_type: Any, body: dict[str, Any]) -> None:
            if request_type == request:
                return send(self, ZMQRequestType.KV_LIST, {"partition_id": f"refused-{uuid.uuid4().hex}"})
            return send(self, request_type, body)

        monkeypatch.setattr(Exchange, "send", swapped)
        return RuntimeError, f"expected {reply.value}"

    def sync_fails(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError(f"{step} went away")

    async def fails(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError(f"{step} went away")

    if step == "columns":
        if TQ_BACKEND == "RayObjectStore":
            monkeypatch.setattr(client.storage_manager, "register_staged", sync_fails)
        else:
            monkeypatch.setattr(client.storage_manager, "put_data", fails)
    elif step == "tags":
        monkeypatch.setattr(client, "async_set_custom_meta", fails)
    else:
        monkeypatch.setattr(client.storage_manager, "notify_data_update", fails)
    return ConnectionError, f"{step} went away"


@pytest.fixture(scope="session")
def tq_store_session(ray_cluster: None) -> Iterator[TransferQueueStore]:
    """TransferQueue (``TQ_BACKEND``, RayObjectStore by default) started once on the session's Ray cluster; the owning store.

    Teardown closes it twice (the second close must be a no-op) and checks
    that TransferQueue's controller is gone while Ray, which this store did not
    start, keeps running.
    """
    if TQ_BACKEND not in TQ_TEST_CONFIGS:
        raise pytest.UsageError(f"RLDP_TEST_TQ_BACKEND must be one of {sorted(TQ_TEST_CONFIGS)}: got {TQ_BACKEND!r}")
    store = TransferQueueStore.start(TQ_TEST_CONFIGS[TQ_BACKEND] or None)
    try:
        yield store
    finally:
        store.close()
        store.close()
        deadline = time.monotonic() + 10.0  # ray.kill of the controller completes asynchronously
        while is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(), "closing the owning store must shut TransferQueue's controller down"
        assert ray.is_initialized(), "closing TransferQueue must leave the session's Ray running"


@pytest.fixture(scope="session")
def ray_memory_session(ray_cluster: None) -> Iterator[RayMemoryStore]:
    """One store actor (``RayMemoryStore.start``) on the session's Ray cluster; the owning client.

    Teardown closes it twice (the second close must be a no-op) and checks
    that the actor is gone while Ray keeps running.
    """
    store = RayMemoryStore.start()
    try:
        yield store
    finally:
        store.close()
        store.close()
        deadline = time.monotonic() + 10.0  # ray.kill completes asynchronously
        while ray_memory_is_running(store.name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ray_memory_is_running(store.name), "closing the owning store must kill its actor"
        assert ray.is_initialized(), "closing the Ray memory store must leave the session's Ray running"


@pytest.fixture(params=[pytest.param(name, marks=STORE_MARKS.get(name, ())) for name in STORE_FACTORIES])
def store(request: pytest.FixtureRequest) -> Iterator[DataPlaneClient]:
    """A fresh client of each adapter in ``STORE_FACTORIES``, closed after the test."""
    client = STORE_FACTORIES[request.param](request)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def partition() -> str:
    """A partition id unique to this test."""
    return f"test-{uuid.uuid4().hex}"
