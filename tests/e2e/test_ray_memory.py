"""``RayMemoryStore`` beyond the shared contract: a second process, ownership, start/attach misuse, error types.

The contract itself (``test_store_contract.py``, ``test_store_roundtrip.py``)
runs against this adapter through the ``store`` fixture (``ray_memory``). Here:
a Ray actor that attaches through a pickled factory reads what the driver wrote
and writes back; only the owner's close kills the actor; start and attach
reject bad names; and every error keeps the type and message ``MemoryStore``
gives it. Ray starts once per session (``conftest.py``); the check that needs a
process without Ray runs in one cheap subprocess that never starts Ray.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ray.exceptions import RayTaskError
from tensordict import NonTensorData, TensorDict

from adapters.memory import MemoryStore
from adapters.ray_actors import named_actor_exists
from adapters.ray_memory import NAMESPACE, RayMemoryStore, is_running
from adapters.store_port import DataPlaneClient
from core.codec import to_jagged
from tests.e2e.store_peer import check_round_trip_through_peer, run_without_ray

pytestmark = pytest.mark.e2e

_NO_RAY_SCRIPT = """
import json
import ray
from adapters.ray_memory import RayMemoryStore, is_running
report = {"running": is_running("any")}
for call, args in (("start", ()), ("attach", ("any",))):
    try:
        getattr(RayMemoryStore, call)(*args)
    except RuntimeError as e:
        report[call] = str(e)
