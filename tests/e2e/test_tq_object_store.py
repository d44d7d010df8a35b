"""TransferQueue on the ``RayObjectStore`` backend (:mod:`adapters.tq_object_store`), beyond the store contract.

* No leaks: clearing every key, or rewriting every field, leaves the index holding no column of them.
* A lost writer: rows whose writing process died raise, naming the writer, instead of coming back wrong
  (columns small enough to live in the index survive it).
* Cross-put gets: one get of rows from several puts returns each row's own data.
* A row the index no longer holds when a get reaches it (cleared after the controller's lookup found it) raises,
  naming the field and the global index, instead of coming back empty; a row whose index a put gave to another
  key after the lookup raises, naming both keys, instead of coming back as the other key's row; both whether the
  get located its rows by key (beside the lookup) or by index (after it).
* A get locates its rows by key beside the controller's lookup once it knows the fields' wire names; every read
  runs in the caller's thread and keeps the call's deadline: a stopped index fails a get by key alone, naming the
  index.
* One deadline per call: a put's, a get's or a clear's waits on the controller, on TQ's client loop and on Ray
  share the call's ``call_s``.
* A verified get (integrity on) reads the rows and their digests by key too, and still catches a changed row.
* The controller requests sent in TQ's pickle framing (:data:`adapters.tq_controller_line.PICKLED`) decode to the
  same bodies, type for type, as TQ's own framing would deliver them, for every such request a put (user tags of
  every kind, digests, a rewrite that merges new tags into old ones), a get and a clear send.
* A put whose columns fail to reach Ray's object store while its keys' lookup is in flight leaves the store as
  it was: the keys it registered are dropped.
* Start-up: the index started beside TransferQueue's controller is the one TransferQueue uses, and its handle
  does not stay in TransferQueue's stored config.
* The other backend: the store contract suite passes on TransferQueue as shipped (SimpleStorage) too, in a
  process of its own (one TransferQueue runs per Ray cluster).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

from adapters import tq_controller_line, tq_object_store, tq_system
from adapters.store_health import Deadlines, StoreFailure, StoreTimeout
from adapters.tq_controller_line import Exchange
from adapters.transfer_queue import TransferQueueStore
from shell.metering import IntegrityError, MeteredClient
from tests.e2e.conftest import ROOT, TQ_BACKEND, fail_put_step

pytestmark = pytest.mark.e2e

on_object_store = pytest.mark.skipif(
    TQ_BACKEND != tq_object_store.BACKEND, reason=f"the session's TransferQueue runs {TQ_BACKEND}"
)


def _columns() -> int:
    return ray.get(tq_object_store.find_index().stats.remote())["columns"]


def _jagged(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged)


@on_object_store
def test_clear_and_rewrite_release_every_column(tq_store_session: TransferQueueStore, partition: str) -> None:
    store = TransferQueueStore.attach()
    before = _columns()
    keys = ["a", "b", "c"]
    store.put(keys, partition, TensorDict({"ids": _jagged([[1], [2, 3], []]), "r": torch.ones(3)}, batch_size=[3]))
    assert _columns() == before + 2
    store.put(keys, partition, TensorDict({"r": torch.zeros(3)}, batch_size=[3]))  # the old 'r' column is released
    assert _columns() == before + 2
    store.put(["a"], partition, TensorDict({"lp": torch.ones(1, 2)}, batch_size=[1]))
    assert _columns() == before + 3
    store.clear(["b", "c"], partition)  # 'ids' and 'r' still hold row 'a'
    assert _columns() == before + 3
    store.clear(["a"], partition)
    assert _columns() == before
    store.close()


@on_object_store
def test_a_get_of_rows_from_several_puts_returns_each_rows_data(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    store = TransferQueueStore.attach()
    store.put(["a", "b"], partition, TensorDict({"ids": _jagged([[1, 2], [3]])}, batch_size=[2]))
    store.put(["c"], partition, TensorDict({"ids": _jagged([[4, 5, 6]])}, batch_size=[1]))
    store.put(["b"], partition, TensorDict({"ids": _jagged([[7, 8]])}, batch_size=[1]))  # rewritten
    got = store.get(["c", "b", "a"], partition, ["ids"])["ids"]
    assert [row.tolist() for row in got.unbind()] == [[4, 5, 6], [7, 8], [1, 2]]
    store.clear(["a", "b", "c"], partition)
    store.close()


@ray.remote(num_cpus=0)
class _Writer:
    def put(self, partition: str) -> int:
        store = TransferQueueStore.attach()
        big = torch.arange(tq_object_store.INLINE_BYTES // 8 + 1).reshape(1, -1)  # its own object, owned here
        store.put(["w"], partition, TensorDict({"x": big, "small": torch.tensor([5])}, batch_size=[1]))
        store.close()
        return os.getpid()


@on_object_store
def test_rows_of_a_dead_writer_raise_naming_it(tq_store_session: TransferQueueStore, partition: str) -> None:
    writer = _Writer.remote()
    pid = ray.get(writer.put.remote(partition))
    store = TransferQueueStore.attach()
    assert int(store.get(["w"], partition, ["x"])["x"][0, -1]) == tq_object_store.INLINE_BYTES // 8  # writer lives
    ray.kill(writer)
    with pytest.raises(RuntimeError, match=rf"the process that wrote them died \(writers of these rows: pid {pid} "):
        deadline = time.monotonic() + 20.0  # the owner's death reaches the object directory within moments
        while time.monotonic() < deadline:
            store.get(["w"], partition, ["x"])
            time.sleep(0.1)
    assert store.get(["w"], partition, ["small"])["small"].tolist() == [5]  # a small column lives in the index
    store.clear(["w"], partition)
    store.close()


@on_object_store
@pytest.mark.parametrize("by_key", [False, True], ids=["by-index", "by-key"])
def test_a_row_cleared_after_the_lookup_raises_naming_it(
    tq_store_session: TransferQueueStore, partition: str, by_key: bool
) -> None:
    """The index answers a get's locations; a row it dropped after the controller's lookup is an error, not a
    silently short column (whether the get located its rows by key, beside the lookup, or by index after it)."""
    import transfer_queue as tq

    store = TransferQueueStore.attach()
    store.put(["a", "b"], partition, TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    if by_key:  # a first get of these fields: the next get locates its rows by key
        store.get(["a", "b"], partition, ["x"])
    found = tq.get_client().kv_retrieve_meta(keys=["b"], partition_id=partition, create=False)
    ray.get(tq_object_store.find_index().clear.remote(list(found.global_indexes)))  # as a clear racing the get would
    with pytest.raises(RuntimeError, match=rf"no stored row of field 'x@\S+' at global index {found.global_indexes[0]}: "):
        store.get(["a", "b"], partition, ["x"])
    assert store.get(["a"], partition, ["x"])["x"].tolist() == [[1.0, 1.0, 1.0]]
    store.clear(["a", "b"], partition)
    store.close()


@on_object_store
@pytest.mark.parametrize("by_key", [False, True], ids=["by-index", "by-key"])
def test_a_get_of_a_key_whose_index_was_reused_raises_naming_both_keys(
    tq_store_session: TransferQueueStore, partition: str, by_key: bool
) -> None:
    """A get never reads another key's row: when a put gives a cleared key's global index to another key after
    the get's lookup found it, the get raises, naming both keys, instead of returning the other key's row."""
    import transfer_queue as tq

    store = TransferQueueStore.attach()
    store.put(["a", "b"], partition, TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    if by_key:
        store.get(["a", "b"], partition, ["x"])
    found = tq.get_client().kv_retrieve_meta(keys=["b"], partition_id=partition, create=False)
    (index,), (wire,) = found.global_indexes, found.field_names
    # What a racing clear of 'b' and a put of 'z' that took b's index leave in the index:
    frame = tq_object_store.frame_column(wire, torch.full((1, 3), 7.0), 1)
    puts = [(wire, "racing-put", [(frame, None)], [index])]
    ray.get(tq_object_store.find_index().register.remote("a racing writer", puts, (partition, ["z"])))
    with pytest.raises(
        RuntimeError, match=rf"the row of field 'x@\S+' at global index {index} is key 'z' of partition '{partition}', "
        rf"not key 'b' of partition '{partition}': 'b' was cleared and its index reused"
    ):
        store.get(["a", "b"], partition, ["x"])
    assert store.get(["a"], partition, ["x"])["x"].tolist() == [[1.0, 1.0, 1.0]]
    store.clear(["a", "b"], partition)
    # The clear dropped 'a's row and kept the one the racing put gave 'z' at b's old index: only 'z's clear drops it.
    held = ray.get(tq_object_store.find_index().locate.remote([index], [wire]))
    assert held["locations"][wire][0] == [["racing-put", 1]]
    ray.get(tq_object_store.find_index().clear_owned.remote(partition, ["z"], [index]))
    assert "missing" in ray.get(tq_object_store.find_index().locate.remote([index], [wire]))
    store.close()


@on_object_store
def test_a_put_whose_index_call_lands_after_a_clear_of_its_keys_is_not_read_by_key(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """A clear that races a put of the same key (the put's lookup found the key's global index, the clear then
    released it, and only then did the put's index call land) leaves no row that a get by key reads: the get goes
    through the lookup and raises ``KeyError``, as for any cleared key (before 2026-11-27 it returned the raced
    put's row). The raced rows stay in the index, by global index, until that index is cleared or reused."""
    import transfer_queue as tq

    store = TransferQueueStore.attach()
    columns = _columns()
    store.put(["k", "other"], partition, TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    store.get(["k", "other"], partition, ["x"])  # the store knows x's wire field: a get of x may ask the index alone
    found = tq.get_client().kv_retrieve_meta(keys=["k"], partition_id=partition, create=False)
    (index,), (wire,) = found.global_indexes, found.field_names
    store.clear(["k"], partition)
    # The index call of a write-back of 'k' whose lookup ran before the clear lands now:
    frame = tq_object_store.frame_column(wire, torch.full((1, 3), 7.0), 1)
    puts = [(wire, "raced-put", [(frame, None)], [index])]
    ray.get(tq_object_store.find_index().register.remote("a raced writer", puts, (partition, ["k"])))
    with pytest.raises(KeyError, match="not stored"):
        store.get(["k"], partition, ["x"])
    assert store.get(["other"], partition, ["x"])["x"].tolist() == [[1.0, 1.0, 1.0]]
    held = ray.get(tq_object_store.find_index().locate.remote([index], [wire]))
    assert held["locations"][wire][0] == [["raced-put", 1]]
    store.clear(["other"], partition)
    ray.get(tq_object_store.find_index().clear.remote([index]))
    assert _columns() == columns
    store.close()


@on_object_store
def test_a_get_finds_its_rows_by_key_once_it_knows_their_wire_fields(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first get of some fields locates its rows by index after the controller's lookup. A later get of the
    same fields asks the index alone, by key (no lookup); a get with tags uses the index's by-key answer sent
    beside the lookup. All return the same rows. A rewrite with another dtype puts a second wire field beside
    the first: the index then refuses to answer alone, and that get goes through the lookup, by index. Every
    read runs in the caller's thread (none on TQ's client loop)."""
    store = TransferQueueStore.attach()
    manager = tq_system.client().storage_manager
    calls: list[str] = []
    for name in ("read_indexed", "read_located"):
        original = getattr(manager, name)

        def spy(*args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            assert threading.current_thread() is threading.main_thread(), threading.current_thread()
            out = _original(*args, **kwargs)
            calls.append(_name)
            return out

        monkeypatch.setattr(manager, name, spy)
    by_key = manager.read_by_key

    def spy_by_key(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = by_key(*args, **kwargs)  # in the caller's thread: no hop to TQ's loop
        calls.append("read_by_key" if out is not None else "read_by_key: no answer")
        return out

    monkeypatch.setattr(manager, "read_by_key", spy_by_key)
    lookups = _count_lookups(monkeypatch)
    store.put(["a", "b"], partition, TensorDict({"x": _jagged([[1, 2], [3]])}, batch_size=[2]), tags=[{"t": 1}, {"t": 2}])
    first = store.get(["b", "a"], partition, ["x"])
    looked_up = len(lookups)
    second = store.get(["b", "a"], partition, ["x"])
    assert len(lookups) == looked_up  # the index alone answered
    third, tags = store.get_with_tags(["b", "a"], partition, ["x"], ["t"])
    assert [[r.tolist() for r in column["x"].unbind()] for column in (first, second, third)] == [[[3], [1, 2]]] * 3
    assert tags == ({"t": 2}, {"t": 1})
    store.put(["a", "b"], partition, TensorDict({"x": torch.ones(2, 3, dtype=torch.float16)}, batch_size=[2]))
    assert store.get(["a", "b"], partition, ["x"])["x"].dtype == torch.float16
    assert calls == ["read_indexed", "read_by_key", "read_located", "read_by_key: no answer", "read_indexed"]
    store.clear(["a", "b"], partition)
    with pytest.raises(KeyError, match="not stored"):  # cleared: the index does not know them, the lookup says so
        store.get(["a", "b"], partition, ["x"])
    store.close()


@on_object_store
def test_a_get_by_key_of_a_stopped_index_fails_within_its_deadline_naming_the_index(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get by key alone waits on the index in the caller's thread, probing the store's parts: with the index's
    process stopped (SIGSTOP), the get fails within about the probe timeout, naming the index and its pid."""
    deadlines = Deadlines(call_s=5.0, probe_every_s=0.05, probe_timeout_s=0.5)
    store = TransferQueueStore(tq_system.attach(), parts=tq_system.parts(deadlines.probe_timeout_s), deadlines=deadlines)
    manager = tq_system.client().storage_manager
    by_key, threads = manager.read_by_key, []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return by_key(*args, **kwargs)

    monkeypatch.setattr(manager, "read_by_key", spy)
    store.put(["a"], partition, TensorDict({"x": _jagged([[1, 2]])}, batch_size=[1]))
    assert store.get(["a"], partition, ["x"])["x"].values().tolist() == [1, 2]  # learns the wire fields
    assert store.get(["a"], partition, ["x"])["x"].values().tolist() == [1, 2]  # by key, in this thread
    assert threads == [threading.current_thread()]
    (index,) = [part for part in store.parts() if part.role == "TransferQueue object-store index"]
    assert index.pid is not None
    os.kill(index.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StoreFailure, match=rf"object-store index \(pid {index.pid}\) does not answer"):
            store.get(["a"], partition, ["x"])
        assert time.monotonic() - started < 3.0
    finally:
        os.kill(index.pid, signal.SIGCONT)
    store.close()
    TransferQueueStore.attach().clear(["a"], partition)


@ray.remote(num_cpus=0)
def _after(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


@on_object_store
def test_a_get_by_keys_waits_outlast_a_probe_interval_and_share_one_deadline(tq_store_session: TransferQueueStore) -> None:
    """The waits of one get by key: one that outlasts its first poll (a probe interval) still returns its value
    (a blocking ``ray.get`` finishes it, so no transfer restarts at each poll); and the get's waits share the
    call's one deadline: a second wait fails with what the first left of it, not a deadline of its own."""
    ray.get(_after.remote(0.0, 0))  # a warm worker: the timings below are the waits', not a worker's start
    deadlines = Deadlines(call_s=3.0, probe_every_s=0.05, probe_timeout_s=2.0)
    store = TransferQueueStore(tq_system.attach(), parts=tq_system.parts(deadlines.probe_timeout_s), deadlines=deadlines)
    wait = store._ray_waiter("get")
    assert wait(_after.remote(1.2, 7)) == 7
    never = _after.remote(60.0, 8)
    started = time.monotonic()
    try:
        with pytest.raises(StoreTimeout, match="'get' had no result within 3 s although"):
            wait(never)
        assert time.monotonic() - started < 2.5  # at most the 1.8 s left of the call's 3 s, not 3 s more
    finally:
        ray.cancel(never, force=True)
        store.close()


@on_object_store
@pytest.mark.parametrize("op", ["put", "get", "clear"])
def test_a_calls_waits_on_the_controller_and_on_ray_share_one_deadline(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """One store call's waits share its one ``call_s``: the controller's reply to its lookup takes 1.2 s, then its
    wait on Ray (a put's register, a clear's drop, a get's read by index) never ends;
    the call fails with ``StoreTimeout`` when the call's 3 s are spent, not 3 s after the lookup came back."""
    ray.get(_after.remote(0.0, 0))  # a warm worker: the timings below are the waits', not a worker's start
    deadlines = Deadlines(call_s=3.0, probe_every_s=0.05, probe_timeout_s=2.0)
    store = TransferQueueStore(tq_system.attach(), parts=tq_system.parts(deadlines.probe_timeout_s), deadlines=deadlines)
    rows = TensorDict({"x": _jagged([[1, 2], [3]])}, batch_size=[2])
    if op != "put":
        store.put(["a", "b"], partition, rows)
    manager, never = tq_system.client().storage_manager, []
    receive = Exchange.receive

    def slow_lookup(self: Exchange, response_type: ZMQRequestType) -> dict:
        if response_type == ZMQRequestType.KV_RETRIEVE_META_RESPONSE:
            time.sleep(1.2)
        return receive(self, response_type)

    def hung(*args, **kwargs):  # type: ignore[no-untyped-def]
        never.append(_after.remote(60.0, 0))
        return never[-1]

    monkeypatch.setattr(Exchange, "receive", slow_lookup)
    if op == "put":
        monkeypatch.setattr(manager, "register_staged", hung)
    elif op == "get":
        monkeypatch.setattr(manager, "read_indexed", lambda *args, wait, **kwargs: wait(hung()))
    else:
        monkeypatch.setattr(manager, "drop_owned", lambda *args, wait, **kwargs: wait(hung()))
    call = {
        "put": lambda: store.put(["a", "b"], partition, rows),
        "get": lambda: store.get(["a", "b"], partition, ["x"]),  # a new store: its first get goes by the lookup
        "clear": lambda: store.clear(["a", "b"], partition),
    }[op]
    started = time.monotonic()
    try:
        with pytest.raises(StoreTimeout, match=rf"'{op}' had no result within 3 s although"):  # the call's, not what was left
            call()
        took = time.monotonic() - started
        assert 2.9 < took < 3.8, took  # the call's 3 s (and its clean-up), not 1.2 s + 3 s
    finally:
        for ref in never:
            ray.cancel(ref, force=True)
        monkeypatch.undo()
        store.close()
    attached = TransferQueueStore.attach()
    if op == "clear":  # the controller released the keys; the index still holds their rows, as a raced put's
        with pytest.raises(KeyError, match="not stored"):
            attached.get(["a", "b"], partition, ["x"])
    elif op == "get":
        assert attached.get(["a", "b"], partition, ["x"])["x"].values().tolist() == [1, 2, 3]
        attached.clear(["a", "b"], partition)
    else:
        assert attached.list_keys(partition) == ()  # the failed put's new keys were dropped
    attached.close()


@on_object_store
@pytest.mark.parametrize("fails", ["notice", "tags"])
def test_a_put_failing_after_its_rows_reached_the_index_leaves_no_row_a_get_by_key_would_read(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A put whose controller notice (or tag update) fails after its index call has set its rows in the index, while
    the keys' tags are set back (a rewrite) or the keys dropped (new keys). The store already knows the wire field
    of ``y`` (another key's get), so without more a get by key alone would read the failed put's rows. The failed
    put has the index forget its keys: the get goes through the lookup and raises ``KeyError``, as the port says."""
    store = TransferQueueStore.attach()
    y = TensorDict({"y": torch.ones(1, 2)}, batch_size=[1])
    store.put(["k"], partition, TensorDict({"x": torch.tensor([7])}, batch_size=[1]))
    store.put(["other"], partition, y)
    store.get(["other"], partition, ["y"])  # now the store knows y's wire field: a get of y may ask the index alone
    store.get(["k"], partition, ["x"])

    error, message = fail_put_step(monkeypatch, fails)
    for keys in (["k"], ["new"]):
        with pytest.raises(error, match=message):
            store.put(keys, partition, TensorDict({"y": torch.full((1, 2), 5.0)}, batch_size=[1]))
    monkeypatch.undo()
    for key in ("k", "new"):
        with pytest.raises(KeyError):
            store.get([key], partition, ["y"])
    assert store.get(["k"], partition, ["x"])["x"].tolist() == [7]  # by key again once a get of k went by the lookup
    assert store.get(["other"], partition, ["y"])["y"].tolist() == [[1.0, 1.0]]
    store.clear(["k", "other"], partition)
    store.close()


@on_object_store
@pytest.mark.parametrize("require_stored", [False, True], ids=["first put", "write-back"])
def test_a_put_whose_columns_fail_while_its_lookup_is_in_flight_leaves_the_store_as_it_was(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch, require_stored: bool
) -> None:
    """The put's large columns go into Ray's object store while the controller looks its keys up (and registers the
    new ones). When that fails, the put waits for the lookup and drops the keys it registered: no new key stays
    listed, a stored key keeps its rows and tags, and the next put of the same keys works."""
    store = TransferQueueStore.attach()
    manager = tq_system.client().storage_manager
    store.put(["k"], partition, TensorDict({"x": torch.tensor([7])}, batch_size=[1]), tags=[{"t": 1}])
    stage = manager.stage

    def failing(data: TensorDict) -> None:
        raise MemoryError("object store full")

    monkeypatch.setattr(manager, "stage", failing)
    keys = ["k"] if require_stored else ["k", "new"]
    with pytest.raises(MemoryError, match="object store full"):
        store.put(keys, partition, TensorDict({"x": torch.tensor([1] * len(keys))}, batch_size=[len(keys)]),
                  require_stored=require_stored)
    assert sorted(store.list_keys(partition)) == ["k"]
    assert store.get(["k"], partition, ["x"])["x"].tolist() == [7]
    assert store.describe(["k"], partition).tags == ({"t": 1},)
    monkeypatch.setattr(manager, "stage", stage)
    store.put(keys, partition, TensorDict({"x": torch.tensor([3] * len(keys))}, batch_size=[len(keys)]))
    assert store.get(keys, partition, ["x"])["x"].tolist() == [3] * len(keys)
    store.clear(keys, partition)
    store.close()


@on_object_store
def test_a_verified_get_reads_rows_and_digests_by_key_and_still_catches_a_changed_row(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With integrity on, once the store knows the fields' wire names, a get reads the rows and their digests from
    the index alone, with no controller lookup. It still raises ``IntegrityError`` for a row that a put without
    digests changed under its digest, and for a row a verified rewrite stored while the rewrite failed (its tags
    set back): after that failure the get goes through the lookup again."""
    store = TransferQueueStore.attach()
    client = MeteredClient(store, verify_integrity=True)
    rows = _jagged([[1, 2, 3], [4]])
    client.put(["a", "b"], partition, TensorDict({"x": rows}, batch_size=[2]))
    client.get(["a", "b"], partition, ["x"])  # the store learns x's wire field
    lookups = _count_lookups(monkeypatch)
    got = client.get(["b", "a"], partition, ["x"])["x"]
    assert [r.tolist() for r in got.unbind()] == [[4], [1, 2, 3]]
    assert lookups == []
    client.put(["b"], partition, TensorDict({"x": _jagged([[5, 6]])}, batch_size=[1]))  # verified: new digest
    lookups.clear()
    assert [r.tolist() for r in client.get(["b"], partition, ["x"])["x"].unbind()] == [[5, 6]]
    assert lookups == []
    store.put(["b"], partition, TensorDict({"x": _jagged([[7, 8]])}, batch_size=[1]))  # no digest: the old one stays
    lookups.clear()
    with pytest.raises(IntegrityError, match=r"\['x'\]") as info:
        client.get(["a", "b"], partition, ["x"])
    assert info.value.keys == ("b",) and lookups == []

    client.put(["a"], partition, TensorDict({"x": _jagged([[9]])}, batch_size=[1]))
    with monkeypatch.context() as patch:
        error, message = fail_put_step(patch, "tags")
        with pytest.raises(error, match=message):
            client.put(["a"], partition, TensorDict({"x": _jagged([[10, 11]])}, batch_size=[1]))
    lookups.clear()
    with pytest.raises(IntegrityError) as info:  # its rows reached the index, its digest did not reach the keys
        client.get(["a"], partition, ["x"])
    assert info.value.keys == ("a",) and len(lookups) == 1
    client.put(["a"], partition, TensorDict({"y": torch.ones(1, 2)}, batch_size=[1]))  # a's key is known by key again
    lookups.clear()
    with pytest.raises(IntegrityError) as info:  # which digests a holds only the lookup can say, until a clear
        client.get(["a"], partition, ["x"])
    assert info.value.keys == ("a",) and len(lookups) == 1
    store.clear(["a", "b"], partition)
    store.close()


@on_object_store
def test_requests_in_the_pickle_framing_decode_as_tqs_own_framing_would_deliver_them(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key lookup, tags request, notice and clear that puts, gets and clears send decodes, in the pickle framing the
    line sends it in, to the body TQ's own msgpack framing would give the controller: equal values of equal types
    (a tuple that msgpack turns into a list would differ)."""
    sent: list[ZMQMessage] = []
    frame = tq_controller_line.frame_request

    def recorded(message: ZMQMessage) -> list:  # type: ignore[type-arg]
        sent.append(message)
        return frame(message)

    monkeypatch.setattr(tq_controller_line, "frame_request", recorded)
    store = TransferQueueStore.attach()
    verified = MeteredClient(store, verify_integrity=True)
    keys = ["a", "b", "c"]
    tags = [{"t": (1, (2.5, "x")), "m": {"k": [None, True]}}, {"t": [3]}, {"s": "y", "n": -(2**40)}]
    store.put(keys, partition, TensorDict({"ids": _jagged([[1], [2, 3], []])}, batch_size=[3]), tags=tags,
              sequence_lengths=[1, 2, 0])
    store.put(keys[:2], partition, TensorDict({"r": torch.ones(2)}, batch_size=[2]), tags=[{"t": ("z",)}, {}])
    verified.put(["d"], partition, TensorDict({"ids": _jagged([[4, 5]])}, batch_size=[1]), tags=[{"u": 1.5}])
    store.get_with_tags(keys, partition, ["ids"], ["t", "m"])
    verified.get(["d"], partition, ["ids"])
    store.clear([*keys, "d"], partition)
    store.close()

    framed = [message for message in sent if message.request_type in tq_controller_line.PICKLED]
    assert {message.request_type for message in framed} == set(tq_controller_line.PICKLED)
    for message in framed:
        ours = ZMQMessage.deserialize(tq_controller_line.frame_request(message))
        theirs = ZMQMessage.deserialize(message.serialize())
        assert _typed(ours.body) == _typed(theirs.body), message.request_type
        assert (ours.request_type, ours.sender_id, ours.request_id) == (theirs.request_type, theirs.sender_id, theirs.request_id)


def _typed(value: Any) -> Any:
    """``value`` with the type of every container and item beside it, so that equal results mean equal types too."""
    if isinstance(value, dict):
        return ("dict", [(_typed(k), _typed(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    return (type(value).__name__, value)


def _count_lookups(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that grows by one at each controller key lookup of this process: on a store's line to the controller,
    or through TQ's client."""
    client = tq_system.client()
    original, send, seen = client.async_kv_retrieve_meta, Exchange.send, []

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(None)
        return await original(*args, **kwargs)

    def counted_send(self: Exchange, request_type: ZMQRequestType, body: dict) -> None:  # type: ignore[type-arg]
        if request_type == ZMQRequestType.KV_RETRIEVE_META:
            seen.append(None)
        send(self, request_type, body)

    monkeypatch.setattr(client, "async_kv_retrieve_meta", counted)
    monkeypatch.setattr(Exchange, "send", counted_send)
    return seen


@on_object_store
def test_the_index_started_beside_the_controller_is_the_one_transfer_queue_uses(
    tq_store_session: TransferQueueStore,
) -> None:
    """``tq_system.start`` starts the index before TQ's controller and hands it to TQ's bootstrap, which takes the
    handle out of the config: the controller's stored config names no handle, and the handle TQ keeps (this
    process started the session's TQ) is the named index's."""
    import transfer_queue.interface as tq_interface

    controller = ray.get_actor(tq_system.CONTROLLER_NAME, namespace=tq_system.CONTROLLER_NAMESPACE)
    conf = ray.get(controller.get_config.remote())
    assert conf.backend.storage_backend == tq_object_store.BACKEND
    assert tq_object_store.STARTED_INDEX not in conf.backend[tq_object_store.BACKEND]
    held = tq_interface._TQ_STORAGE[tq_object_store.BACKEND]["index"]
    assert held._actor_id == tq_object_store.find_index()._actor_id


def test_an_index_resource_that_no_node_has_is_refused_before_the_index_starts(ray_cluster: None) -> None:
    """``start_index`` with a custom resource no alive node has raises at once (Ray would leave the actor pending
    for ever), naming TQ's setting and the resource, and starts no actor."""
    named = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(ValueError) as info:
        tq_object_store.start_index("rldp_absent_resource")
    message = str(info.value)
    assert f"backend.{tq_object_store.BACKEND}.{tq_object_store.INDEX_RESOURCE}" in message
    assert "'rldp_absent_resource'" in message
    assert {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)} == named


def test_a_storage_resource_that_no_node_has_names_the_config_key(ray_cluster: None) -> None:
    """The trainer's check before TransferQueue starts: a resource some alive node has (here the node's own
    ``node:<ip>`` resource) and None pass; one that none has raises ``ConfigError`` naming
    ``data_plane.storage_resource`` and the resource."""
    from shell.config_error import ConfigError
    from shell.node_placement import check_storage_resource

    check_storage_resource(None)
    check_storage_resource(next(r for r in ray.cluster_resources() if r.startswith("node:") and "__" not in r))
    with pytest.raises(ConfigError) as info:
        check_storage_resource("rldp_absent_resource")
    assert info.value.key == "data_plane.storage_resource"
    assert "'rldp_absent_resource'" in info.value.message


def test_contract_suite_passes_on_simple_storage() -> None:
    """The whole store contract suite, on TransferQueue's shipped SimpleStorage, in a fresh pytest process."""
    if TQ_BACKEND == "SimpleStorage":
        pytest.skip("the session itself runs SimpleStorage")
    env = {**os.environ, "RLDP_TEST_TQ_BACKEND": "SimpleStorage"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "transfer_queue",
         "tests/e2e/test_store_contract.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
