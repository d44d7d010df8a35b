"""The run's task: imported by ``task.name``, built with ``task.kwargs``, and probed before anything starts.

``task.name`` is a built-in name (``addition``, ``reverse``: see
:data:`BUILT_IN_TASKS`) or an import path ``package.module:Class``; the class is
called with ``task.kwargs``. :func:`probe_task` then asks the task for
what the config checks need: the token length of a sample of its prompts (the
longest row is that plus ``max_new_tokens``), and one reward per response (its
``rewards`` is called once, on a fresh instance, with two one-token responses).

Invariant: every failure of the task's own code while loading or probing,
whatever it raises, is a :class:`ConfigError` naming ``task.name`` (the module,
the class or its methods) or ``task.kwargs`` (the constructor), so a bad task
never gets past the loader.
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core.frozen import FrozenDict, thaw
from core.task import EOS_ID, Prompt, Rewards, Task
from shell.config_error import ConfigError

BUILT_IN_TASKS: Mapping[str, str] = FrozenDict({
    "addition": "core.addition:AdditionTask",
    "reverse": "core.reverse:ReverseTask",
})
"""What each built-in ``task.name`` stands for: the import path of its class."""
PROBE_PROMPTS = 64
"""Prompts sampled (seed, step 0) to find the task's longest prompt."""
PROBE_REWARDS = 2
"""Responses (each a lone EOS) scored to check the task returns one reward per response."""


def load_task(name: str, kwargs: Mapping[str, Any]) -> Task:
    """The task named by ``name`` (a key of :data:`BUILT_IN_TASKS` or ``package.module:Class``), built with ``kwargs``.

    Raises:
        ConfigError: naming ``task.name`` when the name is malformed, its import
            fails (whatever the module raises), or the class does not implement
            :class:`core.task.Task`; naming ``task.kwargs`` when the constructor raises.

    Example:
        >>> load_task("addition", {"max_new_tokens": 3}).max_new_tokens
        3
    """
    path = BUILT_IN_TASKS.get(name, name)
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise ConfigError("task.name", f"must be {built_in_names()} or 'package.module:Class': got {name!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except Exception as error:  # a plug-in module may raise anything at import: still a bad task.name
        raise ConfigError("task.name", f"cannot import {path!r}: {_cause(error)}") from None
    arguments = thaw(kwargs)
    try:
        task = cls(**arguments)
    except Exception as error:  # whatever the constructor raises, the kwargs did not build a task
        raise ConfigError("task.kwargs", f"{path} rejected {arguments}: {_cause(error)}") from None
    if not isinstance(task, Task):
        raise ConfigError("task.name", f"{path} does not implement core.task.Task (name, tokenizer, max_new_tokens, "
                                       f"prompts, prompt_ids, rewards)")
    return task


def built_in_names() -> str:
    """The built-in task names for messages: ``"'addition', 'reverse'"``."""
    return ", ".join(repr(name) for name in BUILT_IN_TASKS)


@attrs.frozen
class TaskShape:
    """What the config checks need from a task: token counts of its rows.

    Attributes:
        longest_prompt: tokens of the longest sampled prompt (BOS included).
        max_new_tokens: the task's response limit (EOS included).
    """

    longest_prompt: int
    max_new_tokens: int

    @property
    def longest_row(self) -> int:
        """Tokens of the longest row the rollout can produce: ``longest_prompt + max_new_tokens``."""
        return self.longest_prompt + self.max_new_tokens

    def arithmetic(self) -> str:
        """The longest row as a sum, for messages: ``"longest prompt 6 + max_new_tokens 2 = 8"``."""
        return f"longest prompt {self.longest_prompt} + max_new_tokens {self.max_new_tokens} = {self.longest_row}"


def probe_task(task: Task, fresh: Task, *, seed: int, name: str) -> TaskShape:
    """Sample ``task``'s prompts and score a probe with ``fresh`` (a second instance, so ``task``'s state is untouched).

    Args:
        task: the run's task.
        fresh: another instance of it (its ``rewards`` is called once).
        seed: the run's seed (the prompts of step 0 are sampled).
        name: ``task.name``, for messages.

    Raises:
        ConfigError: naming ``task.name`` when a method raises or returns the wrong count or type.
    """
    try:
        prompts = task.prompts(seed, 0, PROBE_PROMPTS)
        if len(prompts) != PROBE_PROMPTS or not all(isinstance(p, Prompt) for p in prompts):
            raise ValueError(f"prompts(seed, 0, {PROBE_PROMPTS}) must return {PROBE_PROMPTS} Prompt: got {prompts!r:.80}")
        lengths = [len(task.prompt_ids(p)) for p in prompts]
        max_new_tokens = task.max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1: got {max_new_tokens!r}")
        checked_rewards(fresh, prompts[:PROBE_REWARDS], [(EOS_ID,)] * PROBE_REWARDS)
    except Exception as error:  # the task's own code failed: report it as the task's fault
        raise ConfigError("task.name", f"{name} failed a probe before the run: {_cause(error)}") from None
    return TaskShape(longest_prompt=max(lengths), max_new_tokens=max_new_tokens)


def checked_rewards(task: Task, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> Rewards:
    """``task.rewards(prompts, responses)``, checked to hold one real number per response.

    Raises:
        ValueError: the task returned another count, or a reward that is not a real number
            (the message names the task's ``rewards``).

    Example:
        >>> checked_rewards(load_task("addition", {}), [], [])
        ()
    """
    rewards = task.rewards(prompts, responses)
    where = f"'{type(task).__name__}.rewards'"
    try:
        count = len(rewards)
    except TypeError:
        raise ValueError(f"{where} must return one reward per response: got {type(rewards).__name__}") from None
    if count != len(responses):
        raise ValueError(f"{where} must return one reward per response ({len(responses)}): got {count}")
    bad = [r for r in rewards if isinstance(r, bool) or not isinstance(r, numbers.Real)]
    if bad:
        raise ValueError(f"{where} must return real numbers: got {bad[0]!r}")
    return tuple(float(r) for r in rewards)


def _cause(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
