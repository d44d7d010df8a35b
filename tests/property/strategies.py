"""Every hypothesis strategy the property tests use (one file, by design).

Sections: metadata, sequence lengths, tensors, topology, GRPO. Add new
strategies to the matching section; tests import from here only.
"""

from __future__ import annotations

from hypothesis import strategies as st

from core.meta import KVBatchMeta

# ---------------------------------------------------------------- metadata

keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_@", min_size=1, max_size=8)
field_names = st.lists(st.sampled_from(["input_ids", "token_mask", "logprobs", "advantages", "rewards"]), unique=True, max_size=5)
tag_values = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=3))


@st.composite
def metas(draw: st.DrawFn, *, min_size: int = 0, max_size: int = 24, with_lengths: bool | None = None, with_tags: bool | None = None, partition_id: str = "train") -> KVBatchMeta:
    """A valid ``KVBatchMeta`` with unique keys and optional lengths, tags and extra_info."""
    ks = draw(st.lists(keys, min_size=min_size, max_size=max_size, unique=True))
    n = len(ks)
    lengths_on = draw(st.booleans()) if with_lengths is None else with_lengths
    tags_on = draw(st.booleans()) if with_tags is None else with_tags
    lengths = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n)) if lengths_on else None
    tags = (
        draw(st.lists(st.dictionaries(st.sampled_from(["reward", "uid", "adv"]), tag_values, max_size=3), min_size=n, max_size=n))
        if tags_on
        else None
    )
    extra = draw(st.dictionaries(st.sampled_from(["step", "note"]), st.integers(0, 9), max_size=2))
    return KVBatchMeta(partition_id, ks, fields=draw(field_names), sequence_lengths=lengths, tags=tags, extra_info=extra)


@st.composite
def meta_and_permutation(draw: st.DrawFn) -> tuple[KVBatchMeta, list[int]]:
    """A meta and a permutation of its row positions."""
    meta = draw(metas())
    perm = draw(st.permutations(list(range(len(meta)))))
    return meta, perm


permutations_of_range = st.integers(0, 64).flatmap(lambda n: st.permutations(list(range(n))))

# ---------------------------------------------------------------- sequence lengths
# (packing and sharding strategies go here)

# ---------------------------------------------------------------- tensors
# (codec strategies go here)

# ---------------------------------------------------------------- topology and GRPO
# (topology and GRPO strategies go here)
