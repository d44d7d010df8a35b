"""Reading a GRPO run's configuration: the packaged YAML (or another file), then ``key=value`` overrides.

``load_run_config(overrides)`` reads ``shell/grpo.yaml`` (or ``config_file``,
e.g. a run's ``config.yaml``), applies the command-line overrides in order, and
builds the frozen, checked :class:`~shell.config_schema.RunConfig`. Each value
is read by the type its key declares (:mod:`shell.config_yaml`), so a string
option keeps its characters as typed (``run.progress=off``,
``data_plane.partition=no``, ``run.dir=12:30:00``) and a boolean is ``true`` or
``false``. :func:`dump_run_config` writes a config back as YAML, and
:func:`describe_keys` lists every key with its default and help (``--help``).

Invariant: ``load_run_config`` returns a runnable config or raises a
:class:`ConfigError` naming the key (an unknown key, a missing, ill-typed or
impossible value, an unreadable file, a bad task), before anything starts; and
``load_run_config(config_file=f)`` of a file written by :func:`save_run_config`
gives back an equal config.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from core.frozen import FrozenDict
from shell.config_error import ConfigError
from shell.config_schema import (
    FetchPolicyName,
    PolicyDevice,
    ProgressMode,
    RolloutPrecision,
    RouterReplayMode,
    RunConfig,
    StoreBackend,
    cluster_cpus,
    config_key,
    schema_fields,
)
from shell.config_yaml import Tree, dump, override_node, read_document, read_value, set_path

__all__ = [
    "ConfigError", "RunConfig", "StoreBackend", "FetchPolicyName", "ProgressMode", "RouterReplayMode",
    "RolloutPrecision", "PolicyDevice", "load_run_config",
    "parse_overrides", "run_config_from_dict", "run_config_to_dict", "dump_run_config", "save_run_config",
    "describe_keys", "select", "cluster_cpus",
]

DEFAULT_CONFIG = "grpo.yaml"


# ---------------------------------------------------------------- reading


def _unknown(name: str, prefix: str, names: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{prefix.rstrip('.') or 'the top level'} has " + ", ".join(names)
    return ConfigError(f"{prefix}{name}", f"is not a config key; {hint}")


def _check_known(cls: type, tree: Tree, prefix: str) -> None:
    """Every key of ``tree`` is a key of ``cls`` (checked before any value, so a typo is named first)."""
    fields = schema_fields(cls)
    for name, value in tree.items():
        if name not in fields:
            raise _unknown(name, prefix, list(fields))
        section = fields[name].metadata.get("section")
        if section is not None and isinstance(value, dict):
            _check_known(section, value, f"{prefix}{name}.")


def _build(cls: type, tree: Tree, prefix: str, source: str) -> Any:
    if not prefix:
        _check_known(cls, tree, prefix)
    values: dict[str, Any] = {}
    for name, attribute in schema_fields(cls).items():
        key = f"{prefix}{name}"
        section = attribute.metadata.get("section")
        if name not in tree and section is None:
            raise ConfigError(key, f"has no value: set it in {source} or as {key}=...")
        value = tree.get(name, {})
        if section is None:
            values[attribute.alias] = read_value(attribute.type, value, key)
        elif isinstance(value, dict):
            values[attribute.alias] = _build(section, value, f"{key}.", source)
        else:
            raise _not_a_value(key, section)
    return cls(**values)


def _not_a_value(key: str, section: type) -> ConfigError:
    names = list(schema_fields(section))
    return ConfigError(key, f"is a section with keys {', '.join(names)}: set one, e.g. {key}.{names[0]}=...")


def _attribute(key: str) -> attrs.Attribute:
    """The schema field of dotted ``key`` (a value, a section, or a key under a mapping such as ``task.kwargs``).

    Raises:
        ConfigError: no such key.
    """
    cls, prefix = RunConfig, ""
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = schema_fields(cls)
        if part not in fields:
            raise _unknown(part, prefix, list(fields))
        found = fields[part]
        section = found.metadata.get("section")
        if depth == len(parts) - 1 or (section is None and _is_mapping(found.type)):
            return found
        if section is None:
            raise ConfigError(key, f"is not a config key: {prefix}{part} takes a value, not keys")
        cls, prefix = section, f"{prefix}{part}."
    raise ConfigError(key, "is not a config key")  # not reached: the loop returns at the last part


def _is_mapping(kind: Any) -> bool:
    return getattr(kind, "__origin__", None) is Mapping


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", ...]`` as a nested mapping of values, each read by its key's type.

    Raises:
        ConfigError: an override is not ``key=value``, names no key (or a section), or has an ill-typed value.

    Example:
        >>> parse_overrides(["grpo.num_steps=3", "run.progress=off"])
        {'grpo': {'num_steps': 3}, 'run': {'progress': <ProgressMode.off: 'off'>}}
    """
    out: dict[str, Any] = {}
    for item in overrides:
        key, node = _override(item)
        attribute = _attribute(key)
        section = attribute.metadata.get("section")
        if section is not None:
            raise _not_a_value(key, section)
        kind = attribute.type if config_key(attribute) == key.rsplit(".", 1)[-1] else Any
        branch = out
        *parents, leaf = key.split(".")
        for part in parents:
            branch = branch.setdefault(part, {})
        branch[leaf] = read_value(kind, node, key)
    return out


