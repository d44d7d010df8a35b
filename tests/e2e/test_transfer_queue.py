"""``TransferQueueStore`` beyond the shared contract: lifecycle, a second process, TQ quirks, wire format.

The contract itself (``test_store_contract.py``, ``test_store_roundtrip.py``)
runs against this adapter through the ``store`` fixture. Here: start/attach
ownership, attaching from a Ray actor, config validation, rejected and failed
puts, the TransferQueue quirks the adapter hides, and its wire format (wire
field names, flat reserved tags, the whole-column decode against a row loop).
Ray and TransferQueue start once per session (``conftest.py``); the two checks
that need a process without Ray run in one cheap subprocess that never starts
Ray.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import ray
import torch
import transfer_queue as tq
from hypothesis import given
from tensordict import NonTensorData, NonTensorStack, TensorDict

from adapters.rows import ColumnSpec, columns_equal, stack_column
from adapters.tq_mooncake import from_zero_byte_placeholder, pad_jagged_rows, unpad_jagged_rows, zero_byte_placeholder
from adapters.tq_system import known_backends, quiet_logs, resolve_config
from adapters.tq_wire import (
    decode_column,
    field_set_groups,
    merge_spec_tags,
    parse_spec_tag,
    parse_wire_name,
    spec_tag,
    wire_name,
)
from adapters.transfer_queue import TransferQueueStore, is_running
from core.codec import jagged_lengths, to_jagged
from tests.e2e.conftest import PUT_STEPS, TQ_BACKEND, fail_put_step
from tests.e2e.store_peer import check_round_trip_through_peer, run_without_ray, trainer_batch
from tests.property.strategies import digest_columns

pytestmark = pytest.mark.e2e


"""The session storage manager's method by which the adapter stores a put's columns once the keys' meta is known
(on ``RayObjectStore`` the columns reach Ray's object store before, while the keys' lookup is in flight)."""

_NO_RAY_SCRIPT = """
import json
import ray
from adapters.transfer_queue import TransferQueueStore, is_running
report = {"running": is_running()}
try:
    TransferQueueStore.attach()
except RuntimeError as e:
    report["attach"] = str(e)
try:
    TransferQueueStore.start({"backend": {"storage_backend": "NoSuchStore"}})
except ValueError as e:
    report["start"] = str(e)
report["ray_initialized"] = ray.is_initialized()
print(json.dumps(report))
"""


# ---------------------------------------------------------------- configuration and lifecycle


@pytest.fixture(scope="module")
def no_ray_report() -> dict[str, Any]:
    """What attach() and start(bad config) do in a fresh interpreter without Ray (run once; never starts Ray)."""
    return run_without_ray(_NO_RAY_SCRIPT)


def test_attach_without_ray_raises_runtime_error(no_ray_report: dict[str, Any]) -> None:
    """attach() in a process without Ray raises RuntimeError showing how to connect, and starts nothing."""
    assert no_ray_report["running"] is False
    assert "Ray is not initialised in this process" in no_ray_report["attach"]
    assert "ray.init(address='auto')" in no_ray_report["attach"]


def test_start_with_unknown_backend_raises_before_starting_ray(no_ray_report: dict[str, Any]) -> None:
    """start() with an unknown storage backend raises ValueError before Ray (or anything) starts."""
    assert "'backend.storage_backend' must be one of" in no_ray_report["start"]
    assert "got 'NoSuchStore'" in no_ray_report["start"]
    assert no_ray_report["ray_initialized"] is False


def test_resolve_config_merges_over_defaults() -> None:
    """A partial config is merged over TQ's defaults; MooncakeStore is selectable by name."""
    conf = resolve_config({"backend": {"SimpleStorage": {"num_data_storage_units": 3}}})
    assert conf.backend.storage_backend == "SimpleStorage"
    assert conf.backend.SimpleStorage.num_data_storage_units == 3
    assert resolve_config({"backend": {"storage_backend": "MooncakeStore"}}).backend.storage_backend == "MooncakeStore"
    assert {"SimpleStorage", "MooncakeStore"} <= set(known_backends())


def test_resolve_config_rejects_unknown_backend_and_non_mappings() -> None:
    """An unknown backend is a ValueError naming the known ones; a non-mapping config a TypeError."""
    with pytest.raises(ValueError, match=r"'backend.storage_backend' must be one of \(.*'SimpleStorage'.*\): got 'No'"):
        resolve_config({"backend": {"storage_backend": "No"}})
    with pytest.raises(TypeError, match=r"'config' must be a mapping of TransferQueue settings or None: got str"):
        resolve_config("SimpleStorage")  # type: ignore[arg-type]


