"""Pure, deterministic core of the data plane (no I/O). Public names are re-exported here."""

from core.addition import AdditionTask
from core.codec import Layout, is_jagged, jagged_lengths, materialize, pack_fields, to_jagged, to_padded
from core.dispatch import dp_results, replica_groups, shard_for_ranks
from core.frozen import FrozenDict, freeze, thaw
from core.grpo import (
    clipped_policy_loss,
    dapo_keep_mask,
    group_baseline,
    grpo_advantages,
    kl_k3,
    masked_mean,
)
from core.integrity import digest_matrix, mismatched_rows, object_row_digests, tensor_row_digests
from core.meta import KVBatchMeta
from core.packing import PACKING_ALGORITHMS, PackingAlgorithm, pack_sequences, packing_lower_bound
from core.permutation import inverse_permutation
from core.sharding import (
    DynamicBatchingSpec,
    PackingSpec,
    balanced_partition,
    global_pad_length,
    shard_meta_for_dp,
    shard_row_indices,
)
from core.task import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CharTokenizer,
    Prompt,
    Task,
    task_seed,
    validate_responses,
)
from core.topology import AXES, NamedSharding

__all__ = [
    "AXES",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "AdditionTask",
    "CharTokenizer",
    "Prompt",
    "Task",
    "PACKING_ALGORITHMS",
    "DynamicBatchingSpec",
    "FrozenDict",
    "KVBatchMeta",
    "Layout",
    "NamedSharding",
    "PackingAlgorithm",
    "PackingSpec",
    "balanced_partition",
    "clipped_policy_loss",
    "dapo_keep_mask",
    "dp_results",
    "freeze",
    "global_pad_length",
    "group_baseline",
    "grpo_advantages",
    "inverse_permutation",
    "is_jagged",
    "jagged_lengths",
    "kl_k3",
    "masked_mean",
    "materialize",
    "digest_matrix",
    "mismatched_rows",
    "object_row_digests",
    "pack_fields",
    "pack_sequences",
    "replica_groups",
    "packing_lower_bound",
    "shard_for_ranks",
    "shard_meta_for_dp",
    "shard_row_indices",
    "task_seed",
    "tensor_row_digests",
    "thaw",
    "to_jagged",
    "to_padded",
    "validate_responses",
]
