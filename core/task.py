"""The RL task interface: a character tokenizer, a prompt record and the ``Task`` protocol.

A *task* hands out prompts, turns a prompt into the token ids the policy sees,
and scores the policy's responses. Another task or reward is one new module
with a class that satisfies ``Task`` (see ``docs/tasks.md``).

Invariants:
  * token ids are ``PAD_ID = 0``, ``BOS_ID = 1``, ``EOS_ID = 2``, then one id per
    alphabet character in alphabet order; the alphabet has unique characters, so
    ``tok.decode(tok.encode(s)) == s`` for every string ``s`` over it;
  * ``Task.prompts(seed, step, count)`` depends only on its arguments (no global
    RNG, no ``hash()``): seed a ``random.Random`` with ``task_seed(seed, step)``;
  * a response is the generated token ids *after* the prompt, cut by the rollout
    at the first EOS: it holds at most ``max_new_tokens`` ids and at most one
    EOS, at its end (``validate_responses`` checks this contract).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from core.checks import check_int, check_int_entries

TokenIds = tuple[int, ...]  # token ids of one sequence, no padding
Responses = tuple[TokenIds, ...]  # one response per prompt, in prompt order
Rewards = tuple[float, ...]  # one scalar reward per response

PAD_ID: int = 0
BOS_ID: int = 1
EOS_ID: int = 2
NUM_SPECIAL_TOKENS: int = 3
_SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>")
_MASK64 = (1 << 64) - 1


def _check_alphabet(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"'alphabet' must be a str of unique characters: got {type(value).__name__}")
    if not value:
        raise ValueError("'alphabet' must be a non-empty str of unique characters: got ''")
    seen: dict[str, int] = {}
    for position, char in enumerate(value):
        if char in seen:
            raise ValueError(
                f"'alphabet' must have unique characters: got {char!r} at positions {seen[char]} and {position}"
            )
        seen[char] = position


@attrs.frozen
class CharTokenizer:
    """A character tokenizer: three special tokens, then one id per alphabet character.

    Args:
        alphabet: the characters, each once; character ``alphabet[i]`` has id ``3 + i``.

    Raises:
        TypeError: ``alphabet`` is not a str.
        ValueError: ``alphabet`` is empty or repeats a character.

    Example:
        >>> tok = CharTokenizer("0123456789+=")
        >>> tok.vocab_size, tok.encode("3+4="), tok.decode((1, 6, 13, 7, 14, 2, 5))
        (15, (6, 13, 7, 14), '3+4=')
    """

    alphabet: str = attrs.field(validator=_check_alphabet)

    @property
    def vocab_size(self) -> int:
        """The number of token ids: 3 specials plus one per alphabet character."""
        return NUM_SPECIAL_TOKENS + len(self.alphabet)

    def padded_vocab_size(self, multiple: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``multiple`` (e.g. the tensor-parallel size).

        Args:
            multiple: a positive int.

        Returns:
            The smallest multiple of ``multiple`` that is ``>= vocab_size``.

        Raises:
            TypeError: ``multiple`` is not an int.
            ValueError: ``multiple`` is below 1.

        Example:
            >>> CharTokenizer("0123456789+=").padded_vocab_size(4)
            16
        """
        step = check_int("multiple", multiple, minimum=1)
        return -(-self.vocab_size // step) * step

    def encode(self, text: str) -> TokenIds:
        """The ids of ``text``'s characters, without BOS or EOS.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: ``text`` holds a character outside the alphabet (the first is named, with its position).

        Example:
            >>> CharTokenizer("ab").encode("ba")
            (4, 3)
        """
        if not isinstance(text, str):
            raise TypeError(f"'text' must be a str: got {type(text).__name__}")
        ids: list[int] = []
        for position, char in enumerate(text):
            index = self.alphabet.find(char)
            if index < 0:
                raise ValueError(
                    f"'text' must only hold characters of the alphabet {self.alphabet!r}: got {char!r} at position {position}"
                )
            ids.append(NUM_SPECIAL_TOKENS + index)
        return tuple(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids``: PAD and BOS are skipped, and decoding stops at the first EOS.

        Raises:
            TypeError: ``ids`` is not a sequence of ints.
            ValueError: an id is outside ``range(vocab_size)``.

        Example:
            >>> CharTokenizer("ab").decode([1, 3, 4, 2, 3])
            'ab'
        """
        ids = _check_ids("ids", ids)
        chars: list[str] = []
        for position, token in enumerate(ids):
            if token >= self.vocab_size:
                raise ValueError(f"'ids' entries must be token ids in [0, {self.vocab_size}): got {token} at index {position}")
            if token == EOS_ID:
                break
            if token >= NUM_SPECIAL_TOKENS:
                chars.append(self.alphabet[token - NUM_SPECIAL_TOKENS])
        return "".join(chars)

    def token_name(self, token: int) -> str:
        """A readable name for one id: its character, or ``<pad>``, ``<bos>``, ``<eos>``.

        Raises:
            TypeError: ``token`` is not an int.
            ValueError: ``token`` is outside ``range(vocab_size)``.

        Example:
            >>> CharTokenizer("ab").token_name(2), CharTokenizer("ab").token_name(4)
            ('<eos>', 'b')
        """
        token = check_int("token", token, minimum=0)
        if token >= self.vocab_size:
            raise ValueError(f"'token' must be a token id in [0, {self.vocab_size}): got {token}")
        if token < NUM_SPECIAL_TOKENS:
            return _SPECIAL_NAMES[token]
        return self.alphabet[token - NUM_SPECIAL_TOKENS]


def _check_ids(name: str, ids: object) -> TokenIds:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(
            f"'{name}' must be a sequence of int token ids: got {type(ids).__name__}; pass a list, e.g. tensor.tolist()"
        )
    return check_int_entries(name, ids, minimum=0)


def _check_str(name: str) -> Callable[[object, attrs.Attribute, object], None]:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str):
            raise TypeError(f"'{name}' must be a str: got {type(value).__name__}")

    return check


def _check_prompt_id(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_int("prompt_id", value, minimum=0)


@attrs.frozen
class Prompt:
    """One question of a task.

    Args:
        prompt_id: a non-negative int naming the question; equal questions have equal ids
            (so responses to one question can be grouped and tracked across steps).
        text: the prompt text the policy sees (after BOS).
        answer: the reference answer the reward compares with.

    Raises:
        TypeError: ``prompt_id`` is not an int, or ``text`` / ``answer`` is not a str.
        ValueError: ``prompt_id`` is negative.

    Example:
        >>> Prompt(prompt_id=7, text="1+2=", answer="3").answer
        '3'
    """

    prompt_id: int = attrs.field(validator=_check_prompt_id)
    text: str = attrs.field(validator=_check_str("text"))
    answer: str = attrs.field(validator=_check_str("answer"))


@runtime_checkable
class Task(Protocol):
    """What the GRPO job needs from a task; implement it in a class of your own.

    Attributes:
        name: a short name for logs and metrics, e.g. ``"addition"``.
        tokenizer: the tokenizer of prompts and responses.
        max_new_tokens: the most tokens the rollout generates per response (EOS included).
    """

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> CharTokenizer: ...

    @property
    def max_new_tokens(self) -> int: ...

    def prompts(self, seed: int, step: int, count: int) -> tuple[Prompt, ...]:
        """``count`` prompts for training step ``step``, a function of ``(seed, step, count)`` only."""
        ...

    def prompt_ids(self, prompt: Prompt) -> TokenIds:
        """The token ids the policy is conditioned on: BOS, then the encoded prompt text."""
        ...

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> Rewards:
        """One reward per response; ``responses[i]`` answers ``prompts[i]`` and follows the response contract."""
        ...


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def task_seed(seed: int, step: int) -> int:
    """A 64-bit seed for the prompts of ``step``, mixed from ``(seed, step)`` with SplitMix64.

    Stable across processes and Python versions (it never uses ``hash()``); seed a
    ``random.Random`` with it.

    Args:
        seed: the run's seed, in ``[0, 2**64)``.
        step: the training step, ``>= 0``.

    Returns:
        An int in ``[0, 2**64)``.

    Raises:
        TypeError: ``seed`` or ``step`` is not an int.
        ValueError: ``seed`` is outside ``[0, 2**64)`` or ``step`` is negative.

    Example:
        >>> task_seed(0, 1) == task_seed(0, 1) != task_seed(0, 2)
        True
    """
    seed = check_int("seed", seed, minimum=0)
    step = check_int("step", step, minimum=0)
    if seed > _MASK64:
        raise ValueError(f"'seed' must be in [0, 2**64): got {seed}")
    return _splitmix64(_splitmix64(seed) ^ (step & _MASK64))


def validate_responses(responses: Sequence[Sequence[int]], *, count: int, max_new_tokens: int) -> Responses:
    """``responses`` as tuples of ints, checked against the response contract.

    The contract: one response per prompt, each a sequence of non-negative int ids,
    at most ``max_new_tokens`` long, with at most one EOS, at its end. Ids are not
    checked against a vocabulary: a model whose vocabulary is padded can sample ids
    with no character, and a reward must score them (as wrong), not fail.

    Args:
        responses: the generated ids, one sequence per prompt.
        count: the number of prompts.
        max_new_tokens: the task's generation limit.

    Returns:
        The responses as a tuple of int tuples.

    Raises:
        TypeError: ``responses`` or one response is not a sequence of ints.
        ValueError: the count differs from ``count``, an id is negative, a response is too long,
            or an EOS is followed by more tokens.

    Example:
        >>> validate_responses([[6, 2], [7]], count=2, max_new_tokens=4)
        ((6, 2), (7,))
    """
    if isinstance(responses, (str, bytes)) or not isinstance(responses, Sequence):
        raise TypeError(f"'responses' must be a sequence of token-id sequences: got {type(responses).__name__}")
    if len(responses) != count:
        raise ValueError(f"'responses' must have {count} entries (one per prompt): got {len(responses)}")
    out: list[TokenIds] = []
    for row, response in enumerate(responses):
        ids = _check_ids(f"responses[{row}]", response)
        if len(ids) > max_new_tokens:
            raise ValueError(f"'responses[{row}]' must hold at most max_new_tokens={max_new_tokens} ids: got {len(ids)}")
        if EOS_ID in ids[:-1]:
            raise ValueError(
                f"'responses[{row}]' must hold EOS only as its last id (the rollout cuts at the first EOS): "
                f"got EOS at position {ids.index(EOS_ID)} of {len(ids)}"
            )
        out.append(ids)
    return tuple(out)
