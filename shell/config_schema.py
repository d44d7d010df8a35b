"""The schema of a GRPO run's configuration: frozen, typed sections whose attribute names are the YAML keys.

``RunConfig`` holds one section per top-level key of ``shell/grpo.yaml``
(``config.grpo.num_prompts_per_step``, ``config.policy.layout.data_parallel``,
``config.data_plane.backend``), with ``int``, ``float``, ``bool``, ``str`` and
enum values. A key that is a Python keyword is the attribute of that name plus
``_``, with the key in its field's metadata: the YAML section ``grpo.async`` is
``config.grpo.async_`` (:func:`config_key`, :func:`schema_fields`). Each key
carries its type, its checks and one line of help (``--help``); the values live
in ``grpo.yaml`` alone. :mod:`shell.run_config` reads text into these classes.

Invariant: a ``RunConfig`` that exists is runnable. Every check is made when it
is built: per-field validators (type, range, finiteness), then
``__attrs_post_init__`` for relations between keys (the layout divides the
model; an MoE model routes at most its experts per token and router replay
needs one; the task loads and its longest row fits the model and the
micro-batches; async GRPO runs on the data plane, without DAPO, with a buffer
of at least one step's groups; the embedded cluster has the CPUs the run's
actors need). Every failure is a :class:`ConfigError` naming its key, raised
before Ray, the store or a worker starts.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from core.frozen import freeze
from core.gpu_share import gpu_share_problem
from core.step_plan import StepLayout
from core.task import Task
from shell.config_error import ConfigError
from shell.run_task import TaskShape, built_in_names, load_task, probe_task


TRANSFER_QUEUE_CONTROLLER_CPUS = 1.0
"""Logical CPUs of TransferQueue's controller actor (SimpleStorage: each storage unit takes 1 more, ``data_plane.storage_units``)."""
TQ_OBJECT_STORE_CPUS = 1.0
"""Logical CPUs of TransferQueue on the Ray object store: the controller (the backend's index actor takes none)."""
ROLLOUT_ENGINES = 1
"""Rollout engine actors of a run (each takes ``policy.num_cpus_per_worker`` CPUs)."""


class StoreBackend(str, enum.Enum):
    """Which store the data plane uses."""

    tq_object_store = "tq_object_store"
    transfer_queue = "transfer_queue"
    memory = "memory"

    @property
    def tq_storage(self) -> str | None:
        """TransferQueue's ``backend.storage_backend`` for this store, or None for a store that is not TransferQueue."""
        return {"tq_object_store": "RayObjectStore", "transfer_queue": "SimpleStorage"}.get(self.value)


class NodePlacement(str, enum.Enum):
    """Where the policy ranks and the rollout engine go on a cluster of several nodes (:mod:`shell.node_placement`)."""

    pack = "pack"
    spread = "spread"


class FetchPolicyName(str, enum.Enum):
    """How policy workers fetch their rows (see ``PolicyWorker.fetch``)."""

    auto = "auto"
    independent = "independent"
    leader_broadcast = "leader_broadcast"


class RouterReplayMode(str, enum.Enum):
    """Whether training replays the rollout's MoE routing (R3, :mod:`core.routing`)."""

    off = "off"
    r3 = "r3"


class RolloutPrecision(str, enum.Enum):
    """The rollout engine's compute precision."""

    fp32 = "fp32"
    bf16 = "bf16"


class PolicyDevice(str, enum.Enum):
    """Where the policy ranks run megatron-core: on CPU over gloo (the project's shim), or on GPUs over NCCL
    (``policy.gpus_per_rank`` of one each)."""

    cpu = "cpu"
    cuda = "cuda"


class ProgressMode(str, enum.Enum):
    """How the run shows progress: a live bar on a terminal or plain lines (``auto``), or one of them."""

    auto = "auto"
    bar = "bar"
    plain = "plain"
    off = "off"


KEY = "key"
"""Field metadata: the YAML key of a field whose attribute name differs from it (``async_`` is ``async``)."""


# ---------------------------------------------------------------- per-field checks

Check = Callable[[Any], "str | None"]
"""A field check: the failure (``"must be >= 1"``) for a bad value, None for a good one."""


def _at_least(low: float) -> Check:
    return lambda v: None if v is None or v >= low else f"must be >= {low}"


def _above(low: float) -> Check:
    return lambda v: None if v is None or v > low else f"must be > {low}"


