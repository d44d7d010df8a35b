"""``RunStopper``: how the driver of ``python -m shell.run`` stops on a signal, and when its clean-up hangs.

Invariants:
  * SIGINT and SIGTERM act alike: the first one raises :class:`Interrupted`
    in the main thread, and the run cleans up (clears its keys, stops its
    actors and an embedded Ray cluster); the run's exit status is then 130;
  * clean-up is bounded: a signal that arrives while the run cleans up (a
    second signal, or a first one after a failure), or ``timeout_s`` passing
    since the clean-up (or the first signal) began, skips to the *hard stop*;
  * the hard stop SIGKILLs every process of the run on this machine (the
    descendants of the driver, which hold an embedded Ray cluster, and the
    Ray workers the run recorded with :meth:`RunStopper.track`), runs the
    run's last action (:meth:`RunStopper.before_exit`: the run clears its keys
    from a store it joined) for at most :data:`LAST_ACTION_S`, then ends the
    driver at once with ``os._exit`` (130 after a signal, else the status the
    clean-up was for). Actors on other nodes of a joined cluster end with the
    driver's job, as Ray ends a job's actors when its driver exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import psutil

EXIT_INTERRUPTED = 130
CLEANUP_TIMEOUT_S = 20.0
"""How long the clean-up after a failure or a signal may take before the hard stop."""
LAST_ACTION_S = 5.0
"""How long the hard stop gives the action of :meth:`RunStopper.before_exit`."""
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_RAY_WORKER_TITLE = "ray::"  # Ray sets its workers' process titles so: a recorded pid is killed only if it still is one


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver; ``signum`` is which.

    A ``KeyboardInterrupt``: clean-up code that catches ``Exception`` does not
    swallow it, and Ray's blocking calls (``ray.get``, ``ray.wait``), which
    check for signals while they wait, turn it into their own
    ``KeyboardInterrupt`` (any other exception from a signal handler there is a
    ``SystemError``). So catch ``KeyboardInterrupt``, and read the signal from
    :attr:`RunStopper.signal_name`.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class RunStopper:
    """The driver's signal handling and its bounded clean-up (see the module docstring).

    Args:
        say: prints one line (the hard stop reports why it stopped).
        timeout_s: the clean-up's bound.

    Use ``with stopper.installed():`` around the run (start to clean-up),
    :meth:`track` the run's worker pids once known, and wrap the clean-up in
    ``with stopper.cleanup(status):``.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    def __init__(self, say: Callable[[str], None], *, timeout_s: float = CLEANUP_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"'timeout_s' must be > 0: got {timeout_s!r}")
        self._say = say
        self.timeout_s = timeout_s
        self.signals = 0  # how many signals arrived
        self.signal_name = ""  # the first one's name ("SIGTERM")
        self._pids: set[int] = set()
        self._status: int | None = None  # the clean-up's status, once it began
        self._timer: threading.Timer | None = None
        # Re-entrant: a signal's handler runs on the main thread, which may hold it (inside _start_timer) then.
        self._lock = threading.RLock()
        self._stopping = False
        self._last: Callable[[], None] | None = None

    @property
    def interrupted(self) -> bool:
        """Whether a signal arrived."""
        return self.signals > 0

    def track(self, pids: Iterable[int]) -> None:
        """Add Ray worker pids (the run's actors) to what the hard stop kills."""
        self._pids.update(int(pid) for pid in pids)

    def before_exit(self, action: Callable[[], None]) -> None:
        """What the hard stop does once the run's processes are dead, within :data:`LAST_ACTION_S` (e.g. clear the
        run's keys from a store it joined, which the kill leaves running)."""
        self._last = action

    @contextlib.contextmanager
    def installed(self) -> Iterator[RunStopper]:
        """Handle SIGINT and SIGTERM (main thread only) in the body; put the previous handlers back after it."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            yield self
        finally:
            self._cancel_timer()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def cleanup(self, status: int) -> Iterator[None]:
        """The body is the run's clean-up: bounded by ``timeout_s``, and a signal in it skips to the hard stop.

        Args:
            status: the run's exit status if the clean-up has to be cut short (130 if a signal came).
        """
        self._status = status
        self._start_timer()
        try:
            yield
        finally:
            self._cancel_timer()

    # ------------------------------------------------------------ internals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        self.signal_name = self.signal_name or name
        if self._status is not None or self.signals > 1:
            self._hard_stop(f"{name} during the clean-up")
        self._start_timer()  # the clean-up begins now (the step's own abort included)
        raise Interrupted(signum)

    def _start_timer(self) -> None:
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.timeout_s, self._hard_stop, args=(f"the clean-up took over {self.timeout_s:g} s",))
            self._timer.daemon = True
            self._timer.start()

    def _cancel_timer(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _hard_stop(self, reason: str) -> None:
        """Kill the run's processes on this machine and end the driver now (never returns)."""
        with self._lock:
            if self._stopping:  # the timer and a signal at once: one of them does it
                return
            self._stopping = True
        status = EXIT_INTERRUPTED if self.interrupted else (self._status or 1)
        with contextlib.suppress(Exception):
            killed = kill_processes(self._pids)
            self._say(f"hard stop ({reason}): killed {killed} processes of the run; exit {status}")
        if self._last is not None:  # nothing of the run writes any more: its last action, bounded
            worker = threading.Thread(target=_quietly, args=(self._last,), daemon=True)
            worker.start()
            worker.join(LAST_ACTION_S)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _quietly(action: Callable[[], None]) -> None:
    with contextlib.suppress(BaseException):
        action()


def kill_processes(pids: Iterable[int]) -> int:
    """SIGKILL the descendants of this process and those of ``pids`` that are still Ray workers; return how many.

    A pid in ``pids`` that no longer runs a Ray worker (it ended, and the pid
    may have been reused) is left alone; so is this process.
    """
    me = os.getpid()
    victims: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        victims.update((p.pid, p) for p in psutil.Process(me).children(recursive=True))
    for pid in pids:
        if pid in victims or pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if _is_ray_worker(process):
                victims[pid] = process
    for process in victims.values():
        with contextlib.suppress(psutil.Error):
            process.kill()
    _, alive = psutil.wait_procs(list(victims.values()), timeout=2.0)
    return len(victims) - len(alive)


def _is_ray_worker(process: psutil.Process) -> bool:
    cmdline: list[Any] = process.cmdline()
    return bool(cmdline) and str(cmdline[0]).startswith(_RAY_WORKER_TITLE)
