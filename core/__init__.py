"""Pure, deterministic core of the data plane (no I/O).

The package re-exports the small public set a trainer or task author, or a
property-based fuzzer, needs; everything else is imported from its module
(``from core.packing import packing_lower_bound``).

* batch receipts and row order: ``KVBatchMeta``, ``inverse_permutation``;
* the field vocabulary: the ``fields`` module (names, ``TOKEN_FIELDS``);
* splitting a step over DP ranks: ``StepLayout``, ``PackingSpec``,
  ``DynamicBatchingSpec``, ``shard_meta_for_dp``, ``shard_row_indices``,
  ``global_pad_length``, ``balanced_partition``, ``pack_sequences``, and the
  merged ``TrainResult``;
* the layout of ranks: ``NamedSharding``;
* tensors: ``to_jagged``, ``to_padded``;
* GRPO math: ``group_baseline``, ``grpo_advantages``, ``clipped_policy_loss``;
* tasks: ``Task``, ``Prompt``, ``CharTokenizer``, ``task_seed``.
"""

from core import fields
from core.codec import to_jagged, to_padded
from core.grpo import clipped_policy_loss, group_baseline, grpo_advantages
from core.meta import KVBatchMeta
from core.micro_batch import DynamicBatchingSpec, PackingSpec
from core.packing import pack_sequences
from core.partition import balanced_partition
from core.permutation import inverse_permutation
from core.sharding import global_pad_length, shard_meta_for_dp, shard_row_indices
from core.step_plan import StepLayout, TrainResult
from core.task import CharTokenizer, Prompt, Task, task_seed
from core.topology import NamedSharding

__all__ = [
    "CharTokenizer",
    "DynamicBatchingSpec",
    "KVBatchMeta",
    "NamedSharding",
    "PackingSpec",
    "Prompt",
    "StepLayout",
    "Task",
    "TrainResult",
    "balanced_partition",
    "clipped_policy_loss",
    "fields",
    "global_pad_length",
    "group_baseline",
    "grpo_advantages",
    "inverse_permutation",
    "pack_sequences",
    "shard_meta_for_dp",
    "shard_row_indices",
    "task_seed",
    "to_jagged",
    "to_padded",
]
