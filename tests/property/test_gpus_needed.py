"""Law of ``shell.worker_group.gpus_needed``: it is the number of devices Ray's fractional GPUs fill.

Ray places an actor that asks for less than one GPU on a single device, and a
device holds actors whose shares sum to at most one. The oracle packs the ranks
first-fit in exact integer units (a share of ``k / 100``), so the law checks the
closed form against a packing, not against itself.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.worker_group import GPUShortageError, gpus_needed


def _first_fit_devices(units: int, ranks: int, per_device: int = 100) -> int:
    devices: list[int] = []
    for _ in range(ranks):
        for i, used in enumerate(devices):
            if used + units <= per_device:
                devices[i] += units
                break
        else:
            devices.append(units)
    return len(devices)


@given(units=st.integers(1, 99), ranks=st.integers(0, 64))
def test_a_fractional_share_takes_the_devices_a_packing_fills(units: int, ranks: int) -> None:
    """Ranks of less than a GPU take as many devices as first-fit packing fills, never fewer than their sum."""
    need = gpus_needed(units / 100, ranks)
    assert need == _first_fit_devices(units, ranks)
    assert need >= units * ranks / 100 - 1e-9


@given(per_worker=st.integers(1, 8), ranks=st.integers(0, 64))
def test_whole_gpus_add_up(per_worker: int, ranks: int) -> None:
    """From one GPU up, each rank takes its own devices: the sum."""
    assert gpus_needed(per_worker, ranks) == per_worker * ranks


@pytest.mark.parametrize("per_worker", [0, -1.0])
def test_a_cpu_group_needs_no_gpu(per_worker: float) -> None:
    assert gpus_needed(per_worker, 4) == 0.0


def test_the_shortage_names_both_counts_and_is_a_value_error() -> None:
    error = GPUShortageError(ranks=3, per_worker=0.6, need=3.0, have=1.0)
    assert isinstance(error, ValueError)
    assert str(error).startswith("'num_gpus_per_worker' is 0.6: the group's 3 ranks need 3 GPUs, the Ray cluster has 1;")


@given(units=st.integers(1, 100), ranks=st.integers(1, 8), device=st.sampled_from(["cpu", "cuda"]))
def test_policy_config_accepts_a_gpu_share_only_if_no_two_of_its_ranks_share_a_device(
    units: int, ranks: int, device: str
) -> None:
    """A CUDA policy accepts ``gpus_per_rank`` iff Ray's packing gives each of its ranks a device of its own (NCCL
    refuses two ranks of one group on a device): then its ranks take exactly ``ranks`` GPUs. On CPU the share is
    unused and any share in (0, 1] is accepted; Ray is asked for none."""
    from core.topology import NamedSharding
    from shell.policy import PolicyConfig

    share = units / 100
    sharding = NamedSharding({"data_parallel": ranks})
    own_devices = _first_fit_devices(units, ranks) == ranks
    if device == "cuda" and not own_devices:
        with pytest.raises(ValueError, match=rf"'gpus_per_rank' must exceed 0.5 for a group of {ranks} ranks"):
            PolicyConfig(sharding=sharding, device=device, gpus_per_rank=share)
        return
    config = PolicyConfig(sharding=sharding, device=device, gpus_per_rank=share)
    assert config.num_gpus_per_worker == (share if device == "cuda" else 0.0)
    assert gpus_needed(config.num_gpus_per_worker, ranks) == (ranks if device == "cuda" else 0)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_policy_config_refuses_a_gpu_share_outside_0_1(share: float) -> None:
    from core.topology import NamedSharding
    from shell.policy import PolicyConfig

    with pytest.raises(ValueError, match=r"'gpus_per_rank' must be in \(0, 1\]"):
        PolicyConfig(sharding=NamedSharding({"data_parallel": 1}), device="cuda", gpus_per_rank=share)
