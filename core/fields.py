"""The data plane's vocabulary: every field name, every ``extra_info`` key, and which fields are per-token.

A *field* is a column stored per row (under a meta's keys) or carried in a
rank batch; ``B`` is the rows of a batch, ``S`` its padded token width. An
*``extra_info`` key* names batch-wide metadata on a
:class:`~core.meta.KVBatchMeta`.

Invariant: each name is spelled once, here; every other module imports it.
A field is per-token (``[B, S, ...]`` padded, or jagged on the wire and trimmed
to each row's length) exactly when it is in :data:`TOKEN_FIELDS`.
"""

from __future__ import annotations

# ---------------------------------------------------------------- fields

INPUT_IDS = "input_ids"  # LongTensor[B, S]: prompt and response token ids
TOKEN_MASK = "token_mask"  # BoolTensor[B, S]: the tokens that count in the loss
LENGTHS = "lengths"  # LongTensor[B]: valid tokens per row (the meta's sequence_lengths)
PREV_LOGPROBS = "prev_logprobs"  # FloatTensor[B, S]: log-probs of the policy that sampled
REFERENCE_LOGPROBS = "reference_policy_logprobs"  # FloatTensor[B, S]: log-probs of the frozen reference
ADVANTAGES = "advantages"  # FloatTensor[B] (per row, as GRPO writes it) or [B, S]
SAMPLE_MASK = "sample_mask"  # FloatTensor[B]: 1 for rows that count in the loss, 0 for filtered rows
GENERATION_LOGPROBS = "generation_logprobs"  # FloatTensor[B, S]: log-probs the behaviour policy sampled each token with (async)
VERSION_LAG = "version_lag"  # FloatTensor[B]: trainer's weight version minus the row's sampling version (async)
ROUTED_EXPERTS = "routed_experts"  # IntTensor[B, S, layers, topk]: experts the MoE router chose at rollout, -1 = no route (R3)

FIELDS: tuple[str, ...] = (
    INPUT_IDS, TOKEN_MASK, LENGTHS, GENERATION_LOGPROBS, ROUTED_EXPERTS, PREV_LOGPROBS, REFERENCE_LOGPROBS, ADVANTAGES, SAMPLE_MASK,
    VERSION_LAG,
)
"""Every field name, in the order a step produces them."""

TOKEN_FIELDS: frozenset[str] = frozenset(
    {INPUT_IDS, TOKEN_MASK, GENERATION_LOGPROBS, ROUTED_EXPERTS, PREV_LOGPROBS, REFERENCE_LOGPROBS}
)
"""The per-token fields: ``[B, S, *rest]`` in a rank batch (``rest`` is ``()`` but for ``routed_experts``'
``(layers, topk)``), jagged (trimmed to each row's length) in the store."""

# ---------------------------------------------------------------- per-key tags

WEIGHT_VERSION = "weight_version"
"""Per-key tag (int) of an async rollout row: the version of the weights that sampled it (0: the initial
weights; version ``v`` is the policy after ``v`` GRPO steps)."""

# ---------------------------------------------------------------- extra_info keys

GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
"""int: the step's one pad length, its longest row rounded up (every DP rank forwards at it)."""

MICRO_BATCH_INDICES = "micro_batch_indices"
"""tuple[tuple[tuple[int, int], ...], ...]: per global batch, the ``(start, end)`` row spans of a
shard's micro-batches (positions in the shard); stamped on every shard by ``core.sharding.shard_meta_for_dp``."""

MICRO_BATCH_LENGTHS = "micro_batch_lengths"
"""tuple[tuple[int, ...], ...]: per global batch, each micro-batch's padded token count (with
packing or dynamic batching only)."""

EXTRA_INFO_KEYS: tuple[str, ...] = (GLOBAL_FORWARD_PAD_SEQLEN, MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS)
"""Every ``extra_info`` key core stamps."""


def is_token_field(name: str) -> bool:
    """Whether field ``name`` is per-token (in :data:`TOKEN_FIELDS`).

    Raises:
        TypeError: ``name`` is not a str.

    Example:
        >>> is_token_field("prev_logprobs"), is_token_field("advantages")
        (True, False)
    """
    if not isinstance(name, str):
        raise TypeError(f"'name' must be a str (a field name): got {type(name).__name__}")
    return name in TOKEN_FIELDS
