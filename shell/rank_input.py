"""How a policy rank gets its rows and returns its results: a store shard (data plane) or an inline shard (legacy).

A sharded worker call receives one *rank input* per data-parallel index. Both
kinds answer the same two questions for the worker, so the worker's compute
is written once:

* ``rows(worker, fields)``: the rank batch (token fields ``[B, S]`` padded to
  the step's ``global_forward_pad_seqlen``, other fields ``[B, ...]``, and
  ``lengths`` LongTensor[B]);
* ``deliver(worker, outputs)``: hand per-row results back. A store shard's
  replica leader writes them to the store under the shard's keys (exactly one
  writer per key and field) and returns nothing bulky, except the rows the
  shard says to keep: the step's train call gives those to the same rank,
  which reads them from its own memory; an inline shard's replica leader
  returns them to the driver.

Invariant: for the same rows and ``extra_info``, both kinds give the worker a
byte-identical rank batch (``tests/e2e/test_policy_parity_data.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from tensordict import TensorDict

from core.frozen import FrozenDict, freeze
from core.meta import KVBatchMeta

if TYPE_CHECKING:  # the worker calls these methods; importing it here would be circular
    from shell.policy_worker import PolicyWorker

Outputs = Mapping[str, torch.Tensor]


def _per_row_columns(instance: StoreShard, attribute: attrs.Attribute[Any], value: Mapping[str, torch.Tensor]) -> None:
    for name, column in value.items():
        if not isinstance(column, torch.Tensor) or column.dim() < 1 or column.shape[0] != len(instance.meta):
            got = tuple(column.shape) if isinstance(column, torch.Tensor) else type(column).__name__
            raise ValueError(f"'columns[{name!r}]' must be a tensor with one row per key ({len(instance.meta)}): got {got}")


def _shard_keys(instance: StoreShard, attribute: attrs.Attribute[Any], value: frozenset[str]) -> None:
    outside = sorted(value.difference(instance.meta.keys))
    if outside:
        raise ValueError(f"'keep' must name keys of the shard: {outside[:5]} are not in 'meta.keys'")


@attrs.frozen
class StoreShard:
    """A data-plane rank input: the shard's meta; the worker fetches its rows by key and writes results back.

    Args:
        meta: the rank's shard of the step meta (keys, lengths, ``extra_info``).
        columns: small per-row columns the driver holds (advantages, sample mask), the shard's rows in
            ``meta.keys`` order; they travel with the call and are not fetched.
        keep: keys of ``meta`` whose results the rank keeps for the step's train call, which gives them to this
            same rank (:func:`core.step_plan.kept_rows`): they are not written to the store.
    """

    meta: KVBatchMeta = attrs.field(validator=attrs.validators.instance_of(KVBatchMeta))
    columns: Mapping[str, torch.Tensor] = attrs.field(factory=dict, validator=_per_row_columns)
    keep: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset, validator=_shard_keys)

    @property
    def extra_info(self) -> FrozenDict:
        """The shard's ``extra_info`` (pad length, micro-batch spans)."""
        return self.meta.extra_info

    def rows(self, worker: PolicyWorker, fields: Sequence[str], *, also: Sequence[str] = ()) -> TensorDict:
        """The rank batch: the fields the driver holds from ``columns``, the others fetched from the store as the
        worker's ``fetch_policy`` says; ``also``'s stored fields are read in the same fetch, for a later call
        of the step (the worker keeps them)."""
        fetched = [name for name in fields if name not in self.columns]
        fetched += [name for name in also if name in self.meta.fields and name not in self.columns and name not in fetched]
        batch = worker.fetch(self.meta, fields=fetched)
        for name in fields:
            if name in self.columns:
                batch.set(name, self.columns[name])
        return batch

    def deliver(self, worker: PolicyWorker, outputs: Outputs) -> dict[str, Any]:
        """Write ``outputs`` (per-token) under the shard's keys from the replica leader, except the rows of
        ``keep``, which the rank keeps for the train call; report the store I/O."""
        wrote = worker.write_back(self.meta, outputs, token_fields=list(outputs), keep=self.keep) if outputs else False
        return {"wrote": wrote, "data_plane": worker.store_io()}


@attrs.frozen
class InlineShard:
    """A legacy rank input: the rank batch itself, sliced and padded on the driver, and its shard's ``extra_info``.

    Args:
        data: the rank batch (token fields ``[B, S]``, ``lengths`` LongTensor[B]).
        extra_info: the shard meta's ``extra_info`` (pad length, micro-batch spans).
    """

    data: TensorDict = attrs.field(validator=attrs.validators.instance_of(TensorDict))
    extra_info: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze)

    def rows(self, worker: PolicyWorker, fields: Sequence[str], *, also: Sequence[str] = ()) -> TensorDict:
        """The rank batch as shipped (every field the driver sliced); ``also`` is for store shards only."""
        return self.data

    def deliver(self, worker: PolicyWorker, outputs: Outputs) -> dict[str, Any]:
        """Return ``outputs`` to the driver from the replica leader (other ranks return none)."""
        return {"outputs": dict(outputs) if worker.is_replica_leader else {}}


RankInput = StoreShard | InlineShard
