"""ReverseTask laws: deterministic prompts, answers are reversals, rewards bounded, exact answer maximal, monotone."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.reverse import ReverseTask
from core.task import EOS_ID, Prompt


@st.composite
def tasks_and_prompts(draw: st.DrawFn) -> tuple[ReverseTask, Prompt]:
    task = ReverseTask(length=draw(st.integers(1, 12)), digits=draw(st.integers(2, 10)))
    (prompt,) = task.prompts(draw(st.integers(0, 2**32)), draw(st.integers(0, 1000)), 1)
    return task, prompt


@given(tasks_and_prompts())
def test_reverse_prompts_ask_for_the_reversed_digits(case: tuple[ReverseTask, Prompt]) -> None:
    """Each prompt is ``length`` digits below ``digits`` then the marker; the answer is those digits reversed."""
    task, prompt = case
    digits = prompt.text[:-1]
    assert prompt.text.endswith(">") and len(digits) == task.length
    assert all(int(c) < task.digits for c in digits)
    assert prompt.answer == digits[::-1]


@given(st.integers(0, 2**32), st.integers(0, 1000), st.integers(0, 20), st.integers(0, 20))
def test_reverse_prompts_are_deterministic_and_prefix_stable(seed: int, step: int, n: int, m: int) -> None:
    """prompts(seed, step, n) is a prefix of prompts(seed, step, m) for n <= m, and the same on every call."""
    task = ReverseTask()
    short, long = sorted((n, m))
    assert task.prompts(seed, step, long)[:short] == task.prompts(seed, step, short)
    assert task.prompts(seed, step, long) == task.prompts(seed, step, long)


@given(tasks_and_prompts(), st.data())
def test_reverse_rewards_are_bounded_and_the_exact_answer_is_the_unique_maximum(
    case: tuple[ReverseTask, Prompt], data: st.DataObject
) -> None:
    """Every reward lies in [0, max_reward]; the reversal followed by EOS reaches it and nothing else does;
    righting one wrong position never lowers the reward."""
    task, prompt = case
    exact = (*task.tokenizer.encode(prompt.answer), EOS_ID)
    ids = st.integers(0, task.tokenizer.vocab_size - 1).filter(lambda t: t != EOS_ID)
    body = data.draw(st.lists(ids, max_size=task.max_new_tokens - 1))
    response = (*body, EOS_ID)
    (best,), (got,) = task.rewards([prompt], [exact]), task.rewards([prompt], [response])
    assert best == task.max_reward
    assert 0.0 <= got <= task.max_reward
    assert (got == task.max_reward) == (response == exact)
    target = task.tokenizer.encode(prompt.answer)
    wrong = [i for i in range(min(len(body), len(target))) if body[i] != target[i]]
    if wrong:
        fixed = list(body)
        fixed[wrong[0]] = target[wrong[0]]
        (better,) = task.rewards([prompt], [(*fixed, EOS_ID)])
        assert better >= got


def test_reverse_random_policy_reward_is_near_zero() -> None:
    """A uniform random policy earns a few percent of the maximum reward with the defaults."""
    assert 0.0 < float(ReverseTask().random_policy_reward()) < 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"length": 0}, "length"), ({"digits": 1}, "digits"), ({"digits": 11}, "digits"),
     ({"length": 5, "max_new_tokens": 5}, "max_new_tokens")],
)
def test_reverse_task_rejects_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    """Bad constructor arguments raise naming the argument."""
    with pytest.raises(ValueError, match=match):
        ReverseTask(**kwargs)
