"""Typed reading of YAML config text: a value is read by the type its key declares, never by YAML 1.1's guesses.

PyYAML resolves plain scalars by YAML 1.1 rules: ``off``, ``no``, ``on`` and
``yes`` become booleans, ``12:30:00`` the integer 45000 and ``0777`` the octal
511. Here a document is only *composed* (parsed into nodes, each scalar kept as
the characters typed), and :func:`read_value` converts each scalar by the type
its key declares:

* ``str``: the characters as typed (``off`` stays ``'off'``, ``0777`` stays ``'0777'``);
* ``bool``: ``true`` or ``false`` (any case), nothing else;
* ``int`` and ``float``: YAML 1.2 numbers (``0777`` is 777, ``.inf`` is infinity);
* an ``Enum``: one of its member names;
* ``X | None``: a plain ``null``, ``~`` or empty value is ``None`` (quote it to keep the text);
* ``Any`` (free-form values, such as a task's constructor arguments): YAML 1.2 core
  resolution (``null``, ``true``/``false``, numbers; anything else is a string).

A command-line override ``key=value`` is one plain scalar holding the
characters after ``=``, unless they start with a quote (``'...'``,
``"..."``), or with a bracket (``[...]``, ``{...}``) where the key takes a
collection (a section, or free-form values such as ``task.kwargs``); those
are parsed as YAML.

Invariant: :func:`read_value` returns a value of the declared type or raises
:class:`ConfigError` naming the key; a ``str`` is ``node.value`` unchanged, and
``read_value(kind, node_of(dump(v)))`` gives back ``v`` for every value ``dump``
writes (the round trip of ``config.yaml``).
"""

from __future__ import annotations

import enum
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

import yaml

from core.frozen import FrozenDict, freeze, thaw
from shell.config_error import ConfigError

Tree = dict[str, Any]
"""A composed mapping: key -> a scalar or sequence ``yaml.Node``, or a nested ``Tree`` for a mapping."""

_PLAIN = None  # ScalarNode.style of an unquoted scalar
_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_BOOLS = {"true": True, "false": False}
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")
_STR_TAG = "tag:yaml.org,2002:str"


# ---------------------------------------------------------------- composing text into trees


