"""Laws of :class:`shell.row_cache.StepRowCache` (a policy rank's rows of the step).

* Partition: ``split`` puts every position in exactly one of hits and misses.
* Round trip: a fetched row gathers back as it was kept; a written row gathers back as the store round trip
  gives it (trimmed to its length, zero-padded to the pad length).
* Keys and pad: a row is found by key in any order, never under another pad length; the latest write wins.
* Bound: at most ``max_blocks`` blocks are kept.
* Model: after any sequence of fetched blocks (key lists, fields and pad lengths; a fetch of the same keys and pad
  adds fields to their block), ``split`` and ``gather`` agree with a table of the latest row kept per
  ``(key, field, pad)`` among the blocks still held.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from core.codec import to_jagged, to_padded
from shell.row_cache import StepRowCache


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 10), data=st.data())
def test_split_partitions_and_gather_returns_kept_rows(n: int, data: st.DataObject) -> None:
    pad = 6
    keys = [f"k{i}" for i in range(n)]
    cached = data.draw(st.lists(st.sampled_from(keys), unique=True))
    ids = torch.randint(0, 100, (len(cached), pad))
    cache = StepRowCache()
    cache.remember_fetched(cached, {"input_ids": ids}, pad)
    asked = data.draw(st.permutations(keys))
    hits, misses = cache.split(asked, ["input_ids"], pad)
    assert sorted(hits + misses) == list(range(n))
    assert all(asked[i] in cached for i in hits) and all(asked[i] not in cached for i in misses)
    if hits:
        got = cache.gather([asked[i] for i in hits], ["input_ids"], pad)["input_ids"]
        assert torch.equal(got, ids[[cached.index(asked[i]) for i in hits]])
    else:
        with pytest.raises(ValueError, match=r"'keys' must name at least one row"):
            cache.gather([], ["input_ids"], pad)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_written_rows_come_back_as_the_store_round_trip_gives_them(lengths: list[int]) -> None:
    pad = 5
    keys = [f"k{i}" for i in range(len(lengths))]
    out = torch.randn(len(lengths), pad)  # garbage past each row's length, as a forward leaves it
    cache = StepRowCache()
    cache.remember_written(keys, {"prev_logprobs": out}, lengths, pad)
    got = cache.gather(keys, ["prev_logprobs"], pad)["prev_logprobs"]
    assert torch.equal(got, to_padded(to_jagged(out, lengths), pad_to_length=pad))
    for i, length in enumerate(lengths):
        assert torch.equal(got[i, :length], out[i, :length]) and not got[i, length:].any()


def test_another_pad_length_is_a_miss_and_the_latest_write_wins() -> None:
    cache = StepRowCache()
    cache.remember_fetched(["a", "b"], {"x": torch.tensor([[1], [2]])}, 4)
    assert cache.split(["a"], ["x"], 8) == ([], [0])
    cache.remember_fetched(["b"], {"x": torch.tensor([[9]])}, 4)
    assert cache.gather(["a", "b"], ["x"], 4)["x"].tolist() == [[1], [9]]
    with pytest.raises(KeyError, match=r"row 'c' field 'x' is not cached at pad length 4"):
        cache.gather(["c"], ["x"], 4)


def test_the_same_rows_share_one_block_and_blocks_are_bounded() -> None:
    cache = StepRowCache(max_blocks=2)
    cache.remember_fetched(["a", "b"], {"x": torch.zeros(2, 1)}, 4)
    cache.remember_written(["a", "b"], {"y": torch.ones(2, 4)}, [4, 4], 4)
    assert len(cache) == 1 and cache.split(["b", "a"], ["x", "y"], 4) == ([0, 1], [])
    cache.remember_fetched(["c"], {"x": torch.zeros(1, 1)}, 4)
    cache.remember_fetched(["d"], {"x": torch.zeros(1, 1)}, 4)
    assert len(cache) == 2 and cache.split(["a", "c", "d"], ["x"], 4) == ([1, 2], [0])
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match=r"'max_blocks' must be >= 1: got 0"):
        StepRowCache(max_blocks=0)


_remember = st.tuples(
    st.lists(st.sampled_from([f"k{i}" for i in range(6)]), min_size=1, max_size=6, unique=True),
    st.lists(st.sampled_from(["x", "y"]), min_size=1, max_size=2, unique=True),
    st.sampled_from([3, 4]),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_remember, min_size=1, max_size=8), asked=st.permutations([f"k{i}" for i in range(6)]))
def test_split_and_gather_agree_with_a_table_of_the_latest_rows_of_the_blocks_held(
    ops: list[tuple[list[str], list[str], int]], asked: list[str]
) -> None:
    cache = StepRowCache(max_blocks=3)
    blocks: list[tuple[list[str], dict[str, torch.Tensor], int]] = []  # the model: blocks as the cache keeps them
    for n, (keys, fields, pad) in enumerate(ops):
        columns = {name: torch.full((len(keys), pad), float(n * 10 + j)) + torch.arange(len(keys))[:, None]
                   for j, name in enumerate(fields)}
        cache.remember_fetched(keys, columns, pad)
        same = next((b for b in blocks if b[2] == pad and b[0] == keys), None)
        if same is not None:
            same[1].update(columns)
        else:
            blocks.append((keys, dict(columns), pad))
            del blocks[:-3]
    for pad in (3, 4):
        for fields in (["x"], ["y"], ["x", "y"]):
            table = {}
            for keys, columns, block_pad in blocks:  # oldest first: a later block overwrites
                if block_pad == pad:
                    for name, column in columns.items():
                        table.update({(key, name): column[i] for i, key in enumerate(keys)})
            hits, misses = cache.split(asked, fields, pad)
            assert hits == [i for i, key in enumerate(asked) if all((key, f) in table for f in fields)]
            assert misses == [i for i in range(len(asked)) if i not in hits]
            if hits:
                got = cache.gather([asked[i] for i in hits], fields, pad)
                for name in fields:
                    assert torch.equal(got[name], torch.stack([table[(asked[i], name)] for i in hits]))