def _within(low: float, high: float) -> Check:
    return lambda v: None if low <= v <= high else f"must be in [{low}, {high}]"


def _dense_or_experts(v: int) -> str | None:
    return None if v == 0 or v >= 2 else "must be 0 (a dense MLP) or >= 2 (experts per MoE layer)"


def _finite(v: Any) -> str | None:
    return None if v is None or math.isfinite(v) else "must be a finite number"


def _non_empty(v: str | None) -> str | None:
    return None if v is None or v else "must be a non-empty string"


def _resource_name(v: str | None) -> str | None:
    if v is None or (v.strip() == v and v and v not in ("CPU", "GPU", "memory", "object_store_memory")):
        return None
    return "must name a custom Ray node resource (not CPU, GPU, memory or object_store_memory; no surrounding spaces), or be null"


_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def _ray_address(v: str | None) -> str | None:
    if v is None or v == "auto":
        return None
    match = _ADDRESS.fullmatch(v)
    if match and 1 <= int(match.group(2)) <= 65535:
        return None
    return "must be 'auto', host:port of a running cluster (e.g. 10.0.0.1:6379), or null for an embedded cluster"


def _key_of(instance: Any, attribute: attrs.Attribute) -> str:
    return f"{type(instance).PATH}{config_key(attribute)}"


def _kind_ok(kind: Any, value: Any) -> bool:
    if kind is bool:
        return type(value) is bool
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, float)
    if isinstance(kind, type):
        return isinstance(value, kind)
    args = getattr(kind, "__args__", ())
    if type(None) in args:
        return value is None or any(_kind_ok(k, value) for k in args if k is not type(None))
    return isinstance(value, Mapping)


def _checked(*checks: Check) -> Callable[[Any, attrs.Attribute, Any], None]:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        key = _key_of(instance, attribute)
        if not _kind_ok(attribute.type, value):
            raise ConfigError(key, f"must be of type {getattr(attribute.type, '__name__', attribute.type)}: "
                                   f"got {type(value).__name__} {value!r}")
        for check in checks:
            failure = check(value)
            if failure:
                raise ConfigError(key, f"{failure}: got {value!r}")

    return validate


def _to_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _key(help: str, *checks: Check, float_: bool = False) -> Any:
    """A config key: its one-line help (``--help``) and its checks."""
    return attrs.field(
        validator=_checked(*checks), converter=_to_float if float_ else None, metadata={"help": help}
    )


def _number(help: str, *checks: Check) -> Any:
    return _key(help, _finite, *checks, float_=True)


def _section(cls: type, *, key: str | None = None) -> Any:
    """A section field; ``key``: its YAML key where the attribute name cannot be it (a Python keyword)."""
    return attrs.field(validator=_checked(), metadata={"section": cls, **({KEY: key} if key is not None else {})})


# ---------------------------------------------------------------- the schema (values: shell/grpo.yaml)


@attrs.frozen
class RunSection:
    """``run``: where the run writes and what it shows."""

    PATH: ClassVar[str] = "run."
    dir: str | None = _key("output folder (metrics.jsonl, plot, checkpoint); null: runs/<timestamp>/", _non_empty)
    progress: ProgressMode = _key("auto | bar | plain | off")
    checkpoint_every: int = _key("also checkpoint every N steps (0: only at the end)", _at_least(0))
    samples_to_log: int = _key("decoded responses written per step to samples.jsonl", _at_least(0))
    memory_every: int = _key(
        "every N steps, each process's resident memory in the step's record (rss_mib, MiB by process); 0: never",
        _at_least(0),
    )
    memory_rise_limit: float = _number(
        "warn when a process's resident memory grows faster than this many MiB per 100 steps over its last "
        "run.memory_rise_window readings (rss_rising in the record; a leak's sign); 0: never",
        _at_least(0),
    )
    memory_rise_window: int = _key("readings of rss_mib that run.memory_rise_limit judges a slope over", _at_least(2))
    overwrite: bool = _key("true: reuse a run.dir holding an earlier run, deleting its files (else use --resume)")


