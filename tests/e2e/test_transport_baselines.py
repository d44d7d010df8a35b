"""The dataplane bench's key-table baseline (``adapters.transport_baselines.RefsByKey``) on the session's Ray.

Laws: a get by any of a put's keys returns that put's TensorDict bitwise,
whatever other puts wrote (other keys, other partitions); a get of a cleared
key raises ``KeyError`` naming it; a put's object stays readable through the
keys not cleared (the table holds it, not the caller).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from tensordict import TensorDict

from adapters.transport_baselines import RefsByKey
from core.codec import to_jagged

pytestmark = pytest.mark.e2e


@pytest.fixture
def refs(ray_cluster: None) -> Iterator[RefsByKey]:
    table = RefsByKey()
    yield table
    table.close()


def _batch(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4]
    return TensorDict(
        {
            "input_ids": to_jagged(torch.randint(0, 100, (3, 4), generator=g), lengths),
            "logprobs": to_jagged(torch.randn(3, 4, generator=g), lengths),
        },
        batch_size=[3],
    )


def _equal(a: TensorDict, b: TensorDict) -> bool:
    return all(
        torch.equal(a[name].values(), b[name].values()) and torch.equal(a[name].offsets(), b[name].offsets())
        for name in ("input_ids", "logprobs")
    ) and set(a.keys()) == set(b.keys())


def test_a_get_by_a_puts_keys_returns_that_put_and_a_cleared_key_raises(refs: RefsByKey) -> None:
    first, second = _batch(0), _batch(1)
    refs.put(["a", "b", "c"], "p", first)
    refs.put(["d", "e", "f"], "p", second)
    refs.put(["a", "b", "c"], "q", second)  # another partition, same keys
    assert _equal(refs.get(["a", "b", "c"], "p"), first)
    assert _equal(refs.get(["c"], "p"), first)
    assert _equal(refs.get(["d", "e", "f"], "p"), second)
    assert _equal(refs.get(["a"], "q"), second)
    refs.clear(["a", "b", "c"], "p")
    with pytest.raises(KeyError) as raised:
        refs.get(["a"], "p")
    assert "'a'" in str(raised.value)
    assert _equal(refs.get(["a"], "q"), second)


def test_a_partial_clear_keeps_the_puts_other_keys(refs: RefsByKey) -> None:
    batch = _batch(2)
    refs.put(["a", "b", "c"], "p", batch)
    refs.clear(["a", "b"], "p")
    gc.collect()  # nothing but the table's key "c" holds the object now
    assert _equal(refs.get(["c"], "p"), batch)
    with pytest.raises(KeyError):
        refs.get(["b", "c"], "p")
