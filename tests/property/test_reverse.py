"""Laws and error paths of the reversal task (``core.reverse``)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.reverse import MARKER, ReverseTask
from core.task import BOS_ID, EOS_ID, Prompt, Task
from tests.property.strategies import reverse_rollouts, reverse_tasks, task_seeds, task_steps

TASK = ReverseTask()


def _digits_of(prompt_id: int, task: ReverseTask) -> str:
    """The question whose id is ``prompt_id``: its base-``digits`` numeral, ``length`` digits wide."""
    out = []
    for _ in range(task.length):
        prompt_id, digit = divmod(prompt_id, task.digits)
        out.append(str(digit))
    assert prompt_id == 0
    return "".join(reversed(out))


# ---------------------------------------------------------------- construction and protocol


def test_reverse_task_implements_task_with_its_defaults() -> None:
    """The default task is a Task: 10 digits of 0..3, 11-token responses, the 8-token vocabulary '0123>'."""
    assert isinstance(TASK, Task)
    assert (TASK.name, TASK.length, TASK.digits, TASK.max_new_tokens) == ("reverse", 10, 4, 11)
    assert (TASK.tokenizer.alphabet, TASK.tokenizer.vocab_size, TASK.max_reward) == ("0123>", 8, 1.0)
    assert ReverseTask(length=3, digits=10).tokenizer.alphabet == "0123456789>"
    assert ReverseTask(length=7).max_new_tokens == 8  # the answer plus EOS


@given(reverse_tasks())
def test_reverse_task_evolve_keeps_invariants(task: ReverseTask) -> None:
    """Every generated task is a Task, and evolving a field re-runs the checks (and rebuilds the tokenizer)."""
    assert isinstance(task, Task)
    with pytest.raises(ValueError, match=f"'max_new_tokens' must be >= {task.length + 1} "):
        attrs.evolve(task, max_new_tokens=task.length)
    assert attrs.evolve(task, digits=2).tokenizer.alphabet == "01" + MARKER


def test_reverse_task_rejects_bad_fields() -> None:
    """Each field's misuse names the field, the expected and the got value."""
    with pytest.raises(ValueError, match="'length' must be >= 1: got 0"):
        ReverseTask(length=0)
    with pytest.raises(TypeError, match="'length' must be an int: got float"):
        ReverseTask(length=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'digits' must be an int in \[2, 10\]: got 11"):
        ReverseTask(digits=11)
    with pytest.raises(ValueError, match="'digits' must be >= 2: got 1"):
        ReverseTask(digits=1)
    with pytest.raises(TypeError, match="'digits' must be an int: got bool"):
        ReverseTask(digits=True)
    with pytest.raises(TypeError, match="'digits' must be an int: got str"):
        ReverseTask(digits="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'length' must be an int: got str"):
        ReverseTask(length="8")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"'max_new_tokens' must be >= 9 \(the 8 digits of the answer plus EOS\) for length=8: got 8"
    ):
        ReverseTask(length=8, max_new_tokens=8)
    with pytest.raises(ValueError, match="'max_new_tokens' must be >= 1: got 0"):
        ReverseTask(max_new_tokens=0)
    with pytest.raises(ValueError, match="'digit_weight' must be a finite real number >= 0: got -1"):
        ReverseTask(digit_weight=-1)
    with pytest.raises(ValueError, match="'exact_bonus' must be a finite real number >= 0: got inf"):
        ReverseTask(exact_bonus=math.inf)


# ---------------------------------------------------------------- prompts and prompt_ids


@given(reverse_tasks(), task_seeds, task_steps, st.integers(0, 40))
def test_prompts_deterministic_and_well_formed(task: ReverseTask, seed: int, step: int, count: int) -> None:
    """prompts is a function of (seed, step, count); each is `length` digits of 0..digits-1 then '>', answered by the reversal."""
    first = task.prompts(seed, step, count)
    random.seed(12345)  # the global RNG has no influence
    assert task.prompts(seed, step, count) == first
    assert len(first) == count
    for prompt in first:
        body = prompt.text.removesuffix(MARKER)
        assert prompt.text == body + MARKER and len(body) == task.length
        assert all(int(char) < task.digits for char in body)
        assert prompt.answer == body[::-1]


@given(reverse_tasks(), task_seeds, task_steps)
def test_prompt_id_is_the_base_digits_numeral(task: ReverseTask, seed: int, step: int) -> None:
    """prompt_id is the question read as a base-``digits`` number: it decodes back to the question (so equal
    questions share an id and different ones do not) and lies in [0, digits**length)."""
    for prompt in task.prompts(seed, step, 8):
        assert 0 <= prompt.prompt_id < task.digits**task.length
        assert _digits_of(prompt.prompt_id, task) + MARKER == prompt.text