@attrs.frozen
class RaySection:
    """``ray``: the Ray cluster the run starts or joins (:mod:`shell.ray_cluster`)."""

    PATH: ClassVar[str] = "ray."
    address: str | None = _key("join a running cluster: 'auto' or host:port; null: start an embedded one", _ray_address)
    num_cpus: int = _key(
        "logical CPUs of an embedded cluster (TransferQueue's actors need 1 + data_plane.storage_units)", _at_least(1)
    )
    placement: NodePlacement = _key(
        "pack | spread: where policy ranks and the rollout engine go; pack: Ray's default (the driver's node first); "
        "spread: round-robin over the eligible nodes, one rank per node before any node gets two (docs/scaling.md)"
    )
    worker_resource: str | None = _key(
        "a custom node resource (ray start --resources): policy ranks and the rollout engine run only on nodes "
        "that have it (null: any node; needs ray.address)",
        _resource_name,
    )

    def __attrs_post_init__(self) -> None:
        if self.address is None and self.worker_resource is not None:
            raise ConfigError(
                "ray.worker_resource",
                "must be null for an embedded cluster (ray.address: null starts one node with no custom resources, "
                f"so no actor could be scheduled); join a cluster whose nodes have it: got {self.worker_resource!r}",
            )


@attrs.frozen
class DapoSection:
    """``grpo.dapo``: DAPO dynamic sampling."""

    PATH: ClassVar[str] = "grpo.dapo."
    enabled: bool = _key("DAPO dynamic sampling: keep only groups whose rewards vary")
    max_generation_batches: int = _key("give up (error) after this many generation batches in a step", _at_least(1))


@attrs.frozen
class LossSection:
    """``grpo.loss``: the clipped GRPO loss and its KL term."""

    PATH: ClassVar[str] = "grpo.loss."
    clip_low: float = _number("ratio clipped below at 1 - clip_low", _within(0, 1))
    clip_high: float = _number("ratio clipped above at 1 + clip_high", _at_least(0))
    kl_coef: float = _number("weight of the k3 KL to the reference policy (0: no reference pass)", _at_least(0))


@attrs.frozen
class AsyncSection:
    """``grpo.async``: asynchronous GRPO (``config.grpo.async_``: ``async`` is a Python keyword)."""

    PATH: ClassVar[str] = "grpo.async."
    enabled: bool = _key("asynchronous GRPO: a rollout collector runs ahead of the trainer through the store (docs/async.md)")
    max_staleness: int = _key(
        "a trained row's weights are at most this many versions behind the trainer's (0: synchronous, bitwise equal)",
        _at_least(0),
    )
    buffer_groups: int = _key(
        "replay buffer capacity in prompt groups (receipts only; the rows stay in the store)", _at_least(1)
    )
    is_cap: float = _number(
        "truncation cap of the importance weight exp(proximal - behaviour) in the decoupled loss", _at_least(1)
    )


@attrs.frozen
class GrpoSection:
    """``grpo``: steps, groups, sampling and advantages."""

    PATH: ClassVar[str] = "grpo."
    num_steps: int = _key("GRPO steps", _at_least(1))
    num_prompts_per_step: int = _key("prompts (groups) per step", _at_least(1))
    num_generations_per_prompt: int = _key(
        "responses sampled per prompt (>= 2: a lone response has advantage 0)", _at_least(2)
    )
    temperature: float = _number("sampling temperature of the rollout", _above(0))
    leave_one_out: bool = _key("baseline = mean of the other responses of the prompt")
    normalize_by_std: bool = _key("divide advantages by the group's reward std")
    overlong_filter: bool = _key("responses cut off at max_new_tokens do not count in the loss")
    dapo: DapoSection = _section(DapoSection)
    loss: LossSection = _section(LossSection)
    async_: AsyncSection = _section(AsyncSection, key="async")


@attrs.frozen
class LayoutSection:
    """``policy.layout``: how many ranks, along each parallel axis."""

    PATH: ClassVar[str] = "policy.layout."
    data_parallel: int = _key("DP ranks (model replicas)", _at_least(1))
    tensor_parallel: int = _key("TP ranks per replica", _at_least(1))
    pipeline_parallel: int = _key("PP stages per replica", _at_least(1))

    @property
    def world_size(self) -> int:
        """Policy ranks: ``data_parallel * tensor_parallel * pipeline_parallel``."""
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel


