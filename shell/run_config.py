"""The GRPO run's configuration: a typed schema, the packaged YAML defaults, and ``key=value`` overrides.

``load_run_config(overrides)`` merges, in order, the schema's defaults, the
packaged ``shell/grpo.yaml`` (or another YAML file), and command-line
``key=value`` overrides, then checks every value. OmegaConf's structured
configs reject unknown keys and ill-typed values; :func:`check_run_config`
rejects values that are well typed but impossible (a layout that does not
divide the model, a backend that does not exist, ...).

Invariant: a config that loads is runnable: every error a bad key or value
can cause is raised here, before Ray, the store or a worker starts, as a
:class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DEFAULT_CONFIG = "grpo.yaml"


class ConfigError(ValueError):
    """A bad config key or value; ``key`` is its dotted name (e.g. ``policy.layout.tensor_parallel``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}")


class StoreBackend(str, Enum):
    """Which store the data plane uses."""

    transfer_queue = "transfer_queue"
    memory = "memory"


class FetchPolicyName(str, Enum):
    """How policy workers fetch their rows (see ``PolicyWorker.fetch``)."""

    auto = "auto"
    independent = "independent"
    leader_broadcast = "leader_broadcast"


class ProgressMode(str, Enum):
    """How the run shows progress: a live bar on a terminal or plain lines (``auto``), or one of them."""

    auto = "auto"
    bar = "bar"
    plain = "plain"
    off = "off"


# The schema holds types and one comment per key (``--help`` shows them); the values live in
# the packaged YAML alone, so defaults have one home. ``MISSING`` leaves must be set there.


@dataclasses.dataclass
class RunSection:
    dir: str | None = MISSING  # output folder (metrics.jsonl, plot, checkpoint); default runs/<timestamp>/
    progress: ProgressMode = MISSING  # auto | bar | plain | off
    checkpoint_every: int = MISSING  # also checkpoint every N steps (0: only at the end)
    samples_to_log: int = MISSING  # decoded responses written per step to samples.jsonl


@dataclasses.dataclass
class RaySection:
    address: str | None = MISSING  # an existing cluster ("auto" or host:port); null starts an embedded one
    num_cpus: int = MISSING  # logical CPUs of an embedded cluster (TransferQueue's actors need 1 each)


@dataclasses.dataclass
class DapoSection:
    enabled: bool = MISSING  # DAPO dynamic sampling: keep only groups whose rewards vary
    max_generation_batches: int = MISSING  # give up (error) after this many generation batches in a step


@dataclasses.dataclass
class LossSection:
    clip_low: float = MISSING  # ratio clipped below at 1 - clip_low
    clip_high: float = MISSING  # ratio clipped above at 1 + clip_high
    kl_coef: float = MISSING  # weight of the k3 KL to the reference policy (0: no reference pass)


@dataclasses.dataclass
class GrpoSection:
    num_steps: int = MISSING  # GRPO steps
    num_prompts_per_step: int = MISSING  # prompts (groups) per step
    num_generations_per_prompt: int = MISSING  # responses sampled per prompt
    temperature: float = MISSING  # sampling temperature of the rollout
    leave_one_out: bool = MISSING  # baseline = mean of the other responses of the prompt
    normalize_by_std: bool = MISSING  # divide advantages by the group's reward std
    overlong_filter: bool = MISSING  # responses cut off at max_new_tokens do not count in the loss
    dapo: DapoSection = dataclasses.field(default_factory=DapoSection)
    loss: LossSection = dataclasses.field(default_factory=LossSection)


@dataclasses.dataclass
class LayoutSection:
    data_parallel: int = MISSING  # DP ranks (model replicas)
    tensor_parallel: int = MISSING  # TP ranks per replica
    pipeline_parallel: int = MISSING  # PP stages per replica


@dataclasses.dataclass
class ModelSection:
    hidden_size: int = MISSING  # transformer width
    num_layers: int = MISSING  # transformer layers
    num_attention_heads: int = MISSING  # attention heads
    max_sequence_length: int = MISSING  # positions of the model


