"""Laws and error paths of the task interface (``core.task``) and the addition task (``core.addition``)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.addition import ADDITION_ALPHABET, AdditionTask
from core.task import (
    BOS_ID,
    EOS_ID,
    NUM_SPECIAL_TOKENS,
    PAD_ID,
    CharTokenizer,
    Prompt,
    Task,
    task_seed,
    validate_responses,
)
from tests.property.strategies import (
    addition_rollouts,
    addition_tasks,
    alphabet_and_foreign_text,
    alphabet_and_text,
    reverse_rollouts,
    task_seeds,
    task_steps,
    tokenizer_alphabets,
)

TOK = CharTokenizer(ADDITION_ALPHABET)


def _digit_ids(text: str) -> list[int]:
    return list(TOK.encode(text))


# ---------------------------------------------------------------- CharTokenizer


def test_special_token_ids_are_fixed() -> None:
    """PAD, BOS and EOS are ids 0, 1, 2 and characters start at 3."""
    assert (PAD_ID, BOS_ID, EOS_ID, NUM_SPECIAL_TOKENS) == (0, 1, 2, 3)
    assert TOK.encode("0") == (3,)


@given(alphabet_and_text())
def test_encode_decode_round_trip(case: tuple[str, str]) -> None:
    """decode(encode(s)) == s for every string over the alphabet, and encode gives one id per character."""
    alphabet, text = case
    tok = CharTokenizer(alphabet)
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(NUM_SPECIAL_TOKENS <= t < tok.vocab_size for t in ids)
    assert tok.decode(ids) == text


@given(alphabet_and_text(), st.integers(0, 4), st.integers(0, 4), st.lists(st.integers(0, 20), max_size=4))
def test_decode_skips_pad_bos_and_stops_at_eos(case: tuple[str, str], pads: int, bos: int, tail: list[int]) -> None:
    """PAD and BOS render as nothing and everything after the first EOS is ignored."""
    alphabet, text = case
    tok = CharTokenizer(alphabet)
    ids = [PAD_ID] * pads + [BOS_ID] * bos + list(tok.encode(text)) + [EOS_ID] + [t % tok.vocab_size for t in tail]
    assert tok.decode(ids) == text


@given(alphabet_and_foreign_text())
def test_encode_rejects_unknown_character(case: tuple[str, str, int]) -> None:
    """encode names the first character outside the alphabet and its position."""
    alphabet, text, position = case
    with pytest.raises(ValueError, match=f"'text' must only hold characters of the alphabet .*: got .* at position {position}$"):
        CharTokenizer(alphabet).encode(text)


def test_encode_rejects_non_str() -> None:
    """encode of a non-str is a TypeError."""
    with pytest.raises(TypeError, match="'text' must be a str: got list"):
        TOK.encode(["1"])  # type: ignore[arg-type]


def test_decode_rejects_out_of_range_id() -> None:
    """decode rejects an id at or past vocab_size, naming its position."""
    with pytest.raises(ValueError, match=r"'ids' entries must be token ids in \[0, 15\): got 15 at index 1"):
        TOK.decode([3, 15])


def test_decode_rejects_non_sequence_and_negative_id() -> None:
    """decode rejects a non-sequence (with the .tolist() hint) and a negative id."""
    with pytest.raises(TypeError, match=r"'ids' must be a sequence of int token ids: got str; .*tolist\(\)"):
        TOK.decode("12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'ids' entries must be >= 0: got -1 at index 0"):
        TOK.decode([-1])


@given(tokenizer_alphabets)
def test_vocab_size_counts_specials_and_alphabet(alphabet: str) -> None:
    """vocab_size == 3 + len(alphabet)."""
    assert CharTokenizer(alphabet).vocab_size == 3 + len(alphabet)


@given(tokenizer_alphabets, st.integers(1, 64))
def test_padded_vocab_size_is_smallest_multiple(alphabet: str, multiple: int) -> None:
    """padded_vocab_size(m) is the smallest multiple of m that is >= vocab_size."""
    tok = CharTokenizer(alphabet)
    padded = tok.padded_vocab_size(multiple)
    assert padded % multiple == 0
    assert tok.vocab_size <= padded < tok.vocab_size + multiple


def test_padded_vocab_size_rejects_non_positive_multiple() -> None:
    """padded_vocab_size needs a positive int multiple."""
    with pytest.raises(ValueError, match="'multiple' must be >= 1: got 0"):
        TOK.padded_vocab_size(0)
    with pytest.raises(TypeError, match="'multiple' must be an int: got float"):
        TOK.padded_vocab_size(2.0)  # type: ignore[arg-type]


def test_char_tokenizer_rejects_bad_alphabet() -> None:
    """The alphabet must be a non-empty str without repeated characters."""
    with pytest.raises(ValueError, match="'alphabet' must have unique characters: got '1' at positions 1 and 3"):
        CharTokenizer("0121")
    with pytest.raises(ValueError, match="'alphabet' must be a non-empty str"):
        CharTokenizer("")
    with pytest.raises(TypeError, match="'alphabet' must be a str of unique characters: got list"):
        CharTokenizer(["0", "1"])  # type: ignore[arg-type]


def test_char_tokenizer_is_frozen() -> None:
    """A tokenizer cannot be mutated after construction."""
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        TOK.alphabet = "01"  # type: ignore[misc]


def test_token_name_renders_specials_and_characters() -> None:
    """token_name names the three specials and maps character ids to their character."""
    assert [TOK.token_name(t) for t in range(4)] == ["<pad>", "<bos>", "<eos>", "0"]
    assert "".join(TOK.token_name(t) for t in TOK.encode("12+3=")) == "12+3="


def test_token_name_rejects_out_of_range_id() -> None:
    """token_name rejects an id past the vocabulary."""
    with pytest.raises(ValueError, match=r"'token' must be a token id in \[0, 15\): got 99"):
        TOK.token_name(99)


# ---------------------------------------------------------------- Prompt, task_seed, validate_responses


def test_prompt_holds_its_fields() -> None:
    """A Prompt keeps its id, text and answer."""
    prompt = Prompt(prompt_id=3, text="0+3=", answer="3")
    assert (prompt.prompt_id, prompt.text, prompt.answer) == (3, "0+3=", "3")


def test_prompt_rejects_bad_fields() -> None:
    """prompt_id must be a non-negative int, text and answer str."""
    with pytest.raises(ValueError, match="'prompt_id' must be >= 0: got -1"):
        Prompt(prompt_id=-1, text="1+1=", answer="2")
    with pytest.raises(TypeError, match="'text' must be a str: got int"):
        Prompt(prompt_id=0, text=11, answer="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'answer' must be a str: got int"):
        Prompt(prompt_id=0, text="1+1=", answer=2)  # type: ignore[arg-type]


@given(task_seeds, task_steps)
def test_task_seed_is_deterministic_and_64_bit(seed: int, step: int) -> None:
    """task_seed is a function of (seed, step) with values in [0, 2**64)."""
    value = task_seed(seed, step)
    assert value == task_seed(seed, step)
    assert 0 <= value < 2**64


def test_task_seed_separates_nearby_inputs() -> None:
    """Nearby (seed, step) pairs map to distinct seeds (no collisions on a 50 x 50 grid)."""
    values = {task_seed(seed, step) for seed in range(50) for step in range(50)}
    assert len(values) == 2500


def test_task_seed_rejects_out_of_range() -> None:
    """seed must lie in [0, 2**64) and step be non-negative."""
    with pytest.raises(ValueError, match=r"'seed' must be in \[0, 2\*\*64\): got 18446744073709551616"):
        task_seed(2**64, 0)
    with pytest.raises(ValueError, match="'step' must be >= 0: got -1"):
        task_seed(0, -1)
    with pytest.raises(TypeError, match="'seed' must be an int: got str"):
        task_seed("0", 0)  # type: ignore[arg-type]


def test_validate_responses_returns_int_tuples() -> None:
    """validate_responses accepts contract-abiding responses and returns them as int tuples."""
    assert validate_responses([[3, 2], (), [99, 4]], count=3, max_new_tokens=2) == ((3, 2), (), (99, 4))


def test_validate_responses_rejects_contract_breaches() -> None:
    """Wrong count, tokens after EOS, over-long responses, negative ids and non-sequences are rejected."""
    with pytest.raises(ValueError, match=r"'responses' must have 2 entries \(one per prompt\): got 1"):
        validate_responses([[3]], count=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"'responses\[0\]' must hold EOS only as its last id .*: got EOS at position 1 of 3"):
        validate_responses([[3, 2, 4]], count=1, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"'responses\[1\]' must hold at most max_new_tokens=2 ids: got 3"):
        validate_responses([[3], [3, 3, 2]], count=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"'responses\[0\]' entries must be >= 0: got -5 at index 1"):
        validate_responses([[3, -5]], count=1, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"'responses\[0\]' must be a sequence of int token ids: got set"):
        validate_responses([{3}], count=1, max_new_tokens=4)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'responses' must be a sequence of token-id sequences: got str"):
        validate_responses("32", count=2, max_new_tokens=4)  # type: ignore[arg-type]


# ---------------------------------------------------------------- AdditionTask: construction and protocol


def test_addition_task_implements_task() -> None:
    """AdditionTask satisfies the runtime-checkable Task protocol; an unrelated object does not."""
    task = AdditionTask()
    assert isinstance(task, Task)
    assert not isinstance(CharTokenizer("01"), Task)
    assert (task.name, task.max_new_tokens, task.tokenizer.alphabet) == ("addition", 2, ADDITION_ALPHABET)
    assert AdditionTask(max_operand=9).max_new_tokens == 3  # the default fits the longest answer plus EOS
    assert task.tokenizer.vocab_size == 15 and task.tokenizer.padded_vocab_size(2) == 16
    assert task.max_reward == 1.0


@given(addition_tasks())
def test_addition_task_evolve_keeps_invariants(task: AdditionTask) -> None:
    """Every generated task is a Task, and evolving a field re-runs the checks."""
    assert isinstance(task, Task)
    with pytest.raises(ValueError, match="'max_new_tokens' must be >= "):
        attrs.evolve(task, max_new_tokens=len(str(2 * task.max_operand)))


def test_addition_task_rejects_bad_fields() -> None:
    """Each field's misuse names the field, the expected and the got value."""
    with pytest.raises(ValueError, match=r"'max_operand' must be an int in \[0, 9\]: got 12"):
        AdditionTask(max_operand=12)
    with pytest.raises(ValueError, match="'max_operand' must be >= 0: got -1"):
        AdditionTask(max_operand=-1)
    with pytest.raises(TypeError, match="'max_operand' must be an int: got bool"):
        AdditionTask(max_operand=True)
    with pytest.raises(ValueError, match=r"'max_new_tokens' must be >= 3 \(the digits of the largest sum 18 plus EOS\) for max_operand=9: got 2"):
        AdditionTask(max_operand=9, max_new_tokens=2)
    with pytest.raises(ValueError, match="'max_new_tokens' must be >= 1: got 0"):
        AdditionTask(max_new_tokens=0)
    with pytest.raises(ValueError, match="'digit_weight' must be a finite real number >= 0: got -0.5"):
        AdditionTask(digit_weight=-0.5)
    with pytest.raises(ValueError, match="'exact_bonus' must be a finite real number >= 0: got nan"):
        AdditionTask(exact_bonus=math.nan)
    with pytest.raises(TypeError, match="'exact_bonus' must be a real number >= 0: got str"):
        AdditionTask(exact_bonus="1")  # type: ignore[arg-type]