def test_quiet_logs_keeps_only_errors_of_every_transfer_queue_logger(tq_store_session: TransferQueueStore) -> None:
    """quiet_logs raises every TransferQueue logger (their levels are set explicitly) to ERROR, and no other logger."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith("transfer_queue")]
    other = logging.getLogger("tests.e2e.quiet_logs")
    saved = {name: logging.getLogger(name).level for name in names}
    try:
        quiet_logs()
        assert names and all(logging.getLogger(name).level == logging.ERROR for name in names)
        assert other.level == logging.NOTSET
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_start_while_running_raises_runtime_error(tq_store_session: TransferQueueStore) -> None:
    """A second start() on a cluster that runs TransferQueue raises RuntimeError pointing to attach()."""
    with pytest.raises(RuntimeError, match=r"a TransferQueue already runs on this Ray cluster.*attach\(\)"):
        TransferQueueStore.start()
    assert is_running() and ray.is_initialized()


def test_close_of_attached_store_leaves_transfer_queue_running(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """Closing an attached store twice is a no-op for TQ: the store refuses calls, a new handle reads the data."""
    first = TransferQueueStore.attach()
    assert tq_store_session.owns_transfer_queue and not first.owns_transfer_queue
    first.put(["a"], partition, TensorDict({"x": torch.arange(3).view(1, 3)}, batch_size=[1]))
    first.close()
    first.close()
    with pytest.raises(RuntimeError, match=r"TransferQueueStore is closed"):
        first.get(["a"], partition, ["x"])
    second = TransferQueueStore.attach()
    assert is_running()
    assert second.get(["a"], partition, ["x"])["x"].tolist() == [[0, 1, 2]]
    second.clear(["a"], partition)
    second.close()


# ---------------------------------------------------------------- a second process


def test_actor_attaches_reads_the_driver_writes_and_writes_back(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """A Ray actor attaches, reads byte-equal what the driver put (objects included), sees the store's own errors,
    and the driver reads the field it writes back; the actor's close leaves TQ running."""
    store = TransferQueueStore.attach()
    try:
        check_round_trip_through_peer(store, TransferQueueStore.attach, partition, is_running)
    finally:
        store.close()


# ---------------------------------------------------------------- quirks the adapter hides


