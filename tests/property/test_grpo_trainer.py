"""The GRPO trainer's pure parts: task and model from the config, step-row concatenation, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.addition import AdditionTask
from core.meta import KVBatchMeta
from shell.grpo_trainer import CHECKPOINT_FILE, build_task, load_checkpoint, model_config
from shell.run_config import ConfigError, load_run_config
from shell.step_rows import StepRows


def test_build_task_addition_and_import_path_build_the_same_task() -> None:
    """'addition' and its import path give equal tasks, with task.kwargs passed to the constructor."""
    short = build_task(load_run_config(["task.kwargs.max_new_tokens=3"]))
    long = build_task(load_run_config(["task.name=core.addition:AdditionTask", "task.kwargs.max_new_tokens=3"]))
    assert short == long == AdditionTask(max_new_tokens=3)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["task.name=no_such_module:Task"], "task.name"),
        (["task.name=core.addition:NoSuchClass"], "task.name"),
        (["task.name=core.addition"], "task.name"),
        (["task.name=core.frozen:FrozenDict"], "task.name"),
        (["task.kwargs.max_operand=12"], "task.kwargs"),
        (["task.kwargs.no_such_arg=1"], "task.kwargs"),
    ],
)
def test_build_task_rejects_bad_tasks_naming_the_key(overrides: list[str], key: str) -> None:
    """An unimportable name, a class that is not a Task, or kwargs the class rejects is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=f"config key '{key}'") as info:
        build_task(load_run_config(overrides))
    assert info.value.key == key


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_model_config_pads_the_vocabulary_to_a_multiple_of_8_and_tp(tp: int) -> None:
    """The model's vocabulary covers the tokenizer and divides by lcm(8, TP)."""
    config = load_run_config([f"policy.layout.tensor_parallel={tp}"])
    task = build_task(config)
    model = model_config(config, task)
    assert model.vocab_size >= task.tokenizer.vocab_size
    assert model.vocab_size % math.lcm(8, tp) == 0 and model.vocab_size - task.tokenizer.vocab_size < math.lcm(8, tp)


def test_model_config_rejects_a_context_too_short_for_the_task() -> None:
    """Prompt plus max_new_tokens longer than max_sequence_length is a ConfigError naming that key."""
    config = load_run_config(["policy.model.max_sequence_length=6", "task.kwargs.max_new_tokens=4"])
    with pytest.raises(ConfigError, match="policy.model.max_sequence_length"):
        model_config(config, build_task(config))


def _rows(prefix: str, n: int, width: int, offset: int) -> StepRows:
    """``n`` legacy rows of ``width`` tokens each (ids ``offset + 1 ...``), keys ``prefix<i>``."""
    ids = torch.arange(1, n * width + 1).reshape(n, width) + offset
    meta = KVBatchMeta("legacy", [f"{prefix}{i}" for i in range(n)], fields=["input_ids"], sequence_lengths=[width] * n)
    return StepRows(meta, TensorDict({"input_ids": ids, "lengths": torch.full((n,), width)}, [n]))


@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(1, 6),
)
def test_step_rows_concat_keeps_rows_and_pads_token_fields_with_zeros(na: int, nb: int, wa: int, wb: int) -> None:
    """Rows of a then b (keys, lengths and batch aligned); each row's tokens are unchanged and the padding added is 0."""
    a, b = _rows("a", na, wa, 0), _rows("b", nb, wb, 100)
    rows = a.concat(b)
    out = rows.require_batch()
    width = max(wa, wb)
    assert out["input_ids"].shape == (na + nb, width)
    assert torch.equal(out["input_ids"][:na, :wa], a.require_batch()["input_ids"]) and not out["input_ids"][:na, wa:].any()
    assert torch.equal(out["input_ids"][na:, :wb], b.require_batch()["input_ids"]) and not out["input_ids"][na:, wb:].any()
    assert torch.equal(out["lengths"], torch.cat([a.require_batch()["lengths"], b.require_batch()["lengths"]]))
    assert rows.meta.keys == a.meta.keys + b.meta.keys and len(rows) == na + nb
    assert rows.meta.sequence_lengths == (wa,) * na + (wb,) * nb


def test_step_rows_concat_rejects_rows_that_travel_differently() -> None:
    """Rows with a batch (legacy) and rows without one (in a store) cannot be concatenated; a batch must fit the meta."""
    a, b = _rows("a", 2, 3, 0), _rows("b", 1, 3, 0)
    with pytest.raises(ValueError, match=r"'other' must travel like these rows: one holds a batch and the other does not"):
        a.concat(StepRows(b.meta))
    with pytest.raises(ValueError, match=r"'batch' must have one row per key \(2\): got 1"):
        StepRows(a.meta, b.require_batch())


def test_load_checkpoint_reads_a_folder_or_file_and_rejects_others(tmp_path: Path) -> None:
    """A run folder or its checkpoint file loads; a missing file or a foreign file raises."""
    torch.save({"step": 3, "weights": {"w": torch.ones(2)}, "config": "seed: 0\n"}, tmp_path / CHECKPOINT_FILE)
    assert load_checkpoint(tmp_path)["step"] == 3
    assert torch.equal(load_checkpoint(tmp_path / CHECKPOINT_FILE)["weights"]["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="'--resume' must name a run folder"):
        load_checkpoint(tmp_path / "nowhere")
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a GRPO checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