@dataclasses.dataclass
class PolicySection:
    layout: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    learning_rate: float = MISSING  # Adam step size
    train_global_batch_size: int | None = MISSING  # rows per optimizer step (null: one step per GRPO step)
    micro_batch_tokens: int = MISSING  # sequence packing: token capacity of a micro-batch (0: no packing)
    fetch_policy: FetchPolicyName = MISSING  # auto | independent | leader_broadcast
    num_cpus_per_worker: float = MISSING  # Ray CPUs per policy rank
    timeout_s: float = MISSING  # a worker call that takes longer fails the run


@dataclasses.dataclass
class TaskSection:
    name: str = MISSING  # "addition" or an import path "package.module:Class"
    kwargs: dict[str, Any] = MISSING  # constructor arguments of the task


@dataclasses.dataclass
class DataPlaneSection:
    enabled: bool = MISSING  # true: bulk tensors go through the store; false: the legacy in-memory path
    backend: StoreBackend = MISSING  # transfer_queue | memory
    partition: str = MISSING  # the store partition of the run's rows
    verify_integrity: bool = MISSING  # digest every row at put and check it at get


@dataclasses.dataclass
class RunConfig:
    seed: int = MISSING  # initial weights, prompts and sampling
    run: RunSection = dataclasses.field(default_factory=RunSection)
    ray: RaySection = dataclasses.field(default_factory=RaySection)
    grpo: GrpoSection = dataclasses.field(default_factory=GrpoSection)
    policy: PolicySection = dataclasses.field(default_factory=PolicySection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    data_plane: DataPlaneSection = dataclasses.field(default_factory=DataPlaneSection)


# ---------------------------------------------------------------- loading


def _error_key(error: OmegaConfBaseException, fallback: str = "<config>") -> str:
    key = getattr(error, "full_key", None) or getattr(error, "key", None)
    return str(key) if key else fallback


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``["a.b=1", ...]`` as a config (values parsed as YAML scalars).

    Raises:
        ConfigError: an override is not ``key=value``.
    """
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(item, "overrides must look like key=value (e.g. grpo.num_steps=10)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise ConfigError(_error_key(error), _first_line(error)) from None


def load_run_config(overrides: Sequence[str] = (), *, config_file: str | Path | None = None) -> DictConfig:
    """The checked run config: schema defaults, then the YAML file, then ``overrides``.

    Args:
        overrides: ``key=value`` strings, e.g. ``["grpo.num_steps=5", "data_plane.enabled=false"]``.
        config_file: a YAML file (default: the packaged ``shell/grpo.yaml``).

    Raises:
        ConfigError: an unknown key, an ill-typed or impossible value, or an unreadable file.

    Example:
        >>> load_run_config(["grpo.num_steps=5"]).grpo.num_steps
        5
    """
    schema = OmegaConf.structured(RunConfig)
    if config_file is None:
        text = resources.files("shell").joinpath(DEFAULT_CONFIG).read_text()
        source = "shell/" + DEFAULT_CONFIG
    else:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError("--config", f"no such file: {path}")
        text, source = path.read_text(), str(path)
    try:
        file_config = OmegaConf.create(yaml.safe_load(text) or {})
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(source, f"is not a valid YAML config: {_first_line(error)}") from None
    if not isinstance(file_config, DictConfig):
        raise ConfigError(source, f"must hold a mapping of config keys at the top level: got a {type(file_config).__name__}")
    try:
        merged = OmegaConf.merge(schema, file_config)
    except OmegaConfBaseException as error:
        raise ConfigError(_error_key(error, source), _first_line(error)) from None
    for item in overrides:  # one by one, so an error names the override's own key
        try:
            merged = OmegaConf.merge(merged, parse_overrides([item]))
        except OmegaConfBaseException as error:
            raise ConfigError(_error_key(error, item.split("=", 1)[0]), _first_line(error)) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(missing[0], f"has no value: set it in {source} or as {missing[0]}=...")
    check_run_config(merged)  # type: ignore[arg-type]
    OmegaConf.set_readonly(merged, True)
    return merged


def _require(key: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_run_config(config: DictConfig) -> None:
    """Reject values that are well typed but impossible.

    Raises:
        ConfigError: naming the first bad key.
    """
    c = config
    _require("seed", c.seed >= 0, f"must be >= 0: got {c.seed}")
    _require("run.checkpoint_every", c.run.checkpoint_every >= 0, f"must be >= 0: got {c.run.checkpoint_every}")
    _require("run.samples_to_log", c.run.samples_to_log >= 0, f"must be >= 0: got {c.run.samples_to_log}")
    _require("ray.num_cpus", c.ray.num_cpus >= 1, f"must be >= 1: got {c.ray.num_cpus}")
    g = c.grpo
    for name in ("num_steps", "num_prompts_per_step", "num_generations_per_prompt"):
        _require(f"grpo.{name}", g[name] >= 1, f"must be >= 1: got {g[name]}")
    _require("grpo.temperature", g.temperature > 0, f"must be > 0: got {g.temperature}")
    _require(
        "grpo.dapo.max_generation_batches",
        g.dapo.max_generation_batches >= 1,
        f"must be >= 1: got {g.dapo.max_generation_batches}",
    )
    _require("grpo.loss.clip_low", 0 <= g.loss.clip_low <= 1, f"must be in [0, 1]: got {g.loss.clip_low}")
    _require("grpo.loss.clip_high", g.loss.clip_high >= 0, f"must be >= 0: got {g.loss.clip_high}")
    _require("grpo.loss.kl_coef", g.loss.kl_coef >= 0, f"must be >= 0: got {g.loss.kl_coef}")
    p = c.policy
    for name in ("data_parallel", "tensor_parallel", "pipeline_parallel"):
        _require(f"policy.layout.{name}", p.layout[name] >= 1, f"must be >= 1: got {p.layout[name]}")
    for name in ("hidden_size", "num_layers", "num_attention_heads", "max_sequence_length"):
        _require(f"policy.model.{name}", p.model[name] >= 1, f"must be >= 1: got {p.model[name]}")
    heads, tp, pp = p.model.num_attention_heads, p.layout.tensor_parallel, p.layout.pipeline_parallel
    _require(
        "policy.model.hidden_size",
        p.model.hidden_size % heads == 0,
        f"must be a multiple of policy.model.num_attention_heads ({heads}): got {p.model.hidden_size}",
    )
    _require("policy.layout.tensor_parallel", heads % tp == 0,
             f"must divide policy.model.num_attention_heads ({heads}): got {tp}")
    _require("policy.layout.pipeline_parallel", p.model.num_layers % pp == 0,
             f"must divide policy.model.num_layers ({p.model.num_layers}): got {pp}")
    _require("policy.learning_rate", p.learning_rate > 0, f"must be > 0: got {p.learning_rate}")
    rows = g.num_prompts_per_step * g.num_generations_per_prompt
    gbs, dp = p.train_global_batch_size, p.layout.data_parallel
    if gbs is not None:
        _require(
            "policy.train_global_batch_size",
            gbs >= 1 and gbs % dp == 0 and rows % gbs == 0,
            f"must be a multiple of policy.layout.data_parallel ({dp}) that divides the rows of a step "
            f"(num_prompts_per_step * num_generations_per_prompt = {rows}): got {gbs}",
        )
    _require("policy.micro_batch_tokens", p.micro_batch_tokens >= 0, f"must be >= 0: got {p.micro_batch_tokens}")
    _require("policy.num_cpus_per_worker", p.num_cpus_per_worker > 0, f"must be > 0: got {p.num_cpus_per_worker}")
    _require("policy.timeout_s", p.timeout_s > 0, f"must be > 0: got {p.timeout_s}")
    _require("task.name", bool(c.task.name), "must name a task: 'addition' or 'package.module:Class'")
    _require("data_plane.partition", bool(c.data_plane.partition), "must be a non-empty string")


def describe_keys(defaults: DictConfig | None = None) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, default, comment)`` of every config key, in schema order (for ``--help``).

    Args:
        defaults: the config whose values to show (default: the packaged YAML's).
    """
    values = load_run_config() if defaults is None else defaults
    for key, comment in _describe(RunConfig, ""):
        value = OmegaConf.select(values, key)
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(
            value.value if isinstance(value, Enum) else OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
        )
        yield key, shown, comment


def _comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith("#"):
            name = stripped.split(":", 1)[0].strip()
            comments[name] = stripped.split("#", 1)[1].strip()
    return comments


def _describe(cls: type, prefix: str) -> Iterator[tuple[str, str]]:
    comments = _comments(cls)
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name, field in hints.items():
        factory = field.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            yield from _describe(factory, f"{prefix}{name}.")  # type: ignore[arg-type]
            continue
        yield f"{prefix}{name}", comments.get(name, "")
