"""The GRPO trainer's pure parts: task and model from the config, batch concatenation, checkpoints.

The config's checks (task, model size) are tested with the loader, in test_run_config.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.addition import AdditionTask
from shell.grpo_trainer import CHECKPOINT_FILE, _cat_batches, build_task, load_checkpoint, model_config
from shell.run_config import load_run_config


def test_build_task_is_the_configs_checked_task() -> None:
    """The trainer's task is the one the loader built and probed from task.name and task.kwargs."""
    config = load_run_config(["task.kwargs.max_new_tokens=3"])
    assert build_task(config) is config.task.instance
    assert build_task(config) == AdditionTask(max_new_tokens=3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_model_config_pads_the_vocabulary_to_a_multiple_of_8_and_tp(tp: int) -> None:
    """The model's vocabulary covers the tokenizer and divides by lcm(8, TP)."""
    config = load_run_config([f"policy.layout.tensor_parallel={tp}"])
    task = build_task(config)
    model = model_config(config, task)
    assert model.vocab_size >= task.tokenizer.vocab_size
    assert model.vocab_size % math.lcm(8, tp) == 0 and model.vocab_size - task.tokenizer.vocab_size < math.lcm(8, tp)


@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(1, 6),
)
def test_cat_batches_keeps_rows_and_pads_token_fields_with_zeros(na: int, nb: int, wa: int, wb: int) -> None:
    """Rows of a then b; each row's tokens are unchanged and the padding added is 0."""
    a = TensorDict({"input_ids": torch.arange(1, na * wa + 1).reshape(na, wa), "lengths": torch.full((na,), wa)}, [na])
    b = TensorDict({"input_ids": torch.arange(1, nb * wb + 1).reshape(nb, wb) + 100, "lengths": torch.full((nb,), wb)}, [nb])
    out = _cat_batches(a, b)
    width = max(wa, wb)
    assert out["input_ids"].shape == (na + nb, width)
    assert torch.equal(out["input_ids"][:na, :wa], a["input_ids"]) and not out["input_ids"][:na, wa:].any()
    assert torch.equal(out["input_ids"][na:, :wb], b["input_ids"]) and not out["input_ids"][na:, wb:].any()
    assert torch.equal(out["lengths"], torch.cat([a["lengths"], b["lengths"]]))


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
