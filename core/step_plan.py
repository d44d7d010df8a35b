"""The pure split and merge of one policy step: the halves around a worker call that do no I/O.

Concept: a step is a batch of rows (a :class:`~core.meta.KVBatchMeta`) that the
DP ranks forward or train on. Before the call, the driver stamps the step's
one pad length (:func:`stamp_step`) and splits the rows over the ranks
(:func:`shard_step`, by the :class:`StepLayout`); each worker reads its
micro-batch spans (:func:`micro_batch_spans`); after the call, the driver
merges the ranks' train results (:func:`merge_train`). The in-memory (legacy)
path names its rows with :func:`legacy_meta`, so both paths shard alike. When
a log-prob call is followed by the train call on the same rows, each rank may
keep the rows it computes and will train on (:func:`kept_rows`, checked by
:func:`check_kept_rows` at the train call).

Invariants:
  * a :class:`StepLayout` is valid on construction: a train global batch is a
    positive multiple of the DP size, and packing excludes dynamic batching;
  * ``stamp_step`` stamps ``global_forward_pad_seqlen`` once: stamping again
    with the same multiple is a no-op, with another value an error;
  * ``shard_step(meta, layout, train=...)`` is
    :func:`core.sharding.shard_meta_for_dp` of the layout (train: one global
    batch per ``train_global_batch_size`` rows; else one global batch), so
    its shards partition the rows, ``unsorted`` inverts their concatenation,
    and ``micro_batch_spans`` of every shard tiles the shard's rows;
  * ``merge_train`` needs every rank to have run the same number of
    optimizer steps; its loss is, step by step, the ranks' summed losses over
    their summed counts (the token mean over the global batch), or the mean
    over ranks for losses that give no counts; ``token_mean_metric`` weighs
    every micro-batch's token-mean metric by its tokens in the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core.checks import check_int, check_int_entries
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES
from core.meta import KVBatchMeta
from core.micro_batch import DynamicBatchingSpec, PackingSpec
from core.sharding import Shards, Unsorted, global_pad_length, shard_meta_for_dp
from core.topology import NamedSharding

LEGACY_PARTITION = "legacy"  # the partition name of legacy_meta's synthetic keys
Spans = tuple[tuple[int, int], ...]  # one global batch's micro-batches as (start, end) row spans
StepSpans = tuple[Spans, ...]  # per global batch (optimizer step), its micro-batch spans


def _int_field(*, minimum: int | None, optional: bool = False) -> Any:
    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        check_int(attribute.name, value, minimum=minimum)

    return check


def _optional(cls: type) -> Any:
    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"'{attribute.name}' must be a {cls.__name__} or None: got {type(value).__name__}")

    return check


@attrs.frozen
class StepLayout:
    """How a step's rows are split over the DP ranks and padded.

    Args:
        dp_size: the number of data-parallel ranks (``>= 1``).
        train_global_batch_size: rows per optimizer step, a positive multiple
            of ``dp_size`` (None: one step per ``train`` call).
        packing: sequence packing into micro-batches (exclusive with ``dynamic_batching``).
        dynamic_batching: length-sorted padded micro-batches.
        pad_multiple: the step's pad length is a multiple of this (``>= 1``;
            None: the packing pad multiple, else ``tensor_parallel``).
        tensor_parallel: the tensor-parallel size (``>= 1``), the default pad multiple.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a size is below 1; both packing and dynamic batching; the
            global batch size is not a positive multiple of the DP size.

    Example:
        >>> StepLayout(dp_size=2, train_global_batch_size=8, tensor_parallel=4).step_pad_multiple
        4
    """

    dp_size: int = attrs.field(validator=_int_field(minimum=1))
    train_global_batch_size: int | None = attrs.field(default=None, validator=_int_field(minimum=None, optional=True))
    packing: PackingSpec | None = attrs.field(default=None, validator=_optional(PackingSpec))
    dynamic_batching: DynamicBatchingSpec | None = attrs.field(default=None, validator=_optional(DynamicBatchingSpec))
    pad_multiple: int | None = attrs.field(default=None, validator=_int_field(minimum=1, optional=True))
    tensor_parallel: int = attrs.field(default=1, validator=_int_field(minimum=1))

    def __attrs_post_init__(self) -> None:
        if self.packing is not None and self.dynamic_batching is not None:
            raise ValueError("'packing' and 'dynamic_batching' are mutually exclusive: got both; pass one")
        gbs, dp = self.train_global_batch_size, self.dp_size
        if gbs is not None and (gbs < 1 or gbs % dp):
            raise ValueError(f"'train_global_batch_size' must be a positive multiple of the DP size {dp}: got {gbs}")

    @classmethod
    def for_sharding(cls, sharding: NamedSharding, **fields: Any) -> StepLayout:
        """The layout of ``sharding`` (its DP and TP sizes) with the other ``fields``.

        Raises:
            TypeError: ``sharding`` is not a NamedSharding.

        Example:
            >>> StepLayout.for_sharding(NamedSharding({"data_parallel": 2, "tensor_parallel": 2})).dp_size
            2
        """
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"'sharding' must be a NamedSharding: got {type(sharding).__name__}")
        return cls(
            dp_size=sharding.axis_size("data_parallel"),
            tensor_parallel=sharding.axis_size("tensor_parallel"),
            **fields,
        )

    @property
    def step_pad_multiple(self) -> int:
        """The multiple the step's pad length is rounded up to: ``pad_multiple``, else the packing pad multiple,
        else the TP size."""
        if self.pad_multiple is not None:
            return self.pad_multiple
        if self.packing is not None:
            return self.packing.sequence_length_pad_multiple
        return self.tensor_parallel


@attrs.frozen
class TrainResult:
    """One ``train`` call's outcome, the same fields on both paths.

    Attributes:
        loss: per optimizer step, the loss over the global batch: the ranks' summed losses over their
            summed counts (the token mean, for a loss that counts tokens), else the mean of their losses.
        grad_norm: per optimizer step, the norm of the step's gradient (that of ``loss``, reduced over DP).
        micro_batch_metrics: per DP rank, per step, one metrics dict per micro-batch.
        micro_batches: per DP rank, the micro-batch count of each step.
        forward_seq_lengths: per DP rank, the sequence length it forwarded at.
    """

    loss: tuple[float, ...]
    grad_norm: tuple[float, ...]
    micro_batch_metrics: tuple[Any, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    forward_seq_lengths: tuple[int, ...]


# ---------------------------------------------------------------- split


def stamp_step(meta: KVBatchMeta, *, multiple: int) -> KVBatchMeta:
    """``meta`` with the step's ``global_forward_pad_seqlen`` (its longest row rounded up to ``multiple``).

    Idempotent: a meta already stamped with the same value is returned as is.

    Raises:
        TypeError: ``meta`` is not a KVBatchMeta.
        ValueError: ``meta`` has no sequence lengths, or is stamped with another value.

    Example:
        >>> stamp_step(legacy_meta([5, 9]), multiple=4).extra_info["global_forward_pad_seqlen"]
        12
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"'meta' must be a KVBatchMeta: got {type(meta).__name__}")
    if meta.sequence_lengths is None:
        raise ValueError("'meta.sequence_lengths' is required to stamp a step's pad length: got None")
    pad = global_pad_length(meta.sequence_lengths, multiple=multiple)
    got = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
    if got is not None and got != pad:
        raise ValueError(
            f"'extra_info[{GLOBAL_FORWARD_PAD_SEQLEN!r}]' is stamped once per step: expected {pad}, got {got}"
        )
    return meta.with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: pad})


