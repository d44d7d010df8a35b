"""CPU time of this node's processes, for the benches: where a store call's or a GRPO step's CPU goes.

A reading is each named process's CPU seconds (user + system, every thread
it ran included, its children not), read from the kernel's CPU clock of the
process (``clock_gettime`` of the process's clock id: nanoseconds, where
``/proc``'s and ``psutil``'s times count 10 ms ticks), or from ``psutil``
where that clock cannot be read; two readings around some calls give each
process's milliseconds per call (:func:`cpu_per_call`). On a
machine of few cores the CPU any process spends lengthens whatever waits on
it, so a call's or a step's cost is its CPU over every process it touches, not
only its caller's.

Invariant: a process appears in a difference only when both readings hold it
(a process that ended or started in between, or whose pid another process
took, has no figure), and a reading never goes down for the same process (one
that does is refused). Readings are of this node's processes only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import psutil

RAYLET = "raylet (Ray's object store)"
GCS = "Ray GCS"


def cpu_per_call(before: Mapping[str, float], after: Mapping[str, float], calls: int) -> dict[str, float]:
    """Milliseconds of CPU per call in each process, from two readings of the processes' CPU seconds taken around
    ``calls`` calls; a process absent from either reading is left out.

    Raises:
        ValueError: ``calls`` < 1, or a process's CPU time went down between the readings (not the same process).
    """
    if calls < 1:
        raise ValueError(f"'calls' must be >= 1: got {calls}")
    out = {}
    for name, start in before.items():
        if name not in after:
            continue
        spent = after[name] - start
        if spent < 0:
            raise ValueError(f"the CPU time of {name!r} went down between the readings: {start} s then {after[name]} s")
        out[name] = spent * 1e3 / calls
    return out


def _cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (Linux: ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``, what
    ``clock_getcpuclockid`` returns)."""
    return ((~pid) << 3) | 2


def cpu_seconds(processes: Mapping[str, psutil.Process]) -> dict[str, float]:
    """A reading: each live process's CPU seconds. A process gone is left out, and so is one whose pid another
    process now holds (``psutil`` compares the start time it saw first), whose clock would be another's."""
    out = {}
    for name, process in processes.items():
        if not process.is_running():
            continue
        try:
            out[name] = time.clock_gettime(_cpu_clock(process.pid))
            continue
        except (OSError, AttributeError):  # gone, not Linux, or another user's: psutil says which
            pass
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        out[name] = times.user + times.system
    return out


def named_pids(record: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """A flat ``name -> pid`` of a process-id record whose values are pids or records of their own
    (``GRPOTrainer.process_ids``: ``{"driver": 7, "policy": {"0": 8}}`` gives ``{"driver": 7, "policy 0": 8}``);
    entries that are neither (None: a part that did not say) are left out."""
    out: dict[str, int] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(named_pids(value, f"{name} "))
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    return out


def processes(pids: Mapping[str, int]) -> dict[str, psutil.Process]:
    """``name -> psutil.Process`` for the live ones of ``pids``."""
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid)
        except psutil.Error:
            continue
    return out


def ray_daemons() -> dict[str, psutil.Process]:
    """The raylet (which holds Ray's object store) and the GCS server that this process started, by name
    (:data:`RAYLET`, :data:`GCS`); none when Ray was started elsewhere."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            name = child.name()
        except psutil.Error:
            continue
        if name == "raylet":
            out.setdefault(RAYLET, child)
        elif name == "gcs_server":
            out.setdefault(GCS, child)
    return out