@given(reverse_tasks(), task_seeds, task_steps, st.integers(0, 20), st.integers(0, 20))
def test_prompts_shorter_count_is_prefix(task: ReverseTask, seed: int, step: int, n: int, extra: int) -> None:
    """prompts(seed, step, n) is a prefix of prompts(seed, step, n + extra)."""
    assert task.prompts(seed, step, n + extra)[:n] == task.prompts(seed, step, n)


@settings(max_examples=25)
@given(reverse_tasks().filter(lambda t: t.digits**t.length >= 16), task_seeds)
def test_prompts_differ_across_steps(task: ReverseTask, seed: int) -> None:
    """Different steps (and different seeds) draw different prompt sequences of 32."""
    assert len({task.prompts(seed, step, 32) for step in range(20)}) == 20
    assert task.prompts(seed, 0, 32) != task.prompts((seed + 1) % 2**64, 0, 32)


def test_prompts_cover_every_question() -> None:
    """Over enough draws every question of a small task appears, with ids 0..digits**length - 1."""
    ids = {p.prompt_id for p in ReverseTask(length=2, digits=3).prompts(seed=7, step=3, count=500)}
    assert ids == set(range(9))


def test_prompts_rejects_bad_arguments() -> None:
    """count and step must be non-negative ints and seed in [0, 2**64)."""
    with pytest.raises(ValueError, match="'count' must be >= 0: got -1"):
        TASK.prompts(0, 0, -1)
    with pytest.raises(ValueError, match="'step' must be >= 0: got -3"):
        TASK.prompts(0, -3, 1)
    with pytest.raises(ValueError, match=r"'seed' must be in \[0, 2\*\*64\): got 18446744073709551616"):
        TASK.prompts(2**64, 0, 1)
    with pytest.raises(TypeError, match="'seed' must be an int: got float"):
        TASK.prompts(0.5, 0, 1)  # type: ignore[arg-type]


@given(reverse_tasks(), task_seeds, task_steps)
def test_prompt_ids_is_bos_then_text_and_round_trips(task: ReverseTask, seed: int, step: int) -> None:
    """prompt_ids is BOS then the encoded text, decodes back to the text, and the answer round-trips too."""
    (prompt,) = task.prompts(seed, step, 1)
    ids = task.prompt_ids(prompt)
    assert ids == (BOS_ID, *task.tokenizer.encode(prompt.text)) and len(ids) == task.length + 2
    assert task.tokenizer.decode(ids) == prompt.text
    assert task.tokenizer.decode((*task.tokenizer.encode(prompt.answer), EOS_ID)) == prompt.answer


def test_prompt_ids_rejects_non_prompt_and_foreign_text() -> None:
    """prompt_ids needs a Prompt whose text is over the task's alphabet (digit 7 is not one of 0..3)."""
    with pytest.raises(TypeError, match="'prompt' must be a Prompt: got str"):
        TASK.prompt_ids("0123>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got '7' at position 1"):
        TASK.prompt_ids(Prompt(prompt_id=0, text="07>", answer="70"))


# ---------------------------------------------------------------- rewards


def _reference_reward(task: ReverseTask, answer: str, response: tuple[int, ...]) -> float:
    """The reward written out on characters: None stands for an id with no character."""
    chars = [task.tokenizer.alphabet[t - 3] if 3 <= t < task.tokenizer.vocab_size else None for t in response]
    ended = bool(response) and response[-1] == EOS_ID
    generated = chars[:-1] if ended else chars
    matches = sum(1 for i, ch in enumerate(generated) if i < len(answer) and ch == answer[i])
    credit = task.digit_weight * (matches / max(len(answer), len(generated)))
    return credit + (task.exact_bonus if ended and generated == list(answer) else 0.0)


@given(reverse_rollouts())
def test_rewards_matches_reference_and_bounds(rollout: tuple[ReverseTask, Prompt, tuple[int, ...]]) -> None:
    """rewards equals the character-level reference and lies in [0, digit_weight + exact_bonus]."""
    task, prompt, response = rollout
    (reward,) = task.rewards([prompt], [response])
    assert reward == _reference_reward(task, prompt.answer, response)
    assert 0.0 <= reward <= task.max_reward == task.digit_weight + task.exact_bonus


@given(reverse_rollouts(positive_weights=True))
def test_rewards_exact_reversal_is_the_unique_max(rollout: tuple[ReverseTask, Prompt, tuple[int, ...]]) -> None:
    """The reversal followed by EOS scores max_reward; any other response scores strictly less when exact_bonus > 0."""
    task, prompt, response = rollout
    exact = (*task.tokenizer.encode(prompt.answer), EOS_ID)
    best, other = task.rewards([prompt, prompt], [exact, response])
    assert best == task.max_reward
    assert other < best or response == exact


