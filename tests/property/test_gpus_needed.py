"""Law of ``gpus_needed`` (``core.gpu_share``, public in ``shell.worker_group``): the devices fractional GPUs fill.

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
    """A share of zero or less asks Ray for no GPU."""
    assert gpus_needed(per_worker, 4) == 0.0


def test_the_shortage_names_both_counts_and_is_a_value_error() -> None:
    """``GPUShortageError`` is a ``ValueError`` whose message names the share and both counts."""
    error = GPUShortageError(ranks=3, per_worker=0.6, need=3.0, have=1.0)
    assert isinstance(error, ValueError)
    assert str(error).startswith("'num_gpus_per_worker' is 0.6: the group's 3 ranks need 3 GPUs, the Ray cluster has 1;")

