"""Every hypothesis strategy the property tests use (one file, by design).

Sections: metadata, sequence lengths, tensors, topology, GRPO, stores. Add new
strategies to the matching section; tests import from here only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from core.dtypes import BIT_VIEWS, CODEC_DTYPES
from core.meta import KVBatchMeta
from core.packing import PACKING_ALGORITHMS
from core.routing import routing_dtype
from core.step_plan import StepLayout
from core.micro_batch import DynamicBatchingSpec, PackingSpec
from core.topology import AXES, NamedSharding

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


@st.composite
def concat_operands(draw: st.DrawFn, *, count: int = 3) -> list[KVBatchMeta]:
    """``count`` metas that concat accepts in any grouping: one partition and task name, disjoint keys,
    agreeing extra_info; some are the empty meta ``KVBatchMeta()``, some have zero rows."""
    task = draw(st.sampled_from([None, "addition"]))
    shared_info = draw(st.dictionaries(st.sampled_from(["step", "note", "pad"]), st.integers(0, 9), max_size=3))
    out = []
    for i in range(count):
        if draw(st.integers(0, 3)) == 0:
            out.append(KVBatchMeta())
            continue
        meta = draw(metas(max_size=6))
        info = {name: value for name, value in shared_info.items() if draw(st.booleans())}
        out.append(attrs.evolve(meta, keys=[f"{i}-{k}" for k in meta.keys], extra_info=info, task_name=task))
    return out


permutations_of_range = st.integers(0, 64).flatmap(lambda n: st.permutations(list(range(n))))

# ---------------------------------------------------------------- sequence lengths
# (packing and sharding strategies go here)

# packing (core/packing.py)

packing_algorithms = st.sampled_from(PACKING_ALGORITHMS)
packing_capacities = st.integers(min_value=1, max_value=64)


@st.composite
def sequence_lengths(draw: st.DrawFn, *, capacity: int, min_size: int = 0, max_size: int = 40) -> list[int]:
    """Lengths in ``[0, capacity]``: uniform, short-heavy, bimodal, or mixing over-half with sixth-to-third lengths.

    Zeros and ``capacity`` itself are allowed.
    """
    length = draw(
        st.sampled_from(
            [
                st.integers(0, capacity),
                st.integers(0, max(capacity // 4, 1)),
                st.one_of(st.integers(0, capacity // 5), st.integers(capacity // 3, capacity)),
                st.one_of(st.integers(capacity // 2 + 1, capacity), st.integers(capacity // 7, capacity // 3)),
            ]
        )
    )
    return draw(st.lists(length, min_size=min_size, max_size=max_size))


@st.composite
def capacity_and_lengths(draw: st.DrawFn, *, min_size: int = 0) -> tuple[int, list[int]]:
    """A capacity and lengths that each fit in it."""
    capacity = draw(packing_capacities)
    return capacity, draw(sequence_lengths(capacity=capacity, min_size=min_size))


@st.composite
def packing_cases(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """``(lengths, capacity, bin_count_multiple, min_bin_count)`` that always admit a packing.

    ``len(lengths)`` is a positive multiple of ``bin_count_multiple`` and
    ``min_bin_count <= len(lengths)``, so the required bin count never exceeds
    the number of sequences.
    """
    capacity = draw(packing_capacities)
    multiple = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 10))
    n = multiple * groups
    lengths = draw(sequence_lengths(capacity=capacity, min_size=n, max_size=n))
    min_bin_count = draw(st.integers(0, n))
    return lengths, capacity, multiple, min_bin_count


@st.composite
def packing_requests(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """``(lengths, capacity, bin_count_multiple, min_bin_count)``, feasible or not (few sequences, many bins)."""
    capacity = draw(packing_capacities)
    lengths = draw(sequence_lengths(capacity=capacity, max_size=12))
    return lengths, capacity, draw(st.integers(1, 8)), draw(st.integers(0, 10))


@st.composite
def distinct_lengths_and_permutation(draw: st.DrawFn) -> tuple[list[int], int, list[int]]:
    """Pairwise-distinct lengths, a capacity that holds each, and a permutation of their positions."""
    capacity = draw(st.integers(8, 200))
    lengths = draw(st.lists(st.integers(0, capacity), min_size=1, max_size=30, unique=True))
    return lengths, capacity, draw(st.permutations(list(range(len(lengths)))))


# partitioning and sharding (core/partition.py, core/sharding.py)


def lognormal_lengths(n: int, seed: int) -> list[int]:
    """``n`` reproducible lognormal sequence lengths (median 700, clipped to [16, 8192]), like real rollouts."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(700), 1.0, n)), 16, 8192).astype(int).tolist()


partition_weight_values = st.sampled_from([st.integers(0, 1000), st.integers(0, 9), st.floats(0, 1e4, allow_nan=False)]).flatmap(lambda s: s)


@st.composite
def equal_partition_cases(draw: st.DrawFn, *, integral: bool = False) -> tuple[list[int | float], int]:
    """``(weights, parts)`` with ``len(weights)`` a multiple of ``parts`` (possibly zero)."""
    parts = draw(st.integers(1, 8))
    n = parts * draw(st.integers(0, 8))
    element = st.integers(0, 1000) if integral else partition_weight_values
    return draw(st.lists(element, min_size=n, max_size=n)), parts


@st.composite
def free_partition_cases(draw: st.DrawFn, *, integral: bool = False) -> tuple[list[int | float], int]:
    """``(weights, parts)`` of any sizes, including fewer weights than parts."""
    element = st.integers(0, 1000) if integral else partition_weight_values
    return draw(st.lists(element, max_size=40)), draw(st.integers(1, 8))


@st.composite
def sharding_cases(draw: st.DrawFn, *, with_lengths: bool | None = True) -> tuple[KVBatchMeta, int, int | None]:
    """``(meta, dp_world, batch_size)`` valid for plain (no packing) sharding.

    Every global batch is a multiple of ``dp_world`` rows; ``batch_size`` is
    None (one global batch) or divides ``len(meta)``.
    """
    dp = draw(st.integers(1, 4))
    per_rank = draw(st.integers(1, 3))
    batches = draw(st.integers(1, 3))
    batch_size = dp * per_rank
    n = batch_size * batches
    meta = draw(metas(min_size=n, max_size=n, with_lengths=with_lengths))
    return meta, dp, draw(st.sampled_from([batch_size, None]))


