"""Store liveness: the processes a store is made of, a probe of each, and a deadline on every call.

A store on Ray is several processes (TransferQueue: a controller and storage
units; the Ray memory store: one actor). When one dies, a call that waits on
it may wait forever (TransferQueue's client waits on a ZeroMQ reply that never
comes). This module is what every adapter plugs into so that never happens:

* :class:`StorePart`: one process of a store, named for people
  (``"TransferQueue storage unit 1 (pid 4242)"``);
* :class:`ActorParts`: the Ray actors of a store, probed with a no-op call;
  the first part found dead or silent is remembered, and every later call of
  the store fails at once with the same :class:`StoreFailure`;
* :class:`Deadlines` and :func:`wait_for`: a store call waits in slices of
  ``probe_every_s``; after each slice without a result it probes the parts,
  so a dead part ends the call within about ``probe_every_s`` (plus the
  probe), and a call that outlives ``call_s`` while every part answers fails
  with :class:`StoreTimeout`;
* :class:`HealthCheckedStore`: the optional capability of a store
  (``parts()``, ``check_health()``, ``note_failure()``, ``deadlines``), which
  the trainer uses to name the store part that died when a step fails, and to
  hand a failure a worker found to the driver's own client;
* :func:`failure_in`: the :class:`StoreFailure` in an error's chain (a worker's
  store call that failed comes back to the driver wrapped in Ray's errors).

Invariants: no store call of an adapter built on this waits longer than
``Deadlines.call_s`` plus one probe; once a part is found dead, every later
call raises :class:`StoreFailure` naming it without touching the store; a
Ctrl-C while a call waits interrupts the wait at once (the wait is a timed
lock wait, which signals break) and cancels the call.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError, RayTaskError

from adapters import proc_memory

T = TypeVar("T")


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"'{attribute.name}' must be a number of seconds: got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"'{attribute.name}' must be a finite number of seconds > 0: got {value!r}")


@attrs.frozen
class Deadlines:
    """How long a store call may take, and how often its store's parts are probed while it waits.

    Attributes:
        call_s: a call that has no result after this long (every part answering) raises :class:`StoreTimeout`.
        probe_every_s: while a call waits, the store's parts are probed this often.
        probe_timeout_s: a part that does not answer a probe within this long counts as hung
            (:class:`StoreFailure`, "does not answer").

    Raises:
        TypeError, ValueError: a value is not a finite number of seconds > 0.
    """

    call_s: float = attrs.field(default=120.0, validator=_positive)
    probe_every_s: float = attrs.field(default=2.0, validator=_positive)
    probe_timeout_s: float = attrs.field(default=10.0, validator=_positive)


DEFAULT_DEADLINES = Deadlines()
"""The deadlines every adapter uses unless told otherwise: a call fails after 120 s; parts are probed every 2 s and
count as hung after 10 s without an answer. A dead part therefore fails a waiting call within about 2 s."""


@attrs.frozen
class StorePart:
    """One process of a store.

    Attributes:
        role: what the part is, e.g. ``"TransferQueue storage unit 1"``.
        pid: its process id (None when unknown).
    """

    role: str
    pid: int | None = None

    def __str__(self) -> str:
        return self.role if self.pid is None else f"{self.role} (pid {self.pid})"


class StoreFailure(RuntimeError):
    """A part of a store died or stopped answering; the store cannot serve this run any more.

    Attributes:
        part: the part that failed (None when the store as a whole failed, e.g. a timeout).
    """

    def __init__(self, message: str, *, part: StorePart | None = None) -> None:
        super().__init__(message)
        self.part = part

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray (a worker's store call) with its part
        return (_rebuild_failure, (type(self), str(self), self.part))


class StoreTimeout(StoreFailure, TimeoutError):
    """A store call had no result within ``Deadlines.call_s`` although every part answered its probe."""


def _rebuild_failure(cls: type[StoreFailure], message: str, part: StorePart | None) -> StoreFailure:
    return cls(message, part=part)


@runtime_checkable
class HealthCheckedStore(Protocol):
    """The optional capability of a store made of processes: name them, probe them, bound every call."""

    @property
    def deadlines(self) -> Deadlines:
        """The deadlines of this store's calls."""
        ...

    def parts(self) -> tuple[StorePart, ...]:
        """The processes the store is made of (the ones its calls depend on)."""
        ...

    def check_health(self) -> None:
        """Probe every part; raise :class:`StoreFailure` naming the first dead or silent one. Bounded by
        ``deadlines.probe_timeout_s``."""
        ...

    def note_failure(self, failure: StoreFailure) -> None:
        """Take ``failure``, found by another process's call of the same store, as this store's own: every later
        call fails at once with it, and closing the store does not wait on the failed part."""
        ...