def shard_step(meta: KVBatchMeta, layout: StepLayout, *, train: bool) -> tuple[Shards, Unsorted]:
    """Split a step meta over the DP ranks of ``layout`` (train: in global batches of ``train_global_batch_size``).

    Every shard carries ``micro_batch_indices`` (read them with
    :func:`micro_batch_spans`); ``unsorted`` puts the ranks' concatenated rows
    back in ``meta``'s order.

    Raises:
        TypeError: ``layout`` is not a StepLayout; see :func:`core.sharding.shard_meta_for_dp`.
        ValueError: see :func:`core.sharding.shard_meta_for_dp`.

    Example:
        >>> shards, unsorted = shard_step(legacy_meta([3, 1, 2, 2]), StepLayout(dp_size=2, train_global_batch_size=2), train=True)
        >>> [s.extra_info["micro_batch_indices"] for s in shards]
        [(((0, 1),), ((1, 2),)), (((0, 1),), ((1, 2),))]
    """
    if not isinstance(layout, StepLayout):
        raise TypeError(f"'layout' must be a StepLayout: got {type(layout).__name__}")
    return shard_meta_for_dp(
        meta,
        dp_world=layout.dp_size,
        batch_size=layout.train_global_batch_size if train else None,
        packing=layout.packing,
        dynamic_batching=layout.dynamic_batching,
    )


