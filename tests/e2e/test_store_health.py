"""Store liveness (``adapters.store_health``): deadlines, probes of the store's processes, and the failure they name.

The waiting rule is checked with plain callables; the adapters with real
processes: a Ray memory store actor killed or stopped by pid, and the parts of
the session's TransferQueue.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import ray
import torch
from ray.exceptions import RayTaskError
from tensordict import TensorDict

from adapters.ray_memory import NAMESPACE, RayMemoryStore
from adapters.store_health import (
    Deadlines, HealthCheckedStore, StoreFailure, StorePart, StoreTimeout, failure_in, wait_for,
)
from adapters.transfer_queue import TransferQueueStore
from tests.e2e.conftest import TQ_BACKEND

pytestmark = [pytest.mark.e2e]

FAST = Deadlines(call_s=1.0, probe_every_s=0.05, probe_timeout_s=0.5)


def _never_done(timeout: float) -> tuple[bool, None]:
    time.sleep(timeout)
    return False, None


@pytest.mark.parametrize("field", ["call_s", "probe_every_s", "probe_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf")])
def test_deadlines_rejects_non_positive_or_infinite(field: str, value: float) -> None:
    """Every deadline is a finite number of seconds > 0."""
    with pytest.raises(ValueError, match=rf"'{field}' must be a finite number of seconds > 0: got"):
        Deadlines(**{field: value})


def test_wait_for_returns_a_prompt_result_without_probing() -> None:
    """A call done within the first slice returns its value; the store is not probed."""
    probes: list[int] = []
    value = wait_for(lambda t: (True, 7), op="get", store="S", deadlines=FAST, check=lambda: probes.append(1))
    assert value == 7 and probes == []


def test_wait_for_times_out_after_call_s_and_cancels() -> None:
    """A call with no result while every part answers fails with StoreTimeout after ``call_s``, and is cancelled."""
    cancelled: list[int] = []
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"S: 'get' had no result within 1 s although every part answered"):
        wait_for(_never_done, op="get", store="S", deadlines=FAST, check=lambda: None, cancel=lambda: cancelled.append(1))
    assert 1.0 <= time.monotonic() - started < 2.0
    assert cancelled == [1]


def test_wait_for_a_calls_last_part_waits_what_is_left_and_names_the_whole_deadline() -> None:
    """A wait that is the rest of a longer call waits ``deadlines.call_s`` (what the call has left) and its timeout
    names the call's whole ``call_s``."""
    started = time.monotonic()
    left = Deadlines(call_s=0.3, probe_every_s=0.05, probe_timeout_s=0.5)
    with pytest.raises(StoreTimeout, match=r"S: 'put' had no result within 120 s although every part answered"):
        wait_for(_never_done, op="put", store="S", deadlines=left, check=lambda: None, call_s=120.0)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_wait_for_stops_at_a_dead_part_and_cancels() -> None:
    """The first probe that finds a dead part ends the wait with its failure (long before ``call_s``)."""
    part = StorePart("unit 1", 42)
    cancelled: list[int] = []

    def check() -> None:
        raise StoreFailure(f"{part} died", part=part)

    started = time.monotonic()
    with pytest.raises(StoreFailure, match=r"unit 1 \(pid 42\) died") as caught:
        wait_for(_never_done, op="get", store="S", deadlines=Deadlines(call_s=60.0, probe_every_s=0.05), check=check,
                 cancel=lambda: cancelled.append(1))
    assert time.monotonic() - started < 1.0
    assert caught.value.part == part and cancelled == [1]


def test_store_failure_pickles_with_its_part() -> None:
    """A StoreFailure crosses Ray (a worker's store call) with its type, message and part."""
    failure = StoreTimeout("slow", part=StorePart("unit 0", 7))
    back = pickle.loads(pickle.dumps(failure))
    assert type(back) is StoreTimeout and str(back) == "slow" and back.part == StorePart("unit 0", 7)


def _raises_store_failure() -> None:
    raise StoreFailure("TransferQueue storage unit 1 (pid 42) died", part=StorePart("TransferQueue storage unit 1", 42))


