"""How the trainer reports a policy that cannot get its GPUs: a ``ConfigError`` on ``policy.device`` naming both
counts and the share (so ``shell.run`` exits 2), the group's ``GPUShortageError`` chained; any other failure of the
policy's start passes through as it is."""

from __future__ import annotations

from typing import Any

import pytest

from shell import grpo_trainer
from shell.config_error import ConfigError
from shell.run_config import load_run_config
from shell.worker_group import GPUShortageError


def _start_policy(monkeypatch: pytest.MonkeyPatch, failure: BaseException, *overrides: str) -> Any:
    trainer = grpo_trainer.GRPOTrainer(load_run_config(["run.progress=off", "policy.device=cuda", *overrides]))

    def policy(config: Any, transport: Any) -> None:
        assert config is trainer.policy_config
        raise failure

    monkeypatch.setattr(grpo_trainer, "Policy", policy)
    return trainer._start_policy(transport=None)


def _from_build_group(shortage: GPUShortageError) -> GPUShortageError:
    s = shortage
    try:  # as shell.policy.build_group re-raises it: the same counts, the policy's wording
        raise GPUShortageError(s.ranks, s.per_worker, s.need, s.have, message="'device' is 'cuda': ...") from shortage
    except GPUShortageError as error:
        return error


@pytest.mark.parametrize(
    ("ranks", "share", "need", "have", "says"),
    [
        (2, 1.0, 2.0, 0.0, "the run's 2 policy ranks need 2 GPUs at policy.gpus_per_rank=1, the cluster has 0"),
        (1, 1.0, 1.0, 0.0, "the run's 1 policy rank needs 1 GPU at policy.gpus_per_rank=1, the cluster has 0"),
        (1, 0.5, 1.0, 0.0, "the run's 1 policy rank needs 1 GPU at policy.gpus_per_rank=0.5, the cluster has 0"),
        (4, 1.0, 4.0, 2.0, "the run's 4 policy ranks need 4 GPUs at policy.gpus_per_rank=1, the cluster has 2"),
    ],
)
def test_a_gpu_shortage_is_a_config_error_on_policy_device(
    monkeypatch: pytest.MonkeyPatch, ranks: int, share: float, need: float, have: float, says: str
) -> None:
    shortage = GPUShortageError(ranks=ranks, per_worker=share, need=need, have=have)
    for failure in (_from_build_group(shortage), shortage):  # build_group's wording, or the group's own
        with pytest.raises(ConfigError) as info:
            _start_policy(monkeypatch, failure, f"policy.layout.data_parallel={ranks}", f"policy.gpus_per_rank={share}")
        assert info.value.key == "policy.device"
        assert says in info.value.message and info.value.message.endswith(": got cuda")
        assert info.value.__cause__ is failure


@pytest.mark.parametrize("failure", [ValueError("some other policy setting"), RuntimeError("a rank died")])
def test_any_other_failure_passes_through(monkeypatch: pytest.MonkeyPatch, failure: BaseException) -> None:
    with pytest.raises(type(failure)) as info:
        _start_policy(monkeypatch, failure)
    assert info.value is failure
