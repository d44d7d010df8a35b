#!/usr/bin/env python3
"""Project entry commands: ``python3 dev.py run``, ``test``, ``setup`` and ``wheelhouse``.

Both create the virtual environment at ``.venv/`` when it is missing (or when
``pyproject.toml`` changed since the last install), then run the main job or
the test suite inside it. Only the standard library is used here, so a fresh
clone needs nothing but ``python3``.

``python3 dev.py wheelhouse DIR`` gathers, as wheels in ``DIR``, what a GPU
machine without network (a PyTorch image, as on the benchmarks' lent H100s)
lacks to run the tests' and benchmarks' code, at the versions ``.venv`` holds;
see :func:`wheelhouse`.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import venv
import zipfile
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


OFFLINE_DISTRIBUTIONS = (
    "ray", "TransferQueue", "tensordict", "megatron-core", "omegaconf", "antlr4-python3-runtime", "hydra-core",
    "msgspec", "pyzmq", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "pyvers",
)
"""What a PyTorch GPU image lacks of the project's dependencies: :func:`wheelhouse` fetches these, at ``.venv``'s
versions. The image has the rest: torch, numpy, attrs, rich, xxhash, psutil, matplotlib, pytest and hypothesis, and
what these distributions need beyond one another (click, msgpack, protobuf, cloudpickle, prometheus_client, PyYAML,
requests, filelock)."""

RAY_TRIMMED = ("ray/jars/", "ray/dashboard/client/build/")
"""What ``--trim-ray`` drops from Ray's wheel (Java workers and the dashboard's web pages, which this project never
starts): 79 of its MB become about 45, so that the wheelhouse and the repository travel in 64 MiB."""

MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def trim_wheel(wheel: Path, prefixes: tuple[str, ...]) -> int:
    """Rewrite ``wheel`` without its members under ``prefixes`` and their ``RECORD`` lines; return how many
    members it dropped. A wheel with none of them is left as it was.

    The members kept keep their metadata (modes, times), and the file its mode. Nothing is left beside
    ``wheel`` when the rewrite fails, and ``wheel`` is then as it was.

    Raises:
        ValueError: ``wheel`` is not a wheel (not exactly one top-level ``*.dist-info/RECORD``).
    """
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"'wheel' must hold exactly one top-level *.dist-info/RECORD: got {len(records)} in {wheel}")
        dropped = [n for n in names if n.startswith(prefixes)]
        if not dropped:
            return 0
        kept_lines = [
            line for line in src.read(records[0]).decode().splitlines(keepends=True)
            if not line.split(",", 1)[0].startswith(prefixes)
        ]
        with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".whl", delete=False) as tmp:
            out_path = Path(tmp.name)
        try:
            with zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
                for info in src.infolist():
                    if info.filename.startswith(prefixes):
                        continue
                    data = "".join(kept_lines).encode() if info.filename == records[0] else src.read(info)
                    out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            os.chmod(out_path, wheel.stat().st_mode)
            out_path.replace(wheel)
        except BaseException:
            out_path.unlink(missing_ok=True)
            raise
    return len(dropped)


def pinned(distributions: tuple[str, ...], python: Path) -> list[str]:
    """``name==version`` of each of ``distributions`` as ``python``'s environment holds it.

    Raises:
        RuntimeError: one is not installed there (run ``python3 dev.py setup`` first).
    """
    code = (
        "import sys, importlib.metadata as m\n"
        "for n in sys.argv[1:]:\n"
        "    try: print(f'{n}=={m.version(n)}')\n"
        "    except m.PackageNotFoundError: print(f'{n}==MISSING')\n"
    )
    lines = subprocess.run([str(python), "-c", code, *distributions], check=True, capture_output=True, text=True)
    specs = lines.stdout.split()
    missing = [s.split("==")[0] for s in specs if s.endswith("==MISSING")]
    if missing:
        raise RuntimeError(f"not installed in {python}: {', '.join(missing)}; run python3 dev.py setup first")
    return specs


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheels_of(specs: list[str], target: Path) -> list[Path]:
    """The wheel in ``target`` of each ``name==version`` of ``specs``, in their order.

    Raises:
        ValueError: a distribution has no wheel of its version there, or ``target`` also holds a wheel of another
            version of it (an install of the folder would refuse the two).
    """
    found = []
    for spec in specs:
        name, version = spec.split("==")
        mine = [w for w in sorted(target.glob("*.whl")) if _normalized(w.name.split("-")[0]) == _normalized(name)]
        versions = {w.name.split("-")[1] for w in mine}
        if versions != {version}:
            raise ValueError(
                f"{target} must hold wheels of {name} {version} only: got versions {sorted(versions)} "
                f"({', '.join(w.name for w in mine) or 'none'})"
            )
        found.extend(mine)
    return found


def wheelhouse(target: Path, *, python_version: str = "3.12", trim_ray: bool = False) -> list[Path]:
    """Download :data:`OFFLINE_DISTRIBUTIONS` at ``.venv``'s versions as wheels for CPython ``python_version`` on
    x86-64 Linux into ``target`` (without their dependencies, which the image has); a distribution
    published only as source is built into a wheel here. Returns the wheels. Install them on the other machine with
    ``python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl`` and ``PYTHONPATH=/tmp/site:$PWD``.
    """
    specs = pinned(OFFLINE_DISTRIBUTIONS, ensure_env())
    target.mkdir(parents=True, exist_ok=True)
    platforms = [arg for tag in MANYLINUX for arg in ("--platform", tag)]
    for done, spec in enumerate(specs, 1):
        name = spec.split("==")[0]
        print(f"[dev] {done}/{len(specs)} {spec}", flush=True)
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
             python_version, "--implementation", "cp", *platforms, "--platform", "any", "-d", str(target), spec],
            capture_output=True, text=True,
        )
        if got.returncode:  # no wheel for that platform: a pure-Python source distribution, built here
            print(f"[dev] {name}: no wheel for CPython {python_version} on x86-64 Linux; building one", flush=True)
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(target), spec],
                                   capture_output=True, text=True)
            if built.returncode:
                raise RuntimeError(
                    f"{spec}: neither a wheel for CPython {python_version} on x86-64 Linux nor a build of one; pip "
                    f"download said: {got.stderr.strip()[-500:]}; pip wheel said: {built.stderr.strip()[-500:]}"
                )
            # A build here is for this Python and machine: only a pure-Python wheel serves another.
            for wheel in wheels_of([spec], target):
                if not wheel.name.endswith("-none-any.whl"):
                    wheel.unlink()
                    raise RuntimeError(
                        f"{spec}: no wheel for CPython {python_version} on x86-64 Linux, and its build here is not "
                        f"pure Python ({wheel.name}); pip download said: {got.stderr.strip()[-500:]}"
                    )
    wheels = wheels_of(specs, target)
    if trim_ray:
        for wheel in wheels:
            if wheel.name.startswith("ray-"):
                print(f"[dev] {wheel.name}: dropped {trim_wheel(wheel, RAY_TRIMMED)} files of {', '.join(RAY_TRIMMED)}",
                      flush=True)
    total = sum(w.stat().st_size for w in wheels)
    print(f"[dev] {len(wheels)} wheels, {total / 2**20:.1f} MiB, in {target}", flush=True)
    return wheels


SLOWEST_SHOWN = 15
"""How many of the slowest test phases ``dev.py test`` lists at the end of its report."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "setup", "wheelhouse"}:
        print("usage: python3 dev.py {run|test|setup} [extra args...]\n"
              "       python3 dev.py wheelhouse DIR [--python-version 3.12] [--trim-ray]", file=sys.stderr)
        return 2
    command, extra = argv[0], argv[1:]
    if command == "wheelhouse":
        import argparse

        parser = argparse.ArgumentParser(prog="python3 dev.py wheelhouse", description=wheelhouse.__doc__)
        parser.add_argument("dir", type=Path)
        parser.add_argument("--python-version", default="3.12")
        parser.add_argument("--trim-ray", action="store_true", help="drop " + ", ".join(RAY_TRIMMED) + " from Ray's wheel")
        args = parser.parse_args(extra)
        wheelhouse(args.dir, python_version=args.python_version, trim_ray=args.trim_ray)
        return 0
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
