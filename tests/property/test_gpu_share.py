"""Laws of ``core.gpu_share.gpu_share_problem``, and ``PolicyConfig`` and the run config that apply it.

A share is accepted for a group of NCCL ranks exactly when Ray's packing (a
first-fit oracle in exact integer units) gives every rank a device of its own,
and only on Ray's 0.0001 grid in ``(0, 1]``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.gpu_share import GPU_SHARE_STEP, gpu_share_problem, gpus_needed
from core.topology import NamedSharding
from shell.policy import PolicyConfig
from tests.property.test_gpus_needed import _first_fit_devices


@given(units=st.integers(1, 10_000), ranks=st.integers(1, 16))
def test_a_share_on_rays_grid_is_accepted_iff_every_rank_gets_a_device_of_its_own(units: int, ranks: int) -> None:
    """Accepted iff first-fit packing of ``ranks`` shares of ``units / 10_000`` fills ``ranks`` devices (a lone
    rank always does); then the ranks take ``ranks`` GPUs or more."""
    share = units / 10_000
    own = _first_fit_devices(units, ranks, per_device=10_000) == ranks
    problem = gpu_share_problem(share, ranks)
    assert (problem is None) == own, problem
    if problem is None:
        assert gpus_needed(share, ranks) >= ranks
    else:
        assert problem.startswith(f"exceed 0.5 for a group of {ranks} ranks")


@given(share=st.floats(allow_nan=True, allow_infinity=True), ranks=st.integers(1, 4))
def test_a_share_off_the_grid_or_outside_0_1_is_refused(share: float, ranks: int) -> None:
    """Outside ``(0, 1]``, NaN included, or finer than Ray's step: refused, whatever the ranks."""
    if 0.0 < share <= 1.0 and abs(share / GPU_SHARE_STEP - round(share / GPU_SHARE_STEP)) <= 1e-6:
        return
    assert gpu_share_problem(share, ranks) is not None


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
