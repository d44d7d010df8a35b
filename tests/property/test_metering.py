"""Laws of :class:`shell.metering.MeteredClient`'s outstanding accounting.

* Model: after any sequence of puts (new keys, rewrites of some fields, other partitions) and clears, with
  snapshots anywhere between, ``outstanding_bytes`` and ``outstanding_keys`` equal what a table of every
  ``(partition, field, key)`` put and not cleared gives, and the ``clear`` counter's bytes equal the bytes the
  clears freed.
* No table: with ``track_outstanding=False`` the same sequence gives the same call, key and put/get byte counters,
  empty outstanding maps, and 0 cleared bytes.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from tensordict import TensorDict

from adapters.memory import MemoryStore
from core.codec import to_jagged
from shell.metering import MeteredClient

KEYS = [f"k{i}" for i in range(6)]
PARTITIONS = ("p", "q")
WIDTH = 5


def _column(field: str, lengths: list[int]) -> torch.Tensor:
    n = len(lengths)
    if field == "ids":  # jagged int64: 8 bytes a token
        return to_jagged(torch.arange(n * WIDTH).reshape(n, WIDTH), lengths)
    if field == "mask":  # jagged bool: 1 byte a token
        return to_jagged(torch.ones(n, WIDTH, dtype=torch.bool), lengths)
    return torch.zeros(n, 2)  # "score": dense float32, 8 bytes a row


def _row_bytes(field: str, length: int) -> int:
    return {"ids": 8 * length, "mask": length, "score": 8}[field]


_put = st.tuples(
    st.just("put"),
    st.sampled_from(PARTITIONS),
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    st.lists(st.sampled_from(["ids", "mask", "score"]), min_size=1, max_size=3, unique=True),
    st.lists(st.integers(0, WIDTH), min_size=4, max_size=4),
)
_clear = st.tuples(st.just("clear"), st.sampled_from(PARTITIONS), st.lists(st.sampled_from(KEYS), min_size=1, unique=True))
_snapshot = st.tuples(st.just("snapshot"))


def _run(client: MeteredClient, ops: list[tuple]) -> tuple[dict[tuple[str, str, str], int], int]:
    """Apply ``ops`` to ``client`` (clears only of stored keys) and to a model table; the table and bytes freed."""
    table: dict[tuple[str, str, str], int] = {}
    freed = 0
    for op in ops:
        if op[0] == "put":
            _, partition, keys, fields, lengths = op
            lengths = lengths[: len(keys)]
            client.put(keys, partition, TensorDict({f: _column(f, lengths) for f in fields}, batch_size=[len(keys)]))
            table.update({(partition, f, key): _row_bytes(f, n) for f in fields for key, n in zip(keys, lengths)})
        elif op[0] == "clear":
            _, partition, keys = op
            stored = [key for key in keys if key in client.list_keys(partition)]
            if stored:
                client.clear(stored, partition)
                for entry in [e for e in table if e[0] == partition and e[2] in stored]:
                    freed += table.pop(entry)
        else:
            client.snapshot()
    return table, freed


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(_put, _clear, _snapshot), max_size=14))
def test_outstanding_bytes_and_keys_follow_a_model_of_every_row_put_and_not_cleared(ops: list[tuple]) -> None:
    client = MeteredClient(MemoryStore())
    table, freed = _run(client, ops)
    snap = client.snapshot()
    for partition in PARTITIONS:
        rows = {entry: size for entry, size in table.items() if entry[0] == partition}
        assert snap.outstanding_bytes.get(partition, 0) == sum(rows.values())
        assert snap.outstanding_keys.get(partition, 0) == len({key for _, _, key in rows})
    assert snap.ops["clear"].bytes == freed


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.one_of(_put, _clear, _snapshot), max_size=14))
def test_a_client_that_tracks_nothing_outstanding_counts_the_same_calls_and_keeps_no_rows(ops: list[tuple]) -> None:
    tracked, untracked = MeteredClient(MemoryStore()), MeteredClient(MemoryStore(), track_outstanding=False)
    _run(tracked, ops)
    _run(untracked, ops)
    full, bare = tracked.snapshot(), untracked.snapshot()
    assert bare.outstanding_bytes == {} and bare.outstanding_keys == {}
    for op in ("put", "get", "clear"):
        assert (bare.ops[op].calls, bare.ops[op].keys) == (full.ops[op].calls, full.ops[op].keys)
    assert bare.ops["put"].bytes == full.ops["put"].bytes
    assert bare.ops["clear"].bytes == 0
