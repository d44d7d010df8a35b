"""Law: ``docs/api.md`` documents the public set exactly, and every project name it gives exists.

* The public-set table lists exactly ``core.__all__`` and ``shell.__all__``, and every name of
  ``adapters.__all__``: a name added to (or dropped from) a package's public face without the
  docs, or the docs naming one that is gone, fails here.
* Every dotted project name in backticks (``core.sharding.shard_row_indices``,
  ``adapters.store_port.TagColumns.lacking``) resolves: its longest importable prefix is a module
  of the project, and each name after it is an attribute there, or a field a class declares
  (attrs fields and annotations). A renamed function, class or method leaves no stale name in the
  docs.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import adapters
import core
import shell

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PACKAGES: dict[str, ModuleType] = {"core": core, "shell": shell, "adapters": adapters}
_REFERENCE = re.compile(r"(?<![\w.])((?:core|shell|adapters)(?:\.[A-Za-z_]\w*)+)")
_CODE = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"`(?:[\w.]+\.)?([A-Za-z_]\w*)`")


def table_names(text: str, package: str) -> set[str]:
    """The names that the public-set table's row for ``package`` gives in backticks (its first cell excluded;
    ``adapters.memory.MemoryStore`` counts as ``MemoryStore``)."""
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().startswith(f"`{package}`"):
            return set(_NAME.findall(cells[2]))
    raise AssertionError(f"docs/api.md has no public-set table row for `{package}`")


def references(text: str) -> set[str]:
    """Every dotted project name (``core.*``, ``shell.*``, ``adapters.*``) inside backticks in ``text``."""
    return {m.group(1) for span in _CODE.findall(text) for m in _REFERENCE.finditer(span)}


def _declared(owner: Any, name: str) -> bool:
    """Whether class ``owner`` declares ``name`` as a field (attrs or an annotation), set on instances only."""
    if not isinstance(owner, type):
        return False
    return any(name in getattr(cls, "__annotations__", {}) for cls in owner.__mro__) or name in {
        a.name for a in getattr(owner, "__attrs_attrs__", ())
    }


def unresolved(reference: str) -> str | None:
    """Why ``reference`` names nothing in the project, or None when it does."""
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):  # a dependency is missing
                raise
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif _declared(obj, attr) and i == len(parts) - 1:
                return None
            else:
                return f"{'.'.join(parts[:i])} has no attribute {attr!r}"
        return None
    return f"no module {parts[0]!r}"


@pytest.fixture(scope="module")
def api_text() -> str:
    return API_DOC.read_text()


@pytest.mark.parametrize("package", ["core", "shell"])
def test_public_set_table_lists_exactly_the_package_all(api_text: str, package: str) -> None:
    """The table's row for ``core`` / ``shell`` names exactly the package's ``__all__``."""
    documented, exported = table_names(api_text, package), set(PACKAGES[package].__all__)
    assert documented == exported, (
        f"docs/api.md's `{package}` row: undocumented {sorted(exported - documented)}, "
        f"not exported {sorted(documented - exported)}"
    )


def test_public_set_table_lists_every_adapters_export(api_text: str) -> None:
    """Every name of ``adapters.__all__`` is in the table's ``adapters`` row (which also lists names that are
    imported from their modules only)."""
    missing = sorted(set(adapters.__all__) - table_names(api_text, "adapters"))
    assert missing == [], f"docs/api.md's `adapters` row lacks {missing}"


def test_every_project_name_in_the_api_doc_resolves(api_text: str) -> None:
    """Each backticked ``core.`` / ``shell.`` / ``adapters.`` name is a module, or an attribute or declared field
    of one, in this tree."""
    found = references(api_text)
    assert len(found) > 50, f"only {len(found)} project names found in docs/api.md: is the pattern still right?"
    stale = {ref: why for ref in sorted(found) if (why := unresolved(ref)) is not None}
    assert stale == {}, f"docs/api.md names {len(stale)} things that do not exist: {stale}"


def test_unresolved_names_the_missing_part() -> None:
    """The check itself: a real name resolves (modules, classes, methods, attrs fields); a wrong one is reported
    with the attribute that is missing."""
    assert unresolved("core.sharding.shard_row_indices") is None
    assert unresolved("core.meta.KVBatchMeta.keys") is None
    assert unresolved("core.step_plan") is None
    assert unresolved("core.sharding.no_such_function") == "core.sharding has no attribute 'no_such_function'"
    assert unresolved("core.meta.KVBatchMeta.no_field") == "core.meta.KVBatchMeta has no attribute 'no_field'"
    assert unresolved("core.no_such_module") == "core has no attribute 'no_such_module'"
    assert table_names("| `core` (x) | `A`, `b.C`; the `fields` module |\n", "core") == {"A", "C", "fields"}
