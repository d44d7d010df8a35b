"""MeteredClient: counters, per-step deltas, outstanding bytes, and integrity checks against injected corruption,
within one process and across processes (a Ray actor with its own client over TransferQueue)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

from adapters.memory import MemoryStore
from adapters.rows import columns_equal, read_columns_of
from adapters.store_port import DataPlaneClient, TagColumns
from adapters.transfer_queue import TransferQueueStore
from core.codec import to_jagged
from core.meta import KVBatchMeta
from shell.metering import DIGEST_PREFIX, DataPlaneEvent, IntegrityError, MeteredClient

LENGTHS = [5, 0, 3, 7]
KEYS = [f"k{i}" for i in range(len(LENGTHS))]


def _batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (4, 8), generator=g)
    td = TensorDict(
        {
            "input_ids": to_jagged(ids, LENGTHS),
            "logprobs": to_jagged(torch.randn(4, 8, generator=g).to(torch.bfloat16), LENGTHS),
            "mask": to_jagged(torch.rand(4, 8, generator=g) > 0.5, LENGTHS),
            "reward": torch.tensor([0.5, 1.0, 0.0, 0.25]),
        },
        batch_size=[4],
    )
    td["prompt"] = np.array(["a", {"b": {1, 2}}, None, 3], dtype=object)
    return td


class FaultyStore:
    """Wraps a store and corrupts the named field of every get with ``corrupt``."""

    def __init__(self, inner: DataPlaneClient, field: str, corrupt: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner, self.field, self.corrupt = inner, field, corrupt
        self.describes = 0

    def put(self, keys: Sequence[str], partition_id: str, fields: TensorDict, **kw: object) -> KVBatchMeta:
        return self.inner.put(keys, partition_id, fields, **kw)  # type: ignore[arg-type]

    def put_with_reserved_tags(self, keys: Sequence[str], partition_id: str, fields: TensorDict, **kw: object) -> KVBatchMeta:
        return self.inner.put_with_reserved_tags(keys, partition_id, fields, **kw)  # type: ignore[attr-defined]

    def get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        out = self.inner.get(keys, partition_id, select_fields)
        if self.field in out.keys():
            out.set(self.field, self.corrupt(out.get(self.field)))
        return out

    def clear(self, keys: Sequence[str], partition_id: str) -> None:
        self.inner.clear(keys, partition_id)

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        return self.inner.list_keys(partition_id)

    def describe(self, keys: Sequence[str], partition_id: str) -> KVBatchMeta:
        self.describes += 1
        return self.inner.describe(keys, partition_id)

    def close(self) -> None:
        self.inner.close()


class FaultyTaggedStore(FaultyStore):
    """A FaultyStore that also has ``get_with_tags``, corrupting it the same way."""

    def get_with_tags(
        self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, tuple[dict[str, Any], ...]]:
        out, tags = self.inner.get_with_tags(keys, partition_id, select_fields, tag_names)  # type: ignore[attr-defined]
        if self.field in out.keys():
            out.set(self.field, self.corrupt(out.get(self.field)))
        return out, tags


class FaultyByNameStore(FaultyTaggedStore):
    """A FaultyTaggedStore whose ``get_with_tags`` answers the tags by name (a ``TagColumns``), as the
    ``RayObjectStore`` index does."""

    def get_with_tags(
        self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, TagColumns]:
        out, tags = super().get_with_tags(keys, partition_id, select_fields, tag_names)
        return out, TagColumns.from_mappings(tags, tag_names)


def _rows(j: torch.Tensor) -> list[torch.Tensor]:
    return [r.clone() for r in j.unbind()]


def _jag(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _change_element(j: torch.Tensor) -> torch.Tensor:
    rows = _rows(j)
    rows[3][2] += 1
    return _jag(rows)


def _truncate(j: torch.Tensor) -> torch.Tensor:
    rows = _rows(j)
    rows[3] = rows[3][:-1]
    return _jag(rows)


def _swap(j: torch.Tensor) -> torch.Tensor:
    rows = _rows(j)
    rows[0], rows[3] = rows[3], rows[0]
    return _jag(rows)


def _permute_within(j: torch.Tensor) -> torch.Tensor:
    rows = _rows(j)
    rows[0] = rows[0].flip(0)
    return _jag(rows)


def _constant(j: torch.Tensor) -> torch.Tensor:
    rows = _rows(j)
    rows[3] = torch.full_like(rows[3], int(rows[3][0]))
    return _jag(rows)


@pytest.mark.parametrize(
    ("corrupt", "bad_keys"),
    [(_change_element, {"k3"}), (_truncate, {"k3"}), (_swap, {"k0", "k3"}), (_permute_within, {"k0"}), (_constant, {"k3"})],
    ids=["changed-element", "truncated-row", "swapped-rows", "permuted-within-row", "constant-row"],
)
@pytest.mark.parametrize(
    "faulty", [FaultyStore, FaultyTaggedStore, FaultyByNameStore], ids=["describe", "get_with_tags", "get_with_tags-by-name"]
)
def test_metered_client_get_raises_integrity_error_on_corruption(
    corrupt: Callable[[torch.Tensor], torch.Tensor], bad_keys: set[str], faulty: type[FaultyStore]
) -> None:
    """Every injected corruption of a stored row raises IntegrityError naming the keys and the field,
    whether the digests come back with the data (get_with_tags) or through describe."""
    client = MeteredClient(faulty(MemoryStore(), "input_ids", corrupt), verify_integrity=True)
    client.put(KEYS, "p", _batch())
    with pytest.raises(IntegrityError, match=r"fields \['input_ids'\] differ") as info:
        client.get(KEYS, "p", ["input_ids", "reward"])
    assert set(info.value.keys) == bad_keys
    assert info.value.fields == ("input_ids",)


def test_metered_client_reads_digests_with_the_data_when_the_store_can() -> None:
    """With a TaggedGetClient inner store a verified get makes no describe call; without one it makes one."""
    for faulty, describes in ((FaultyTaggedStore, 0), (FaultyStore, 1)):
        inner = faulty(MemoryStore(), "input_ids", lambda j: j)
        client = MeteredClient(inner, verify_integrity=True)
        client.put(KEYS, "p", _batch())
        client.get(KEYS, "p", ["input_ids", "prompt"])
        assert inner.describes == describes, faulty.__name__


def test_metered_client_detects_changed_bf16_and_bool_elements() -> None:
    """A flipped element in a bf16 or bool field is caught."""
    for field in ("logprobs", "mask"):
        flip = (lambda j: _jag([~r if r.dtype == torch.bool else r + 1 for r in _rows(j)]))
        client = MeteredClient(FaultyStore(MemoryStore(), field, flip), verify_integrity=True)
        client.put(KEYS, "p", _batch())
        with pytest.raises(IntegrityError, match=field):
            client.get(KEYS, "p", [field])


def test_metered_client_integrity_round_trip_never_false_alarms() -> None:
    """Uncorrupted data, read in any key order and field subset, passes and equals what was put."""
    client = MeteredClient(MemoryStore(), verify_integrity=True)
    batch = _batch()
    receipt = client.put(KEYS, "p", batch)
    assert receipt.tags is None and set(receipt.fields) == set(batch.keys())
    order = [KEYS[i] for i in (3, 1, 0, 2)]
    fields = ["input_ids", "prompt", "reward", "logprobs"]
    got = read_columns_of(client.get(order, "p", fields))
    plain = MemoryStore()
    plain.put(KEYS, "p", batch)
    reference = read_columns_of(plain.get(order, "p", fields))
    assert set(got) == set(fields)
    for name in fields:
        assert columns_equal(got[name], reference[name]), name
    described = client.describe(KEYS, "p")
    assert set(described.fields) == set(batch.keys()) and all(dict(t) == {} for t in described.tags)


def test_metered_client_put_keeps_user_tags_and_hides_digest_tags() -> None:
    """User tags reach the store and come back unchanged; the digest tags never show in a receipt or describe."""
    client = MeteredClient(MemoryStore(), verify_integrity=True)
    user = [{"uid": i, "reward": 0.5 * i} for i in range(len(KEYS))]
    receipt = client.put(KEYS, "p", _batch(), tags=user, sequence_lengths=LENGTHS)
    assert [dict(t) for t in receipt.tags] == user and list(receipt.sequence_lengths) == LENGTHS
    assert [dict(t) for t in client.describe(KEYS, "p").tags] == user
    inner_tags = client.inner.describe(KEYS, "p").tags
    assert all(set(t) - set(u) == {DIGEST_PREFIX + f for f in _batch().keys()} for t, u in zip(inner_tags, user))
    client.get(KEYS, "p", ["input_ids", "prompt"])


def test_metered_client_rewrite_replaces_the_fields_digest() -> None:
    """Rewriting one field of some keys (in another put, with other companions) updates exactly its digests."""
    store = MemoryStore()
    writer = MeteredClient(store, verify_integrity=True)
    writer.put(KEYS, "p", _batch())
    g = torch.Generator().manual_seed(1)
    rewritten = KEYS[1:3]
    new_ids = to_jagged(torch.randint(100, 200, (2, 8), generator=g), [6, 2])
    writer.put(rewritten, "p", TensorDict({"input_ids": new_ids, "extra": torch.ones(2, 3)}, batch_size=[2]))
    reader = MeteredClient(store, verify_integrity=True)  # no state shared with the writer, as in another process
    got = reader.get(KEYS, "p", ["input_ids", "logprobs", "reward"])
    assert torch.equal(got["input_ids"][1], new_ids[0]) and torch.equal(got["input_ids"][2], new_ids[1])
    assert torch.equal(got["input_ids"][0], _batch()["input_ids"][0])
    reader.get(rewritten, "p", ["extra", "input_ids"])
    stale = MeteredClient(FaultyStore(store, "input_ids", lambda j: _jag([*_rows(_batch()["input_ids"])])), verify_integrity=True)
    with pytest.raises(IntegrityError, match="input_ids") as info:
        stale.get(KEYS, "p", ["input_ids"])  # the rows as first written no longer match for the rewritten keys
    assert set(info.value.keys) == set(rewritten)


@pytest.mark.parametrize("by_name", [False, True], ids=["per-key-tags", "tags-by-name"])
def test_metered_client_get_without_digests_raises_key_error(by_name: bool) -> None:
    """Reading with integrity a field written without it raises KeyError naming the field, not a false alarm,
    whether the store answers the tags per key or by name (``TagColumns``)."""
    store = MemoryStore()
    MeteredClient(store).put(KEYS, "p", _batch())
    rewrite = TensorDict({"reward": torch.tensor([0.5, 1.0])}, batch_size=[2])
    MeteredClient(store, verify_integrity=True).put(KEYS[:2], "p", rewrite)  # two keys get digests of 'reward'
    reader = FaultyByNameStore(store, "reward", lambda j: j) if by_name else store
    with pytest.raises(KeyError, match=r"field 'reward' has no integrity digest .* for 2 keys \['k2', 'k3'\]: it was written without verify_integrity=True"):
        MeteredClient(reader, verify_integrity=True).get(KEYS, "p", ["reward"])
    assert MeteredClient(reader, verify_integrity=True).get(KEYS[:2], "p", ["reward"])["reward"].tolist() == [0.5, 1.0]


def test_metered_client_rejects_reserved_tag_names_and_bad_tags() -> None:
    """Tags may not use the digest prefix and must be one mapping per key; nothing is written."""
    client = MeteredClient(MemoryStore(), verify_integrity=True)
    with pytest.raises(ValueError, match="tag names starting with '__digest__.' are reserved"):
        client.put(KEYS, "p", _batch(), tags=[{DIGEST_PREFIX + "reward": 1}] * len(KEYS))
    with pytest.raises(ValueError, match=r"'tags' must have 4 entries \(one per key\): got 1"):
        client.put(KEYS, "p", _batch(), tags=[{}])
    with pytest.raises(TypeError, match="'tags' entries must be mappings: got int at index 0"):
        client.put(KEYS, "p", _batch(), tags=[1, 2, 3, 4])  # type: ignore[list-item]
    assert client.list_keys("p") == ()


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "plain"])
def test_metered_client_rejects_forged_digests_on_every_adapter(store: DataPlaneClient, partition: str, verify: bool) -> None:
    """On every adapter a put whose tags carry a digest name raises and writes nothing; real digests still verify."""
    client = MeteredClient(store, verify_integrity=verify)
    forged = [{DIGEST_PREFIX + "reward": 0} for _ in KEYS]
    with pytest.raises(ValueError, match=r"tag names starting with '__digest__\.' are reserved .* at index 0"):
        client.put(KEYS, partition, _batch(), tags=forged)
    with pytest.raises(ValueError, match=r"tag names starting with '__digest__\.' are reserved"):
        store.put(KEYS, partition, _batch(), tags=forged)  # the adapter itself, unwrapped
    assert store.list_keys(partition) == ()
    client.put(KEYS, partition, _batch(), tags=[{"uid": i} for i in range(len(KEYS))])
    if verify:
        got = read_columns_of(client.get(KEYS, partition, ["input_ids", "prompt"]))
        assert columns_equal(got["input_ids"], _batch()["input_ids"])
    assert [dict(t) for t in client.describe(KEYS, partition).tags] == [{"uid": i} for i in range(len(KEYS))]
    client.clear(KEYS, partition)


def test_metered_client_verifying_needs_a_reserved_tag_put() -> None:
    """Verifying integrity over a client that cannot write the digest tags is refused up front."""

    class PlainStore(FaultyStore):
        put_with_reserved_tags = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"'inner' must be able to write the reserved digest tags .* got PlainStore"):
        MeteredClient(PlainStore(MemoryStore(), "x", lambda j: j), verify_integrity=True)  # type: ignore[arg-type]
    MeteredClient(PlainStore(MemoryStore(), "x", lambda j: j))  # metering alone needs no such put


def test_metered_client_counts_calls_keys_bytes_and_outstanding() -> None:
    """Counters follow puts, gets and clears; outstanding bytes return to zero after clearing every key."""
    events: list[DataPlaneEvent] = []
    client = MeteredClient(MemoryStore(), on_event=events.append)
    client.put(KEYS, "p", _batch())
    tokens = sum(LENGTHS)
    payload = tokens * (8 + 2 + 1) + 4 * 4  # int64 ids, bf16 logprobs, bool mask, float32 reward
    snap = client.snapshot()
    assert snap.ops["put"].calls == 1 and snap.ops["put"].keys == 4 and snap.ops["put"].bytes == payload
    assert snap.outstanding_bytes == {"p": payload} and snap.outstanding_keys == {"p": 4}
    client.get(KEYS[:2], "p", ["input_ids"])
    first = client.step_delta()
    assert first.ops["get"].calls == 1 and first.ops["get"].bytes == (LENGTHS[0] + LENGTHS[1]) * 8
    client.put(KEYS[:1], "p", TensorDict({"reward": torch.tensor([9.0])}, batch_size=[1]))
    assert client.snapshot().outstanding_bytes == {"p": payload}, "a rewrite replaces, it does not add"
    client.clear(KEYS[:1], "p")
    second = client.step_delta()
    assert second.ops["put"].calls == 1 and second.ops["get"].calls == 0 and second.ops["clear"].calls == 1
    assert second.ops["clear"].bytes == LENGTHS[0] * 11 + 4
    client.clear(KEYS[1:], "p")
    final = client.snapshot()
    assert final.outstanding_bytes == {"p": 0} and final.outstanding_keys == {"p": 0}
    assert final.ops["clear"].bytes == payload
    assert [e.op for e in events] == ["put", "get", "put", "clear", "clear"]
    assert all(e.wall_ms >= 0 for e in events)
    flat = final.flat()
    assert flat["put_calls"] == 2 and flat["outstanding_bytes"] == 0


def test_the_trainers_worker_clients_keep_no_outstanding_table() -> None:
    """A worker's rows are cleared by the driver, so the clients the trainer builds for workers keep no per-key
    table (it would grow a row and field per write for the whole run); they still count calls, keys and bytes."""
    from shell.grpo_trainer import MeteredFactory

    client = MeteredFactory(MemoryStore)()
    for step in range(3):
        client.put([f"s{step}_{key}" for key in KEYS], "p", _batch())
    delta = client.step_delta()
    assert delta.ops["put"].calls == 3 and delta.ops["put"].keys == 3 * len(KEYS)
    assert delta.ops["put"].bytes == 3 * (sum(LENGTHS) * (8 + 2 + 1) + 4 * 4)
    assert delta.outstanding_bytes == {} and delta.outstanding_keys == {}
    assert MeteredClient(MemoryStore()).track_outstanding, "a client built directly keeps the table"


def test_metered_client_rejects_reserved_field_names() -> None:
    """User fields may not start with the digest prefix, and nothing is written."""
    client = MeteredClient(MemoryStore(), verify_integrity=True)
    bad = TensorDict({DIGEST_PREFIX + "x": torch.zeros(1)}, batch_size=[1])
    with pytest.raises(ValueError, match="reserved for integrity digests"):
        client.put(["a"], "p", bad)
    assert client.list_keys("p") == ()


@pytest.mark.parametrize("verify", [False, True])
def test_metered_client_put_passes_require_stored_through(verify: bool) -> None:
    """A metered put with require_stored refuses unknown keys (writing nothing), with or without digests."""
    client = MeteredClient(MemoryStore(), verify_integrity=verify)
    client.put(["a"], "p", TensorDict({"x": torch.zeros(1)}, batch_size=[1]))
    with pytest.raises(KeyError, match=r"not stored in partition 'p': \['b'\]"):
        client.put(["a", "b"], "p", TensorDict({"y": torch.ones(2)}, batch_size=[2]), require_stored=True)
    assert client.list_keys("p") == ("a",)
    client.put(["a"], "p", TensorDict({"y": torch.ones(1)}, batch_size=[1]), require_stored=True)
    assert client.get(["a"], "p", ["y"])["y"].tolist() == [1.0]


def test_metered_client_passes_errors_through() -> None:
    """Errors of the inner client (unknown keys) reach the caller unchanged."""
    client = MeteredClient(MemoryStore(), verify_integrity=True)
    with pytest.raises(KeyError, match="not stored"):
        client.get(["nope"], "p", ["x"])


@ray.remote
class _Verifier:
    """A Ray actor (another process) with its own verifying MeteredClient over the session's TransferQueue."""

    def __init__(self) -> None:
        self._client = MeteredClient(TransferQueueStore.attach(), verify_integrity=True)

    def read(self, keys: list[str], partition: str, names: list[str]) -> dict[str, Any]:
        got = read_columns_of(self._client.get(keys, partition, names))
        return {name: got[name] for name in names}

    def double_logprobs(self, keys: list[str], partition: str) -> None:
        logprobs = self._client.get(keys, partition, ["logprobs"])["logprobs"]
        self._client.put(keys, partition, TensorDict({"logprobs": logprobs * 2}, batch_size=[len(keys)]))


