"""The public face of ``core``: the package re-exports exactly its small public set, each from its home module."""

from __future__ import annotations

import importlib

import core

PUBLIC = {
    "CharTokenizer": "core.task",
    "DynamicBatchingSpec": "core.micro_batch",
    "KVBatchMeta": "core.meta",
    "NamedSharding": "core.topology",
    "PackingSpec": "core.micro_batch",
    "Prompt": "core.task",
    "StepLayout": "core.step_plan",
    "Task": "core.task",
    "TrainResult": "core.step_plan",
    "balanced_partition": "core.partition",
    "clipped_policy_loss": "core.grpo",
    "global_pad_length": "core.sharding",
    "group_baseline": "core.grpo",
    "grpo_advantages": "core.grpo",
    "inverse_permutation": "core.permutation",
    "pack_sequences": "core.packing",
    "shard_meta_for_dp": "core.sharding",
    "shard_row_indices": "core.sharding",
    "task_seed": "core.task",
    "to_jagged": "core.codec",
    "to_padded": "core.codec",
}


def test_core_all_is_exactly_the_public_set() -> None:
    """core.__all__ lists the public names (and the fields vocabulary module), nothing else."""
    assert set(core.__all__) == set(PUBLIC) | {"fields"}
    assert core.fields is importlib.import_module("core.fields")


def test_core_reexports_each_name_from_its_home_module() -> None:
    """Each re-exported name is the very object its home module defines."""
    for name, module in PUBLIC.items():
        assert getattr(core, name) is getattr(importlib.import_module(module), name), name