@st.composite
def micro_batching_cases(draw: st.DrawFn) -> tuple[KVBatchMeta, int, int | None, PackingSpec | DynamicBatchingSpec]:
    """``(meta, dp_world, batch_size, spec)`` with a ``PackingSpec`` or ``DynamicBatchingSpec`` that admits a plan.

    Global batches are multiples of ``dp_world`` rows and the capacity is a
    multiple of the pad/round step, so every padded length fits and a uniform
    micro-batch count always exists.
    """
    dp = draw(st.integers(1, 4))
    batch_size = dp * draw(st.integers(1, 6))
    batches = draw(st.integers(1, 2))
    n = batch_size * batches
    step = draw(st.sampled_from([1, 1, 2, 8]))
    capacity = step * draw(st.integers(1, 16))
    lengths = draw(sequence_lengths(capacity=capacity, min_size=n, max_size=n))
    ks = draw(st.lists(keys, min_size=n, max_size=n, unique=True))
    tags = draw(st.none() | st.lists(st.fixed_dictionaries({"uid": st.integers(0, 3)}), min_size=n, max_size=n))
    meta = KVBatchMeta("train", ks, fields=["input_ids"], sequence_lengths=lengths, tags=tags, extra_info={"step": 1})
    if draw(st.booleans()):
        spec: PackingSpec | DynamicBatchingSpec = PackingSpec(capacity, algorithm=draw(packing_algorithms), sequence_length_pad_multiple=step)
    else:
        spec = DynamicBatchingSpec(capacity, sequence_length_round=step)
    return meta, dp, draw(st.sampled_from([batch_size, None] if batches == 1 else [batch_size])), spec


# step plans (core/step_plan.py)


@st.composite
def step_cases(draw: st.DrawFn) -> tuple[KVBatchMeta, StepLayout]:
    """``(meta, layout)`` that ``shard_step`` accepts, train or not: plain, packing or dynamic batching,
    with or without a train global batch size, pad multiple and TP size."""
    plain = sharding_cases(with_lengths=True).map(lambda c: (*c, None))
    meta, dp, batch_size, spec = draw(st.one_of(plain, micro_batching_cases()))
    layout = StepLayout(
        dp_size=dp,
        train_global_batch_size=batch_size,
        packing=spec if isinstance(spec, PackingSpec) else None,
        dynamic_batching=spec if isinstance(spec, DynamicBatchingSpec) else None,
        pad_multiple=draw(st.none() | st.integers(1, 16)),
        tensor_parallel=draw(st.sampled_from([1, 2, 4])),
    )
    return meta, layout


@st.composite
def train_results(draw: st.DrawFn) -> list[dict[str, Any]]:
    """One worker train result per DP rank (1..4 ranks), every rank with the same number of optimizer steps."""
    steps = draw(st.integers(0, 4))
    finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    grad_norm = draw(st.lists(st.floats(0, 1e3, width=32), min_size=steps, max_size=steps))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        micro_batches = draw(st.lists(st.integers(1, 3), min_size=steps, max_size=steps))
        out.append(
            {
                "loss": draw(st.lists(finite, min_size=steps, max_size=steps)),
                "grad_norm": grad_norm,
                "metrics": [[{"loss": draw(finite)} for _ in range(count)] for count in micro_batches],
                "micro_batches": micro_batches,
                "forward_seq_length": draw(st.integers(0, 512)),
            }
        )
    return out


# ---------------------------------------------------------------- tensors
# (codec strategies go here)

codec_dtypes = st.sampled_from(CODEC_DTYPES)
trailing_dims = st.lists(st.integers(1, 3), max_size=2).map(tuple)


def codec_row_lengths(*, max_rows: int = 6, max_len: int = 10) -> st.SearchStrategy[list[int]]:
    """Ragged row lengths, often empty rows, sometimes no rows or all rows empty."""
    return st.lists(st.one_of(st.just(0), st.integers(0, max_len)), max_size=max_rows)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A reproducible tensor of ``shape`` spanning the range of ``dtype`` (finite floats, within the dtype's range)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return random_tensor(shape, BIT_VIEWS[dtype], seed).view(dtype)  # the full unsigned range, as bits
    if dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.complex128) * 100).to(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).clamp(info.min, info.max).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A reproducible tensor of ``shape`` with uniformly random bit patterns (bool: 0/1).

    Floats hold every kind of value their bits can spell: NaNs with payloads,
    infinities, -0.0, subnormals; so only a bitwise comparison can match them.
    """
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def tensors_of(shape: tuple[int, ...], dtype: torch.dtype, *, bits: bool = False) -> st.SearchStrategy[torch.Tensor]:
    """Random tensors of a fixed shape and dtype: finite values, or with ``bits`` any bit pattern (``random_bits``)."""
    make = random_bits if bits else random_tensor
    return st.integers(0, 2**32 - 1).map(lambda seed: make(shape, dtype, seed))


def pad_values_for(dtype: torch.dtype) -> st.SearchStrategy[bool | int | float]:
    """Pad values valid for ``dtype`` (exactly representable for bool and integer dtypes)."""
    if dtype == torch.bool:
        return st.booleans()
    if dtype.is_floating_point or dtype.is_complex:
        info = torch.finfo(dtype)
        bound = min(info.max, torch.finfo(torch.float16).max)
        return st.one_of(st.just(0), st.integers(-5, 5), st.floats(-bound, bound, width=16))
    info = torch.iinfo(dtype)
    return st.integers(info.min, info.max)


@st.composite
def padded_batches(
    draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 10, bits: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """A dense ``(N, S, *rest)`` batch (random dtype; any bit pattern with ``bits``) and row lengths with ``max <= S``."""
    lengths = draw(codec_row_lengths(max_rows=max_rows, max_len=max_len))
    width = max(lengths, default=0) + draw(st.integers(0, 3))
    shape = (len(lengths), width, *draw(trailing_dims))
    return draw(tensors_of(shape, draw(codec_dtypes), bits=bits)), lengths


@st.composite
def jagged_batches(draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 10, bits: bool = False) -> torch.Tensor:
    """A ``torch.jagged`` nested tensor built straight from values and offsets, sometimes with holes
    (random dtype; any bit pattern with ``bits``)."""
    lengths = draw(codec_row_lengths(max_rows=max_rows, max_len=max_len))
    gaps = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths))))
    rest = draw(trailing_dims)
    dtype = draw(codec_dtypes)
    if gaps is None:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        total = sum(lengths)
    else:
        starts = [sum(lengths[:i]) + sum(gaps[: i + 1]) for i in range(len(lengths))]
        total = sum(lengths) + sum(gaps)
    values = draw(tensors_of((total, *rest), dtype, bits=bits))
    offsets = torch.tensor([*starts, total], dtype=torch.int64)
    if gaps is None:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor(lengths, dtype=torch.int64))


@st.composite
def bit_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A dense tensor (0-d to 3-d) or a ``torch.jagged`` batch (holes sometimes) of any codec dtype and bit pattern."""
    if draw(st.booleans()):
        return draw(jagged_batches(bits=True))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    return draw(tensors_of(shape, draw(codec_dtypes), bits=True))