def test_addition_task_accepts_int_weights() -> None:
    """Integral weights are stored as floats."""
    task = AdditionTask(max_operand=9, max_new_tokens=3, digit_weight=1, exact_bonus=0)
    assert (task.digit_weight, task.exact_bonus) == (1.0, 0.0) and isinstance(task.digit_weight, float)


# ---------------------------------------------------------------- AdditionTask.prompts and prompt_ids


@given(addition_tasks(), task_seeds, task_steps, st.integers(0, 40))
def test_prompts_deterministic_and_well_formed(task: AdditionTask, seed: int, step: int, count: int) -> None:
    """prompts is a function of (seed, step, count); each is 'a+b=' with a, b in range, the sum as answer and the stable id."""
    first = task.prompts(seed, step, count)
    random.seed(12345)  # the global RNG has no influence
    assert task.prompts(seed, step, count) == first
    assert len(first) == count
    for prompt in first:
        a_text, b_text = prompt.text.removesuffix("=").split("+")
        a, b = int(a_text), int(b_text)
        assert prompt.text == f"{a}+{b}="
        assert 0 <= a <= task.max_operand and 0 <= b <= task.max_operand
        assert prompt.answer == str(a + b)
        assert prompt.prompt_id == a * (task.max_operand + 1) + b


@given(addition_tasks(), task_seeds, task_steps, st.integers(0, 20), st.integers(0, 20))
def test_prompts_shorter_count_is_prefix(task: AdditionTask, seed: int, step: int, n: int, extra: int) -> None:
    """prompts(seed, step, n) is a prefix of prompts(seed, step, n + extra)."""
    assert task.prompts(seed, step, n + extra)[:n] == task.prompts(seed, step, n)