@attrs.frozen
class ModelSection:
    """``policy.model``: the tiny GPT's sizes (its vocabulary comes from the task)."""

    PATH: ClassVar[str] = "policy.model."
    hidden_size: int = _key("transformer width", _at_least(1))
    num_layers: int = _key("transformer layers", _at_least(1))
    num_attention_heads: int = _key("attention heads", _at_least(1))
    max_sequence_length: int = _key("positions of the model (the longest row must fit)", _at_least(1))
    num_experts: int = _key(
        "experts of each layer's MoE MLP (0: a dense MLP); no expert parallelism: every rank holds every expert; under TP an MoE model runs sequence parallel",
        _dense_or_experts,
    )
    moe_topk: int = _key("experts routed per token, in [1, num_experts] (MoE only; unused when dense)", _at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "policy.model.hidden_size",
                f"must be a multiple of policy.model.num_attention_heads ({self.num_attention_heads}): "
                f"got {self.hidden_size}",
            )
        if self.num_experts and self.moe_topk > self.num_experts:
            raise ConfigError(
                "policy.model.moe_topk",
                f"must be in [1, policy.model.num_experts ({self.num_experts})]: got {self.moe_topk}",
            )


@attrs.frozen
class PolicySection:
    """``policy``: the trained model, its layout and its optimizer."""

    PATH: ClassVar[str] = "policy."
    layout: LayoutSection = _section(LayoutSection)
    model: ModelSection = _section(ModelSection)
    learning_rate: float = _number("Adam step size", _above(0))
    train_global_batch_size: int | None = _key("rows per optimizer step (null: one step per GRPO step)", _at_least(1))
    micro_batch_tokens: int = _key(
        "sequence packing: token capacity of a micro-batch, >= the longest row (0: no packing)", _at_least(0)
    )
    fetch_policy: FetchPolicyName = _key("auto | independent | leader_broadcast")
    router_replay: RouterReplayMode = _key(
        "off | r3: the rollout records each token's MoE routing (field routed_experts) and training replays it "
        "(needs policy.model.num_experts > 0)"
    )
    device: PolicyDevice = _key(
        "cpu | cuda: where the policy ranks run (cuda: a GPU each, NCCL; the rollout engine stays on CPU)"
    )
    gpus_per_rank: float = _number(
        "Ray GPUs per policy rank with policy.device=cuda, in (0, 1], a multiple of 0.0001; below 1 another run's "
        "ranks may share the device (ranks of one run never do: NCCL refuses, so <= 0.5 needs one rank)",
    )
    num_cpus_per_worker: float = _number("Ray CPUs per policy rank and per rollout engine", _above(0))
    timeout_s: float = _number("a worker call that takes longer fails the run", _above(0))

    def __attrs_post_init__(self) -> None:
        heads, layers = self.model.num_attention_heads, self.model.num_layers
        tp, pp = self.layout.tensor_parallel, self.layout.pipeline_parallel
        if heads % tp:
            raise ConfigError("policy.layout.tensor_parallel", f"must divide policy.model.num_attention_heads ({heads}): got {tp}")
        if layers % pp:
            raise ConfigError("policy.layout.pipeline_parallel", f"must divide policy.model.num_layers ({layers}): got {pp}")
        ranks = self.layout.world_size if self.device == PolicyDevice.cuda else 1  # on CPU: its range and grid only
        problem = gpu_share_problem(self.gpus_per_rank, ranks)
        if problem is not None:
            raise ConfigError("policy.gpus_per_rank", f"must {problem}: got {self.gpus_per_rank!r}")
        if self.replays_routing and not self.model.num_experts:
            raise ConfigError(
                "policy.router_replay",
                "must be off for a dense model (policy.model.num_experts = 0; R3 replays MoE routing): got r3",
            )

    @property
    def replays_routing(self) -> bool:
        """Whether R3 is on: the rollout records ``routed_experts`` and the policy replays it."""
        return self.router_replay == RouterReplayMode.r3


@attrs.frozen
class RolloutSection:
    """``rollout``: how the rollout engine samples."""

    PATH: ClassVar[str] = "rollout."
    precision: RolloutPrecision = _key(
        "fp32 | bf16: the rollout engine's compute precision (training stays fp32)"
    )


@attrs.frozen
class TaskSection:
    """The task: its name and constructor arguments; ``instance`` is the task they build (not a key)."""

    PATH: ClassVar[str] = "task."
    name: str = _key(f"a built-in task ({built_in_names()}) or an import path 'package.module:Class'", _non_empty)
    kwargs: Mapping[str, Any] = attrs.field(
        converter=freeze, validator=_checked(), metadata={"help": "constructor arguments of the task"}
    )
    instance: Task = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "instance", load_task(self.name, self.kwargs))

    def build(self) -> Task:
        """A new instance of the task (the checks passed for these arguments: it raises nothing new)."""
        return load_task(self.name, self.kwargs)


