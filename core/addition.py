"""``AdditionTask``: answer ``a+b=`` with the decimal sum, then EOS.

Operands are drawn uniformly from ``0..max_operand``; the question ``a+b=`` has
the stable id ``a * (max_operand + 1) + b``.

Reward of a response to a question with answer ``ans`` (a digit string): let
``gen`` be the ids before the response's EOS (all of them if it has none), then

    reward = digit_weight * (#{i : gen[i] == ans[i]}) / max(len(ans), len(gen))
           + exact_bonus * [response == ans + EOS]

so extra or missing characters dilute the digit credit, a non-digit (or any id
with no character) scores 0 at its position, and only the exact answer followed
by EOS earns the bonus.

Invariants (checked on construction and in ``tests/property/test_task.py``):
  * ``0 <= max_operand <= 9``; ``max_new_tokens >= digits(2 * max_operand) + 1``;
    ``digit_weight, exact_bonus >= 0`` and finite;
  * every reward lies in ``[0, digit_weight + exact_bonus]``; the answer followed by
    EOS reaches the upper bound and, when ``exact_bonus > 0``, nothing else does;
  * turning a wrong position into the right digit never lowers the reward.

Random-policy baseline: with max_operand=4, max_new_tokens=4, weights 0.5 / 0.5
and the 15-token vocabulary, a policy sampling each token uniformly from the
vocabulary, stopping at EOS or after 4 tokens, earns an expected reward of
3919/303750 ~= 0.0129 out of 1.0 (1/50 with the default max_new_tokens=2), the same for every question (each sum has
one digit). Only a right first token (probability 1/15) scores:

    E = 1/15 * (1/15 * 1.0 + 14/15 * (1/15 * 0.25 + 14/15 * (1/15 * 0.5/3 + 14/15 * 0.5/4)))

where the inner terms are EOS at position 2, 3, 4, or no EOS at all; the exact
bonus alone contributes 0.5/225 ~= 0.0022.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

import attrs

from core.checks import check_int
from core.match_reward import match_reward, reward_weight
from core.task import BOS_ID, CharTokenizer, Prompt, Rewards, TokenIds, task_seed, validate_responses

ADDITION_ALPHABET = "0123456789+="


def _check_max_operand(instance: object, attribute: attrs.Attribute, value: object) -> None:
    number = check_int("max_operand", value, minimum=0)
    if number > 9:
        raise ValueError(f"'max_operand' must be an int in [0, 9]: got {number}")


def _check_max_new_tokens(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_int("max_new_tokens", value, minimum=1)


def _check_prompts(prompts: object) -> tuple[Prompt, ...]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"'prompts' must be a sequence of Prompt: got {type(prompts).__name__}")
    for row, prompt in enumerate(prompts):
        if not isinstance(prompt, Prompt):
            raise TypeError(f"'prompts[{row}]' must be a Prompt: got {type(prompt).__name__}")
        if not prompt.answer or not all(char in "0123456789" for char in prompt.answer):
            raise ValueError(f"'prompts[{row}].answer' must be a non-empty string of decimal digits: got {prompt.answer!r}")
    return tuple(prompts)


@attrs.frozen
class AdditionTask:
    """Small addition: prompt ``a+b=``, answer the decimal sum then EOS.

    Args:
        max_operand: the largest operand, in ``[0, 9]``.
        max_new_tokens: the generation limit; at least the digits of ``2 * max_operand`` plus one for EOS
            (the default: exactly that, so every extra token is a wrong one).
        digit_weight: the reward for a response whose every position is right (before the bonus).
        exact_bonus: the extra reward for exactly the answer followed by EOS.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: ``max_operand`` is outside ``[0, 9]``, ``max_new_tokens`` cannot hold the
            longest answer plus EOS, or a weight is negative or not finite.

    Example:
        >>> task = AdditionTask()
        >>> p = Prompt(prompt_id=8, text="1+3=", answer="4")
        >>> task.prompt_ids(p), task.rewards([p, p, p], [[7, 2], [7], [7, 7, 2]])
        ((1, 4, 13, 6, 14), (1.0, 0.5, 0.25))
    """

    name: ClassVar[str] = "addition"

    max_operand: int = attrs.field(default=4, validator=_check_max_operand)
    max_new_tokens: int = attrs.field(
        default=attrs.Factory(lambda self: len(str(2 * self.max_operand)) + 1, takes_self=True),
        validator=_check_max_new_tokens,
    )
    digit_weight: float = attrs.field(default=0.5, converter=reward_weight("digit_weight"))
    exact_bonus: float = attrs.field(default=0.5, converter=reward_weight("exact_bonus"))
    tokenizer: CharTokenizer = attrs.field(init=False, factory=lambda: CharTokenizer(ADDITION_ALPHABET), repr=False)

    def __attrs_post_init__(self) -> None:
        needed = len(str(2 * self.max_operand)) + 1
        if self.max_new_tokens < needed:
            raise ValueError(
                f"'max_new_tokens' must be >= {needed} (the digits of the largest sum "
                f"{2 * self.max_operand} plus EOS) for max_operand={self.max_operand}: got {self.max_new_tokens}"
            )

    @property
    def max_reward(self) -> float:
        """The largest reward, earned by exactly the answer followed by EOS."""
        return self.digit_weight + self.exact_bonus

    def prompts(self, seed: int, step: int, count: int) -> tuple[Prompt, ...]:
        """``count`` questions with operands uniform in ``0..max_operand``, drawn from ``task_seed(seed, step)``.

        The draw depends on ``(seed, step)`` only, and ``prompts(seed, step, n)`` is a
        prefix of ``prompts(seed, step, m)`` for ``n <= m``.

        Raises:
            TypeError: an argument is not an int.
            ValueError: ``seed`` is outside ``[0, 2**64)``, or ``step`` or ``count`` is negative.

        Example:
            >>> [p.text for p in AdditionTask().prompts(seed=0, step=0, count=2)]
            ['2+3=', '3+0=']
        """
        rng = random.Random(task_seed(seed, step))
        size = self.max_operand + 1
        out: list[Prompt] = []
        for _ in range(check_int("count", count, minimum=0)):
            a, b = rng.randrange(size), rng.randrange(size)
            out.append(Prompt(prompt_id=a * size + b, text=f"{a}+{b}=", answer=str(a + b)))
        return tuple(out)

    def prompt_ids(self, prompt: Prompt) -> TokenIds:
        """BOS followed by the encoded prompt text.

        Raises:
            TypeError: ``prompt`` is not a ``Prompt``.
            ValueError: the prompt text holds a character outside ``"0123456789+="``.

        Example:
            >>> AdditionTask().prompt_ids(Prompt(prompt_id=0, text="0+0=", answer="0"))
            (1, 3, 13, 3, 14)
        """
        if not isinstance(prompt, Prompt):
            raise TypeError(f"'prompt' must be a Prompt: got {type(prompt).__name__}")
        return (BOS_ID, *self.tokenizer.encode(prompt.text))

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> Rewards:
        """The reward of each response (see the module docstring for the formula).

        Args:
            prompts: the questions.
            responses: ``responses[i]`` answers ``prompts[i]``: generated ids, at most
                ``max_new_tokens`` long, with at most one EOS, at the end.

        Returns:
            One float per response, in ``[0, max_reward]``.

        Raises:
            TypeError: ``prompts`` is not a sequence of ``Prompt``, or a response is not a sequence of ints.
            ValueError: the counts differ, an answer is not a digit string, or a response breaks
                the response contract (negative id, too long, tokens after EOS).

        Example:
            >>> p = Prompt(prompt_id=24, text="4+4=", answer="8")
            >>> AdditionTask().rewards([p], [[11, 2]])
            (1.0,)
        """
        questions = _check_prompts(prompts)
        checked = validate_responses(responses, count=len(questions), max_new_tokens=self.max_new_tokens)
        return tuple(self._reward(q.answer, r) for q, r in zip(questions, checked))

    def _reward(self, answer: str, response: TokenIds) -> float:
        target = self.tokenizer.encode(answer)
        return match_reward(target, response, digit_weight=self.digit_weight, exact_bonus=self.exact_bonus)
