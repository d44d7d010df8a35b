"""Laws of the position-match reward shared by the built-in tasks (``core.match_reward``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.match_reward import match_reward, reward_weight
from core.task import EOS_ID
from tests.property.strategies import match_cases, reward_weights


def _reference(target: tuple[int, ...], response: tuple[int, ...], digit_weight: float, exact_bonus: float) -> float:
    """The formula of the module docstring, written out position by position."""
    body = response[:-1] if response and response[-1] == EOS_ID else response
    matches = 0
    for i, token in enumerate(body):
        if i < len(target) and token == target[i]:
            matches += 1
    credit = digit_weight * (matches / max(len(target), len(body)))
    exact = list(response) == [*target, EOS_ID]
    return credit + (exact_bonus if exact else 0.0)


@given(match_cases(), reward_weights, reward_weights)
def test_match_reward_matches_reference_and_bounds(case: tuple[tuple[int, ...], tuple[int, ...]], digit: float, bonus: float) -> None:
    """match_reward equals the position-by-position reference and lies in [0, digit_weight + exact_bonus]."""
    target, response = case
    reward = match_reward(target, response, digit_weight=digit, exact_bonus=bonus)
    assert reward == _reference(target, response, digit, bonus)
    assert 0.0 <= reward <= digit + bonus


@given(match_cases(), st.floats(1e-3, 4.0), st.floats(1e-3, 4.0))
def test_match_reward_target_then_eos_is_the_unique_max(case: tuple[tuple[int, ...], tuple[int, ...]], digit: float, bonus: float) -> None:
    """The target followed by EOS earns exactly digit_weight + exact_bonus; any other response earns less."""
    target, response = case
    best = match_reward(target, (*target, EOS_ID), digit_weight=digit, exact_bonus=bonus)
    other = match_reward(target, response, digit_weight=digit, exact_bonus=bonus)
    assert best == digit + bonus
    assert other < best or response == (*target, EOS_ID)


@given(match_cases(), st.data())
def test_match_reward_monotone_in_right_positions(case: tuple[tuple[int, ...], tuple[int, ...]], data: st.DataObject) -> None:
    """Making one wrong position right (same length, same EOS) never lowers the reward."""
    target, response = case
    ended = bool(response) and response[-1] == EOS_ID
    body = list(response[:-1] if ended else response)
    wrong = [i for i in range(min(len(body), len(target))) if body[i] != target[i]]
    if not wrong:
        return
    i = data.draw(st.sampled_from(wrong))
    fixed = tuple(body[:i] + [target[i]] + body[i + 1 :] + ([EOS_ID] if ended else []))
    before = match_reward(target, response, digit_weight=0.5, exact_bonus=0.5)
    after = match_reward(target, fixed, digit_weight=0.5, exact_bonus=0.5)
    assert after >= before


def test_match_reward_worked_cases() -> None:
    """Exact, cut, one wrong, one extra and one missing position against the target (4, 5)."""
    score = [match_reward((4, 5), r, digit_weight=0.5, exact_bonus=0.5) for r in [(4, 5, 2), (4, 5), (4, 6, 2), (4, 5, 4, 2), (5, 2)]]
    assert score == [1.0, 0.5, 0.25, 0.5 * (2 / 3), 0.0]


@given(st.one_of(st.integers(0, 10), st.floats(0, 1e6)))
def test_reward_weight_returns_the_float(value: float) -> None:
    """A finite real number >= 0 converts to the equal float."""
    converted = reward_weight("w")(value)
    assert isinstance(converted, float) and converted == value


def test_reward_weight_rejects_misuse() -> None:
    """A bool or a str is a TypeError; a negative, infinite or NaN weight a ValueError, each naming the field."""
    with pytest.raises(TypeError, match="'digit_weight' must be a real number >= 0: got bool"):
        reward_weight("digit_weight")(True)
    with pytest.raises(TypeError, match="'exact_bonus' must be a real number >= 0: got str"):
        reward_weight("exact_bonus")("0.5")
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match=f"'exact_bonus' must be a finite real number >= 0: got {bad!r}"):
            reward_weight("exact_bonus")(bad)