@given(reverse_rollouts(positive_weights=True))
def test_rewards_copying_the_question_wins_only_on_palindromes(rollout: tuple[ReverseTask, Prompt, tuple[int, ...]]) -> None:
    """Echoing the question's digits (then EOS) earns max_reward exactly when the question reads the same reversed."""
    task, prompt, _ = rollout
    echo = (*task.tokenizer.encode(prompt.text.removesuffix(MARKER)), EOS_ID)
    (reward,) = task.rewards([prompt], [echo])
    assert (reward == task.max_reward) == (prompt.answer == prompt.answer[::-1])


def test_rewards_worked_example() -> None:
    """The worked example of docs/tasks.md: '0123>' (answer '3210') against five responses."""
    task = ReverseTask(length=4)
    prompt = Prompt(prompt_id=27, text="0123>", answer="3210")
    ids = task.tokenizer.encode
    responses = [
        [*ids("3210"), EOS_ID],  # exact: 0.5 + 0.5
        [*ids("3210"), ids("0")[0]],  # no EOS, one extra digit: 4 of 5
        [*ids("3200"), EOS_ID],  # one wrong digit: 3 of 4
        [*ids("0123"), EOS_ID],  # the question echoed: 0 of 4
        [*ids("321"), EOS_ID],  # one digit short: 3 of 4
    ]
    assert task.rewards([prompt] * 5, responses) == (1.0, 0.5 * (4 / 5), 0.5 * (3 / 4), 0.0, 0.5 * (3 / 4))


@pytest.mark.parametrize(("length", "digits", "max_new_tokens"), [(1, 2, None), (2, 3, None), (3, 2, 5), (2, 10, None)])
def test_random_policy_reward_matches_enumeration(length: int, digits: int, max_new_tokens: int | None) -> None:
    """random_policy_reward equals the expectation over every response of a uniform policy (enumerated), for any question."""
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    task = ReverseTask(length=length, digits=digits, **kwargs)
    vocab = task.tokenizer.vocab_size
    leaves: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while frontier:
        prefix = frontier.pop()
        if prefix and (prefix[-1] == EOS_ID or len(prefix) == task.max_new_tokens):
            leaves.append(prefix)
        else:
            frontier.extend((*prefix, t) for t in range(vocab))
    for prompt in task.prompts(seed=0, step=0, count=3):
        rewards = task.rewards([prompt] * len(leaves), leaves)
        expected = sum(Fraction(r).limit_denominator(1000) * Fraction(1, vocab ** len(leaf)) for r, leaf in zip(rewards, leaves))
        assert expected == task.random_policy_reward()


def test_random_policy_reward_of_the_defaults_is_documented() -> None:
    """The default task's random-policy reward is the module docstring's 3340335311/94489280512 (~0.0354)."""
    assert TASK.random_policy_reward() == Fraction(3340335311, 94489280512)
    assert round(float(TASK.random_policy_reward()), 4) == 0.0354


def test_rewards_rejects_misuse() -> None:
    """Mismatched counts, non-Prompt entries, answers outside the task's digits and contract breaches are rejected."""
    prompt = Prompt(prompt_id=0, text="0000000000>", answer="0000000000")
    with pytest.raises(ValueError, match=r"'responses' must have 2 entries \(one per prompt\): got 1"):
        TASK.rewards([prompt, prompt], [[3, 2]])
    with pytest.raises(TypeError, match=r"'prompts\[0\]' must be a Prompt: got str"):
        TASK.rewards(["0>"], [[3, 2]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'prompts' must be a sequence of Prompt: got generator"):
        TASK.rewards((p for p in [prompt]), [[3, 2]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'prompts\[0\]\.answer' must be a non-empty string of the digits '0123': got '19'"):
        TASK.rewards([Prompt(prompt_id=0, text="91>", answer="19")], [[3, 2]])
    with pytest.raises(ValueError, match=r"'prompts\[0\]\.answer' must be a non-empty string of the digits '0123': got ''"):
        TASK.rewards([Prompt(prompt_id=0, text=">", answer="")], [[3, 2]])
    with pytest.raises(ValueError, match=r"'responses\[0\]' must hold EOS only as its last id"):
        TASK.rewards([prompt], [[2, 3]])
    with pytest.raises(ValueError, match=r"'responses\[0\]' must hold at most max_new_tokens=11 ids: got 12"):
        TASK.rewards([prompt], [[3] * 12])
