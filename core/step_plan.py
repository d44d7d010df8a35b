"""TEMPORARY (coordinator's branch): replaced by the core helper's core/step_plan.py at merge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES
from core.meta import KVBatchMeta
from core.sharding import DynamicBatchingSpec, PackingSpec, global_pad_length, shard_meta_for_dp

_TGBS = "train_global_batch_size"


@attrs.frozen
class StepLayout:
    dp_size: int = 1
    train_global_batch_size: int | None = None
    packing: PackingSpec | None = None
    dynamic_batching: DynamicBatchingSpec | None = None
    pad_multiple: int | None = None
    tensor_parallel: int = 1

    def __attrs_post_init__(self) -> None:
        if self.packing is not None and self.dynamic_batching is not None:
            raise ValueError("'packing' and 'dynamic_batching' are mutually exclusive: got both; pass one")
        gbs, dp = self.train_global_batch_size, self.dp_size
        if gbs is not None and (gbs < 1 or gbs % dp):
            raise ValueError(f"'train_global_batch_size' must be a positive multiple of the DP size {dp}: got {gbs}")

    @property
    def step_pad_multiple(self) -> int:
        if self.pad_multiple is not None:
            return self.pad_multiple
        if self.packing is not None:
            return self.packing.sequence_length_pad_multiple
        return self.tensor_parallel


def stamp_step(meta: KVBatchMeta, *, multiple: int) -> KVBatchMeta:
    if meta.sequence_lengths is None:
        raise ValueError("'meta.sequence_lengths' is required to stamp a step's pad length: got None")
    pad = global_pad_length(meta.sequence_lengths, multiple=multiple)
    got = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
    if got is not None and got != pad:
        raise ValueError(f"'extra_info[{GLOBAL_FORWARD_PAD_SEQLEN!r}]' is stamped once per step: expected {pad}, got {got}")
    return meta.with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: pad})


def shard_step(meta: KVBatchMeta, layout: StepLayout, *, train: bool) -> tuple[tuple[KVBatchMeta, ...], tuple[int, ...]]:
    if train and layout.train_global_batch_size is not None:
        meta = meta.with_extra_info(**{_TGBS: layout.train_global_batch_size // layout.dp_size})
    return shard_meta_for_dp(
        meta,
        dp_world=layout.dp_size,
        batch_size=layout.train_global_batch_size if train else None,
        packing=layout.packing,
        dynamic_batching=layout.dynamic_batching,
    )


def legacy_meta(lengths: Sequence[int]) -> KVBatchMeta:
    return KVBatchMeta("legacy", [f"row{i}" for i in range(len(lengths))], sequence_lengths=[int(x) for x in lengths])


@attrs.frozen
class TrainResult:
    loss: tuple[float, ...]
    grad_norm: tuple[float, ...]
    micro_batch_metrics: tuple[Any, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    forward_seq_lengths: tuple[int, ...]


def merge_train(results: Sequence[Mapping[str, Any]]) -> TrainResult:
    counts = {len(r["loss"]) for r in results}
    if len(counts) != 1:
        raise ValueError(f"every DP rank must run the same number of steps: got {[len(r['loss']) for r in results]}")
    (steps,) = counts
    return TrainResult(
        loss=tuple(sum(r["loss"][s] for r in results) / len(results) for s in range(steps)),
        grad_norm=tuple(results[0]["grad_norm"]),
        micro_batch_metrics=tuple(tuple(r["metrics"]) for r in results),
        micro_batches=tuple(tuple(r["micro_batches"]) for r in results),
        forward_seq_lengths=tuple(int(r["forward_seq_length"]) for r in results),
    )


def micro_batch_spans(extra_info: Mapping[str, Any], rows: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    indices = extra_info.get(MICRO_BATCH_INDICES)
    if indices is not None:
        plan = tuple(tuple((int(a), int(b)) for a, b in step) for step in indices)
        flat = [span for step in plan for span in step]
        ends = [0] + [b for _, b in flat]
        if any(a != prev for (a, _), prev in zip(flat, ends)) or ends[-1] != rows:
            raise ValueError(f"'micro_batch_indices' must tile range({rows}) in order: got {plan}")
        return plan
    per = extra_info.get(_TGBS)
    if per is None:
        return (((0, rows),),)
    return tuple(((s, s + per),) for s in range(0, rows, per))
