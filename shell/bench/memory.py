"""Resident memory of processes on this node, read from ``/proc``, and its growth over a run.

Invariant: every figure is in MiB and comes from the kernel's own counters
(``VmRSS`` and ``VmHWM`` of ``/proc/<pid>/status``); a process that is gone, or
a kernel without those lines, raises rather than reads as zero. Only processes
of this node can be read: the benches that use this run their cluster here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _status_mib(field: str, pid: int | str) -> float:
    path = Path(f"/proc/{pid}/status")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid} on this node ({path} is gone)") from None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{path} has no {field} line")


def resident_mib(pid: int | str = "self") -> float:
    """The resident set size of process ``pid`` (this process by default), in MiB."""
    return _status_mib("VmRSS", pid)


def peak_resident_mib() -> float:
    """This process's peak resident set size since it started or since :func:`reset_peak`, in MiB."""
    return _status_mib("VmHWM", "self")


def reset_peak() -> None:
    """Start this process's peak resident set size over from its current size."""
    Path("/proc/self/clear_refs").write_text("5")


def settle() -> None:
    """Free what this process no longer holds (Python's garbage, then glibc's free pages), so the RSS read next is
    what lives on, not what an earlier piece of work left in the allocator."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def process_labels(info: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """Label -> pid for a nested record of pids by role (``GRPOTrainer.process_ids()``): ``{"policy": {"0": 7}}``
    gives ``{"policy 0": 7}``. Roles whose pid is unknown (None) are left out."""
    out: dict[str, int] = {}
    for role, value in info.items():
        label = f"{prefix}{role}"
        if isinstance(value, Mapping):
            out.update(process_labels(value, f"{label} "))
        elif isinstance(value, int) and not isinstance(value, bool):
            out[label] = value
    return out


def growth_per_100_steps(steps: Sequence[int], mib: Sequence[float]) -> float:
    """The least-squares slope of ``mib`` over ``steps``, per 100 steps (0.0 for fewer than two steps).

    A slope over every step, rather than last minus first, reads a steady leak through the step-to-step noise of a
    process's allocator.
    """
    if len(steps) != len(mib):
        raise ValueError(f"'mib' must have one value per step ({len(steps)}): got {len(mib)}")
    if len(steps) < 2:
        return 0.0
    return statistics.linear_regression(steps, mib).slope * 100
