"""TEMPORARY (coordinator's branch): replaced by the core helper's core/fields.py at merge."""

INPUT_IDS = "input_ids"
TOKEN_MASK = "token_mask"
LENGTHS = "lengths"
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_LOGPROBS = "reference_policy_logprobs"
ADVANTAGES = "advantages"
SAMPLE_MASK = "sample_mask"
GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
MICRO_BATCH_INDICES = "micro_batch_indices"
TOKEN_FIELDS = frozenset({INPUT_IDS, TOKEN_MASK, PREV_LOGPROBS, REFERENCE_LOGPROBS})


def is_token_field(name: str) -> bool:
    return name in TOKEN_FIELDS
