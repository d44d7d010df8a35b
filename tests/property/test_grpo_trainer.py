"""The GRPO trainer's pure parts: task and model from the config, step-row concatenation, checkpoints, and the
start-up helper that builds its engines at once.

The config's checks (task, model size) are tested with the loader, in test_run_config.py.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.addition import AdditionTask
from core.meta import KVBatchMeta
from shell.grpo_trainer import CHECKPOINT_FILE, build_at_once, build_task, load_checkpoint, model_config
from shell.run_config import load_run_config
from shell.step_rows import StepRows


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


def _rows(prefix: str, n: int, width: int, offset: int) -> StepRows:
    """``n`` legacy rows of ``width`` tokens each (ids ``offset + 1 ...``), keys ``prefix<i>``, with a per-token
    ``[n, width, 2 layers, top-3]`` routing (ids from ``offset + 1`` too, in int16)."""
    ids = torch.arange(1, n * width + 1).reshape(n, width) + offset
    routed = (torch.arange(1, n * width * 6 + 1).reshape(n, width, 2, 3) + offset).to(torch.int16)
    meta = KVBatchMeta(
        "legacy", [f"{prefix}{i}" for i in range(n)], fields=["input_ids", "routed_experts"], sequence_lengths=[width] * n
    )
    return StepRows(meta, TensorDict({"input_ids": ids, "routed_experts": routed, "lengths": torch.full((n,), width)}, [n]))


@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(1, 6),
)
def test_step_rows_concat_keeps_rows_and_pads_token_fields_with_zeros(na: int, nb: int, wa: int, wb: int) -> None:
    """Rows of a then b (keys, lengths and batch aligned); each row's tokens are unchanged and the padding added is 0,
    along the tokens (dim 1) for a [B, S] field and for a [B, S, layers, topk] routing alike."""
    a, b = _rows("a", na, wa, 0), _rows("b", nb, wb, 10_000)
    rows = a.concat(b)
    out = rows.require_batch()
    width = max(wa, wb)
    assert out["input_ids"].shape == (na + nb, width) and out["routed_experts"].shape == (na + nb, width, 2, 3)
    for name in ("input_ids", "routed_experts"):
        assert torch.equal(out[name][:na, :wa], a.require_batch()[name]) and not out[name][:na, wa:].any()
        assert torch.equal(out[name][na:, :wb], b.require_batch()[name]) and not out[name][na:, wb:].any()
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


def test_build_at_once_runs_the_builders_concurrently_and_keeps_each_result() -> None:
    """Every builder runs at the same time as the others (each waits for all to have started) and each result is
    kept under its name."""
    started = threading.Barrier(3, timeout=10)
    kept: dict[str, int] = {}

    def build(value: int) -> int:
        started.wait()  # only returns once all three run at once
        return value

    build_at_once(
        {name: (lambda v=v: build(v)) for v, name in enumerate("abc")}, keep=kept.__setitem__, discard=_never
    )
    assert kept == {"a": 0, "b": 1, "c": 2}


def test_build_at_once_keeps_what_was_built_and_raises_the_first_failure_naming_it() -> None:
    """A failed builder does not lose the others' results (the caller must stop them); the first failure in
    ``builders`` order is raised, with a note naming its builder."""
    kept: dict[str, str] = {}

    def fail(message: str) -> str:
        raise RuntimeError(message)

    with pytest.raises(RuntimeError, match=r"^policy failed\n\(while starting the policy\)$") as info:
        build_at_once(
            {"policy": lambda: fail("policy failed"), "source": lambda: "engine", "other": lambda: fail("later")},
            keep=kept.__setitem__,
            discard=_never,
        )
    assert kept == {"source": "engine"}
    assert info.value.__notes__ == ["(while starting the policy)"]


class _Interrupted(BaseException):
    """What this test's SIGINT handler raises in the main thread (a stand-in for Ctrl-C)."""


def _never(name: str, value: object) -> None:
    raise AssertionError(f"nothing is discarded here: got {name}={value!r}")


def test_build_at_once_gives_up_at_an_interrupt_keeping_what_was_built_and_discarding_what_comes_later() -> None:
    """An interrupt while a builder still runs is raised at once; what was built before it is kept, and what a
    builder finishes afterwards goes to ``discard`` (so it can be stopped), not to ``keep``."""
    kept: dict[str, str] = {}
    discarded: list[tuple[str, str]] = []
    fast_done, release, slow_discarded = threading.Event(), threading.Event(), threading.Event()

    def fast() -> str:
        fast_done.set()
        return "fast engine"

    def slow() -> str:
        fast_done.wait(10)
        time.sleep(0.05)  # the fast builder's result is recorded
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while this build still runs
        release.wait(10)
        return "slow engine"

    def discard(name: str, value: str) -> None:
        discarded.append((name, value))
        slow_discarded.set()

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        with pytest.raises(_Interrupted):
            build_at_once({"fast": fast, "slow": slow}, keep=kept.__setitem__, discard=discard)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert kept == {"fast": "fast engine"} and discarded == []
    release.set()
    assert slow_discarded.wait(10)
    assert discarded == [("slow", "slow engine")] and kept == {"fast": "fast engine"}
