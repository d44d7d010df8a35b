"""Fault injectors for the GRPO run's e2e tests (importable by Ray workers: the session puts the repo on their path).

* :class:`RaisingLoss`: a GRPO loss that raises inside the policy workers' train step.
* :class:`RewardFailsOnCall`: the addition task whose reward raises on its n-th call in the rollout engine.
* :class:`RewardSlowOnCall`: the addition task whose n-th reward call marks a file, then sleeps (a window in the rollout).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from core.addition import AdditionTask
from core.task import Prompt
from shell.loss import GRPOLoss

FAULT_MESSAGE = "injected fault"


class RaisingLoss(GRPOLoss):
    """A GRPO loss that raises ``RuntimeError(FAULT_MESSAGE)`` when called (in a worker)."""

    def __call__(self, logprobs: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> Any:
        raise RuntimeError(f"{FAULT_MESSAGE}: loss")


@attrs.frozen
class RewardFailsOnCall(AdditionTask):
    """The addition task, except that ``rewards`` raises on call number ``fail_on_call`` in its process."""

    fail_on_call: int = 2
    calls: list[int] = attrs.field(factory=lambda: [0], eq=False)  # mutable across calls in the rollout engine

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> tuple[float, ...]:
        self.calls[0] += 1
        if self.calls[0] == self.fail_on_call:
            raise RuntimeError(f"{FAULT_MESSAGE}: reward call {self.calls[0]}")
        return super().rewards(prompts, responses)


@attrs.frozen
class RewardSlowOnCall(AdditionTask):
    """The addition task, except that ``rewards`` call number ``slow_on_call`` in its process first creates the file
    ``marker`` (so a test knows the rollout is scoring), then sleeps ``sleep_s`` seconds."""

    marker: str = ""
    slow_on_call: int = 3
    sleep_s: float = 5.0
    calls: list[int] = attrs.field(factory=lambda: [0], eq=False)  # mutable across calls in the rollout engine

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> tuple[float, ...]:
        self.calls[0] += 1
        if self.calls[0] == self.slow_on_call:
            if self.marker:
                Path(self.marker).touch()
            time.sleep(self.sleep_s)
        return super().rewards(prompts, responses)
