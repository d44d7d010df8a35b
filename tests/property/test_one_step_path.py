"""Architecture law: one step path. The trainer's step never branches on the transport or on the step source
(sync or async), and no worker call names its method by a string.

Checked statically: the functions of ``GRPOTrainer`` that run a step call no
``isinstance`` and test no ``data_plane`` or ``grpo.async`` flag; and no module of ``shell/``
calls ``.call``, ``.submit``, ``.run_all`` or ``.run_sharded`` with a string
literal as the method.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP_FUNCTIONS = ("step", "_step", "_record")
DISPATCH_CALLS = {"call", "submit", "run_all", "run_sharded", "submit_all"}


def _trainer_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((ROOT / "shell" / "grpo_trainer.py").read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer"]
    return {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}


def transport_branches(function: ast.AST) -> list[str]:
    """``isinstance`` calls, and reads of the transport or source switch (``self.data_plane``,
    ``...data_plane.enabled``, ``...async_.enabled``)."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            found.append(f"line {node.lineno}: isinstance")
        if isinstance(node, ast.Attribute) and node.attr == "data_plane" and getattr(node.value, "id", None) == "self":
            found.append(f"line {node.lineno}: self.data_plane")
        if isinstance(node, ast.Attribute) and node.attr == "enabled" and getattr(node.value, "attr", None) == "data_plane":
            found.append(f"line {node.lineno}: data_plane.enabled")
        if isinstance(node, ast.Attribute) and node.attr == "enabled" and getattr(node.value, "attr", None) == "async_":
            found.append(f"line {node.lineno}: async_.enabled")
    return found


def string_dispatches(source: str) -> list[str]:
    """Calls like ``group.call("name", ...)``: a dispatch method given a string literal as its method."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in DISPATCH_CALLS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(f"line {node.lineno}: .{node.func.attr}({node.args[0].value!r}, ...)")
    return found


@pytest.mark.parametrize("name", STEP_FUNCTIONS)
def test_trainer_step_functions_do_not_branch_on_the_transport(name: str) -> None:
    """The step's functions hold no isinstance and read no data_plane or async flag: the transport and the
    step source alone differ."""
    assert transport_branches(_trainer_functions()[name]) == []


@pytest.mark.parametrize("path", sorted((ROOT / "shell").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_module_calls_no_worker_method_by_string(path: Path) -> None:
    """Every worker call in the shell passes the method itself, never its name."""
    assert string_dispatches(path.read_text()) == []


def test_checks_see_what_they_forbid() -> None:
    """The two detectors find a string dispatch and a transport branch when there is one."""
    assert string_dispatches("g.call('train', shards)\ng.call(W.train, shards)") == ["line 1: .call('train', ...)"]
    branchy = ast.parse(
        "def f(self, p):\n    if isinstance(p, X) or self.data_plane or c.data_plane.enabled or g.async_.enabled:\n        pass\n"
    )
    found = sorted(transport_branches(branchy))
    assert found == ["line 2: async_.enabled", "line 2: data_plane.enabled", "line 2: isinstance", "line 2: self.data_plane"]