def kept_rows(forward: Shards, train: Shards) -> tuple[frozenset[str], ...]:
    """For each DP rank, the keys of its ``forward`` shard that its ``train`` shard holds too.

    A rank that computes a row's log-probs and then trains on that row can keep
    the result where it is; only the rows the train sharding gives to another
    rank need to travel. Both shardings are of the same step's rows.

    Laws (``tests/property/test_step_plan.py``):
      * ``kept[r]`` is a subset of both ``forward[r].keys`` and ``train[r].keys``;
      * every key of ``train[r]`` is in ``kept[r]`` or in another rank's forward shard.

    Raises:
        ValueError: the shardings have different rank counts, or not the same keys.

    Example:
        >>> meta = legacy_meta([5, 1, 4, 2])
        >>> forward, _ = shard_step(meta, StepLayout(dp_size=2), train=False)
        >>> train, _ = shard_step(meta, StepLayout(dp_size=2, train_global_batch_size=2), train=True)
        >>> [sorted(keys) for keys in kept_rows(forward, train)]
        [['row0'], ['row3']]
    """
    if len(forward) != len(train):
        raise ValueError(f"'train' must have one shard per rank of 'forward' ({len(forward)}): got {len(train)}")
    forward_keys = sorted(key for shard in forward for key in shard.keys)
    train_keys = sorted(key for shard in train for key in shard.keys)
    if forward_keys != train_keys:
        extra = sorted(set(train_keys) ^ set(forward_keys))[:5]
        raise ValueError(f"'forward' and 'train' must shard the same keys: they differ in {extra}")
    return tuple(frozenset(f.keys).intersection(t.keys) for f, t in zip(forward, train))


def check_kept_rows(kept: Mapping[str, int], train: Shards) -> None:
    """Check that every row kept for a train call (key -> the DP rank that kept it) is in that rank's train shard.

    A key of no train shard is not checked (a train call on fewer rows may leave kept rows unused).

    Raises:
        ValueError: a kept row is in another rank's train shard (named with both ranks).

    Example:
        >>> check_kept_rows({"row0": 1}, (legacy_meta([3]),))
        Traceback (most recent call last):
        ...
        ValueError: row 'row0': the log-prob call kept its results on DP rank 1, but the train call gives it to DP rank 0; train on the rows the log-prob call returned
    """
    for rank, shard in enumerate(train):
        for key in shard.keys:
            holder = kept.get(key, rank)
            if holder != rank:
                raise ValueError(
                    f"row {key!r}: the log-prob call kept its results on DP rank {holder}, but the train call gives "
                    f"it to DP rank {rank}; train on the rows the log-prob call returned"
                )


def legacy_meta(lengths: Sequence[int]) -> KVBatchMeta:
    """A meta of synthetic keys ``row<i>`` (partition ``"legacy"``) and ``lengths``, for sharding an in-memory batch.

    Raises:
        TypeError: ``lengths`` is not a sequence of ints.
        ValueError: a length is negative.

    Example:
        >>> legacy_meta([3, 5]).keys
        ('row0', 'row1')
    """
    checked = check_int_entries("lengths", lengths, minimum=0)
    return KVBatchMeta(LEGACY_PARTITION, [f"row{i}" for i in range(len(checked))], sequence_lengths=checked)


def micro_batch_spans(extra_info: Mapping[str, Any], rows: int) -> StepSpans:
    """The micro-batch spans of a rank's ``rows`` rows, per global batch, as the driver stamped them.

    This is the worker's half of the plan: it reads ``micro_batch_indices``
    (stamped on every shard by :func:`shard_step`) and checks that the spans
    are non-empty and tile ``range(rows)`` in order; it never recomputes them.

    Raises:
        TypeError: ``micro_batch_indices`` is not a sequence of sequences of ``(start, end)`` pairs.
        ValueError: ``extra_info`` has no ``micro_batch_indices``, or the spans
            do not tile ``range(rows)``.

    Example:
        >>> micro_batch_spans({"micro_batch_indices": (((0, 2), (2, 3)), ((3, 5),))}, 5)
        (((0, 2), (2, 3)), ((3, 5),))
    """
    rows = check_int("rows", rows, minimum=0)
    if not isinstance(extra_info, Mapping):
        raise TypeError(f"'extra_info' must be a mapping: got {type(extra_info).__name__}")
    indices = extra_info.get(MICRO_BATCH_INDICES)
    if indices is None:
        raise ValueError(
            f"'extra_info' must hold {MICRO_BATCH_INDICES!r} (stamped on every shard by shard_step): "
            f"got keys {sorted(extra_info)}; shard the step with core.step_plan.shard_step(meta, layout, train=...)"
        )
    try:
        plan = tuple(tuple((int(start), int(end)) for start, end in step) for step in indices)
    except (TypeError, ValueError):
        raise TypeError(
            f"'{MICRO_BATCH_INDICES}' must be, per global batch, a sequence of (start, end) pairs: got {indices!r}"
        ) from None
    position = 0
    for start, end in (span for step in plan for span in step):
        if start != position or end <= start:
            break
        position = end
    else:
        if position == rows:
            return plan
    raise ValueError(f"'{MICRO_BATCH_INDICES}' must tile range({rows}) in order with non-empty spans: got {plan}")