def _override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(item, "overrides must look like key=value (e.g. grpo.num_steps=10)")
    attribute = _attribute(key)
    scalar = "section" not in attribute.metadata and not _is_mapping(attribute.type)
    return key, override_node(key, text, collections=not scalar)


def _read_source(config_file: str | Path | None) -> tuple[str, str]:
    if config_file is None:
        return resources.files("shell").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8"), "shell/" + DEFAULT_CONFIG
    path = Path(config_file)
    if not path.exists():
        raise ConfigError("--config", f"no such file: {path}")
    if not path.is_file():
        raise ConfigError("--config", f"must be a YAML file: {path} is a folder")
    try:
        return path.read_bytes().decode("utf-8"), str(path)
    except UnicodeDecodeError as error:
        raise ConfigError("--config", f"{path} is not a text (UTF-8) YAML file: byte {error.start} is 0x{error.object[error.start]:02x}") from None
    except OSError as error:
        raise ConfigError("--config", f"cannot read {path}: {error.strerror or error}") from None


def load_run_config(overrides: Sequence[str] = (), *, config_file: str | Path | None = None) -> RunConfig:
    """The checked run config: the YAML file, then ``overrides`` (later ones win).

    Args:
        overrides: ``key=value`` strings, e.g. ``["grpo.num_steps=5", "data_plane.enabled=false"]``.
        config_file: a YAML file with every key (default: the packaged ``shell/grpo.yaml``),
            e.g. a run's ``config.yaml``.

    Raises:
        ConfigError: an unknown key, an ill-typed or impossible value, an unreadable file, or a bad task.

    Example:
        >>> load_run_config(["grpo.num_steps=5"]).grpo.num_steps
        5
    """
    text, source = _read_source(config_file)
    tree = read_document(text, source)
    for item in overrides:
        key, node = _override(item)
        set_path(tree, key, node)
    return _build(RunConfig, tree, "", source)


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """A checked config from nested plain values (the inverse of :func:`run_config_to_dict`).

    Raises:
        ConfigError: as :func:`load_run_config`.
    """
    return run_config_from_text(dump(data), "the mapping")


def run_config_from_text(text: str, source: str) -> RunConfig:
    """A checked config from YAML ``text`` with every key (as :func:`dump_run_config` writes, e.g. the one a
    checkpoint holds); ``source`` names it in errors.

    Raises:
        ConfigError: as :func:`load_run_config`.
    """
    return _build(RunConfig, read_document(text, source), "", source)


# ---------------------------------------------------------------- writing and describing


def run_config_to_dict(config: Any) -> dict[str, Any]:
    """``config`` (or one of its sections) as nested plain values: enums as their names, mappings as dicts."""
    out: dict[str, Any] = {}
    for key, attribute in schema_fields(type(config)).items():
        value = getattr(config, attribute.name)
        if "section" in attribute.metadata:
            out[key] = run_config_to_dict(value)
        elif isinstance(value, enum.Enum):
            out[key] = value.value
        elif isinstance(value, FrozenDict):
            out[key] = dict(value)
        else:
            out[key] = value
    return out


def dump_run_config(config: RunConfig) -> str:
    """``config`` as YAML that :func:`load_run_config` reads back equal (``--config RUN_DIR/config.yaml``)."""
    return "# The config of a `python -m shell.run` run; rerun it with --config this-file\n" + dump(run_config_to_dict(config))


def save_run_config(config: RunConfig, path: str | Path) -> Path:
    """Write :func:`dump_run_config` to ``path``."""
    out = Path(path)
    out.write_text(dump_run_config(config), encoding="utf-8")
    return out


def select(config: RunConfig, key: str) -> Any:
    """The value at dotted ``key`` (``select(config, "policy.layout.data_parallel")``), by YAML key:
    ``select(config, "grpo.async.enabled")`` is ``config.grpo.async_.enabled``.

    Raises:
        ConfigError: ``key`` is not a config key.
    """
    _attribute(key)
    node: Any = config
    for part in key.split("."):
        node = getattr(node, schema_fields(type(node))[part].name) if attrs.has(type(node)) else node[part]
    return node


def describe_keys(defaults: RunConfig | None = None) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, default, help)`` of every config key, in schema order (for ``--help``).

    Args:
        defaults: the config whose values to show (default: the packaged YAML's).
    """
    values = load_run_config() if defaults is None else defaults
    yield from _describe(RunConfig, values, "")


def _describe(cls: type, values: Any, prefix: str) -> Iterator[tuple[str, str, str]]:
    for name, attribute in schema_fields(cls).items():
        key, value = f"{prefix}{name}", getattr(values, attribute.name)
        if "section" in attribute.metadata:
            yield from _describe(attribute.metadata["section"], value, f"{key}.")
        else:
            yield key, _shown(value), attribute.metadata["help"]


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Mapping):
        return str(dict(value))
    return str(value)
