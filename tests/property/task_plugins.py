"""Broken task plug-ins for the loader's tests: each fails in a way ``shell.run_task`` must report as a ConfigError."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from core.addition import AdditionTask
from core.task import Prompt


class ConstructorRaises(AdditionTask):
    """A task whose constructor raises something other than TypeError or ValueError."""

    def __init__(self) -> None:
        raise RuntimeError("the dataset is not downloaded")


@attrs.frozen
class TooFewRewards(AdditionTask):
    """The addition task, except that ``rewards`` returns one reward whatever it is given."""

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> tuple[float, ...]:
        return super().rewards(prompts, responses)[:1]


@attrs.frozen
class PromptsRaise(AdditionTask):
    """The addition task, except that ``prompts`` raises."""

    def prompts(self, seed: int, step: int, count: int) -> tuple[Prompt, ...]:
        raise KeyError("split 'train'")


class NotATask:
    """A class with none of the Task protocol's members."""


class KwargsEcho:
    """The addition task, accepting (and keeping) any constructor arguments."""

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        self._task = AdditionTask()
        self.name, self.tokenizer, self.max_new_tokens = "echo", self._task.tokenizer, self._task.max_new_tokens

    def prompts(self, seed: int, step: int, count: int) -> tuple[Prompt, ...]:
        return self._task.prompts(seed, step, count)

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        return self._task.prompt_ids(prompt)

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> tuple[float, ...]:
        return self._task.rewards(prompts, responses)
