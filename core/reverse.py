"""``ReverseTask``: answer ``d1 d2 ... dn>`` with the digits reversed, then EOS.

A generation-heavy task: every response is ``length`` digits plus EOS, so the
rollout's token-by-token sampling takes most of a synchronous GRPO step (the
addition task answers in 2 tokens).

Each of the ``length`` digits is drawn uniformly from the first ``digits``
decimal digits ``0..digits-1``; the question ``s>`` (``s`` the digit string) has
the stable id ``int(s, digits)``, its digits read as a base-``digits`` number, so
equal questions have equal ids and the ids of one task are ``0..digits**length - 1``.

Reward: the position-match reward of ``core.match_reward`` against the reversed
string, as for addition:

    reward = digit_weight * (#{i : gen[i] == ans[i]}) / max(len(ans), len(gen))
           + exact_bonus * [response == ans + EOS]

so every right position earns ``digit_weight / length`` (the credit is dense:
a policy learns position by position), extra or missing tokens dilute it, and
only the exact reversal followed by EOS earns the bonus.

Invariants (checked on construction and in ``tests/property/test_reverse.py``):
  * ``length >= 1``; ``2 <= digits <= 10``; ``max_new_tokens >= length + 1``;
    ``digit_weight, exact_bonus >= 0`` and finite;
  * every reward lies in ``[0, digit_weight + exact_bonus]``; the reversal followed
    by EOS reaches the upper bound and, when ``exact_bonus > 0``, nothing else does;
  * turning a wrong position into the right digit never lowers the reward.

Random-policy baseline: with the defaults (length 10, digits 4, so 11-token
responses, an 8-token vocabulary of 3 specials, ``0123`` and ``>``, weights
0.5 / 0.5) a policy sampling each token uniformly from the vocabulary, stopping
at EOS or after 11 tokens, earns an expected reward of
3340335311/94489280512 ~= 0.0354 out of 1.0, the same for every question. Of the
``g`` tokens before EOS (``g = k < 11`` with probability ``(7/8)**k / 8``, or 11
with probability ``(7/8)**11``), each of the first ``min(g, 10)`` is right with
probability 1/7, so

    E = 0.5 * sum_g P(g) * (min(g, 10) / 7) / max(10, g) + 0.5 * 8**-11

where the exact bonus adds only ``0.5 * 8**-11 ~= 5.8e-11``. A mean reward well
above 0.035 means learning. ``ReverseTask.random_policy_reward`` computes the
value for any configuration (a test checks it against an enumeration).

Defaults, tuned on the default policy of ``shell/grpo.yaml`` (a 2-layer GPT of
width 64, 32 prompts x 8 responses a step): the longest row, BOS + 10 digits +
``>`` + 10 digits + EOS = 23 tokens, fits ``max_sequence_length`` 32, and GRPO
lifts the mean reward from under 0.1 past 0.8 within 120 steps at seeds 0-2
(``docs/tasks.md`` has the curves). With all ten digit values, or 12-digit
questions, it learns more slowly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction
from typing import ClassVar

import attrs

from core.checks import check_int
from core.match_reward import match_reward, reward_weight
from core.task import BOS_ID, CharTokenizer, Prompt, Rewards, TokenIds, task_seed, validate_responses

DECIMAL_DIGITS = "0123456789"
MARKER = ">"
"""Ends the digit string of a prompt: the response starts after it."""


def _length(value: object) -> int:
    return check_int("length", value, minimum=1)


def _digits(value: object) -> int:
    number = check_int("digits", value, minimum=2)
    if number > 10:
        raise ValueError(f"'digits' must be an int in [2, 10]: got {number}")
    return number


def _check_length(instance: object, attribute: attrs.Attribute, value: object) -> None:
    _length(value)


def _check_digits(instance: object, attribute: attrs.Attribute, value: object) -> None:
    _digits(value)


def _check_max_new_tokens(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_int("max_new_tokens", value, minimum=1)


# The defaults below are built before the validators run: they check the fields they read.
def _default_max_new_tokens(task: ReverseTask) -> int:
    return _length(task.length) + 1


def _tokenizer(task: ReverseTask) -> CharTokenizer:
    return CharTokenizer(DECIMAL_DIGITS[: _digits(task.digits)] + MARKER)


@attrs.frozen
class ReverseTask:
    """String reversal: prompt ``s>`` with ``s`` a digit string, answer ``s`` reversed then EOS.

    Args:
        length: the number of digits of every question (and of every answer).
        digits: how many digit values a question uses, ``0..digits-1``, in ``[2, 10]``;
            the alphabet is those digits and ``>``.
        max_new_tokens: the generation limit; at least ``length + 1`` (the answer plus EOS,
            the default: so every extra token is a wrong one).
        digit_weight: the reward for a response whose every position is right (before the bonus).
        exact_bonus: the extra reward for exactly the answer followed by EOS.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: ``length`` is below 1, ``digits`` is outside ``[2, 10]``, ``max_new_tokens``
            cannot hold the answer plus EOS, or a weight is negative or not finite.

    Example:
        >>> task = ReverseTask(length=3)
        >>> p = Prompt(prompt_id=6, text="012>", answer="210")  # id: "012" in base 4
        >>> task.prompt_ids(p), task.rewards([p, p, p], [[5, 4, 3, 2], [5, 4, 3], [5, 5, 5, 2]])
        ((1, 3, 4, 5, 7), (1.0, 0.5, 0.16666666666666666))
    """

    name: ClassVar[str] = "reverse"

    length: int = attrs.field(default=10, validator=_check_length)
    digits: int = attrs.field(default=4, validator=_check_digits)
    max_new_tokens: int = attrs.field(
        default=attrs.Factory(_default_max_new_tokens, takes_self=True), validator=_check_max_new_tokens
    )
    digit_weight: float = attrs.field(default=0.5, converter=reward_weight("digit_weight"))
    exact_bonus: float = attrs.field(default=0.5, converter=reward_weight("exact_bonus"))
    tokenizer: CharTokenizer = attrs.field(init=False, default=attrs.Factory(_tokenizer, takes_self=True), repr=False)

    def __attrs_post_init__(self) -> None:
        if self.max_new_tokens < self.length + 1:
            raise ValueError(
                f"'max_new_tokens' must be >= {self.length + 1} (the {self.length} digits of the answer plus EOS) "
                f"for length={self.length}: got {self.max_new_tokens}"
            )

    @property
    def max_reward(self) -> float:
        """The largest reward, earned by exactly the answer followed by EOS."""
        return self.digit_weight + self.exact_bonus

    def prompts(self, seed: int, step: int, count: int) -> tuple[Prompt, ...]:
        """``count`` questions of ``length`` digits uniform in ``0..digits-1``, drawn from ``task_seed(seed, step)``.

        The draw depends on ``(seed, step)`` only, and ``prompts(seed, step, n)`` is a
        prefix of ``prompts(seed, step, m)`` for ``n <= m``.

        Raises:
            TypeError: an argument is not an int.
            ValueError: ``seed`` is outside ``[0, 2**64)``, or ``step`` or ``count`` is negative.

        Example:
            >>> [p.text for p in ReverseTask(length=4, digits=3).prompts(seed=0, step=0, count=2)]
            ['1211>', '0110>']
        """
        rng = random.Random(task_seed(seed, step))
        out: list[Prompt] = []
        for _ in range(check_int("count", count, minimum=0)):
            text = "".join(DECIMAL_DIGITS[rng.randrange(self.digits)] for _ in range(self.length))
            out.append(Prompt(prompt_id=int(text, self.digits), text=text + MARKER, answer=text[::-1]))
        return tuple(out)

    def prompt_ids(self, prompt: Prompt) -> TokenIds:
        """BOS followed by the encoded prompt text.

        Raises:
            TypeError: ``prompt`` is not a ``Prompt``.
            ValueError: the prompt text holds a character outside the task's alphabet.

        Example:
            >>> ReverseTask(length=2).prompt_ids(Prompt(prompt_id=1, text="01>", answer="10"))
            (1, 3, 4, 7)
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
            ValueError: the counts differ, an answer is not a non-empty string of the task's digits,
                or a response breaks the response contract (negative id, too long, tokens after EOS).

        Example:
            >>> p = Prompt(prompt_id=1, text="01>", answer="10")
            >>> ReverseTask(length=2).rewards([p, p], [[4, 3, 2], [4, 4, 2]])
            (1.0, 0.25)
        """
        questions = self._check_prompts(prompts)
        checked = validate_responses(responses, count=len(questions), max_new_tokens=self.max_new_tokens)
        return tuple(
            match_reward(self.tokenizer.encode(q.answer), r, digit_weight=self.digit_weight, exact_bonus=self.exact_bonus)
            for q, r in zip(questions, checked)
        )

    def random_policy_reward(self) -> Fraction:
        """The exact expected reward of a policy drawing each token uniformly from the vocabulary.

        It stops at EOS or after ``max_new_tokens`` tokens; the value is the same for every
        question. The weights enter as the exact value of their floats.

        Example:
            >>> ReverseTask().random_policy_reward(), ReverseTask(length=1, digits=2, exact_bonus=0).random_policy_reward()
            (Fraction(3340335311, 94489280512), Fraction(7, 144))
        """
        vocab = self.tokenizer.vocab_size
        go_on = Fraction(vocab - 1, vocab)  # any token but EOS
        right = Fraction(1, vocab - 1)  # one given character, knowing the token is not EOS
        expected = Fraction(0)
        for before_eos in range(self.max_new_tokens + 1):
            if before_eos < self.max_new_tokens:
                chance = go_on**before_eos / vocab  # EOS as token before_eos + 1
            else:
                chance = go_on**before_eos  # cut at max_new_tokens without EOS
            matches = min(before_eos, self.length) * right
            expected += chance * Fraction(self.digit_weight) * matches / max(self.length, before_eos)
        return expected + Fraction(self.exact_bonus) * Fraction(1, vocab) ** (self.length + 1)

    def _check_prompts(self, prompts: object) -> tuple[Prompt, ...]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"'prompts' must be a sequence of Prompt: got {type(prompts).__name__}")
        alphabet = DECIMAL_DIGITS[: self.digits]
        for row, prompt in enumerate(prompts):
            if not isinstance(prompt, Prompt):
                raise TypeError(f"'prompts[{row}]' must be a Prompt: got {type(prompt).__name__}")
            if not prompt.answer or not all(char in alphabet for char in prompt.answer):
                raise ValueError(
                    f"'prompts[{row}].answer' must be a non-empty string of the digits {alphabet!r}: got {prompt.answer!r}"
                )
        return tuple(prompts)
