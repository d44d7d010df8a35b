"""Architecture law: imports run shell -> adapters -> core only.

No module of ``adapters/`` imports ``shell``, and no module of ``core/``
imports ``adapters`` or ``shell``. Checked statically on every ``import`` and
``from ... import`` statement (including those inside functions), so adding
one such import anywhere in a module fails the test that names the module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"adapters": ("shell",), "core": ("adapters", "shell")}
MODULES = [(package, path) for package in FORBIDDEN for path in sorted((ROOT / package).rglob("*.py"))]


def imported_packages(source: str) -> set[str]:
    """The top-level package of every module that ``source`` imports (relative imports excluded)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(("package", "path"), MODULES, ids=lambda p: getattr(p, "name", p))
def test_module_imports_only_inward(package: str, path: Path) -> None:
    """A module of adapters/ never imports shell; a module of core/ never imports adapters or shell."""
    wrong = sorted(imported_packages(path.read_text()) & set(FORBIDDEN[package]))
    assert wrong == [], f"{path.relative_to(ROOT)} imports {wrong}: arrows run shell -> adapters -> core only"


def test_imported_packages_sees_every_import_form() -> None:
    """Plain, dotted, from- and function-local imports are all found; relative ones are skipped."""
    source = (
        "import shell\nimport shell.run as r\nfrom shell.metering import X\n"
        "def f():\n    from adapters import memory\nfrom . import sibling\n"
    )
    assert imported_packages(source) == {"shell", "adapters"}


def test_adapters_public_face_loads_no_runtime() -> None:
    """``import adapters`` gives the ports and the in-process store, and loads neither Ray, TransferQueue nor megatron."""
    code = (
        "import json, sys, adapters\n"
        "names = sorted(adapters.__all__)\n"
        "print(json.dumps({'loaded': [m for m in ('ray', 'transfer_queue', 'megatron') if m in sys.modules],"
        " 'names': names}))\n"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out["loaded"] == []
    assert {"DataPlaneClient", "MemoryStore", "PolicyBackend", "RESERVED_TAG_PREFIX"} <= set(out["names"])


def test_adapters_loads_each_exported_name_from_its_module_on_first_access() -> None:
    """``adapters.X`` is the object its home module defines, for every name of ``adapters.__all__``; an unknown name
    is an ``AttributeError`` naming it."""
    import importlib

    import adapters

    for name in adapters.__all__:
        assert getattr(adapters, name) is getattr(importlib.import_module(adapters._HOMES[name]), name), name
    with pytest.raises(AttributeError, match="'NoSuchPort'"):
        adapters.NoSuchPort  # noqa: B018


def test_the_row_index_actor_module_loads_neither_torch_nor_tensordict_nor_transfer_queue() -> None:
    """The ``RayObjectStore`` index actor's process imports ``adapters.tq_row_index`` alone: it must stay light, or
    the actor's start takes seconds and its process hundreds of MiB (it holds only row locations and refs)."""
    code = (
        "import json, sys, adapters.tq_row_index\n"
        "print(json.dumps([m for m in ('torch', 'tensordict', 'transfer_queue', 'numpy') if m in sys.modules]))\n"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    assert loaded == []