@st.composite
def field_batches(
    draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 10
) -> tuple[dict[str, torch.Tensor], list[int], list[str], dict[str, bool | int | float]]:
    """Fields of one batch: ``(fields, lengths, token_fields, pad_values)``.

    Token fields are ``(N, S_f, *rest)`` with ``S_f >= max(lengths)`` (each its own
    width and dtype); the other fields are ``(N,)`` or ``(N, D)``. Pad values are
    given for some token fields only.
    """
    lengths = draw(codec_row_lengths(max_rows=max_rows, max_len=max_len))
    n, longest = len(lengths), max(lengths, default=0)
    fields: dict[str, torch.Tensor] = {}
    pad_values: dict[str, bool | int | float] = {}
    token_fields = [f"tok{i}" for i in range(draw(st.integers(1, 3)))]
    for name in token_fields:
        dtype = draw(codec_dtypes)
        shape = (n, longest + draw(st.integers(0, 3)), *draw(trailing_dims))
        fields[name] = draw(tensors_of(shape, dtype))
        if draw(st.booleans()):
            pad_values[name] = draw(pad_values_for(dtype))
    for i in range(draw(st.integers(0, 2))):
        shape = (n, *draw(st.lists(st.integers(1, 4), max_size=1)))
        fields[f"dense{i}"] = draw(tensors_of(shape, draw(codec_dtypes)))
    return fields, lengths, token_fields, pad_values

# ---------------------------------------------------------------- topology and GRPO
# (topology and GRPO strategies go here)

sharding_sizes = st.dictionaries(st.sampled_from(AXES), st.integers(1, 3))
"""Axis sizes for ``NamedSharding``: any subset of ``AXES`` (the rest default to 1), each in 1..3."""
named_shardings = sharding_sizes.map(NamedSharding)
node_id_lists = st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=6), max_size=6)
"""Cluster node ids (hex text, duplicates and the empty cluster included)."""
actor_counts = st.integers(0, 20)


@st.composite
def socket_pairs(draw: st.DrawFn, *, max_pairs: int = 6) -> tuple[list[Any], list[Any], dict[int, str]]:
    """Two snapshots of TCP connections between pids owned by a few nodes: ``(before, after, owners)``.

    Every connection appears from both ends (each end held by one pid); ``after``'s counters are
    ``before``'s plus a drawn increase, and some connections are new in ``after``. Some pids have no owner.
    """
    from shell.bench.traffic import SocketStat

    owners = draw(st.dictionaries(st.integers(1, 8), st.sampled_from(["head", "worker 1", "worker 2"]), max_size=8))
    before: list[Any] = []
    after: list[Any] = []
    for i in range(draw(st.integers(0, max_pairs))):
        a, b = f"h:{1000 + 2 * i}", f"h:{1001 + 2 * i}"
        pa, pb = draw(st.integers(1, 10)), draw(st.integers(1, 10))
        old_ab, old_ba = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        more_ab, more_ba = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        if draw(st.booleans()):
            before += [SocketStat(a, b, (pa,), old_ab, old_ba), SocketStat(b, a, (pb,), old_ba, old_ab)]
        else:
            old_ab = old_ba = 0
        after += [SocketStat(a, b, (pa,), old_ab + more_ab, old_ba + more_ba),
                  SocketStat(b, a, (pb,), old_ba + more_ba, old_ab + more_ab)]
    return before, after, owners


positive_times = st.lists(st.floats(0.01, 100.0, allow_nan=False), min_size=1, max_size=9)

reward_values = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(-10, 10, allow_nan=False, width=32))
"""Rewards: often the 0 / 0.5 / 1 of verifiable tasks (so ties are common), else any moderate float."""


@st.composite
def grouped_rewards(draw: st.DrawFn, *, max_groups: int = 6, max_group_size: int = 6) -> tuple[torch.Tensor, list[int]]:
    """[N] float64 rewards and their group ids: sparse (possibly negative) ids, rows interleaved, some groups constant."""
    ids = draw(st.lists(st.integers(-50, 50), min_size=1, max_size=max_groups, unique=True))
    rows: list[tuple[int, float]] = []
    for gid in ids:
        size = draw(st.integers(1, max_group_size))
        if draw(st.booleans()):
            rows += [(gid, draw(reward_values))] * size
        else:
            rows += [(gid, draw(reward_values)) for _ in range(size)]
    order = draw(st.permutations(list(range(len(rows)))))
    return torch.tensor([rows[i][1] for i in order], dtype=torch.float64), [rows[i][0] for i in order]


def _float_grid(draw: st.DrawFn, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    n = 1
    for dim in shape:
        n *= dim
    values = draw(st.lists(st.floats(low, high, allow_nan=False, allow_subnormal=False), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


@st.composite
def policy_loss_inputs(draw: st.DrawFn, *, max_batch: int = 4, max_len: int = 6) -> dict[str, torch.Tensor]:
    """Float64 ``logprobs``/``prev_logprobs`` [B, S] with ratios spanning both clip bounds, advantages [B] or [B, S], and a bool or weighted mask."""
    b, s = draw(st.integers(1, max_batch)), draw(st.integers(1, max_len))
    logprobs = _float_grid(draw, (b, s), -4.0, 0.0)
    prev = logprobs + _float_grid(draw, (b, s), -0.7, 0.7)
    advantages = _float_grid(draw, draw(st.sampled_from([(b,), (b, s)])), -3.0, 3.0)
    if draw(st.booleans()):
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * s, max_size=b * s))).reshape(b, s)
    else:
        weights = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=b * s, max_size=b * s))
        mask = torch.tensor(weights, dtype=torch.float64).reshape(b, s)
    return {"logprobs": logprobs, "prev_logprobs": prev, "advantages": advantages, "mask": mask}


clip_ranges = st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 0.5))
"""``(clip_low, clip_high)`` pairs, asymmetric as in DAPO."""


@st.composite
def weighted_policy_loss_inputs(draw: st.DrawFn, *, max_batch: int = 4, max_len: int = 6) -> dict[str, torch.Tensor]:
    """``policy_loss_inputs`` plus float64 ``importance_weights`` [B, S] in [0, 3] (exact 0 and 1 common)."""
    case = draw(policy_loss_inputs(max_batch=max_batch, max_len=max_len))
    b, s = case["logprobs"].shape
    values = draw(st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 3.0)), min_size=b * s, max_size=b * s))
    return {**case, "importance_weights": torch.tensor(values, dtype=torch.float64).reshape(b, s)}


