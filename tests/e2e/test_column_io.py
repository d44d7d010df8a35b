"""Column I/O over every adapter: first write jagged, read padded to the global length, trimmed write-back."""

from __future__ import annotations

import attrs
import pytest
import torch

from adapters.store_port import DataPlaneClient
from core.codec import is_jagged, jagged_lengths
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN
from core.meta import KVBatchMeta
from shell.column_io import first_write, read_columns, write_columns

LENGTHS = [3, 0, 6, 2]
KEYS = ["u0_g0", "u0_g1", "u1_g0", "u1_g1"]


def _rollout() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "input_ids": torch.randint(1, 90, (4, 8), generator=g),
        "token_mask": torch.rand(4, 8, generator=g) > 0.3,
        "reward": torch.tensor([1.0, 0.0, 0.5, 0.25]),
    }


def test_first_write_puts_token_fields_jagged(store: DataPlaneClient, partition: str) -> None:
    """Token fields travel trimmed to each row's length; other fields stay dense; the receipt carries lengths and extra info."""
    data = _rollout()
    meta = first_write(store, data, keys=KEYS, partition_id=partition, lengths=LENGTHS,
                       token_fields=["input_ids", "token_mask"], extra_info={"step": 1})
    assert meta.sequence_lengths == tuple(LENGTHS) and meta.extra_info == {"step": 1}
    out = read_columns(store, meta, ["input_ids", "reward"], layout="jagged")
    assert is_jagged(out["input_ids"]) and jagged_lengths(out["input_ids"]) == tuple(LENGTHS)
    for i, row in enumerate(out["input_ids"].unbind()):
        assert torch.equal(row, data["input_ids"][i, : LENGTHS[i]])
    assert torch.equal(out["reward"], data["reward"])


def test_read_columns_pads_to_global_forward_length(store: DataPlaneClient, partition: str) -> None:
    """Padded reads use the meta's global pad length and the given pad values, in the meta's key order."""
    data = _rollout()
    meta = first_write(store, data, keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=["input_ids", "token_mask"])
    shard = meta.subset([2, 0]).with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: 10})
    out = read_columns(store, shard, ["input_ids", "token_mask"], pad_values={"input_ids": -1})
    assert out["input_ids"].shape == (2, 10) and out["token_mask"].shape == (2, 10)
    for row, i in enumerate([2, 0]):
        n = LENGTHS[i]
        assert torch.equal(out["input_ids"][row, :n], data["input_ids"][i, :n])
        assert (out["input_ids"][row, n:] == -1).all()
        assert not out["token_mask"][row, n:].any()


def test_write_columns_trims_per_token_results(store: DataPlaneClient, partition: str) -> None:
    """A (N, W) result wider than the rows is trimmed per row; the meta lists the new field."""
    data = _rollout()
    meta = first_write(store, data, keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=["input_ids"])
    logprobs = torch.randn(4, 12)  # wider than any row: the tail is forward padding
    advantages = torch.tensor([0.1, 0.2, 0.3, 0.4])
    meta2 = write_columns(store, meta, {"prev_logprobs": logprobs, "advantages": advantages})
    assert "prev_logprobs" in meta2.fields and "advantages" in meta2.fields
    out = read_columns(store, meta2, ["prev_logprobs", "advantages"], layout="jagged")
    assert jagged_lengths(out["prev_logprobs"]) == tuple(LENGTHS)
    for i, row in enumerate(out["prev_logprobs"].unbind()):
        assert torch.equal(row, logprobs[i, : LENGTHS[i]])
    assert torch.equal(out["advantages"], advantages)


def test_write_columns_rejects_bad_token_fields(store: DataPlaneClient, partition: str) -> None:
    """Naming an absent token field, or trimming without lengths, raises before anything is written."""
    meta = first_write(store, _rollout(), keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=["input_ids"])
    with pytest.raises(ValueError, match=r"'token_fields' must name fields being written: \['nope'\]"):
        write_columns(store, meta, {"x": torch.zeros(4, 8)}, token_fields=["nope"])
    no_lengths = attrs.evolve(meta, sequence_lengths=None)
    with pytest.raises(ValueError, match=r"'meta.sequence_lengths' is needed"):
        write_columns(store, no_lengths, {"x": torch.zeros(4, 8)}, token_fields=["x"])
    assert "x" not in store.describe(KEYS, partition).fields


def test_write_columns_to_unstored_keys_raises_and_writes_nothing(store: DataPlaneClient, partition: str) -> None:
    """Writing results under keys no first write stored (never put, or cleared) raises KeyError naming the
    partition and the keys, and writes nothing: no orphan key, no new field on the stored keys."""
    meta = first_write(store, _rollout(), keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=["input_ids"])
    ghosts = KVBatchMeta(partition, [KEYS[0], "ghost_a", "ghost_b"], sequence_lengths=[3, 1, 2])
    with pytest.raises(KeyError, match=rf"orphan keys: 2 keys are not stored in partition '{partition}': \['ghost_a', 'ghost_b'\]"):
        write_columns(store, ghosts, {"advantages": torch.ones(3)})
    store.clear(KEYS[2:], partition)
    with pytest.raises(KeyError, match=r"not stored in partition .*\['u1_g0', 'u1_g1'\]"):
        write_columns(store, meta, {"advantages": torch.ones(4), "prev_logprobs": torch.zeros(4, 8)})
    assert store.list_keys(partition) == tuple(KEYS[:2])
    assert "advantages" not in store.describe(KEYS[:2], partition).fields


def test_first_write_rejects_missing_token_field(store: DataPlaneClient, partition: str) -> None:
    """A token field that is not given raises and writes nothing."""
    with pytest.raises(ValueError, match=r"'token_fields' names 'nope', which is not in 'fields'"):
        first_write(store, _rollout(), keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=["nope"])
    assert store.list_keys(partition) == ()
    with pytest.raises(TypeError, match="'fields' must be a TensorDict or a mapping"):
        first_write(store, [1, 2], keys=KEYS, partition_id=partition, lengths=LENGTHS, token_fields=[])  # type: ignore[arg-type]