@settings(max_examples=25)
@given(addition_tasks().filter(lambda t: t.max_operand >= 1), task_seeds)
def test_prompts_differ_across_steps(task: AdditionTask, seed: int) -> None:
    """Different steps (and different seeds) draw different prompt sequences of 32."""
    by_step = {task.prompts(seed, step, 32) for step in range(20)}
    assert len(by_step) == 20
    assert task.prompts(seed, 0, 32) != task.prompts((seed + 1) % 2**64, 0, 32)


def test_prompts_cover_every_question() -> None:
    """Over enough draws every (a, b) of the default task appears, with ids 0..24."""
    ids = {p.prompt_id for p in AdditionTask().prompts(seed=7, step=3, count=1000)}
    assert ids == set(range(25))


def test_prompts_rejects_bad_arguments() -> None:
    """count and step must be non-negative ints and seed in [0, 2**64)."""
    task = AdditionTask()
    with pytest.raises(ValueError, match="'count' must be >= 0: got -1"):
        task.prompts(0, 0, -1)
    with pytest.raises(ValueError, match="'step' must be >= 0: got -3"):
        task.prompts(0, -3, 1)
    with pytest.raises(TypeError, match="'seed' must be an int: got float"):
        task.prompts(0.5, 0, 1)  # type: ignore[arg-type]


