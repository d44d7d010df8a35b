"""Resident memory of a process on this node, from Linux's ``/proc``.

Invariant: every figure is in MiB and is the kernel's own counter (``VmRSS`` or
``VmHWM`` of ``/proc/<pid>/status``); a process that is gone, or a kernel
without those lines, raises rather than reads as zero. A process of another
node cannot be read here: ask it to read itself (``Worker.resident_mib``,
:func:`adapters.store_health.actor_resident_mib`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path


def _status_mib(field: str, pid: int | str) -> float:
    path = Path(f"/proc/{pid}/status")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid} on this node ({path} is gone)") from None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
        if line.startswith("State:") and line.split()[1:2] == ["Z"]:  # exited, not reaped yet: no memory lines
            raise ProcessLookupError(f"process {pid} on this node has exited (a zombie, not reaped yet)")
    raise RuntimeError(f"{path} has no {field} line")


def resident_mib(pid: int | str = "self") -> float:
    """The resident set size of process ``pid`` of this node (this process by default), in MiB.

    Raises:
        ProcessLookupError: no such process on this node.
    """
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
