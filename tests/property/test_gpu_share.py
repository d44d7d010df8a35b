"""Laws of ``core.gpu_share.gpu_share_problem``, and ``PolicyConfig`` and the run config that apply it.

A share is accepted for a group of NCCL ranks exactly when Ray's packing (a
first-fit oracle in exact integer units) gives every rank a device of its own,
and only on Ray's 0.0001 grid in ``(0, 1]``.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.gpu_share import gpu_share_problem, gpus_needed
from core.topology import NamedSharding
from shell.policy import PolicyConfig
from tests.property.test_gpus_needed import _first_fit_devices


def _ray_devices(share: float, ranks: int) -> int:
    """Devices a first-fit packing fills with ``ranks`` actors of ``share``, in the units Ray counts (truncated)."""
    return _first_fit_devices(int(share * 10_000), ranks, per_device=10_000)


@given(share=st.floats(min_value=0, max_value=1, exclude_min=True), ranks=st.integers(1, 16))
def test_an_accepted_share_is_one_ray_takes_and_gives_every_rank_a_device_of_its_own(share: float, ranks: int) -> None:
    """Whatever float is asked for: an accepted share is at least Ray's unit and within float noise of a whole
    number of units, and Ray's packing (first fit, in Ray's truncated units) puts no two of its ranks on a device."""
    problem = gpu_share_problem(share, ranks)
    if problem is None:
        assert int(share * 10_000) >= 1 and abs(share * 10_000 - round(share * 10_000)) <= 1e-6
        assert ranks == 1 or _ray_devices(share, ranks) == ranks
        assert gpus_needed(share, ranks) == _ray_devices(share, ranks)


@given(units=st.integers(1, 10_000), ranks=st.integers(1, 16))
def test_a_whole_number_of_units_is_refused_only_when_two_ranks_would_share_a_device(units: int, ranks: int) -> None:
    """On the grid, the only refusal is the NCCL one, exactly when Ray's packing puts two ranks on one device."""
    share = units / 10_000
    shared = _ray_devices(share, ranks) < ranks
    problem = gpu_share_problem(share, ranks)
    assert (problem is not None) == shared, problem
    if problem is not None:
        assert problem.startswith(f"exceed 0.5 for a group of {ranks} ranks")


@pytest.mark.parametrize(
    ("share", "ranks", "says"),
    [
        (0.0, 1, r"be in \(0, 1\]"), (-0.5, 1, r"be in \(0, 1\]"), (1.5, 1, r"be in \(0, 1\]"),
        (float("nan"), 1, r"be in \(0, 1\]"), (float("inf"), 1, r"be in \(0, 1\]"),
        (1e-11, 1, "be a multiple of 0.0001"), (5e-324, 2, "be a multiple of 0.0001"),  # below Ray's unit
        (0.00005, 1, "be a multiple of 0.0001"), (0.30000001, 1, "be a multiple of 0.0001"),
        (0.50009999999, 2, "exceed 0.5 for a group of 2 ranks"),  # Ray truncates it to 0.5: two ranks a device
        (0.5, 2, "exceed 0.5"), (0.3, 4, r"exceed 0.5 for a group of 4 ranks \(Ray puts up to 3 ranks"),
    ],
)
def test_shares_ray_would_refuse_truncate_or_pack_two_to_a_device_are_refused(share: float, ranks: int, says: str) -> None:
    """Ray refuses less than one unit and truncates finer shares: both are refused here, with the reason."""
    problem = gpu_share_problem(share, ranks)
    assert problem is not None and re.match(says, problem), problem


@pytest.mark.parametrize("share", [0.1 + 0.2, 0.3334, 0.5001, 1.0, 1, 0.0001])
def test_float_noise_around_a_whole_number_of_units_is_accepted(share: float) -> None:
    """0.1 + 0.2 is 0.30000000000000004: float noise, not a finer share."""
    assert gpu_share_problem(share, 1) is None


@pytest.mark.parametrize("share", [True, "0.5", None])
def test_a_share_that_is_not_a_number_is_refused(share: object) -> None:
    """A bool, a string or None is not a share (no silent conversion)."""
    assert gpu_share_problem(share, 1) == "be a number (an int or a float, not a bool)"  # type: ignore[arg-type]


@given(units=st.integers(1, 100), ranks=st.integers(1, 8), device=st.sampled_from(["cpu", "cuda"]))
def test_policy_config_accepts_a_gpu_share_only_if_no_two_of_its_ranks_share_a_device(
    units: int, ranks: int, device: str
) -> None:
    """A CUDA policy accepts ``gpus_per_rank`` iff Ray's packing gives each of its ranks a device of its own (NCCL
    refuses two ranks of one group on a device): then its ranks take exactly ``ranks`` GPUs. On CPU the share is
    unused and any share in (0, 1] is accepted; Ray is asked for none."""
    share = units / 100
    sharding = NamedSharding({"data_parallel": ranks})
    if device == "cuda" and _first_fit_devices(units, ranks) < ranks:
        with pytest.raises(ValueError, match=rf"'gpus_per_rank' must exceed 0.5 for a group of {ranks} ranks"):
            PolicyConfig(sharding=sharding, device=device, gpus_per_rank=share)
        return
    config = PolicyConfig(sharding=sharding, device=device, gpus_per_rank=share)
    assert config.num_gpus_per_worker == (share if device == "cuda" else 0.0)
    assert gpus_needed(config.num_gpus_per_worker, ranks) == (ranks if device == "cuda" else 0)


@pytest.mark.parametrize(
    ("share", "says"),
    [(0.0, r"be in \(0, 1\]"), (-0.5, r"be in \(0, 1\]"), (1.5, r"be in \(0, 1\]"), (float("nan"), r"be in \(0, 1\]"),
     (0.00005, "be a multiple of 0.0001"), (True, "be a number")],
)
def test_policy_config_names_gpus_per_rank_and_the_value(share: object, says: str) -> None:
    """``PolicyConfig`` refuses a bad share with a ``ValueError`` naming the field, the rule and the value."""
    with pytest.raises(ValueError, match=rf"^'gpus_per_rank' must {says}") as raised:
        PolicyConfig(sharding=NamedSharding({"data_parallel": 1}), device="cuda", gpus_per_rank=share)
    assert str(raised.value).endswith(f": got {share!r}")
