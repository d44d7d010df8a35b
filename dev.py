#!/usr/bin/env python3
"""Project entry commands: ``python3 dev.py run`` and ``python3 dev.py test``.

Both create the virtual environment at ``.venv/`` when it is missing (or when
``pyproject.toml`` changed since the last install), then run the main job or
the test suite inside it. Only the standard library is used here, so a fresh
clone needs nothing but ``python3``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".installed-pyproject-sha256"
MAIN_JOB = ["-m", "shell.run"]


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _pyproject_digest() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_env() -> Path:
    """Create ``.venv`` and install the project (with test extras) if needed."""
    python = _venv_python()
    if not python.exists():
        print(f"[dev] creating virtual environment at {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    digest = _pyproject_digest()
    if not STAMP.exists() or STAMP.read_text().strip() != digest:
        print("[dev] installing the project and its pinned dependencies", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"],
            check=True,
            cwd=ROOT,
        )
        STAMP.write_text(digest + "\n")
    return python


SLOWEST_SHOWN = 15
"""How many of the slowest test phases ``dev.py test`` lists at the end of its report."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "setup"}:
        print("usage: python3 dev.py {run|test|setup} [extra args...]", file=sys.stderr)
        return 2
    command, extra = argv[0], argv[1:]
    python = ensure_env()
    if command == "setup":
        return 0
    if command == "run":
        args = [str(python), *MAIN_JOB, *extra]
    else:
        # The slowest tests close the report, so every CI log shows where the suite's time goes.
        args = [str(python), "-m", "pytest", f"--durations={SLOWEST_SHOWN}", *extra]
    child = subprocess.Popen(args, cwd=ROOT)
    # Ctrl-C reaches the child too (same process group) and it shuts down cleanly; this process
    # must neither die first nor kill it (subprocess.run kills its child on KeyboardInterrupt).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