# ---------------------------------------------------------------- Ray actors as parts


def _process_id(_actor: Any) -> int:
    return os.getpid()


def _resident_mib(_actor: Any) -> float:
    return proc_memory.resident_mib()


def _ask_actors(handles: Sequence[ActorHandle], function: Callable[[Any], Any], timeout_s: float) -> list[Any]:
    """``function(actor)`` run inside each actor's process (``__ray_call__``): each answer, or None for an actor that
    did not answer within ``timeout_s`` or is dead."""
    refs = [h.__ray_call__.remote(function) for h in handles]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    answers: list[Any] = []
    for ref in refs:
        try:
            answers.append(ray.get(ref) if ref in done else None)
        except RayError:
            answers.append(None)
    return answers


def actor_pids(handles: Sequence[ActorHandle], timeout_s: float) -> list[int | None]:
    """Each actor's process id (None for one that did not answer within ``timeout_s`` or is dead)."""
    return [None if pid is None else int(pid) for pid in _ask_actors(handles, _process_id, timeout_s)]


def actor_resident_mib(handles: Sequence[ActorHandle], timeout_s: float) -> list[float | None]:
    """Each actor's resident memory in MiB, read by the actor itself, on whatever node it runs (None for one that did
    not answer within ``timeout_s`` or is dead)."""
    return _ask_actors(handles, _resident_mib, timeout_s)