@attrs.frozen
class DataPlaneSection:
    """``data_plane``: whether and how the bulk rows go through a store."""

    PATH: ClassVar[str] = "data_plane."
    enabled: bool = _key("true: bulk tensors go through the store; false: the legacy in-memory path")
    backend: StoreBackend = _key(
        "tq_object_store (TransferQueue, rows in Ray's object store) | transfer_queue (TransferQueue as shipped, "
        "SimpleStorage units) | memory (one Ray actor)"
    )
    partition: str = _key("the store partition of the run's rows (any text)", _non_empty)
    verify_integrity: bool = _key("digest every row at put and check it at get")
    storage_units: int = _key(
        "TransferQueue storage units (backend transfer_queue only: SimpleStorage), placed round-robin over the "
        "eligible nodes; unused when TransferQueue already runs on the cluster",
        _at_least(1),
    )
    storage_resource: str | None = _key(
        "a custom node resource: TransferQueue's parts run only on nodes that have it: its controller (1 CPU), "
        "and with backend transfer_queue the storage units (1 CPU each), with tq_object_store the index, which "
        "holds the small columns (no CPU); null: where Ray puts them; needs ray.address",
        _resource_name,
    )


@attrs.frozen
class RunConfig:
    """The whole run; each attribute is a section (or ``seed``), named as in ``grpo.yaml``.

    Raises:
        ConfigError: a value is ill-typed or impossible, alone or with others (see the module docstring).

    Example:
        >>> from shell.run_config import load_run_config
        >>> config = load_run_config(["grpo.num_steps=5", "run.progress=off"])
        >>> config.grpo.num_steps, config.run.progress, config.policy.layout.data_parallel
        (5, <ProgressMode.off: 'off'>, 1)
    """

    PATH: ClassVar[str] = ""
    seed: int = _key("initial weights, prompts and sampling", _within(0, 2**63 - 1))
    run: RunSection = _section(RunSection)
    ray: RaySection = _section(RaySection)
    grpo: GrpoSection = _section(GrpoSection)
    policy: PolicySection = _section(PolicySection)
    rollout: RolloutSection = _section(RolloutSection)
    task: TaskSection = _section(TaskSection)
    data_plane: DataPlaneSection = _section(DataPlaneSection)

    def __attrs_post_init__(self) -> None:
        g, p = self.grpo, self.policy
        rows, dp, gbs = g.num_prompts_per_step * g.num_generations_per_prompt, p.layout.data_parallel, p.train_global_batch_size
        try:  # "a global batch is a multiple of DP" is core's rule (StepLayout); the config adds "divides a step"
            StepLayout(dp_size=dp, train_global_batch_size=gbs)
            bad = gbs is not None and rows % gbs
        except ValueError:
            bad = True
        if bad:
            raise ConfigError(
                "policy.train_global_batch_size",
                f"must be a multiple of policy.layout.data_parallel ({dp}) that divides the rows of a step "
                f"(num_prompts_per_step * num_generations_per_prompt = {rows}): got {gbs}",
            )
        _check_async(self)
        if self.data_plane.storage_resource is not None and self.data_plane.backend.tq_storage is None:
            raise ConfigError(
                "data_plane.storage_resource",
                "must be null unless data_plane.backend is transfer_queue or tq_object_store (it places "
                f"TransferQueue's storage parts; {self.data_plane.backend.value} has none): "
                f"got {self.data_plane.storage_resource!r}",
            )
        if self.ray.address is None and self.data_plane.storage_resource is not None:
            raise ConfigError(
                "data_plane.storage_resource",
                "must be null for an embedded cluster (ray.address: null starts one node with no custom resources, "
                f"so no storage unit could be placed); join a cluster whose nodes have it: got "
                f"{self.data_plane.storage_resource!r}",
            )
        shape = probe_task(self.task.instance, self.task.build(), seed=self.seed, name=self.task.name)
        _check_rows_fit(self, shape)
        if self.ray.address is None:
            needed, arithmetic = cluster_cpus(self)
            if needed > self.ray.num_cpus + 1e-9:
                raise ConfigError(
                    "ray.num_cpus",
                    f"the run's actors need {arithmetic} CPUs, more than the embedded cluster's {self.ray.num_cpus}, "
                    f"so they could never be scheduled: raise ray.num_cpus to {math.ceil(needed - 1e-9)} "
                    f"or lower policy.num_cpus_per_worker: got {self.ray.num_cpus}",
                )