# off-policy (core/off_policy.py)

importance_caps = st.one_of(st.just(1.0), st.floats(1.0, 4.0))
"""``is_cap`` values: exactly 1 (every weight above 1 truncated) up to 4."""


@st.composite
def decoupled_loss_inputs(draw: st.DrawFn, *, max_batch: int = 4, max_len: int = 6) -> dict[str, torch.Tensor]:
    """Float64 ``logprobs``, ``proximal_logprobs``, ``behaviour_logprobs`` [B, S], ``advantages`` and ``mask``.

    Proximal is as ``prev_logprobs`` of ``policy_loss_inputs``; behaviour is
    proximal shifted by [-2, 2] per token (weights from e^-2 to e^2, on both
    sides of every cap in ``importance_caps``), exactly proximal on some rows.
    """
    case = draw(policy_loss_inputs(max_batch=max_batch, max_len=max_len))
    prox = case.pop("prev_logprobs")
    b, s = prox.shape
    shift = _float_grid(draw, (b, s), -2.0, 2.0)
    on_policy = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    behaviour = torch.where(on_policy[:, None], prox, prox + shift)
    return {"proximal_logprobs": prox, "behaviour_logprobs": behaviour, **case}


@st.composite
def version_lags(draw: st.DrawFn, rows: int) -> torch.Tensor:
    """[rows] version lags in 0..3, as an int64 or a float64 tensor (all 0 and all positive both common)."""
    lag = st.sampled_from([st.just(0), st.integers(1, 3), st.integers(0, 3)]).flatmap(
        lambda entry: st.lists(entry, min_size=rows, max_size=rows)
    )
    return torch.tensor(draw(lag), dtype=draw(st.sampled_from([torch.int64, torch.float64])))


# router replay (core/routing.py)

expert_counts = st.one_of(st.integers(1, 300), st.integers(32_700, 32_800), st.integers(1, 2**31))
"""``num_experts`` values, dense around the int8 and int16 boundaries (128, 32768) and up to int32's (2**31)."""


@st.composite
def routing_cases(
    draw: st.DrawFn, *, max_rows: int = 4, max_len: int = 6, max_layers: int = 3, max_experts: int = 10
) -> dict[str, Any]:
    """A valid padded routing: ``routed`` [B, S, layers, topk] in ``routing_dtype(num_experts)``, ``lengths``,
    ``num_layers``, ``topk`` and ``num_experts``.

    Each real token's slots hold ``topk`` distinct experts in ``[0, num_experts)``, in random order; padding
    holds -1, 0 or junk (out-of-range ids, repeats), which a valid routing may have there.
    """
    experts = draw(st.integers(1, max_experts))
    topk, layers = draw(st.integers(1, experts)), draw(st.integers(1, max_layers))
    lengths = draw(codec_row_lengths(max_rows=max_rows, max_len=max_len))
    width = max(lengths, default=0) + draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    shape = (len(lengths), width, layers)
    routed = torch.rand((*shape, experts), generator=gen).argsort(dim=-1)[..., :topk]
    padding = draw(st.sampled_from(["no_route", "zero", "junk"]))
    fill = {
        "no_route": torch.full((*shape, topk), -1),
        "zero": torch.zeros((*shape, topk), dtype=torch.int64),
        "junk": torch.randint(-1, experts + 3, (*shape, topk), generator=gen),
    }[padding]
    real = torch.arange(width) < torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1)
    routed = torch.where(real[:, :, None, None], routed, fill).to(routing_dtype(experts))
    return {"routed": routed, "lengths": lengths, "num_layers": layers, "topk": topk, "num_experts": experts}


@st.composite
def mismatch_inputs(draw: st.DrawFn, *, max_batch: int = 4, max_len: int = 6) -> dict[str, torch.Tensor]:
    """Float64 ``train_logprobs`` and ``rollout_logprobs`` [B, S] (rollout = train shifted by [-1, 1], exactly train on
    some rows) and a bool or weighted ``mask``."""
    case = draw(policy_loss_inputs(max_batch=max_batch, max_len=max_len))
    train = case["logprobs"]
    b, s = train.shape
    same = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    rollout = torch.where(same[:, None], train, train + _float_grid(draw, (b, s), -1.0, 1.0))
    return {"train_logprobs": train, "rollout_logprobs": rollout, "mask": case["mask"]}


# ---------------------------------------------------------------- stores
# (column and batch strategies for adapters.rows and the store contract)

store_object_values = st.one_of(
    st.none(),
    st.integers(-5, 5),
    st.text(max_size=4),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), max_size=2),
)
"""Per-row Python objects: None, ints, short strings, small lists and dicts."""


def _store_tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = draw(tensors_of(shape, dtype))
    if dtype.is_floating_point and t.numel() and draw(st.booleans()):
        t.view(-1)[0] = float("nan")  # NaN and -0.0 must survive a store bit for bit
        t.view(-1)[-1] = -0.0
    return t


@st.composite
def dense_columns(draw: st.DrawFn, n: int) -> torch.Tensor:
    """A dense ``(n, *rest)`` column with ``rest`` in ``()``, ``(1,)``, ``(S,)``, ``(S, D)``; any codec dtype, NaNs sometimes."""
    rest = draw(st.one_of(st.just(()), st.just((1,)), st.lists(st.integers(0, 3), min_size=1, max_size=2).map(tuple)))
    return _store_tensor(draw, (n, *rest), draw(codec_dtypes))


@st.composite
def jagged_columns(draw: st.DrawFn, n: int, *, max_len: int = 6) -> torch.Tensor:
    """A ``torch.jagged`` column of ``n`` rows (empty rows common), ``(len_i,)`` or ``(len_i, D)`` rows, sometimes with holes."""
    lengths = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_len)), min_size=n, max_size=n))
    gaps = draw(st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    rest = draw(st.one_of(st.just(()), st.tuples(st.integers(1, 3))))
    starts = [sum(lengths[:i]) + (0 if gaps is None else sum(gaps[: i + 1])) for i in range(n)]
    total = sum(lengths) + (0 if gaps is None else sum(gaps))
    values = _store_tensor(draw, (total, *rest), draw(codec_dtypes))
    offsets = torch.tensor([*starts, total], dtype=torch.int64)
    if gaps is None:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor(lengths, dtype=torch.int64))


@st.composite
def object_array_columns(draw: st.DrawFn, n: int) -> np.ndarray:
    """A numpy ``dtype=object`` column: ``(n,)`` of arbitrary objects, or ``(n, W)`` of scalars."""
    if draw(st.booleans()):
        return np.fromiter(draw(st.lists(store_object_values, min_size=n, max_size=n)), dtype=object, count=n)
    width = draw(st.integers(1, 3))
    cells = draw(st.lists(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3)), min_size=n * width, max_size=n * width))
    return np.fromiter(cells, dtype=object, count=n * width).reshape(n, width)