class ActorParts:
    """The Ray actors of a store, probed with a no-op call (``__ray_ready__``); the first failure is kept.

    Args:
        store: the store's name in messages, e.g. ``"TransferQueue"``.
        parts: each part and its actor handle.
        probe: which method to call on each actor as the probe (a no-op that its own thread or
            concurrency group serves, so a busy part still answers).
    """

    def __init__(self, store: str, parts: Sequence[tuple[StorePart, ActorHandle]], *, probe: str = "__ray_ready__") -> None:
        self.store = store
        self._parts = tuple(parts)
        self._probe = probe
        self._failure: StoreFailure | None = None
        self._lock = threading.Lock()

    @property
    def parts(self) -> tuple[StorePart, ...]:
        return tuple(part for part, _ in self._parts)

    def resident_mib(self, timeout_s: float) -> dict[str, float | None]:
        """Each part's resident memory in MiB, by role (None for a part that did not answer within ``timeout_s``)."""
        return dict(zip((part.role for part, _ in self._parts), actor_resident_mib([h for _, h in self._parts], timeout_s)))

    @property
    def failure(self) -> StoreFailure | None:
        """The failure found so far (None while every part answered)."""
        return self._failure

    def raise_if_failed(self) -> None:
        """Raise the failure found earlier, if any (a fresh exception with the same message and part)."""
        failure = self._failure
        if failure is not None:
            raise type(failure)(str(failure), part=failure.part)

    def fail(self, failure: StoreFailure) -> StoreFailure:
        """Remember ``failure`` (the first one wins) and return the one remembered."""
        with self._lock:
            if self._failure is None:
                self._failure = failure
            return self._failure

    def check(self, timeout_s: float) -> None:
        """Probe every part; raise :class:`StoreFailure` for the first one dead or silent within ``timeout_s``."""
        self.raise_if_failed()
        if not self._parts:
            return
        refs = [getattr(handle, self._probe).remote() for _, handle in self._parts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        for (part, _), ref in zip(self._parts, refs):
            if ref not in done:
                silent = StoreFailure(
                    f"{part} does not answer (no reply to a probe within {timeout_s:g} s)", part=part
                )
                raise self.fail(silent)
            try:
                ray.get(ref)
            except RayActorError as error:
                raise self.fail(StoreFailure(f"{part} died", part=part)) from error
            except RayError as error:
                raise self.fail(StoreFailure(f"{part} failed its probe: {error}", part=part)) from error


# ---------------------------------------------------------------- a call with a deadline


class ProbedActors:
    """What a store built on :class:`ActorParts` gives for :class:`HealthCheckedStore`, written once: a subclass sets
    ``_parts`` (its :class:`ActorParts`) and ``_deadlines``."""

    _parts: ActorParts
    _deadlines: Deadlines

    @property
    def deadlines(self) -> Deadlines:
        """The deadlines of this store's calls."""
        return self._deadlines

    def parts(self) -> tuple[StorePart, ...]:
        """The store's processes that are probed (see the store's docstring)."""
        return self._parts.parts

    def check_health(self) -> None:
        """Probe every part.

        Raises:
            StoreFailure: one is dead or does not answer within ``deadlines.probe_timeout_s`` (naming it).
        """
        self._parts.check(self._deadlines.probe_timeout_s)

    def parts_resident_mib(self) -> dict[str, float | None]:
        """Each part's resident memory in MiB, by role, read by the part itself (None for one that did not answer
        within ``deadlines.probe_timeout_s``)."""
        return self._parts.resident_mib(self._deadlines.probe_timeout_s)

    def note_failure(self, failure: StoreFailure) -> None:
        """Take ``failure`` (found by another process's call, e.g. a worker's) as this store's: every later call
        raises it at once, without touching the store (the first failure known wins).

        Raises:
            TypeError: ``failure`` is not a :class:`StoreFailure`.
        """
        if not isinstance(failure, StoreFailure):
            raise TypeError(f"'failure' must be a StoreFailure: got {type(failure).__name__}")
        self._parts.fail(StoreFailure(str(failure), part=failure.part))


def failure_in(error: BaseException | None) -> StoreFailure | None:
    """The first :class:`StoreFailure` naming a failed part in ``error``'s chain, or None.

    Only a failure with a ``part`` counts (a process of the store died or went silent): a :class:`StoreTimeout`,
    which names none because every part answered, says nothing about the store's other calls. The chain is the error, what it was raised from or while handling (``__cause__``, ``__context__``), and, for a
    Ray task error, the remote exception it carries (``cause``): so a worker's store call that failed, reported as a
    worker error, still names the store part. A Ray task error is looked through even when its class also derives
    from the remote exception's (Ray's ``RayTaskError(StoreFailure)``), so the failure comes back with its own
    message and part, not Ray's traceback.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RayTaskError):
            error = error.cause
            continue
        if isinstance(error, StoreFailure) and error.part is not None:
            return error
        error = error.__cause__ or error.__context__
    return None


def wait_for(
    poll: Callable[[float], tuple[bool, T | None]],
    *,
    op: str,
    store: str,
    deadlines: Deadlines,
    check: Callable[[], None],
    cancel: Callable[[], None] = lambda: None,
    call_s: float | None = None,
) -> T:
    """Wait for a store call, probing the store while it waits; cancel the call on any failure.

    Args:
        poll: waits at most the seconds it is given for the call; returns ``(True, value)`` once
            the call is done (raising the call's own exception, if any) or ``(False, None)``.
        op: the call's name in messages (``"get"``).
        store: the store's name in messages.
        deadlines: the call's deadline and probe interval.
        check: probes the store's parts; raises :class:`StoreFailure` for a dead one.
        cancel: called (and its errors ignored) when the wait ends without a result:
            a dead part, the deadline, or an interrupt (``KeyboardInterrupt``).
        call_s: the whole call's deadline, which a timeout names, where this wait is the part of a call
            that ``deadlines.call_s`` has left (by default ``deadlines.call_s``).

    Raises:
        StoreFailure: a part died or stopped answering while the call waited.
        StoreTimeout: no result within ``deadlines.call_s``.
    """
    end = time.monotonic() + deadlines.call_s
    finished = False
    try:
        while True:
            finished, value = poll(max(0.0, min(deadlines.probe_every_s, end - time.monotonic())))
            if finished:
                return value  # type: ignore[return-value]
            check()
            if time.monotonic() >= end:
                whole = deadlines.call_s if call_s is None else call_s
                raise StoreTimeout(f"{store}: '{op}' had no result within {whole:g} s although every part answered")
    finally:
        if not finished:
            try:
                cancel()
            except Exception:  # the failure (or the interrupt) is what the caller must see
                pass
