"""Plain reference computations that property tests compare core's results against (loops, no cleverness)."""

from __future__ import annotations

from core.micro_batch import DynamicBatchingSpec, PackingSpec


def padded_length(length: int, spec: PackingSpec | DynamicBatchingSpec) -> int:
    """``length`` rounded up to the spec's pad multiple (packing) or round (dynamic batching)."""
    step = spec.sequence_length_pad_multiple if isinstance(spec, PackingSpec) else spec.sequence_length_round
    return -(-length // step) * step


def micro_batch_tokens(lengths: list[int], spec: PackingSpec | DynamicBatchingSpec) -> int:
    """A micro-batch's padded tokens: the sum of padded lengths (packing), or count x longest (dynamic batching)."""
    if isinstance(spec, PackingSpec):
        return sum(padded_length(x, spec) for x in lengths)
    return len(lengths) * max(padded_length(x, spec) for x in lengths)