def test_failure_in_finds_a_workers_store_failure_through_ray_errors(ray_cluster: None) -> None:
    """A StoreFailure raised in a Ray task comes back as Ray's task error; chained under another error (a worker
    error) it is still found, with its own message and part; an error without one, or a timeout (no part), gives
    None."""
    with pytest.raises(RayTaskError) as caught:
        ray.get(ray.remote(_raises_store_failure).remote())
    try:
        raise RuntimeError("rank 0 raised in 'logprobs'") from caught.value
    except RuntimeError as error:
        found = failure_in(error)
    assert type(found) is StoreFailure and str(found) == "TransferQueue storage unit 1 (pid 42) died"
    assert found.part == StorePart("TransferQueue storage unit 1", 42)
    assert failure_in(RuntimeError("no store here")) is None and failure_in(None) is None
    assert failure_in(StoreTimeout("slow, every part answered")) is None  # names no part


def test_note_failure_fails_every_later_call_at_once(ray_cluster: None) -> None:
    """A failure handed to a client (found by another process) fails its later calls at once, naming the part; the
    store itself, and other clients of it, are untouched."""
    owner = RayMemoryStore.start()
    client = RayMemoryStore.attach(owner.name)
    try:
        part = StorePart("Ray memory store actor 'x'", 7)
        client.note_failure(StoreFailure(f"{part} died", part=part))
        started = time.monotonic()
        with pytest.raises(StoreFailure, match=r"Ray memory store actor 'x' \(pid 7\) died") as caught:
            client.list_keys("p")
        assert time.monotonic() - started < 0.5 and caught.value.part == part
        with pytest.raises(TypeError, match=r"'failure' must be a StoreFailure: got RuntimeError"):
            client.note_failure(RuntimeError("x"))  # type: ignore[arg-type]
        assert owner.list_keys("p") == ()
    finally:
        client.close()
        owner.close()


def test_transfer_queue_store_parts_are_its_controller_and_units(tq_store_session: TransferQueueStore) -> None:
    """An attached store names TransferQueue's controller and each storage unit (or the object-store backend's
    index), with their pids, and all answer."""
    store = TransferQueueStore.attach()
    try:
        assert isinstance(store, HealthCheckedStore)
        parts = store.parts()
        units = {
            "MooncakeStore": [], "RayObjectStore": ["TransferQueue object-store index"],
        }.get(TQ_BACKEND, ["TransferQueue storage unit 0", "TransferQueue storage unit 1"])
        assert [p.role for p in parts] == ["TransferQueue controller", *units]
        assert all(isinstance(p.pid, int) and p.pid > 0 for p in parts)
        store.check_health()
    finally:
        store.close()


def test_ray_memory_store_killed_actor_fails_naming_it_then_at_once(ray_cluster: None) -> None:
    """SIGKILL of the store actor's process: the next call raises StoreFailure naming the actor and its pid, and
    every later call raises it without waiting."""
    store = RayMemoryStore.start()
    try:
        store.put(["a"], "p", TensorDict({"x": torch.tensor([1])}, batch_size=[1]))
        (part,) = store.parts()
        assert part.role == f"Ray memory store actor {store.name!r}" and isinstance(part.pid, int)
        os.kill(part.pid, signal.SIGKILL)
        with pytest.raises(StoreFailure, match=rf"Ray memory store actor '{store.name}' \(pid {part.pid}\) died"):
            store.get(["a"], "p", ["x"])
        started = time.monotonic()
        with pytest.raises(StoreFailure, match=r"died"):
            store.list_keys("p")
        assert time.monotonic() - started < 0.5
    finally:
        store.close()


def test_ray_memory_store_stopped_actor_fails_as_not_answering(ray_cluster: None) -> None:
    """SIGSTOP of the store actor's process: a call fails within about ``probe_timeout_s`` naming the silent actor."""
    owner = RayMemoryStore.start()
    store = RayMemoryStore(owner.name, ray.get_actor(owner.name, namespace=NAMESPACE), deadlines=FAST)
    (part,) = store.parts()
    assert part.pid is not None
    os.kill(part.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StoreFailure, match=rf"\(pid {part.pid}\) does not answer \(no reply to a probe within 0.5 s\)"):
            store.list_keys("p")
        assert time.monotonic() - started < 3.0
    finally:
        os.kill(part.pid, signal.SIGCONT)
        owner.close()
