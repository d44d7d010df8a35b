"""``shell.run_stop``: the first signal interrupts, a second one or the clean-up's deadline kills the run's processes
and exits. The hard stop ends its process, so those cases run in a child interpreter; no Ray is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shell.run_stop import Interrupted, RunStopper

ROOT = Path(__file__).resolve().parents[2]

# A driver stand-in: one descendant (`sleep`, as an embedded Ray node would be), then the scenario in SCENARIO.
_DRIVER = """
import os, signal, subprocess, sys, time
from shell.run_stop import Interrupted, RunStopper
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
stopper = RunStopper(lambda message: print(message, flush=True), timeout_s=float(sys.argv[2]))
with stopper.installed():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        sys.exit(3)  # not reached: the signal raised
    except Interrupted:
        status = 130
    with stopper.cleanup(status):
        if sys.argv[1] == "second signal":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # a clean-up that hangs
sys.exit(4)  # not reached: the hard stop exits
"""


def _run_driver(scenario: str, timeout_s: float) -> tuple[int, list[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, scenario, str(timeout_s)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    return done.returncode, done.stdout.splitlines(), time.monotonic() - started


@pytest.mark.parametrize("scenario", ["second signal", "deadline"])
def test_run_stopper_hard_stop_kills_descendants_and_exits_130(scenario: str) -> None:
    """After a signal, a second signal during the clean-up (at once) or the clean-up's deadline (0.5 s) kills the
    driver's descendants and exits 130, well before the hung clean-up would end."""
    status, lines, took = _run_driver(scenario, timeout_s=30.0 if scenario == "second signal" else 0.5)
    assert status == 130, lines
    reason = "SIGTERM during the clean-up" if scenario == "second signal" else "the clean-up took over 0.5 s"
    assert f"hard stop ({reason}): killed 1 processes of the run; exit 130" in lines, lines
    child = int(lines[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert took < 20.0


# A failed run's clean-up whose deadline timer is being started when a SIGTERM arrives: its handler runs on the
# main thread while that thread holds the stopper's lock inside _start_timer, and must still hard-stop.
_SIGNAL_IN_TIMER_START = """
import os, signal, subprocess, sys, threading, time
from shell.run_stop import RunStopper
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
stopper = RunStopper(lambda message: print(message, flush=True), timeout_s=30.0)
start = threading.Timer.start
def signalled_start(timer):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs here, the lock held
    start(timer)
threading.Timer.start = signalled_start
with stopper.installed():
    with stopper.cleanup(1):
        time.sleep(30)
sys.exit(4)  # not reached: the hard stop exits
"""


def test_run_stopper_hard_stops_on_a_signal_while_its_clean_up_timer_starts() -> None:
    """A SIGTERM whose handler runs while the main thread is starting the clean-up's timer (holding the stopper's
    lock) hard-stops at once, exit 130, instead of waiting forever on that lock."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_TIMER_START],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 130, (lines, done.stderr[-2000:])
    assert "hard stop (SIGTERM during the clean-up): killed 1 processes of the run; exit 130" in lines, lines
    assert time.monotonic() - started < 20.0


def test_run_stopper_first_signal_raises_interrupted_and_restores_handlers() -> None:
    """SIGTERM in the body raises Interrupted (a KeyboardInterrupt, not an Exception: clean-up code cannot swallow
    it, and Ray's waits pass it on); the previous handlers are back afterwards."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stopper = RunStopper(lambda message: None)
    with stopper.installed(), pytest.raises(Interrupted, match="SIGTERM") as info:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert isinstance(info.value, KeyboardInterrupt) and not isinstance(info.value, Exception)
    assert info.value.signum == signal.SIGTERM
    assert stopper.interrupted and stopper.signal_name == "SIGTERM"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_run_stopper_cleanup_without_signal_returns() -> None:
    """A clean-up that finishes in time cancels its deadline: nothing is killed, the caller goes on."""
    stopper = RunStopper(lambda message: pytest.fail(message), timeout_s=0.2)
    with stopper.installed():
        with stopper.cleanup(0):
            pass
        time.sleep(0.4)
    assert not stopper.interrupted


def test_run_stopper_rejects_a_timeout_that_is_not_positive() -> None:
    """timeout_s must be > 0."""
    with pytest.raises(ValueError, match=r"'timeout_s' must be > 0: got 0"):
        RunStopper(lambda message: None, timeout_s=0)


def test_kill_processes_leaves_a_tracked_pid_that_is_not_a_ray_worker() -> None:
    """A tracked pid that runs no Ray worker (ended and reused, say) is not killed; descendants are."""
    script = (
        "import subprocess, sys\n"
        "from shell.run_stop import kill_processes\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "print(kill_processes([int(sys.argv[1])]), child.pid, flush=True)\n"
    )
    stranger = subprocess.Popen(["sleep", "60"])  # not a descendant of the child interpreter
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(stranger.pid)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
        )
        killed, child = done.stdout.split()
        assert killed == "1", done.stderr
        assert not psutil.pid_exists(int(child)) or psutil.Process(int(child)).status() == psutil.STATUS_ZOMBIE
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
