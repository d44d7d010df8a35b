"""``StepRows``: a step's rows as the driver holds them: the meta, and on the legacy path the bulk batch.

The meta (:class:`~core.meta.KVBatchMeta`: keys, sequence lengths, tags,
``extra_info``) is always there, on both transports, so the step is sharded
and stamped by the same core functions whatever moves the rows. ``batch`` is
the rows' tensors when they travel through the driver (legacy), else None.

Invariant: ``batch`` (when present) has one row per key of ``meta``, in the
same order; :meth:`StepRows.subset` and :meth:`StepRows.concat` keep it so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
from tensordict import TensorDict

from adapters.rows import build_tensordict
from core.meta import KVBatchMeta


def _optional_batch(instance: StepRows, attribute: attrs.Attribute[TensorDict | None], value: TensorDict | None) -> None:
    if value is None:
        return
    if not isinstance(value, TensorDict):
        raise TypeError(f"'batch' must be a TensorDict or None: got {type(value).__name__}")
    if value.batch_size[0] != len(instance.meta):
        raise ValueError(f"'batch' must have one row per key ({len(instance.meta)}): got {value.batch_size[0]}")


@attrs.frozen
class StepRows:
    """The step's meta and, on the legacy path, its bulk rows (see the module docstring)."""

    meta: KVBatchMeta = attrs.field(validator=attrs.validators.instance_of(KVBatchMeta))
    batch: TensorDict | None = attrs.field(default=None, validator=_optional_batch, eq=False)

    def __len__(self) -> int:
        return len(self.meta)

    def require_batch(self) -> TensorDict:
        """The bulk rows.

        Raises:
            ValueError: these rows live in a store (no batch on the driver).
        """
        if self.batch is None:
            raise ValueError(f"these rows live in partition {self.meta.partition_id!r}: the driver holds no batch")
        return self.batch

    def subset(self, rows: Sequence[int]) -> StepRows:
        """Rows ``rows`` (in that order)."""
        batch = None
        if self.batch is not None:
            index = torch.tensor(list(rows), dtype=torch.long)
            batch = build_tensordict({k: v[index] for k, v in self.batch.items()}, len(rows))
        return StepRows(self.meta.subset(rows), batch)

    def concat(self, other: StepRows) -> StepRows:
        """These rows, then ``other``'s (per-token fields right-padded with 0 to the wider of the two)."""
        if (self.batch is None) != (other.batch is None):
            raise ValueError("'other' must travel like these rows: one holds a batch and the other does not")
        batch = None if self.batch is None or other.batch is None else _cat_batches(self.batch, other.batch)
        return StepRows(self.meta.concat(other.meta), batch)

    def with_meta(self, meta: KVBatchMeta) -> StepRows:
        """These rows described by ``meta`` (the same keys, e.g. newly stamped or listing new fields)."""
        return StepRows(meta, self.batch)

    def with_columns(self, columns: Mapping[str, torch.Tensor]) -> StepRows:
        """These rows with ``columns`` set on the batch and listed on the meta (legacy)."""
        batch = self.require_batch().clone(recurse=False)
        for name, value in columns.items():
            batch.set(name, value)
        return StepRows(self.meta.with_fields(columns), batch)


def _cat_batches(a: TensorDict, b: TensorDict) -> TensorDict:
    out: dict[str, torch.Tensor] = {}
    for name in a.keys():
        x, y = a[name], b[name]
        if x.dim() >= 2 and x.shape[1] != y.shape[1]:  # pad dim 1, the tokens ([B, S] and [B, S, layers, topk])
            width = max(x.shape[1], y.shape[1])
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]))
            y = torch.nn.functional.pad(y, (0, 0) * (y.dim() - 2) + (0, width - y.shape[1]))
        out[name] = torch.cat([x, y])
    return build_tensordict(out, len(a) + len(b))
