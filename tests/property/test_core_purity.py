"""Architecture law: ``core`` does no I/O and pulls in no distributed runtime.

Checked two ways: statically (no forbidden import, ``print``/``open`` call or
``global`` statement in any ``core`` module) and dynamically (importing every
``core`` module in a fresh interpreter loads none of the forbidden packages).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core"
FORBIDDEN_IMPORTS = {
    "os", "ray", "zmq", "logging", "subprocess", "socket", "requests", "tqdm", "rich",
    "transfer_queue", "megatron", "tensordict", "torch.distributed", "threading", "multiprocessing",
}
FORBIDDEN_CALLS = {"print", "open", "input", "exec", "eval"}
FORBIDDEN_RUNTIME = ("ray", "zmq", "transfer_queue", "megatron", "tensordict")
MODULES = sorted(p for p in CORE.glob("*.py"))


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN_IMPORTS):
                found.append(f"{path.name}:{node.lineno} imports {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{path.name}:{node.lineno} calls {node.func.id}()")
        if isinstance(node, ast.Global):
            found.append(f"{path.name}:{node.lineno} uses a global statement")
        if isinstance(node, ast.Attribute) and node.attr == "distributed":
            found.append(f"{path.name}:{node.lineno} touches .distributed")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_has_no_io_or_distributed_imports(path: Path) -> None:
    """No core module imports I/O, logging or distributed packages, prints, opens files or uses globals."""
    assert _violations(path) == []


def test_core_import_loads_no_distributed_runtime() -> None:
    """Importing every core module in a fresh interpreter loads no Ray, ZMQ, TransferQueue, megatron or tensordict."""
    names = ", ".join(f"core.{p.stem}" for p in MODULES if p.stem != "__init__")
    code = (
        "import sys, json\n"
        f"import core, {names}\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN_RUNTIME!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=CORE.parent)
    assert json.loads(out.stdout) == []