@pytest.mark.e2e
def test_metered_client_verifies_across_processes_on_transfer_queue(tq_store_session: TransferQueueStore, partition: str) -> None:
    """An actor's own client verifies what the driver wrote to TransferQueue; the driver verifies the actor's rewrite."""
    driver = MeteredClient(TransferQueueStore.attach(), verify_integrity=True)
    batch = _batch()
    driver.put(KEYS, partition, batch, tags=[{"uid": i} for i in range(len(KEYS))])
    peer = _Verifier.remote()  # type: ignore[attr-defined]
    try:
        order = KEYS[::-1]
        names = ["input_ids", "prompt", "logprobs"]
        got = ray.get(peer.read.remote(order, partition, names))
        expected = read_columns_of(driver.get(order, partition, names))
        for name in names:
            assert columns_equal(got[name], expected[name]), name
        ray.get(peer.double_logprobs.remote(KEYS[2:], partition))  # rows of 3 and 7 tokens
        after = driver.get(KEYS, partition, ["logprobs", "input_ids"])["logprobs"]
        before = batch["logprobs"]
        for i in range(len(KEYS)):
            assert torch.equal(after[i], before[i] * 2 if i >= 2 else before[i])
        stale = MeteredClient(FaultyStore(driver.inner, "logprobs", lambda j: before), verify_integrity=True)
        with pytest.raises(IntegrityError, match="logprobs") as info:
            stale.get(KEYS, partition, ["logprobs"])
        assert set(info.value.keys) == {"k2", "k3"}
        assert [dict(t) for t in driver.describe(KEYS, partition).tags] == [{"uid": i} for i in range(len(KEYS))]
    finally:
        ray.kill(peer)
        driver.close()