report["ray_initialized"] = ray.is_initialized()
print(json.dumps(report))
"""


def _wait_until_gone(name: str, timeout_s: float = 10.0) -> bool:
    """Whether the actor ``name`` is unregistered within ``timeout_s`` (``ray.kill`` completes asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while is_running(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not is_running(name)


# ---------------------------------------------------------------- a second process


def test_attach_from_an_actor_reads_the_driver_writes_and_writes_back(
    ray_memory_session: RayMemoryStore, partition: str
) -> None:
    """An actor attached through a pickled factory reads bit for bit what the driver put (objects included),
    sees the store's own errors, and the driver reads the field it writes back; its close leaves the actor running."""
    store = RayMemoryStore.attach(ray_memory_session.name)
    try:
        check_round_trip_through_peer(
            store, functools.partial(RayMemoryStore.attach, store.name), partition, lambda: is_running(store.name)
        )
    finally:
        store.close()


def test_pickled_client_attaches_without_owning(ray_memory_session: RayMemoryStore, partition: str) -> None:
    """Unpickling any client (the owner too) gives an attached client of the same actor, whose close kills nothing."""
    ray_memory_session.put(["a"], partition, TensorDict({"x": torch.arange(3).view(1, 3)}, batch_size=[1]))
    copy = pickle.loads(pickle.dumps(ray_memory_session))
    assert isinstance(copy, RayMemoryStore) and copy.name == ray_memory_session.name
    assert ray_memory_session.owns_actor and not copy.owns_actor
    assert copy.get(["a"], partition, ["x"])["x"].tolist() == [[0, 1, 2]]
    copy.close()
    assert is_running(ray_memory_session.name)
    ray_memory_session.clear(["a"], partition)


# ---------------------------------------------------------------- ownership and lifecycle


def test_close_of_the_owner_kills_the_actor_and_attached_close_does_not(ray_cluster: None, partition: str) -> None:
    """An attached close leaves the actor serving; the owner's close kills it: its clients raise RuntimeError
    naming it, later calls on the owner say it is closed, and attach by name fails."""
    owner = RayMemoryStore.start()
    name = owner.name
    first, second = RayMemoryStore.attach(name), RayMemoryStore.attach(name)
    try:
        first.put(["a"], partition, TensorDict({"x": torch.ones(1)}, batch_size=[1]))
        first.close()
        first.close()
        with pytest.raises(RuntimeError, match=rf"RayMemoryStore '{name}' is closed"):
            first.list_keys(partition)
        assert is_running(name) and owner.list_keys(partition) == ("a",)
        owner.close()
        owner.close()
        assert _wait_until_gone(name), "closing the owner must kill the store actor"
        with pytest.raises(RuntimeError, match=rf"RayMemoryStore '{name}' is gone \(its owner closed it"):
            second.list_keys(partition)
        with pytest.raises(RuntimeError, match=rf"RayMemoryStore '{name}' is closed"):
            owner.get(["a"], partition, ["x"])
        with pytest.raises(ValueError, match=rf"'name' must name a running store actor .*got '{name}'"):
            RayMemoryStore.attach(name)
    finally:
        owner.close()
        second.close()


def test_named_actor_exists_finds_an_actor_only_by_its_name_and_namespace(ray_memory_session: RayMemoryStore) -> None:
    """The session's store actor is found under its name in NAMESPACE, and not in another namespace or by another name."""
    assert named_actor_exists(ray_memory_session.name, NAMESPACE)
    assert not named_actor_exists(ray_memory_session.name, f"{NAMESPACE}-other")
    assert not named_actor_exists(f"{ray_memory_session.name}-other", NAMESPACE)


def test_start_with_a_taken_name_raises_value_error(ray_memory_session: RayMemoryStore) -> None:
    """start(name) of a running store raises ValueError pointing to attach, and leaves that store serving."""
    name = ray_memory_session.name
    with pytest.raises(ValueError, match=rf"'name' must be unused: .*{name!r}.*RayMemoryStore.attach\('{name}'\)"):
        RayMemoryStore.start(name)
    assert ray_memory_session.list_keys("unused") == ()


def test_attach_to_a_missing_name_raises_value_error_naming_it(ray_cluster: None) -> None:
    """attach(name) with no such actor raises ValueError naming the name; a non-str or empty name is rejected."""
    with pytest.raises(ValueError, match=r"'name' must name a running store actor .*got 'no-such-store'"):
        RayMemoryStore.attach("no-such-store")
    assert not is_running("no-such-store")
    with pytest.raises(TypeError, match=r"'name' must be a str \(the store actor's name\): got int"):
        RayMemoryStore.attach(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'name' must be a non-empty str: got ''"):
        RayMemoryStore.start("")


def test_start_and_attach_without_ray_raise_runtime_error() -> None:
    """In a process without Ray, start() and attach() raise RuntimeError showing how to connect, and start nothing."""
    report = run_without_ray(_NO_RAY_SCRIPT)
    assert report["running"] is False
    for call in ("start", "attach"):
        assert "Ray is not initialised in this process" in report[call], call
        assert "ray.init(address='auto')" in report[call], call
    assert report["ray_initialized"] is False


# ---------------------------------------------------------------- errors keep their type


def _failing_calls(partition: str) -> dict[str, Callable[[DataPlaneClient], Any]]:
    """Calls that fail inside the store (the actor, for RayMemoryStore) holding 'a' (x) and 'b' (x, y) from _fill."""
    return {
        "get-unknown-key": lambda s: s.get(["a", "zz"], partition, ["x"]),
        "get-missing-field": lambda s: s.get(["a", "b"], partition, ["y"]),
        "get-mixed-layouts": lambda s: s.get(["a", "b"], partition, ["x"]),
        "clear-unknown-key": lambda s: s.clear(["zz"], partition),
        "describe-unknown-key": lambda s: s.describe(["zz"], partition),
    }


def _fill(store: DataPlaneClient, partition: str) -> None:
    store.put(["a"], partition, TensorDict({"x": torch.zeros(1, 2)}, batch_size=[1]))
    jagged = to_jagged(torch.zeros(1, 2), [1])
    store.put(["b"], partition, TensorDict({"x": jagged, "y": torch.ones(1)}, batch_size=[1]))


def _error_of(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as e:  # the caller compares which exception arrived
        return e
    raise AssertionError("the call must raise")


def test_errors_raised_in_the_actor_keep_type_and_message(ray_memory_session: RayMemoryStore, partition: str) -> None:
    """Every error the MemoryStore raises in the actor reaches the caller as MemoryStore raises it in process
    (same type, same message), not as a RayTaskError; the Ray error stays attached as its cause."""
    local = MemoryStore()
    _fill(local, partition)
    _fill(ray_memory_session, partition)
    for case, call in _failing_calls(partition).items():
        want = _error_of(functools.partial(call, local))
        got = _error_of(functools.partial(call, ray_memory_session))
        assert type(got) is type(want), (case, type(got), type(want))
        assert str(got) == str(want), case
        assert not isinstance(got, RayTaskError) and isinstance(got.__cause__, RayTaskError), case
    ray_memory_session.clear(["a", "b"], partition)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s, p: s.put(["n", "n"], p, TensorDict({"x": torch.zeros(2)}, batch_size=[2])), ValueError, r"unique"),
        (
            lambda s, p: s.put(
                ["n", "m"], p, TensorDict({"bad": NonTensorData("batch-wide", batch_size=[2])}, batch_size=[2])
            ),
            TypeError,
            r"field 'bad' must hold one value per row",
        ),
        (lambda s, p: s.put(["n"], p, {"x": torch.zeros(1)}), TypeError, r"'fields' must be a TensorDict"),
        (lambda s, p: s.get(["a"], p, "x"), TypeError, r"not a single string"),
        (lambda s, p: s.get([], p, ["x"]), ValueError, r"'keys' must name at least one row"),
        (lambda s, p: s.get_with_tags(["a"], p, ["x"], "r"), TypeError, r"'tag_names' .* not a single string"),
        (lambda s, p: s.clear(["a", "a"], p), ValueError, r"'keys' must be unique: 'a' repeats"),
        (lambda s, p: s.list_keys(3), TypeError, r"'partition_id' must be a str: got int"),
        (lambda s, p: s.describe([], p), ValueError, r"'keys' must name at least one row"),
    ],
    ids=[
        "put-duplicate-keys",
        "put-unsupported-column",
        "put-not-a-tensordict",
        "get-single-string",
        "get-no-keys",
        "get-with-tags-single-string",
        "clear-duplicate-keys",
        "list-keys-non-str",
        "describe-no-keys",
    ],
)
def test_every_call_rejects_bad_arguments_before_any_remote_call(
    ray_memory_session: RayMemoryStore,
    partition: str,
    call: Callable[[DataPlaneClient, str], Any],
    error: type[Exception],
    match: str,
) -> None:
    """Bad arguments of any call (put columns included) raise in the caller's process, with no Ray error behind
    them, and write or remove nothing."""
    ray_memory_session.put(["a"], partition, TensorDict({"x": torch.ones(1)}, batch_size=[1]))
    with pytest.raises(error, match=match) as excinfo:
        call(ray_memory_session, partition)
    assert excinfo.value.__cause__ is None, "the error must be raised before any remote call"
    assert ray_memory_session.list_keys(partition) == ("a",)
    ray_memory_session.clear(["a"], partition)
