"""Laws of the rollout's write behind (:func:`shell.column_io.first_write_behind`) and of the transport's wait for it
(``DataPlaneTransport.admit(..., landed=...)``), on a MemoryStore.

* Same receipt, same rows: the receipt returned at once equals :func:`first_write`'s, and once the write's future
  resolves the store holds what :func:`first_write` would have stored.
* Checks before I/O: input the port or the codec refuses raises in the call; nothing is submitted or stored.
* The write's own error is the future's, not the call's.
* The transport waits for an admitted write exactly once, before it reads, rewrites or clears the rows or hands
  their keys to a rank; the write's store I/O is counted; a failed write fails the step's next use of the rows,
  and ``abort`` still clears every admitted key.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from adapters.memory import MemoryStore
from core.meta import KVBatchMeta
from shell.column_io import first_write, first_write_behind, read_columns
from shell.step_rows import StepRows
from shell.transport import DataPlaneTransport

PARTITION = "p"


class _Recording(concurrent.futures.Executor):
    """Runs nothing: keeps what was submitted, to run it when the test says."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Callable[..., Any], concurrent.futures.Future[Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.submitted.append((lambda: fn(*args, **kwargs), future))
        return future

    def run_all(self) -> None:
        for call, future in self.submitted:
            try:
                future.set_result(call())
            except Exception as error:
                future.set_exception(error)


def _batch(n: int, lengths: list[int]) -> tuple[dict[str, torch.Tensor], list[str]]:
    width = max(lengths)
    ids = torch.arange(n * width, dtype=torch.int64).reshape(n, width)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": ids, "token_mask": mask, "reward": torch.arange(n, dtype=torch.float32)}, [f"k{i}" for i in range(n)]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=10), tagged=st.booleans())
def test_the_receipt_comes_first_and_the_write_stores_what_first_write_stores(lengths: list[int], tagged: bool) -> None:
    n = len(lengths)
    columns, keys = _batch(n, lengths)
    tags = [{"weight_version": i % 3} for i in range(n)] if tagged else None
    kwargs = dict(keys=keys, partition_id=PARTITION, lengths=lengths, token_fields=["input_ids", "token_mask"], tags=tags)
    eager_store, behind_store = MemoryStore(), MemoryStore()
    expected = first_write(eager_store, columns, **kwargs, extra_info={"e": 1})
    executor = _Recording()
    receipt, written = first_write_behind(behind_store, columns, executor=executor, **kwargs, extra_info={"e": 1})
    assert receipt == expected
    assert behind_store.list_keys(PARTITION) == ()  # nothing stored before the executor runs the write
    executor.run_all()
    assert written.result() == expected
    names = ["input_ids", "token_mask", "reward"]
    got, want = read_columns(behind_store, receipt, names), read_columns(eager_store, expected, names)
    for name in names:
        assert torch.equal(got[name], want[name]), name
    assert behind_store.describe(keys, PARTITION) == eager_store.describe(keys, PARTITION)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(keys=["a", "a"]), "repeat|duplicate"),
        (dict(tags=[{"t": 1}]), "tags"),
        (dict(lengths=[9, 1]), "narrower|length"),
    ],
    ids=["duplicate keys", "tags not one per key", "a length past its row"],
)
def test_refused_input_raises_in_the_call_and_nothing_is_submitted(change: dict[str, Any], error: str) -> None:
    columns, keys = _batch(2, [3, 2])
    kwargs: dict[str, Any] = dict(keys=keys, partition_id=PARTITION, lengths=[3, 2], token_fields=["input_ids", "token_mask"])
    kwargs.update(change)
    store, executor = MemoryStore(), _Recording()
    with pytest.raises(ValueError, match=error):
        first_write_behind(store, columns, executor=executor, **kwargs)
    assert executor.submitted == [] and store.list_keys(PARTITION) == ()