@pytest.mark.parametrize(
    ("keys", "fields", "kwargs", "error", "match"),
    [
        (["a", "a"], TensorDict({"x": torch.zeros(2)}, batch_size=[2]), {}, ValueError, r"'keys' must be unique"),
        (
            ["a", "b"],
            TensorDict({"y": torch.zeros(2), "bad": NonTensorData("batch-wide", batch_size=[2])}, batch_size=[2]),
            {},
            TypeError,
            r"field 'bad' must hold one value per row",
        ),
        (
            ["a", "b"],
            TensorDict({"x": torch.zeros(2)}, batch_size=[2]),
            {"tags": [{"__kvspec__": {}}, {}]},
            ValueError,
            r"'tags' entries must not use the reserved names .*got \['__kvspec__'\] at index 0",
        ),
    ],
    ids=["duplicate-keys", "broadcast-non-tensor-data", "reserved-tag"],
)
def test_put_rejected_registers_no_keys(
    tq_store_session: TransferQueueStore,
    partition: str,
    keys: list[str],
    fields: TensorDict,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    """Puts TQ would half-apply (it registers keys before checking them) are rejected before any TQ call."""
    store = TransferQueueStore.attach()
    with pytest.raises(error, match=match):
        store.put(keys, partition, fields, **kwargs)
    assert store.list_keys(partition) == ()
    store.close()


def test_put_failing_in_transfer_queue_clears_the_keys_it_registered(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When TQ's write fails after the keys were registered, the new keys are cleared and old ones kept."""
    store = TransferQueueStore.attach()
    store.put(["old"], partition, TensorDict({"x": torch.tensor([7])}, batch_size=[1]))
    error, message = fail_put_step(monkeypatch, "columns")
    with pytest.raises(error, match=message):
        store.put(["new1", "old", "new2"], partition, TensorDict({"x": torch.tensor([1, 2, 3])}, batch_size=[3]))
    monkeypatch.undo()
    assert store.list_keys(partition) == ("old",)
    assert store.get(["old"], partition, ["x"])["x"].tolist() == [7]
    store.clear(["old"], partition)
    store.close()


@pytest.mark.parametrize("failing", PUT_STEPS)
def test_put_of_new_keys_failing_in_any_step_leaves_no_key(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A put of new keys sends its columns, its tags and (on RayObjectStore) the controller's notice at once:
    whichever fails, the put raises it and registers nothing, and the next put of the same keys stores them whole."""
    store = TransferQueueStore.attach()
    error, message = fail_put_step(monkeypatch, failing)
    batch = TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2])
    with pytest.raises(error, match=message):
        store.put(["n1", "n2"], partition, batch)
    monkeypatch.undo()
    assert store.list_keys(partition) == ()
    store.put(["n1", "n2"], partition, batch)
    assert store.get(["n2", "n1"], partition, ["x"])["x"].tolist() == [2, 1]
    store.clear(["n1", "n2"], partition)
    store.close()


@pytest.mark.parametrize("tags", [None, [{"t": 2}]], ids=["new field", "new field and a tag the key holds"])
def test_rewrite_failing_in_its_columns_leaves_the_tags_as_they_were(
    tq_store_session: TransferQueueStore, partition: str, monkeypatch: pytest.MonkeyPatch, tags: Any
) -> None:
    """A rewrite whose tag merge can be undone sends its columns and its tags at once; when the columns fail, the
    keys' tags are set back, so the key reads and describes as before the put."""
    store = TransferQueueStore.attach()
    store.put(["k"], partition, TensorDict({"x": torch.tensor([7])}, batch_size=[1]), tags=[{"t": 1}])
    before = store.describe(["k"], partition)
    error, message = fail_put_step(monkeypatch, "columns")
    with pytest.raises(error, match=message):
        store.put(["k"], partition, TensorDict({"y": torch.ones(1, 2)}, batch_size=[1]), tags=tags)
    monkeypatch.undo()
    assert store.describe(["k"], partition) == before
    with pytest.raises(KeyError, match=r"'y'"):
        store.get(["k"], partition, ["y"])
    assert store.get(["k"], partition, ["x"])["x"].tolist() == [7]
    store.clear(["k"], partition)
    store.close()


def test_put_rewrite_with_another_dtype_stays_readable(tq_store_session: TransferQueueStore, partition: str) -> None:
    """TQ allows one dtype per field and partition; through the adapter a field may change dtype per key."""
    store = TransferQueueStore.attach()
    store.put(["a", "b"], partition, TensorDict({"x": torch.tensor([0.5, -0.0])}, batch_size=[2]))
    store.put(["a"], partition, TensorDict({"x": torch.tensor([[3, 4]], dtype=torch.int8)}, batch_size=[1]))
    assert torch.equal(store.get(["a"], partition, ["x"])["x"], torch.tensor([[3, 4]], dtype=torch.int8))
    b = store.get(["b"], partition, ["x"])["x"]
    assert b.dtype == torch.float32 and b.shape == (1,) and torch.signbit(b).tolist() == [True]
    with pytest.raises(ValueError, match=r"field 'x' is stored with different layouts"):
        store.get(["a", "b"], partition, ["x"])
    store.clear(["a", "b"], partition)
    store.close()


def test_get_round_trips_objects_msgpack_would_change(tq_store_session: TransferQueueStore, partition: str) -> None:
    """Tuples, sets, bytes and nested object arrays come back as themselves, not as msgpack lists."""
    store = TransferQueueStore.attach()
    values = [(1, 2), {3}, b"\x00x", None]
    array = np.empty((4, 2), dtype=object)
    array[:, 0] = values
    array[:, 1] = [frozenset({1}), (), "s", 1.5]
    td = TensorDict({"stack": NonTensorStack(*values)}, batch_size=[4])
    td["array"] = array
    store.put(["a", "b", "c", "d"], partition, td)
    got = store.get(["d", "a", "b", "c"], partition, ["stack", "array"])
    assert got.get("stack").tolist() == [None, (1, 2), {3}, b"\x00x"]
    assert isinstance(got.get("stack").tolist()[1], tuple)
    assert got["array"].shape == (4, 2) and got["array"].tolist() == array[[3, 0, 1, 2]].tolist()
    assert [type(v) for v in got["array"][:, 1]] == [float, frozenset, tuple, str]
    store.clear(["a", "b", "c", "d"], partition)
    store.close()


def test_describe_hides_reserved_tags_and_reports_lengths(tq_store_session: TransferQueueStore, partition: str) -> None:
    """describe shows user tags only (TQ's kv_list shows the reserved ones) and the stored lengths."""
    store = TransferQueueStore.attach()
    fields = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    store.put(["a", "b"], partition, fields, tags=[{"r": 1}, {}], sequence_lengths=[4, 0])
    meta = store.describe(["b", "a"], partition)
    assert meta.tags == ({}, {"r": 1}) and meta.sequence_lengths == (0, 4) and meta.fields == ("x",)
    assert set(tq.kv_list(partition)[partition]["a"]) == {"r", "__kvspec__", "__kvlen__"}
    store.clear(["a", "b"], partition)
    store.close()


# ---------------------------------------------------------------- wire format


def _rows(column: torch.Tensor) -> list[torch.Tensor]:
    return list(column.unbind())


@given(digest_columns(max_rows=5, max_len=5).filter(lambda c: c.is_nested and c.shape[0] > 0))
def test_pad_jagged_rows_round_trips_and_leaves_no_row_empty(column: torch.Tensor) -> None:
    """unpad(pad(c)) has c's rows bit for bit; every padded row is one token longer, so never zero bytes."""
    padded = pad_jagged_rows(column)
    assert padded.lengths() is None and int(padded.offsets()[0]) == 0
    lengths = jagged_lengths(column)
    assert jagged_lengths(padded) == tuple(n + 1 for n in lengths)
    back = unpad_jagged_rows("f", padded)
    assert jagged_lengths(back) == lengths and back.dtype == column.dtype
    for got, want in zip(_rows(back), _rows(column)):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_unpad_jagged_rows_rejects_an_empty_row() -> None:
    """A stored row with no token cannot have been padded: RuntimeError naming the field."""
    with pytest.raises(RuntimeError, match=r"empty row of field 'ids', which was stored padded"):
        unpad_jagged_rows("ids", to_jagged(torch.ones(2, 3), [2, 0]))


@pytest.mark.parametrize(
    ("spec", "column"),
    [
        (ColumnSpec("dense", "float16", (0,)), torch.zeros(3, 0, dtype=torch.float16)),
        (ColumnSpec("dense", "int64", (2, 0)), torch.zeros(2, 2, 0, dtype=torch.int64)),
        (ColumnSpec("jagged", "bool", (0,)), to_jagged(torch.zeros(3, 4, 0, dtype=torch.bool), [4, 0, 1])),
    ],
    ids=str,
)
def test_zero_byte_placeholder_round_trips(spec: ColumnSpec, column: torch.Tensor) -> None:
    """A column of zero-byte rows travels as its row lengths and comes back in its kind, dtype and shape,
    from a dense placeholder (SimpleStorage) or rows of one element (Mooncake)."""
    placeholder = zero_byte_placeholder(spec, column)
    n = column.shape[0]
    assert placeholder.dtype == torch.int64 and placeholder.shape == (n,)
    for wire in (placeholder, torch.nested.nested_tensor_from_jagged(placeholder, torch.arange(n + 1))):
        back = from_zero_byte_placeholder("f", spec, wire, n)
        assert columns_equal(back, column)
    with pytest.raises(RuntimeError, match=rf"returned {n - 1} rows of field 'f': expected {n}"):
        from_zero_byte_placeholder("f", spec, placeholder[:-1], n)


def test_field_set_groups_groups_keys_by_their_spec_tag() -> None:
    """Keys holding the same wire fields share a group, in first-seen order; keys without fields form one."""
    a, b = spec_tag(["x@dense.int64."]), spec_tag(["x@dense.float32."])
    tags = [{"__kvspec__": a}, {}, {"__kvspec__": b, "u": 1}, {"__kvspec__": a}]
    assert field_set_groups(tags) == [[0, 3], [1], [2]]



@pytest.mark.parametrize("name", ["x", "a@b", "a.b@dense.int8.", "5x3", ""])
@pytest.mark.parametrize(
    "spec",
    [
        ColumnSpec("dense", "float32", ()),
        ColumnSpec("dense", "float32", (1,)),
        ColumnSpec("dense", "bfloat16", (5, 0, 3)),
        ColumnSpec("jagged", "int64", ()),
        ColumnSpec("jagged", "bool", (2,)),
        ColumnSpec("object_array", "object", (4,)),
        ColumnSpec("non_tensor_stack", "object", ()),
    ],
    ids=str,
)
def test_parse_wire_name_inverts_wire_name(name: str, spec: ColumnSpec) -> None:
    """parse_wire_name(wire_name(n, s)) == (n, s) for any field name, '@' and '.' included."""
    assert parse_wire_name(wire_name(name, spec)) == (name, spec)


def test_wire_name_differs_for_every_spec() -> None:
    """A rewrite with another kind, dtype or shape ((N,) vs (N, 1) included) goes to another wire field."""
    specs = [
        ColumnSpec("dense", "float32", ()),
        ColumnSpec("dense", "float32", (1,)),
        ColumnSpec("dense", "float32", (11,)),
        ColumnSpec("dense", "float32", (1, 1)),
        ColumnSpec("dense", "int8", ()),
        ColumnSpec("jagged", "float32", ()),
    ]
    assert len({wire_name("x", spec) for spec in specs}) == len(specs)


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        ("x", r"wire field 'x' must be of the form 'name@kind\.dtype\.shape'"),
        ("x@dense.float32", r"must be of the form"),
        ("x@dense.float32.2by3", r"must give its shape as ints joined by 'x': got '2by3'"),
        ("x@dense.float99.", r"'dtype' must name a carried torch dtype"),
        ("x@sparse.float32.", r"'kind' must be one of"),
    ],
)
def test_parse_wire_name_rejects_malformed_names(wire: str, match: str) -> None:
    """A wire field not written by wire_name is a ValueError naming what is wrong."""
    with pytest.raises(ValueError, match=match):
        parse_wire_name(wire)


def test_parse_spec_tag_reads_fields_in_order_and_rejects_foreign_tags() -> None:
    """A spec tag parses to field -> spec in first-put order; a merge keeps that order; foreign tags raise."""
    a, b = ColumnSpec("jagged", "int64", ()), ColumnSpec("dense", "float16", (5, 3))
    tag = spec_tag([wire_name("ids", a), wire_name("h", b)])
    assert dict(parse_spec_tag(tag)) == {"ids": a, "h": b}
    assert parse_spec_tag(tag) is parse_spec_tag(str(tag))
    c = ColumnSpec("dense", "int8", (2,))
    merged = merge_spec_tags(tag, spec_tag([wire_name("new", a), wire_name("ids", c)]))
    assert dict(parse_spec_tag(merged)) == {"ids": c, "h": b, "new": a}
    with pytest.raises(ValueError, match=r"reserved tag '__kvspec__' must be a JSON list of wire field names"):
        parse_spec_tag('{"ids": "jagged"}')


def _as_tq_returns(dense: torch.Tensor) -> torch.Tensor:
    """A rectangular column ``(N, *shape)`` as TQ's get returns it: a jagged tensor of its rows."""
    return torch.nested.as_nested_tensor(list(dense.unbind(0)), layout=torch.jagged)


@pytest.mark.parametrize(
    ("spec", "returned"),
    [
        (ColumnSpec("dense", "float32", ()), torch.arange(4, dtype=torch.float32)),
        (ColumnSpec("dense", "int64", (2,)), _as_tq_returns(torch.arange(8).view(4, 2))),
        (ColumnSpec("dense", "bfloat16", (2, 3)), _as_tq_returns(torch.randn(4, 2, 3).bfloat16())),
        (ColumnSpec("dense", "bool", (0,)), _as_tq_returns(torch.zeros(4, 0, dtype=torch.bool))),
        (ColumnSpec("jagged", "float16", ()), to_jagged(torch.randn(4, 3).half(), [3, 0, 1, 2])),
        (ColumnSpec("jagged", "int8", (2,)), to_jagged(torch.ones(4, 3, 2, dtype=torch.int8), [0, 3, 3, 1])),
        (
            ColumnSpec("dense", "int64", (2,)),
            torch.nested.nested_tensor_from_jagged(
                torch.arange(16), torch.tensor([0, 4, 8, 12, 16]), lengths=torch.tensor([2, 2, 2, 2])
            ),
        ),
        (ColumnSpec("dense", "int64", (2,)), torch.arange(8).view(4, 2)),
    ],
    ids=["n", "n2-jagged", "n23-jagged", "n0-jagged", "jagged", "jagged-d", "n2-jagged-with-holes", "n2-dense"],
)
def test_decode_column_matches_stacking_the_rows(spec: ColumnSpec, returned: torch.Tensor) -> None:
    """The whole-column decode of what TQ returns equals stacking its rows one by one with stack_column."""
    rows = list(returned.unbind()) if returned.is_nested else list(returned.unbind(0))
    assert columns_equal(decode_column("f", spec, returned, 4), stack_column("f", spec, rows))


def test_decode_column_rejects_rows_that_do_not_fit() -> None:
    """Rows of the wrong size or row count never reshape silently: ValueError or RuntimeError."""
    ragged = to_jagged(torch.ones(2, 4), [3, 1])
    with pytest.raises(ValueError, match=r"row 0 of field 'f' must have shape \(2,\): got \(3,\)"):
        decode_column("f", ColumnSpec("dense", "float32", (2,)), ragged, 2)
    with pytest.raises(RuntimeError, match=r"TransferQueue returned 2 rows of field 'f': expected 3"):
        decode_column("f", ColumnSpec("jagged", "float32", ()), ragged, 3)


def test_put_stores_native_columns_under_wire_fields_with_flat_tags(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """TQ holds each field natively under its wire name; the reserved tags are a str and an int per key."""
    store = TransferQueueStore.attach()
    fields = trainer_batch(3, [2, 0, 1])
    store.put(["a", "b", "c"], partition, fields, sequence_lengths=[2, 0, 1])
    tags = tq.kv_list(partition)[partition]["b"]
    assert isinstance(tags["__kvspec__"], str) and tags["__kvlen__"] == 0
    assert list(parse_spec_tag(tags["__kvspec__"])) == list(fields.keys())
    wire = "logprobs@jagged.bfloat16."
    raw = tq.kv_batch_get(keys=["c", "a"], partition_id=partition, select_fields=[wire])[wire]
    padding = 1 if TQ_BACKEND == "MooncakeStore" else 0  # a key/value backend stores each row padded by one token
    assert raw.dtype == torch.bfloat16 and jagged_lengths(raw) == (1 + padding, 2 + padding)
    store.clear(["a", "b", "c"], partition)
    store.close()


def test_rewrite_with_another_spec_leaves_the_old_wire_field_until_clear(
    tq_store_session: TransferQueueStore, partition: str
) -> None:
    """The displaced wire field lingers unread (TQ cannot clear one field); a clear drops it with the key."""
    store = TransferQueueStore.attach()
    client = tq.get_client()
    store.put(["a"], partition, TensorDict({"x": torch.zeros(1)}, batch_size=[1]))
    store.put(["a"], partition, TensorDict({"x": torch.ones(1, 2, dtype=torch.int8)}, batch_size=[1]))
    held = client.kv_retrieve_meta(keys=["a"], partition_id=partition).field_names
    assert set(held) == {"x@dense.float32.", "x@dense.int8.2"}
    assert store.get(["a"], partition, ["x"])["x"].tolist() == [[1, 1]]
    assert store.describe(["a"], partition).fields == ("x",)
    store.clear(["a"], partition)
    store.put(["a"], partition, TensorDict({"x": torch.ones(1, 2, dtype=torch.int8)}, batch_size=[1]))
    assert client.kv_retrieve_meta(keys=["a"], partition_id=partition).field_names == ["x@dense.int8.2"]
    store.clear(["a"], partition)
    store.close()


def test_start_with_mooncake_missing_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a loadable 'mooncake' package, start() names the pip package to install and starts nothing."""
    import adapters.tq_mooncake as adapter

    config = {"backend": {"storage_backend": "MooncakeStore"}}
    running = is_running()
    real_find_spec = adapter.importlib.util.find_spec
    monkeypatch.setattr(
        adapter.importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"needs the 'mooncake' package: install it with pip install mooncake-transfer-engine"):
        TransferQueueStore.start(config)
    monkeypatch.undo()
    real_import = adapter.importlib.import_module

    def broken(name: str, *args: Any) -> Any:
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(adapter.importlib, "import_module", broken)
    monkeypatch.setattr(adapter.importlib.util, "find_spec", lambda name, *a: real_find_spec("json") if name == "mooncake" else real_find_spec(name, *a))
    with pytest.raises(RuntimeError, match=r"installed but cannot load \(libibverbs.so.1: .*\): .*libnuma1"):
        TransferQueueStore.start(config)
    assert is_running() == running
