"""Fixtures of the store lane: a ``store`` per adapter and a fresh partition per test.

``STORE_FACTORIES`` maps an adapter name to a factory that takes the pytest
request and returns a new client. The ``store`` fixture is parametrized over its
names, so every contract test runs once per adapter. An adapter that needs a
session resource gets it through the request, e.g. a TransferQueue factory calls
``request.getfixturevalue("ray_cluster")`` for a session-scoped Ray fixture, so
Ray starts once per session and never inside a test body.

Tests use their own ``partition`` (a fresh uuid) so a store shared across tests
never mixes their keys.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from adapters.memory import MemoryStore
from shell.dataplane import DataPlaneClient

StoreFactory = Callable[[pytest.FixtureRequest], DataPlaneClient]


def _memory_store(request: pytest.FixtureRequest) -> DataPlaneClient:
    return MemoryStore()


STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": _memory_store,
}


@pytest.fixture(params=list(STORE_FACTORIES))
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