def _check_async(config: RunConfig) -> None:
    """With ``grpo.async.enabled``: rows go through the store, DAPO is off, and the buffer holds a step's groups."""
    a = config.grpo.async_
    if not a.enabled:
        return
    if not config.data_plane.enabled:
        raise ConfigError(
            "data_plane.enabled",
            "must be true when grpo.async.enabled is true (async GRPO moves rows through the store): got false",
        )
    if config.grpo.dapo.enabled:
        raise ConfigError(
            "grpo.dapo.enabled",
            "must be false when grpo.async.enabled is true (DAPO dynamic sampling and async GRPO "
            "are not supported together yet): got true",
        )
    prompts = config.grpo.num_prompts_per_step
    if a.buffer_groups < prompts:
        raise ConfigError(
            "grpo.async.buffer_groups",
            f"must be >= grpo.num_prompts_per_step ({prompts}; a step samples that many whole groups): "
            f"got {a.buffer_groups}",
        )


def _check_rows_fit(config: RunConfig, shape: TaskShape) -> None:
    limit = config.policy.model.max_sequence_length
    if shape.longest_row > limit:
        raise ConfigError(
            "policy.model.max_sequence_length",
            f"must fit the task's longest row ({shape.arithmetic()}): got {limit}",
        )
    tokens = config.policy.micro_batch_tokens
    if 0 < tokens < shape.longest_row:
        raise ConfigError(
            "policy.micro_batch_tokens",
            f"must hold the task's longest row ({shape.arithmetic()} tokens), or be 0 for no packing: got {tokens}",
        )


def cluster_cpus(config: RunConfig) -> tuple[float, str]:
    """The logical CPUs the run's actors take, and the sum that gives them (for messages).

    Policy ranks and the rollout engine take ``policy.num_cpus_per_worker``
    each; TransferQueue's controller and its ``data_plane.storage_units``
    storage units take one each; the
    memory store's actor and the legacy path take none. With
    ``grpo.async.enabled`` the rollout collector takes the rollout engine's
    place (at the same CPUs) and the replay buffer's actor takes none: the sum
    is the same.

    Example:
        >>> from shell.run_config import load_run_config
        >>> cluster_cpus(load_run_config())[1]
        '1 policy rank x 0.25 + 1 rollout engine x 0.25 + 1 for TransferQueue = 1.5'
    """
    ranks, each = config.policy.layout.world_size, config.policy.num_cpus_per_worker
    backend = config.data_plane.backend if config.data_plane.enabled else None
    simple = TRANSFER_QUEUE_CONTROLLER_CPUS + config.data_plane.storage_units
    store = {StoreBackend.transfer_queue: simple, StoreBackend.tq_object_store: TQ_OBJECT_STORE_CPUS}.get(
        backend, 0.0  # type: ignore[arg-type]
    )
    parts = [ranks * each, ROLLOUT_ENGINES * each] + ([store] if store else [])
    total = math.fsum(parts)
    text = (
        f"{ranks} policy rank{'s' if ranks > 1 else ''} x {each:g} + {ROLLOUT_ENGINES} rollout engine x {each:g}"
        + (f" + {store:g} for TransferQueue" if store else "")
        + f" = {total:g}"
    )
    return total, text


for _cls in (RunSection, RaySection, DapoSection, LossSection, AsyncSection, GrpoSection, LayoutSection,
             ModelSection, PolicySection, RolloutSection, TaskSection, DataPlaneSection, RunConfig):
    attrs.resolve_types(_cls)


def config_key(attribute: attrs.Attribute) -> str:
    """The YAML key of a schema field: its ``key`` metadata if set (``async_`` -> ``async``), else its name."""
    return attribute.metadata.get(KEY, attribute.name)


def schema_fields(cls: type) -> dict[str, attrs.Attribute]:
    """The keys of a section class, in order, each with its field (its init fields; ``TaskSection.instance``
    is not a key).

    Example:
        >>> [(key, field.name) for key, field in schema_fields(GrpoSection).items()][-1]
        ('async', 'async_')
    """
    return {config_key(a): a for a in attrs.fields(cls) if a.init}