@st.composite
def non_tensor_stack_columns(draw: st.DrawFn, n: int) -> NonTensorStack:
    """A ``NonTensorStack`` of batch ``(n,)`` (one object per row) or ``(n, W)``."""
    if draw(st.booleans()):
        return NonTensorStack(*draw(st.lists(store_object_values, min_size=n, max_size=n)))
    width = draw(st.integers(1, 3))
    rows = draw(st.lists(st.lists(st.text(max_size=3), min_size=width, max_size=width), min_size=n, max_size=n))
    return NonTensorStack(*(NonTensorStack(*row) for row in rows))


def store_columns(n: int) -> st.SearchStrategy[Any]:
    """A column of ``n`` rows of any kind a store keeps: dense, jagged, object array or NonTensorStack."""
    return st.one_of(dense_columns(n), jagged_columns(n), object_array_columns(n), non_tensor_stack_columns(n))


store_keys = st.lists(keys, min_size=1, max_size=6, unique=True)
"""Unique row keys of one put (digits and ``@`` included, so prefixes like ``6@a`` / ``16@a`` occur)."""


STORE_FIELDS = ("f0", "f1", "f2", "f3")


@st.composite
def store_batches(draw: st.DrawFn, *, key_pool: Sequence[str] | None = None) -> tuple[list[str], TensorDict]:
    """``(keys, fields)``: a TensorDict of batch ``[len(keys)]`` with 1-4 columns of mixed kinds named from ``STORE_FIELDS``.

    Keys are fresh, or a non-empty subset of ``key_pool`` in random order (so successive batches overlap).
    """
    if key_pool is None:
        ks = draw(store_keys)
    else:
        ks = draw(st.lists(st.sampled_from(list(key_pool)), min_size=1, max_size=len(key_pool), unique=True))
    n = len(ks)
    td = TensorDict(batch_size=[n])
    for name in draw(st.lists(st.sampled_from(STORE_FIELDS), min_size=1, unique=True)):
        td[name] = draw(store_columns(n))
    return ks, td

# ---------------------------------------------------------------- policy (shell/policy.py parity)