# ---------------------------------------------------------------- merge


def merge_train(results: Sequence[Mapping[str, Any]]) -> TrainResult:
    """One result per DP rank (the replica leaders') -> :class:`TrainResult`.

    Each result holds ``loss`` and ``grad_norm`` (one per optimizer step),
    ``metrics``, ``micro_batches`` and ``forward_seq_length``, and may hold
    ``loss_sum`` and ``loss_weight`` (one per step: the rank's summed losses and
    the count they are over, as the backend's train step reports them). With
    them on every rank, a step's loss is the sum of ``loss_sum`` over ranks over
    the sum of ``loss_weight`` (0.0 when the weights sum to 0): the token mean
    over the global batch. Without, it is the mean of the ranks' losses.

    Raises:
        ValueError: ranks ran different numbers of steps (or there are no
            results); some ranks give ``loss_sum``/``loss_weight`` and others
            not, or a rank gives them for another step count, or a negative weight.

    Example:
        >>> r = {"loss": [1.0], "grad_norm": [0.5], "metrics": [[{}]], "micro_batches": [1], "forward_seq_length": 8}
        >>> merge_train([r, {**r, "loss": [3.0]}]).loss
        (2.0,)
    """
    counts = {len(r["loss"]) for r in results}
    if len(counts) != 1:
        raise ValueError(f"every DP rank must run the same number of steps: got {[len(r['loss']) for r in results]}")
    (steps,) = counts
    return TrainResult(
        loss=_merged_loss(results, steps),
        grad_norm=tuple(results[0]["grad_norm"]),
        micro_batch_metrics=tuple(tuple(r["metrics"]) for r in results),
        micro_batches=tuple(tuple(r["micro_batches"]) for r in results),
        forward_seq_lengths=tuple(int(r["forward_seq_length"]) for r in results),
    )


def token_mean_metric(result: TrainResult, name: str, *, tokens: str = "token_count") -> float:
    """The token mean over the whole step of a per-micro-batch metric that is its micro-batch's token mean.

    ``sum(m[name] * m[tokens]) / sum(m[tokens])`` over every micro-batch ``m`` of every rank and optimizer
    step that reports ``name`` (a micro-batch with no tokens weighs nothing); 0.0 when none has tokens. It
    weighs tokens as the loss does (:func:`merge_train`), where a plain mean of the micro-batches' values
    would weigh micro-batches.

    Raises:
        KeyError: a micro-batch reports ``name`` but not ``tokens``.

    Example:
        >>> r = merge_train([{"loss": [0.0], "grad_norm": [0.0], "micro_batches": [2], "forward_seq_length": 8,
        ...     "metrics": [[{"kl": 1.0, "token_count": 1.0}, {"kl": 4.0, "token_count": 3.0}]]}])
        >>> token_mean_metric(r, "kl")
        3.25
    """
    total = count = 0.0
    for rank in result.micro_batch_metrics:
        for step in rank:
            for metrics in step:
                if name not in metrics:
                    continue
                if tokens not in metrics:
                    raise KeyError(f"a micro-batch reports {name!r} without its {tokens!r}: got {sorted(metrics)}")
                total += metrics[name] * metrics[tokens]
                count += metrics[tokens]
    return total / count if count else 0.0


def _merged_loss(results: Sequence[Mapping[str, Any]], steps: int) -> tuple[float, ...]:
    """Per step, the ranks' summed losses over their summed weights, or the mean of their losses without weights."""
    weighted = ["loss_weight" in r or "loss_sum" in r for r in results]
    if not any(weighted):
        return tuple(sum(r["loss"][s] for r in results) / len(results) for s in range(steps))
    for rank, r in enumerate(results):
        if "loss_weight" not in r or "loss_sum" not in r:
            raise ValueError(
                f"'loss_sum' and 'loss_weight' must be given by every DP rank or none: rank {rank} of "
                f"{len(results)} gives {sorted(k for k in ('loss_sum', 'loss_weight') if k in r)}"
            )
        if len(r["loss_weight"]) != steps or len(r["loss_sum"]) != steps or any(not w >= 0 for w in r["loss_weight"]):
            raise ValueError(
                f"'loss_sum' and 'loss_weight' of rank {rank} must be {steps} values each (one per step), the "
                f"weights >= 0: got {list(r['loss_sum'])} and {list(r['loss_weight'])}"
            )
    merged = []
    for s in range(steps):
        total = sum(r["loss_weight"][s] for r in results)
        merged.append(sum(r["loss_sum"][s] for r in results) / total if total else 0.0)
    return tuple(merged)