@given(addition_tasks(), task_seeds, task_steps)
def test_prompt_ids_is_bos_then_text(task: AdditionTask, seed: int, step: int) -> None:
    """prompt_ids is BOS followed by the encoded text, and decodes back to the text."""
    (prompt,) = task.prompts(seed, step, 1)
    ids = task.prompt_ids(prompt)
    assert ids == (BOS_ID, *task.tokenizer.encode(prompt.text))
    assert task.tokenizer.decode(ids) == prompt.text


def test_prompt_ids_rejects_non_prompt_and_foreign_text() -> None:
    """prompt_ids needs a Prompt whose text is over the task's alphabet."""
    with pytest.raises(TypeError, match="'prompt' must be a Prompt: got str"):
        AdditionTask().prompt_ids("1+1=")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 'x' at position 0"):
        AdditionTask().prompt_ids(Prompt(prompt_id=0, text="x+1=", answer="1"))


# ---------------------------------------------------------------- AdditionTask.rewards


def _reference_reward(task: AdditionTask, answer: str, response: tuple[int, ...]) -> float:
    """The reward written out on characters: None stands for an id with no character."""
    chars = [task.tokenizer.alphabet[t - 3] if 3 <= t < task.tokenizer.vocab_size else None for t in response]
    ended = bool(response) and response[-1] == EOS_ID
    generated = chars[:-1] if ended else chars
    matches = sum(1 for i, ch in enumerate(generated) if i < len(answer) and ch == answer[i])
    credit = task.digit_weight * (matches / max(len(answer), len(generated)))
    exact = ended and generated == list(answer)
    return credit + (task.exact_bonus if exact else 0.0)


@given(addition_rollouts())
def test_rewards_matches_reference_and_bounds(rollout: tuple[AdditionTask, Prompt, tuple[int, ...]]) -> None:
    """rewards equals the character-level reference and lies in [0, digit_weight + exact_bonus]."""
    task, prompt, response = rollout
    (reward,) = task.rewards([prompt], [response])
    assert reward == _reference_reward(task, prompt.answer, response)
    assert 0.0 <= reward <= task.digit_weight + task.exact_bonus == task.max_reward


@given(addition_rollouts(positive_weights=True))
def test_rewards_exact_answer_is_the_unique_max(rollout: tuple[AdditionTask, Prompt, tuple[int, ...]]) -> None:
    """The answer followed by EOS scores max_reward; any other response scores strictly less when exact_bonus > 0."""
    task, prompt, response = rollout
    exact = (*task.tokenizer.encode(prompt.answer), EOS_ID)
    best, other = task.rewards([prompt, prompt], [exact, response])
    assert best == task.max_reward
    assert other < best or response == exact


# The position-match laws hold for every built-in task (both score with core.match_reward).
BUILT_IN_ROLLOUTS = st.one_of(addition_rollouts(), reverse_rollouts())