@st.composite
def policy_batches(
    draw: st.DrawFn, *, max_dp: int = 4, max_len: int = 16, vocab: int = 32
) -> tuple[TensorDict, int, int | None, PackingSpec | DynamicBatchingSpec | None]:
    """``(data, dp, train_global_batch_size, spec)``: a ragged in-memory GRPO batch and how to shard it.

    ``data`` holds ``input_ids`` (dense with junk past each row's end, or jagged),
    ``token_mask`` (bool), ``prev_logprobs`` (float32), ``advantages`` ([N] float32)
    and ``lengths`` (in ``[1, max_len]``); ``N`` is a multiple of ``dp``.
    """
    dp = draw(st.integers(1, max_dp))
    per_rank = draw(st.integers(1, 6))
    n = dp * per_rank
    steps = draw(st.sampled_from([s for s in range(1, per_rank + 1) if per_rank % s == 0]))
    gbs = draw(st.sampled_from([None, n // steps]))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    width = max(lengths) + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, width), generator=g)  # junk past each row's end on purpose
    mask = torch.rand(n, width, generator=g) > 0.3
    prev = torch.randn(n, width, generator=g)
    columns: dict[str, Any] = {
        "input_ids": ids,
        "token_mask": mask,
        "prev_logprobs": prev,
        "advantages": torch.randn(n, generator=g),
        "lengths": torch.tensor(lengths, dtype=torch.long),
    }
    if draw(st.booleans()):
        from core.codec import to_jagged

        columns["input_ids"] = to_jagged(ids, lengths)
    kind = draw(st.sampled_from(["none", "packing", "dynamic"]))
    spec: PackingSpec | DynamicBatchingSpec | None = None
    if kind == "packing":
        multiple = draw(st.sampled_from([1, 2, 4]))
        longest = -(-max(lengths) // multiple) * multiple
        spec = PackingSpec(
            max_tokens_per_microbatch=longest * draw(st.integers(1, 4)),
            algorithm=draw(packing_algorithms),
            sequence_length_pad_multiple=multiple,
        )
    elif kind == "dynamic":
        rounding = draw(st.sampled_from([1, 4]))
        longest = -(-max(lengths) // rounding) * rounding
        spec = DynamicBatchingSpec(max_tokens_per_microbatch=longest * draw(st.integers(1, 4)), sequence_length_round=rounding)
    td = TensorDict(batch_size=[n])
    for name, value in columns.items():
        td.set(name, value)
    return td, dp, gbs, spec


# ---------------------------------------------------------------- tasks (core/task.py, core/addition.py)
# core.addition / core.task are imported inside the strategies, as this section is appended.

tokenizer_alphabets = st.lists(st.characters(), min_size=1, max_size=16, unique=True).map("".join)
task_seeds = st.integers(0, 2**64 - 1)
task_steps = st.integers(0, 10**6)


@st.composite
def alphabet_and_text(draw: st.DrawFn) -> tuple[str, str]:
    """An alphabet and a string over it (possibly empty)."""
    alphabet = draw(tokenizer_alphabets)
    return alphabet, draw(st.text(alphabet=alphabet, max_size=24))


@st.composite
def alphabet_and_foreign_text(draw: st.DrawFn) -> tuple[str, str, int]:
    """An alphabet, a string holding a character outside it, and the position of the first such character."""
    alphabet = draw(tokenizer_alphabets)
    prefix = draw(st.text(alphabet=alphabet, max_size=8))
    foreign = draw(st.characters().filter(lambda c: c not in alphabet))
    return alphabet, prefix + foreign + draw(st.text(max_size=8)), len(prefix)


@st.composite
def addition_tasks(draw: st.DrawFn, *, positive_weights: bool = False) -> Any:
    """A valid ``AdditionTask``: any operand bound, a generation limit with some slack, non-negative weights."""
    from core.addition import AdditionTask

    max_operand = draw(st.integers(0, 9))
    needed = len(str(2 * max_operand)) + 1
    low = 1e-3 if positive_weights else 0.0
    return AdditionTask(
        max_operand=max_operand,
        max_new_tokens=draw(st.integers(needed, needed + 3)),
        digit_weight=draw(st.floats(low, 4.0)),
        exact_bonus=draw(st.floats(low, 4.0)),
    )


@st.composite
def addition_rollouts(draw: st.DrawFn, *, positive_weights: bool = False) -> tuple[Any, Any, tuple[int, ...]]:
    """A task, one of its prompts, and a response obeying the response contract.

    Response ids range over the tokenizer's vocabulary plus a few ids past it (a
    padded model vocabulary); EOS, if present, is last.
    """
    from core.task import EOS_ID

    task = draw(addition_tasks(positive_weights=positive_weights))
    (prompt,) = task.prompts(draw(task_seeds), draw(task_steps), 1)
    answer_ids = task.tokenizer.encode(prompt.answer)
    token = st.integers(0, task.tokenizer.vocab_size + 2).filter(lambda t: t != EOS_ID)
    # bias towards the answer's digits so matches and exact answers are common
    body = draw(
        st.one_of(
            st.lists(token, max_size=task.max_new_tokens),
            st.just(list(answer_ids)),
            st.lists(st.sampled_from(answer_ids), max_size=task.max_new_tokens),
        )
    )
    body = body[: task.max_new_tokens]
    if len(body) < task.max_new_tokens and draw(st.booleans()):
        body = [*body, EOS_ID]
    return task, prompt, tuple(body)


# ---------------------------------------------------------------- match reward (core/match_reward.py)
# core.task is imported inside the strategies, as this section is appended.

reward_weights = st.floats(0.0, 4.0)


@st.composite
def match_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A non-empty target of character ids and a response obeying the response contract (EOS only last).

    Ids range over a small vocabulary plus a few ids with no character; the response
    is biased towards the target's ids so matches and exact answers are common.
    """
    from core.task import EOS_ID

    target = tuple(draw(st.lists(st.integers(3, 8), min_size=1, max_size=12)))
    token = st.integers(0, 11).filter(lambda t: t != EOS_ID)
    body = draw(
        st.one_of(
            st.lists(token, max_size=len(target) + 3),
            st.just(list(target)),
            st.lists(st.sampled_from(target), max_size=len(target) + 3),
        )
    )
    if draw(st.booleans()):
        body = [*body, EOS_ID]
    return target, tuple(body)


# ---------------------------------------------------------------- the reverse task (core/reverse.py)
# core.reverse / core.task are imported inside the strategies, as this section is appended.


@st.composite
def reverse_tasks(draw: st.DrawFn, *, positive_weights: bool = False) -> Any:
    """A valid ``ReverseTask``: any length up to 14, any digit count, a generation limit with some slack, weights >= 0."""
    from core.reverse import ReverseTask

    length = draw(st.integers(1, 14))
    low = 1e-3 if positive_weights else 0.0
    return ReverseTask(
        length=length,
        digits=draw(st.integers(2, 10)),
        max_new_tokens=draw(st.integers(length + 1, length + 4)),
        digit_weight=draw(st.floats(low, 4.0)),
        exact_bonus=draw(st.floats(low, 4.0)),
    )


@st.composite
def reverse_rollouts(draw: st.DrawFn, *, positive_weights: bool = False) -> tuple[Any, Any, tuple[int, ...]]:
    """A reverse task, one of its prompts, and a response obeying the response contract.

    Response ids range over the tokenizer's vocabulary plus a few ids past it (a
    padded model vocabulary); the body is biased towards the answer's digits (in
    place, or shuffled) so matches and exact answers are common; EOS, if present, is last.
    """
    from core.task import EOS_ID

    task = draw(reverse_tasks(positive_weights=positive_weights))
    (prompt,) = task.prompts(draw(task_seeds), draw(task_steps), 1)
    answer_ids = task.tokenizer.encode(prompt.answer)
    token = st.integers(0, task.tokenizer.vocab_size + 2).filter(lambda t: t != EOS_ID)
    body = draw(
        st.one_of(
            st.lists(token, max_size=task.max_new_tokens),
            st.just(list(answer_ids)),
            st.permutations(answer_ids),
            st.lists(st.sampled_from(answer_ids), max_size=task.max_new_tokens),
        )
    )
    body = list(body)[: task.max_new_tokens]
    if len(body) < task.max_new_tokens and draw(st.booleans()):
        body = [*body, EOS_ID]
    return task, prompt, tuple(body)


# ---------------------------------------------------------------- rollout carry (core/rollout_carry.py)
# core.rollout_carry is imported inside the strategies, as this section is appended.

carry_rewards = st.sampled_from([0.0, 0.25, 0.5, 1.0])
"""Rewards of a carry: a small set, so constant and varying groups both occur (and float32 sums are exact)."""


@st.composite
def rollout_carries(draw: st.DrawFn, *, min_size: int = 1, max_size: int = 40, max_groups: int = 5) -> Any:
    """A valid ``RolloutCarry``: sparse (possibly negative) group ids, rows interleaved, some groups constant."""
    from core.rollout_carry import RolloutCarry

    n = draw(st.integers(min_size, max_size))
    ids = draw(st.lists(st.integers(-20, 20), min_size=1, max_size=max_groups, unique=True))
    group_ids = draw(st.lists(st.sampled_from(ids), min_size=n, max_size=n))
    constant = {g: draw(st.booleans()) for g in ids}
    fixed = {g: draw(carry_rewards) for g in ids}
    prompt = {g: draw(st.integers(0, 99)) for g in ids}
    return RolloutCarry(
        rewards=[fixed[g] if constant[g] else draw(carry_rewards) for g in group_ids],
        lengths=draw(st.lists(st.integers(1, 64), min_size=n, max_size=n)),
        group_ids=group_ids,
        prompt_ids=[prompt[g] for g in group_ids],
        truncated=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
    )


@st.composite
def carry_and_permutation(draw: st.DrawFn) -> tuple[Any, list[int]]:
    """A carry and a permutation of its row positions."""
    carry = draw(rollout_carries())
    return carry, draw(st.permutations(list(range(carry.size))))


@st.composite
def carry_and_index_blocks(draw: st.DrawFn, *, shuffle: bool) -> tuple[Any, list[list[int]]]:
    """A carry and its row positions cut into consecutive (possibly empty) blocks, shuffled first if ``shuffle``."""
    carry = draw(rollout_carries())
    order = draw(st.permutations(list(range(carry.size)))) if shuffle else list(range(carry.size))
    cuts = sorted(draw(st.lists(st.integers(0, carry.size), max_size=5)))
    bounds = [0, *cuts, carry.size]
    return carry, [order[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- entropy (core/entropy.py)

vocab_sizes = st.integers(1, 512)
"""Vocabulary sizes: from a single id up to a few hundred."""


@st.composite
def masked_logits(draw: st.DrawFn, *, max_rows: int = 4, max_vocab: int = 24) -> torch.Tensor:
    """Float32 logits [B, V] in [-30, 30], some ids masked to -inf, at least one finite id per row."""
    b, v = draw(st.integers(1, max_rows)), draw(st.integers(1, max_vocab))
    values = draw(st.lists(st.floats(-30, 30, width=32), min_size=b * v, max_size=b * v))
    logits = torch.tensor(values, dtype=torch.float32).reshape(b, v)
    masked = torch.tensor(draw(st.lists(st.booleans(), min_size=b * v, max_size=b * v))).reshape(b, v)
    keep = torch.tensor(draw(st.lists(st.integers(0, v - 1), min_size=b, max_size=b)))
    masked[torch.arange(b), keep] = False
    return logits.masked_fill(masked, float("-inf"))


@st.composite
def row_entropies(draw: st.DrawFn, *, max_rows: int = 20) -> tuple[list[float], list[int]]:
    """Per-row summed entropies and token counts (at least one token in all): what a rollout carries."""
    n = draw(st.integers(1, max_rows))
    tokens = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(lambda t: sum(t) > 0))
    return [draw(st.floats(0.0, 3.0 * t)) for t in tokens], tokens


# ---------------------------------------------------------------- integrity (core/integrity.py digests)

DIGEST_DTYPES = (*CODEC_DTYPES, torch.complex128)
"""Every carried dtype, and complex128 for a 16-byte element (two 8-byte words): widths 1, 2, 4, 8 and 16 bytes."""


def _digest_tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_complex:
        real = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1))), dtype=torch.float64)
        return torch.complex(real, real.flip(-1) if real.dim() else real).to(dtype)
    return _store_tensor(draw, shape, dtype)


@st.composite
def digest_columns(draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 6) -> torch.Tensor:
    """A column to digest: dense ``(N,)``, ``(N, S)`` or ``(N, S, D)``, or jagged ``(N, j)`` / ``(N, j, D)``
    (empty rows common, holes between rows sometimes); any dtype of ``DIGEST_DTYPES``; NaN and -0.0 sometimes."""
    n = draw(st.integers(0, max_rows))
    dtype = draw(st.sampled_from(DIGEST_DTYPES))
    if draw(st.booleans()):
        rest = draw(st.one_of(st.just(()), st.tuples(st.integers(0, max_len)), st.tuples(st.integers(1, max_len), st.integers(1, 3))))
        return _digest_tensor(draw, (n, *rest), dtype)
    lengths = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_len)), min_size=n, max_size=n))
    gaps = draw(st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=n + 1, max_size=n + 1)))
    inner = draw(st.one_of(st.just(()), st.tuples(st.integers(1, 3))))
    starts = [sum(lengths[:i]) + (0 if gaps is None else sum(gaps[: i + 1])) for i in range(n)]
    total = sum(lengths) + (0 if gaps is None else sum(gaps))
    values = _digest_tensor(draw, (total, *inner), dtype)
    end = starts[-1] + lengths[-1] if n else 0
    offsets = torch.tensor([*starts, end], dtype=torch.int64)
    if gaps is None:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor(lengths, dtype=torch.int64))


@st.composite
def digest_dense_rows(draw: st.DrawFn) -> torch.Tensor:
    """A dense ``(N, W)`` column with ``N >= 2`` rows of ``W >= 2`` elements, for corrupting one row."""
    dtype = draw(st.sampled_from(DIGEST_DTYPES))
    return _digest_tensor(draw, (draw(st.integers(2, 6)), draw(st.integers(2, 9))), dtype)


@st.composite
def digest_object_rows(draw: st.DrawFn) -> list[Any]:
    """Per-row Python objects (as ``store_object_values``) for object digests."""
    return draw(st.lists(store_object_values, max_size=6))


# ---------------------------------------------------------------- run config (shell/run_config.py)

config_texts = st.text(
    alphabet=st.characters(categories=("L", "N", "P", "S", "Zs"), exclude_characters="\x85\u2028\u2029"),
    min_size=1,
    max_size=12,
)
"""Non-empty text a string config value may hold (letters, digits, punctuation, symbols, spaces)."""

plain_override_texts = config_texts.filter(lambda t: not t.startswith(("'", '"')))
"""Text after ``key=`` of a string key that is read as typed (one that starts with a quote is parsed as YAML)."""

yaml_11_words = st.sampled_from(
    ["off", "on", "no", "yes", "n", "y", "Off", "NO", "true", "False", "null", "~", "12:30:00", "0777", "0x1F",
     "1e3", ".inf", ".nan", "2026-11-23", "<<", "=", "#1", "a: b", "- x", "!tag", "&anchor", "*alias", "%dir"]
)
"""Strings YAML 1.1 (and 1.2) would read as something else, or as syntax."""


@st.composite
def run_config_overrides(draw: st.DrawFn) -> list[str]:
    """``key=value`` overrides that load: typed values, and string keys holding any text."""
    out = [
        f"seed={draw(st.integers(0, 2**31))}",
        f"grpo.num_steps={draw(st.integers(1, 10**6))}",
        f"grpo.temperature={draw(st.floats(1e-3, 10.0))!r}",
        f"grpo.leave_one_out={draw(st.sampled_from(['true', 'false', 'True', 'FALSE']))}",
        f"run.progress={draw(st.sampled_from(['auto', 'bar', 'plain', 'off']))}",
        f"data_plane.partition={draw(st.one_of(plain_override_texts, yaml_11_words))}",
        f"policy.fetch_policy={draw(st.sampled_from(['auto', 'independent', 'leader_broadcast']))}",
        f"grpo.async.enabled={draw(st.sampled_from(['true', 'false']))}",
        f"grpo.async.max_staleness={draw(st.integers(0, 2**31))}",
        f"grpo.async.buffer_groups={draw(st.integers(32, 2**31))}",  # >= grpo.num_prompts_per_step (32)
        f"grpo.async.is_cap={draw(st.floats(1.0, 1e6))!r}",
        f"rollout.precision={draw(st.sampled_from(['fp32', 'bf16']))}",
    ]
    experts = draw(st.one_of(st.just(0), st.integers(2, 64)))
    out += [f"policy.model.num_experts={experts}", f"policy.model.moe_topk={draw(st.integers(1, experts or 4))}"]
    out.append(f"policy.router_replay={draw(st.sampled_from(['off', 'r3'])) if experts else 'off'}")
    if draw(st.booleans()):
        out.append(f"run.dir={draw(st.one_of(plain_override_texts, yaml_11_words).filter(lambda t: t not in ('null', '~')))}")
    return out


# ---------------------------------------------------------------- run records (shell/run_log.py, shell/run_plot.py)


@st.composite
def timed_records(draw: st.DrawFn, *, max_size: int = 30) -> list[dict[str, Any]]:
    """A run's records in any order (distinct steps), each ``step_time_s`` a number, ``None`` or missing."""
    steps = draw(st.lists(st.integers(0, 10**4), min_size=1, max_size=max_size, unique=True))
    records = []
    for step in steps:
        record: dict[str, Any] = {"step": step, "reward_mean": draw(st.one_of(st.none(), st.floats(-1.0, 2.0)))}
        time = draw(st.one_of(st.just("missing"), st.none(), st.floats(0.0, 1e4), st.integers(0, 100)))
        if time != "missing":
            record["step_time_s"] = time
        records.append(record)
    return records


# ---------------------------------------------------------------- replay buffer (core/replay.py)
# core.replay is imported inside the strategies, as this section is appended.

replay_versions = st.integers(0, 8)
"""Weight versions of receipts and trainer versions: small, so lags near every staleness bound occur."""


def replay_receipt(keys: Sequence[str], *, weight_version: int, batch_seq: int, rewards: Sequence[float] | None = None) -> Any:
    """A ``GroupReceipt`` of rows ``keys`` (one prompt group) in partition ``train``, stamped with its versions."""
    from core.replay import GroupReceipt
    from core.rollout_carry import RolloutCarry

    n = len(keys)
    carry = RolloutCarry(
        rewards=[0.0] * n if rewards is None else rewards,
        lengths=[4] * n,
        group_ids=[batch_seq] * n,
        prompt_ids=[0] * n,
        truncated=[False] * n,
    )
    return GroupReceipt(
        KVBatchMeta("train", keys, sequence_lengths=[4] * n),
        carry,
        weight_version=weight_version,
        batch_seq=batch_seq,
        entropy=[0.5] * n,
        response_tokens=[2] * n,
        responses=[f"r{k}" for k in keys[:1]],
    )


@st.composite
def group_receipts(draw: st.DrawFn, *, prefix: str = "g", max_rows: int = 4) -> Any:
    """A valid ``GroupReceipt``: 1..``max_rows`` rows keyed ``<prefix>_<i>``, any versions, carry rewards, entropies and texts."""
    from core.replay import GroupReceipt

    n = draw(st.integers(1, max_rows))
    keys = [f"{prefix}_{i}" for i in range(n)]
    base = replay_receipt(keys, weight_version=draw(replay_versions), batch_seq=draw(st.integers(0, 9)), rewards=draw(st.lists(carry_rewards, min_size=n, max_size=n)))
    return GroupReceipt(
        base.meta,
        base.carry,
        weight_version=base.weight_version,
        batch_seq=base.batch_seq,
        entropy=draw(st.lists(st.floats(0.0, 20.0), min_size=n, max_size=n)),
        response_tokens=draw(st.lists(st.integers(0, 16), min_size=n, max_size=n)),
        responses=draw(st.lists(st.text(max_size=6), max_size=n)),
    )


def receipt_streams(*, min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[list[Any]]:
    """Receipts with pairwise-disjoint keys (group ``i`` is prefixed ``g<i>``), in arrival order, versions in any order."""
    return st.integers(min_size, max_size).flatmap(lambda n: st.tuples(*(group_receipts(prefix=f"g{i}") for i in range(n))).map(list))


@st.composite
def replay_scripts(draw: st.DrawFn) -> tuple[int, list[Any], list[tuple[Any, ...]]]:
    """``(capacity_groups, receipts, operations)``: a buffer driven by offers of the stream's next receipts and samples.

    Each operation is ``("offer", count)`` (the next ``count`` receipts not
    yet accepted, or fewer at the end; a batch that does not fit stays next)
    or ``("sample", num_groups, current_version, max_staleness)``, with
    ``num_groups <= capacity_groups`` and ``current_version`` never decreasing.
    """
    capacity = draw(st.integers(1, 6))
    receipts = draw(receipt_streams())
    operations: list[tuple[Any, ...]] = []
    version = 0
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            operations.append(("offer", draw(st.integers(0, capacity))))
        else:
            version += draw(st.integers(0, 2))
            operations.append(("sample", draw(st.integers(1, capacity)), version, draw(st.integers(0, 3))))
    return capacity, receipts, operations


ASYNC_ACTIONS = ("generate", "sync", "train")
"""The collector generates (or retries its pending offer), pulls the trainer's latest weights, or the trainer takes a step."""


@st.composite
def async_schedules(draw: st.DrawFn, *, max_staleness: int | None = None) -> dict[str, Any]:
    """An asynchronous GRPO run to simulate: batch shape, buffer capacity, staleness bound and an interleaving of actions.

    ``capacity_groups`` is at least ``groups_per_batch`` (a batch always fits
    an empty buffer); ``actions`` is any sequence over ``ASYNC_ACTIONS``.
    """
    groups = draw(st.integers(1, 3))
    return {
        "groups_per_batch": groups,
        "rows_per_group": draw(st.integers(1, 3)),
        "capacity_groups": draw(st.integers(groups, 3 * groups + 1)),
        "max_staleness": draw(st.integers(0, 3)) if max_staleness is None else max_staleness,
        "actions": draw(st.lists(st.sampled_from(ASYNC_ACTIONS), max_size=60)),
    }


# ---------------------------------------------------------------- benches (shell/bench)


@st.composite
def bench_step_records(draw: st.DrawFn, *, min_steps: int = 1, max_steps: int = 30) -> list[dict[str, Any]]:
    """One run's ``metrics.jsonl`` records, steps ``1 .. n`` in step order, with the fields the R3 bench reads."""
    n = draw(st.integers(min_steps, max_steps))
    records = []
    for step in range(1, n + 1):
        rows = draw(st.integers(1, 64))
        records.append({
            "step": step,
            "step_time_s": draw(st.floats(0.01, 5.0)),
            "reward_mean": draw(st.floats(0.0, 1.0)),
            "driver_bytes": draw(st.integers(0, 10**6)),
            "data_plane_bytes": draw(st.integers(0, 10**6)),
            "rows": rows,
            "sequence_tokens_mean": draw(st.integers(rows, 30 * rows)) / rows,
        })
    return records


# ---------------------------------------------------------------- bitwise comparison (shared by the codec and dtype laws)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (so -0.0 != 0.0 and NaN payloads count, complex included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits; jagged: same row lengths and row bits."""
    if a.dtype != b.dtype:
        return False
    if a.is_nested or b.is_nested:
        rows_a, rows_b = a.unbind(0), b.unbind(0)
        return len(rows_a) == len(rows_b) and all(same_bits(x, y) for x, y in zip(rows_a, rows_b))
    return a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))
