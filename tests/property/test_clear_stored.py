"""Laws of :func:`shell.column_io.clear_stored` on a MemoryStore.

* partition: after clearing keys ``K`` from a partition storing ``S``, exactly ``S - K`` is stored, and the count
  returned is ``|K & S|`` (keys already gone are skipped, never an error);
* the usual case is one call: when every key of ``K`` is stored, the partition's keys are not listed.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from adapters.memory import MemoryStore
from shell.column_io import clear_stored, first_write

PARTITION = "p"
NAMES = [f"k{i}" for i in range(8)]


class _CountingStore(MemoryStore):
    """A MemoryStore that counts its ``list_keys`` calls."""

    listed = 0

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        self.listed += 1
        return super().list_keys(partition_id)


@settings(max_examples=60, deadline=None)
@given(stored=st.sets(st.sampled_from(NAMES), min_size=1), cleared=st.lists(st.sampled_from(NAMES), unique=True))
def test_clear_stored_clears_exactly_the_stored_keys_named_and_lists_only_when_some_are_gone(
    stored: set[str], cleared: list[str]
) -> None:
    store = _CountingStore()
    keys = sorted(stored)
    first_write(store, {"x": torch.zeros(len(keys), 2)}, keys=keys, partition_id=PARTITION, lengths=[2] * len(keys), token_fields=[])
    count = clear_stored(store, cleared, PARTITION)
    assert count == len(stored.intersection(cleared))
    assert set(store.list_keys(PARTITION)) == stored.difference(cleared)
    store.listed -= 1  # the check above
    assert store.listed == (0 if set(cleared) <= stored else 1)