class _FailingPut(MemoryStore):
    def put(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        raise RuntimeError("the store is gone")


def test_the_writes_own_error_is_the_futures() -> None:
    columns, keys = _batch(2, [3, 2])
    executor = _Recording()
    receipt, written = first_write_behind(
        _FailingPut(), columns, executor=executor, keys=keys, partition_id=PARTITION, lengths=[3, 2], token_fields=["input_ids"]
    )
    assert receipt.keys == tuple(keys)
    executor.run_all()
    with pytest.raises(RuntimeError, match="the store is gone"):
        written.result()


# ---------------------------------------------------------------- the transport's wait


class _Landing:
    """A write behind, as the transport sees it: ``landed`` runs the write (or fails) and returns its store I/O."""

    def __init__(self, store: MemoryStore, n: int, fail: BaseException | None = None) -> None:
        self.store, self.calls, self.fail = store, 0, fail
        columns, self.keys = _batch(n, [2] * n)
        self.executor = _Recording()
        self.receipt, self.written = first_write_behind(
            store, columns, executor=self.executor, keys=self.keys, partition_id=PARTITION, lengths=[2] * n,
            token_fields=["input_ids"],
        )

    def landed(self) -> Mapping[str, float]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        self.executor.run_all()
        self.written.result()
        return {"ms": 2.5, "bytes": 40.0, "put_ms": 2.5}


USES: dict[str, Callable[[DataPlaneTransport, StepRows], Any]] = {
    "rank_inputs": lambda t, rows: t.rank_inputs(rows, [rows.meta], list(range(len(rows.meta))), ["input_ids"]),
    "read": lambda t, rows: t.read(rows, ["input_ids"]),
    "write": lambda t, rows: t.write(rows, {"wide": torch.zeros(len(rows.meta), 4096)}),
    "discard": lambda t, rows: t.discard(rows),
    "finish": lambda t, rows: t.finish(rows),
    "abort": lambda t, rows: t.abort(),
}


@pytest.mark.parametrize("use", sorted(USES))
def test_the_transport_waits_once_for_an_admitted_write_before_it_touches_the_rows(use: str) -> None:
    store = MemoryStore()
    landing = _Landing(store, 3)
    transport = DataPlaneTransport(store, lambda: store, partition_id=PARTITION)
    rows = StepRows(landing.receipt)
    transport.admit(rows, {"ms": 0.0, "bytes": 0.0}, landed=landing.landed)
    assert landing.calls == 0  # the driver plans while the engine writes
    USES[use](transport, rows)  # reads and rewrites find the rows; clears find them to clear
    assert landing.calls == 1
    report = transport.finish(rows)
    assert landing.calls == 1  # once only
    assert store.list_keys(PARTITION) == ()  # every admitted key cleared
    if use != "finish":  # there the first finish's report had it
        assert report.store_ms_by_call["rollout put"] == pytest.approx(2.5)


def test_a_failed_write_fails_the_next_use_and_abort_still_clears_every_admitted_key() -> None:
    store = MemoryStore()
    good = _Landing(store, 2)
    bad = _Landing(store, 2, fail=RuntimeError("the rollout engine failed in 'wait_write'"))
    transport = DataPlaneTransport(store, lambda: store, partition_id=PARTITION)
    transport.admit(StepRows(good.receipt), {}, landed=good.landed)
    transport.admit(StepRows(bad.receipt.subset([0, 1])), {}, landed=bad.landed)
    rows = StepRows(good.receipt)
    with pytest.raises(RuntimeError, match="wait_write"):
        transport.rank_inputs(rows, [rows.meta], [0, 1], ["input_ids"])
    assert (good.calls, bad.calls) == (1, 1)  # the write before the failed one was waited for too
    transport.abort()  # raises nothing, waits for nothing again
    assert (good.calls, bad.calls) == (1, 1)
    assert store.list_keys(PARTITION) == ()


def test_an_interrupted_wait_is_waited_for_again_by_abort() -> None:
    store = MemoryStore()
    landing = _Landing(store, 2, fail=KeyboardInterrupt())
    transport = DataPlaneTransport(store, lambda: store, partition_id=PARTITION)
    rows = StepRows(landing.receipt)
    transport.admit(rows, {}, landed=landing.landed)
    with pytest.raises(KeyboardInterrupt):
        transport.rank_inputs(rows, [rows.meta], [0, 1], ["input_ids"])
    landing.fail = None  # the write lands after all
    transport.abort()
    assert landing.calls == 2
    assert store.list_keys(PARTITION) == ()
