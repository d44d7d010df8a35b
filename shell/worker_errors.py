"""``WorkerError``: how a failed worker call is reported: one error naming the rank that failed, where it sits, and why.

Invariant: a failed call raises exactly one ``WorkerError`` (or its
``WorkerTimeoutError`` subclass), naming the lowest failed rank (or the dead
rank, whose death made the others fail), its coordinates on every axis, how
many ranks failed, and the remote traceback when there is one. It pickles, so
it can cross Ray like any other exception.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError

from core.topology import AXES, Coords, NamedSharding, Rank

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def format_coords(coords: Coords) -> str:
    return ", ".join(f"{axis}={coords[axis]}" for axis in AXES)


class WorkerError(RuntimeError):
    """A worker of a group failed: raised a Python exception, died, or did not answer in time.

    Attributes:
        rank: the lowest failed (or, on a timeout, still running) rank.
        coords: that rank's coordinates on every axis.
        method: the method that was called.
        remote_traceback: the traceback text from the worker ("" when it died
            or timed out and so has none).
        failed_ranks: every rank known to have failed, ascending.
        world_size: the number of ranks called.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: Rank,
        coords: Coords,
        method: str,
        remote_traceback: str = "",
        failed_ranks: tuple[Rank, ...] = (),
        world_size: int = 0,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.method = method
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks
        self.world_size = world_size

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_error,
            (type(self), str(self), self.rank, self.coords, self.method, self.remote_traceback, self.failed_ranks, self.world_size),
        )


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Some ranks did not finish within the call's timeout (none had failed); ``rank`` is the lowest of them."""


def _rebuild_error(
    cls: type[WorkerError],
    message: str,
    rank: Rank,
    coords: Coords,
    method: str,
    remote_traceback: str,
    failed_ranks: tuple[Rank, ...],
    world_size: int,
) -> WorkerError:
    return cls(
        message,
        rank=rank,
        coords=coords,
        method=method,
        remote_traceback=remote_traceback,
        failed_ranks=failed_ranks,
        world_size=world_size,
    )


def failure_error(
    sharding: NamedSharding,
    method: str,
    failures: Mapping[Rank, RayError],
    *,
    still_running: int,
    called: int,
    role: str = "",
) -> WorkerError:
    """ONE ``WorkerError`` for a call in which ``failures`` (rank -> Ray error) happened: a dead rank is named
first (ranks in a collective with it fail as a consequence), else the lowest failed rank; ``role`` (e.g.
``"policy"``) goes before the word rank."""
    failed = tuple(sorted(failures))
    # A dead actor is the cause; ranks in a collective with it fail as a consequence: name it first.
    dead = [r for r in failed if isinstance(failures[r], RayActorError)]
    first = dead[0] if dead else failed[0]
    shown = "dead rank shown" if dead and len(failed) > 1 else "lowest rank shown"
    error = failures[first]
    coords = sharding.coords(first)
    where = f"{role + ' ' if role else ''}rank {first} ({format_coords(coords)})"
    tally = f"{len(failed)} of {called} ranks failed"
    if still_running:
        tally += f", {still_running} still running"
    if isinstance(error, RayTaskError):
        cause = error.cause
        summary = f"{type(cause).__name__}: {cause}"
        remote = _ANSI.sub("", str(error))  # ray's own text: the remote process, then its traceback
        message = f"{where} raised in '{method}': {summary} [{tally}; {shown}]\n--- remote traceback of rank {first} ---\n{remote}"
    elif isinstance(error, RayActorError):
        remote = ""
        message = f"{where} died during '{method}': its actor is dead [{tally}; {shown}]\n{error}"
    else:
        remote = ""
        message = f"{where} failed in '{method}': {type(error).__name__}: {error} [{tally}; {shown}]"
    failure = WorkerError(
        message,
        rank=first,
        coords=coords,
        method=method,
        remote_traceback=remote,
        failed_ranks=failed,
        world_size=sharding.world_size,
    )
    failure.__cause__ = error
    return failure


_ONE_RANK = NamedSharding({"data_parallel": 1})


def component_error(component: str, method: str, message: str) -> WorkerError:
    """A :class:`WorkerError` for a single-process component, its message starting with the component's name.

    ``python -m shell.run`` prints the first line of a failure, so that line
    names what failed: ``"the rollout engine failed in 'generate': ..."``.

    Args:
        component: what failed, as a reader names it (``"the rollout engine"``, ``"the store"``).
        method: the call that failed.
        message: why.

    Raises:
        ValueError: ``component`` or ``method`` is empty.
    """
    if not component or not method:
        raise ValueError(f"'component' and 'method' must be non-empty: got {component!r}, {method!r}")
    return WorkerError(f"{component} failed in '{method}': {message}", rank=0, coords=_ONE_RANK.coords(0), method=method)