def read_document(text: str, source: str) -> Tree:
    """The mapping of a YAML document, composed but not resolved (every scalar kept as typed).

    Args:
        text: the document.
        source: its name for errors (a file path).

    Raises:
        ConfigError: the text is not YAML, its top level is not a mapping, or a key repeats.

    Example:
        >>> read_document("run:\\n  progress: off\\n", "f.yaml")["run"]["progress"].value
        'off'
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        raise ConfigError(source, f"is not a valid YAML config: {_yaml_problem(error)}") from None
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(source, f"must hold a mapping of config keys at the top level: got a {_kind_of(node)}")
    return _tree(node, "", source)


def override_node(key: str, text: str, *, collections: bool = False) -> yaml.Node:
    """The node of a command-line override's value: one plain scalar of ``text``, unless it is quoted YAML.

    Args:
        key: the dotted key, for errors.
        text: the characters after ``=``.
        collections: the key takes a collection, so ``[...]`` and ``{...}`` are YAML too.

    Raises:
        ConfigError: a quoted or bracketed value is not valid YAML (naming ``key``).

    Example:
        >>> override_node("run.dir", "12:30:00").value, override_node("run.dir", "'null'").style
        ('12:30:00', "'")
    """
    if not text.startswith(("'", '"', "[", "{") if collections else ("'", '"')):
        return yaml.ScalarNode(_STR_TAG, text, style=_PLAIN)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        raise ConfigError(key, f"is not a valid YAML value: {_yaml_problem(error)} (got {text})") from None
    return node if node is not None else yaml.ScalarNode(_STR_TAG, "", style=_PLAIN)


def set_path(tree: Tree, key: str, node: yaml.Node) -> None:
    """Set dotted ``key`` of ``tree`` to ``node`` (a mapping node is merged into what the key holds)."""
    *parents, leaf = key.split(".")
    branch = tree
    for part in parents:
        if not isinstance(branch.get(part), dict):
            branch[part] = {}
        branch = branch[part]
    if isinstance(node, yaml.MappingNode):
        sub = _tree(node, f"{key}.", key)
        if isinstance(branch.get(leaf), dict):
            _merge(branch[leaf], sub)
            return
        branch[leaf] = sub
        return
    branch[leaf] = node


def _merge(into: Tree, other: Tree) -> None:
    for name, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = value


def _tree(node: yaml.MappingNode, prefix: str, source: str) -> Tree:
    out: Tree = {}
    for key_node, value in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(f"{prefix}<key>", f"keys must be names: got a {_kind_of(key_node)} in {source}")
        name = key_node.value
        if name in out:
            raise ConfigError(f"{prefix}{name}", f"is given twice in {source} (line {key_node.start_mark.line + 1})")
        out[name] = _tree(value, f"{prefix}{name}.", source) if isinstance(value, yaml.MappingNode) else value
    return out


def _kind_of(node: yaml.Node | Tree) -> str:
    if isinstance(node, dict) or isinstance(node, yaml.MappingNode):
        return "mapping"
    return "list" if isinstance(node, yaml.SequenceNode) else "scalar"


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


# ---------------------------------------------------------------- nodes -> typed values


def read_value(kind: Any, value: yaml.Node | Tree, key: str) -> Any:
    """``value`` (a node, or a composed mapping) read as type ``kind``.

    Args:
        kind: ``bool``, ``int``, ``float``, ``str``, an ``Enum`` class, ``X | None``,
            a ``Mapping[str, Any]`` (read as a :class:`FrozenDict` of free values) or ``Any``.
        value: what the document or override holds for the key.
        key: the dotted key, for errors.

    Raises:
        ConfigError: the value is not of that type (the message names ``key`` and the value as typed).

    Example:
        >>> read_value(bool, override_node("x", "false"), "x"), read_value(str, override_node("x", "off"), "x")
        (False, 'off')
    """
    origin = typing.get_origin(kind)
    if origin in (Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if is_null(value):
            return None
        (inner,) = options
        return read_value(inner, value, key)
    if kind is Any:
        return freeze(free_value(value))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if not isinstance(value, dict):
            if is_null(value):
                return FrozenDict()
            raise ConfigError(key, f"must be a mapping of names to values: got {_shown(value)}")
        return FrozenDict({name: freeze(free_value(item)) for name, item in value.items()})
    if not isinstance(value, yaml.ScalarNode):
        raise ConfigError(key, f"must be {_expected(kind)}: got a {_kind_of(value)}")
    text = value.value
    if kind is str:
        return text
    if kind is bool:
        if text.lower() in _BOOLS:
            return _BOOLS[text.lower()]
    elif kind is int:
        if _INT.fullmatch(text):
            return int(text, 0) if text.startswith(("0o", "0x")) else int(text)
    elif kind is float:
        number = _float(text)
        if number is not None:
            return number
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        if text in kind.__members__:
            return kind[text]
    else:
        raise TypeError(f"'kind' must be a config value type: got {kind!r}")
    return _reject(kind, value, key)


def _reject(kind: Any, node: yaml.ScalarNode, key: str) -> Any:
    raise ConfigError(key, f"must be {_expected(kind)}: got {_shown(node)}")


def _expected(kind: Any) -> str:
    if kind is bool:
        return "true or false"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is str:
        return "a string"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + ", ".join(kind.__members__)
    return str(kind)


def _shown(value: yaml.Node | Tree) -> str:
    if isinstance(value, yaml.ScalarNode):
        return "nothing (null)" if is_null(value) else repr(value.value)
    return f"a {_kind_of(value)}"


def is_null(value: yaml.Node | Tree) -> bool:
    """Whether ``value`` is a plain ``null``, ``~`` or empty scalar (a quoted one is text)."""
    return isinstance(value, yaml.ScalarNode) and value.style is _PLAIN and value.value in _NULLS


def _float(text: str) -> float | None:
    if _FLOAT.fullmatch(text) or _INT.fullmatch(text) and not text.startswith(("0o", "0x")):
        return float(text)
    if _INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.fullmatch(text):
        return math.nan
    return None


def free_value(value: yaml.Node | Tree) -> Any:
    """A value of no declared type, by YAML 1.2 core rules: null, booleans, numbers, else the text.

    Example:
        >>> [free_value(override_node("k", t)) for t in ("off", "0777", "1e3", "true")]
        ['off', 777, 1000.0, True]
    """
    if isinstance(value, dict):
        return {name: free_value(item) for name, item in value.items()}
    if isinstance(value, yaml.MappingNode):
        return {key.value: free_value(item) for key, item in value.value}
    if isinstance(value, yaml.SequenceNode):
        return [free_value(item) for item in value.value]
    return _resolve_plain(value.value) if value.style is _PLAIN else value.value


def _resolve_plain(text: str) -> Any:
    if text in _NULLS:
        return None
    if text in ("true", "True", "TRUE", "false", "False", "FALSE"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text, 0) if text.startswith(("0o", "0x")) else int(text)
    number = _float(text)
    return text if number is None else number


# ---------------------------------------------------------------- values -> text


class _Dumper(yaml.SafeDumper):
    """Writes a string quoted whenever YAML 1.1 or 1.2 would read its plain form as something else."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "'" if _resolve_plain(data) != data else None
    return dumper.represent_scalar(_STR_TAG, data, style=style)


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(FrozenDict, lambda dumper, data: dumper.represent_dict(dict(data)))


def dump(data: Mapping[str, Any]) -> str:
    """``data`` (plain values, enums as their names) as block YAML that :func:`read_value` reads back unchanged.

    Example:
        >>> dump({"run": {"progress": "off", "dir": "null"}})
        "run:\\n  progress: 'off'\\n  dir: 'null'\\n"
    """
    return yaml.dump(thaw(dict(data)), Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
