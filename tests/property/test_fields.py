"""The vocabulary of ``core.fields``: fixed spellings, and one answer to "is this field per-token?"."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core import fields


def test_fields_spell_every_name_as_the_plan_fixes_it() -> None:
    """Field names and extra_info keys keep the spellings stored data and workers rely on."""
    assert (fields.INPUT_IDS, fields.TOKEN_MASK, fields.LENGTHS) == ("input_ids", "token_mask", "lengths")
    assert (fields.PREV_LOGPROBS, fields.REFERENCE_LOGPROBS) == ("prev_logprobs", "reference_policy_logprobs")
    assert (fields.ADVANTAGES, fields.SAMPLE_MASK) == ("advantages", "sample_mask")
    assert fields.ROUTED_EXPERTS == "routed_experts"
    assert fields.GLOBAL_FORWARD_PAD_SEQLEN == "global_forward_pad_seqlen"
    assert (fields.MICRO_BATCH_INDICES, fields.MICRO_BATCH_LENGTHS) == ("micro_batch_indices", "micro_batch_lengths")


def test_fields_names_are_unique_and_token_fields_are_fields() -> None:
    """No name is spelled twice; every per-token field is a field; lengths and per-row fields are not per-token."""
    assert len(set(fields.FIELDS)) == len(fields.FIELDS)
    assert len(set(fields.EXTRA_INFO_KEYS)) == len(fields.EXTRA_INFO_KEYS)
    assert not set(fields.FIELDS) & set(fields.EXTRA_INFO_KEYS)
    assert fields.TOKEN_FIELDS <= set(fields.FIELDS)
    assert fields.TOKEN_FIELDS == {
        fields.INPUT_IDS, fields.TOKEN_MASK, fields.GENERATION_LOGPROBS, fields.ROUTED_EXPERTS, fields.PREV_LOGPROBS,
        fields.REFERENCE_LOGPROBS,
    }


def test_fields_routed_experts_is_a_rollout_token_field() -> None:
    """``routed_experts`` is per-token and comes after the rollout's fields and before the trainer's, in step order."""
    order = fields.FIELDS
    assert fields.is_token_field(fields.ROUTED_EXPERTS)
    assert order.index(fields.GENERATION_LOGPROBS) < order.index(fields.ROUTED_EXPERTS) < order.index(fields.PREV_LOGPROBS)


@given(st.one_of(st.sampled_from(fields.FIELDS), st.text(max_size=12)))
def test_is_token_field_agrees_with_token_fields(name: str) -> None:
    """is_token_field(name) is exactly membership in TOKEN_FIELDS."""
    assert fields.is_token_field(name) == (name in fields.TOKEN_FIELDS)


def test_is_token_field_rejects_a_non_string() -> None:
    """A field name must be a str."""
    with pytest.raises(TypeError, match=r"'name' must be a str \(a field name\): got int"):
        fields.is_token_field(3)  # type: ignore[arg-type]
