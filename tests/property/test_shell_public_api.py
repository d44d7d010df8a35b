"""Law: the shell's public face is ``shell.__all__``; each name resolves to the object in its home module, lazily."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import shell


@pytest.mark.parametrize("name", shell.__all__)
def test_shell_public_name_is_its_home_modules_object(name: str) -> None:
    """``shell.<name>`` is the very object defined in (or re-exported by) its home module."""
    home = shell._HOMES[name]
    assert getattr(shell, name) is getattr(importlib.import_module(home), name)


def test_shell_unknown_name_raises_attribute_error() -> None:
    """A name outside the public face is an AttributeError naming it."""
    with pytest.raises(AttributeError, match="no attribute 'DataPlanePolicy'"):
        _ = shell.DataPlanePolicy  # type: ignore[attr-defined]


def test_shell_import_loads_no_runtime_until_a_name_is_used() -> None:
    """``import shell`` (as ``python -m shell.run --help`` does first) loads neither Ray nor megatron-core."""
    code = "import json, sys, shell; print(json.dumps([m for m in ('ray', 'megatron', 'transfer_queue') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