@given(BUILT_IN_ROLLOUTS, st.data())
def test_rewards_monotone_in_correct_digits(rollout: tuple[Task, Prompt, tuple[int, ...]], data: st.DataObject) -> None:
    """Making one wrong position right (same length, same EOS) never lowers the reward (addition and reverse)."""
    task, prompt, response = rollout
    answer = task.tokenizer.encode(prompt.answer)
    ended = bool(response) and response[-1] == EOS_ID
    body = list(response[:-1] if ended else response)
    wrong = [i for i in range(min(len(body), len(answer))) if body[i] != answer[i]]
    if not wrong:
        return
    i = data.draw(st.sampled_from(wrong))
    fixed = tuple(body[:i] + [answer[i]] + body[i + 1 :] + ([EOS_ID] if ended else []))
    before, after = task.rewards([prompt, prompt], [response, fixed])
    assert after >= before


@given(BUILT_IN_ROLLOUTS)
def test_rewards_wrong_length_never_gets_bonus(rollout: tuple[Task, Prompt, tuple[int, ...]]) -> None:
    """A response whose pre-EOS length differs from the answer, or without EOS, scores at most digit_weight
    (addition and reverse)."""
    task, prompt, response = rollout
    ended = bool(response) and response[-1] == EOS_ID
    generated = len(response) - 1 if ended else len(response)
    (reward,) = task.rewards([prompt], [response])
    if not ended or generated != len(prompt.answer):
        assert reward <= task.digit_weight


def test_rewards_worked_example() -> None:
    """The worked example of docs/tasks.md: answer '13' against five responses."""
    task = AdditionTask(max_operand=9, max_new_tokens=4)
    prompt = Prompt(prompt_id=94, text="9+4=", answer="13")
    responses = [
        [*_digit_ids("13"), EOS_ID],  # exact: 0.5 + 0.5
        _digit_ids("13"),  # no EOS: full digit credit, no bonus
        [*_digit_ids("12"), EOS_ID],  # one of two digits
        [*_digit_ids("130"), EOS_ID],  # extra character: 2 of 3
        [*_digit_ids("3"), EOS_ID],  # missing character, misaligned: 0 of 2
    ]
    assert task.rewards([prompt] * 5, responses) == (1.0, 0.5, 0.25, 0.5 * (2 / 3), 0.0)


@pytest.mark.parametrize(("max_new_tokens", "value"), [(None, Fraction(1, 50)), (4, Fraction(3919, 303750))])
def test_rewards_random_policy_expectation(max_new_tokens: int | None, value: Fraction) -> None:
    """A uniform policy over the 15-token vocabulary earns exactly 1/50 by default, 3919/303750 with
    max_new_tokens=4 (as documented)."""
    task = AdditionTask() if max_new_tokens is None else AdditionTask(max_new_tokens=max_new_tokens)
    vocab = task.tokenizer.vocab_size
    leaves: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while frontier:
        prefix = frontier.pop()
        if prefix and (prefix[-1] == EOS_ID or len(prefix) == task.max_new_tokens):
            leaves.append(prefix)
        else:
            frontier.extend((*prefix, t) for t in range(vocab))
    for answer in ("0", "4", "8"):
        prompt = Prompt(prompt_id=0, text="0+0=", answer=answer)
        rewards = task.rewards([prompt] * len(leaves), leaves)
        expected = sum(Fraction(r).limit_denominator(1000) * Fraction(1, vocab ** len(leaf)) for r, leaf in zip(rewards, leaves))
        assert expected == value


def test_rewards_rejects_misuse() -> None:
    """Mismatched counts, non-Prompt entries, non-digit answers and contract breaches are rejected."""
    task = AdditionTask(max_new_tokens=4)
    prompt = Prompt(prompt_id=0, text="0+0=", answer="0")
    with pytest.raises(ValueError, match=r"'responses' must have 2 entries \(one per prompt\): got 1"):
        task.rewards([prompt, prompt], [[3, 2]])
    with pytest.raises(TypeError, match=r"'prompts\[0\]' must be a Prompt: got str"):
        task.rewards(["0+0="], [[3, 2]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'prompts' must be a sequence of Prompt: got generator"):
        task.rewards((p for p in [prompt]), [[3, 2]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'prompts\[0\]\.answer' must be a non-empty string of decimal digits: got ''"):
        task.rewards([Prompt(prompt_id=0, text="0+0=", answer="")], [[3, 2]])
    with pytest.raises(ValueError, match=r"'responses\[0\]' must hold EOS only as its last id"):
        task.rewards([prompt], [[2, 3]])
    with pytest.raises(ValueError, match=r"'responses\[0\]' must hold at most max_new_tokens=4 ids: got 5"):
        task.rewards([prompt], [[3, 3, 3, 3, 3]])
