"""Laws and error paths of ``shell.run_config`` (reading a run's config) and ``--help`` (no Ray is started here)."""

from __future__ import annotations

import copy
import enum
import keyword
import math
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from shell.config_schema import TQ_OBJECT_STORE_CPUS, TRANSFER_QUEUE_CONTROLLER_CPUS, AsyncSection, RolloutSection, config_key, schema_fields
from shell.grpo_trainer import model_config, policy_config
from shell.run_config import (
    ConfigError,
    PolicyDevice,
    ProgressMode,
    RolloutPrecision,
    RouterReplayMode,
    RunConfig,
    StoreBackend,
    cluster_cpus,
    describe_keys,
    dump_run_config,
    load_run_config,
    parse_overrides,
    run_config_from_dict,
    run_config_to_dict,
    save_run_config,
    select,
)
from shell.run_task import BUILT_IN_TASKS, checked_rewards, load_task, probe_task
from tests.property.strategies import plain_override_texts, run_config_overrides, yaml_11_words

# The keys the product spec names; they must exist under exactly these names.
SPEC_KEYS = [
    "seed",
    "run.dir",
    "ray.address",
    "grpo.num_steps",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "policy.layout.data_parallel",
    "policy.layout.tensor_parallel",
    "policy.layout.pipeline_parallel",
    "data_plane.enabled",
    "data_plane.backend",
]


@pytest.fixture(scope="module")
def defaults() -> RunConfig:
    """The packaged config, loaded once."""
    return load_run_config()


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a config: a section (attrs class) is a branch, anything else a leaf.

    A key is its field's name, or the field's ``key`` metadata where the name cannot be it (``async_``)."""
    keys: list[str] = []
    for field in attrs.fields(type(node)):
        if not field.init:  # derived, not a key (TaskSection.instance)
            continue
        value, name = getattr(node, field.name), field.metadata.get("key", field.name)
        if attrs.has(type(value)):
            keys += _leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _sections(cls: type = RunConfig) -> list[type]:
    """``cls`` and every section class under it."""
    out = [cls]
    for field in attrs.fields(cls):
        if "section" in field.metadata:
            out += _sections(field.metadata["section"])
    return out


def _with(config: RunConfig, overrides: list[str]) -> dict[str, Any]:
    """``config`` as plain values with ``overrides`` applied (typed by the schema), not checked."""
    data = run_config_to_dict(config)
    parsed = parse_overrides(overrides)

    def merge(into: dict[str, Any], other: dict[str, Any]) -> None:
        for key, value in other.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value.value if isinstance(value, enum.Enum) else value

    merge(data, parsed)
    return data


def _raises_naming(key: str) -> Any:
    """``pytest.raises`` for a ConfigError whose message names ``key``."""
    return pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}'")


# ---------------------------------------------------------------- the packaged defaults


def test_load_run_config_packaged_yaml_sets_every_key(defaults: RunConfig) -> None:
    """With no overrides the packaged YAML loads into a RunConfig and every key has its value there."""
    assert isinstance(defaults, RunConfig)
    packaged = yaml.safe_load((Path(__file__).parents[2] / "shell" / "grpo.yaml").read_text())
    for key in _leaf_keys(defaults):
        node = packaged
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]


def test_describe_keys_lists_exactly_the_leaf_keys_with_comments(defaults: RunConfig) -> None:
    """``describe_keys`` names every leaf of the loaded config once, in schema order, each with a non-empty comment."""
    rows = list(describe_keys())
    assert [key for key, _, _ in rows] == _leaf_keys(defaults)
    assert all(comment.strip() for _, _, comment in rows), [key for key, _, comment in rows if not comment.strip()]


def test_describe_keys_shows_the_given_defaults(defaults: RunConfig) -> None:
    """The shown default of a key follows the config passed in (here: overridden values)."""
    config = load_run_config(["grpo.num_steps=7", "data_plane.backend=memory", "data_plane.enabled=false"])
    shown = {key: value for key, value, _ in describe_keys(config)}
    assert shown["grpo.num_steps"] == "7"
    assert shown["data_plane.backend"] == "memory"
    assert shown["data_plane.enabled"] == "false"
    assert {key: value for key, value, _ in describe_keys()}["grpo.num_steps"] == str(defaults.grpo.num_steps)


@pytest.mark.parametrize("key", SPEC_KEYS)
def test_load_run_config_has_the_spec_keys(defaults: RunConfig, key: str) -> None:
    """Each key the product spec requires exists under its name (as an attribute path) and is listed by ``describe_keys``."""
    node: Any = defaults
    for part in key.split("."):
        node = getattr(node, part)
    assert select(defaults, key) == node
    assert key in {k for k, _, _ in describe_keys(defaults)}


def test_load_run_config_data_plane_defaults_to_transfer_queue_on_the_object_store(defaults: RunConfig) -> None:
    """The data plane is on by default, on TransferQueue with its rows in Ray's object store."""
    assert defaults.data_plane.enabled is True
    assert defaults.data_plane.backend == StoreBackend.tq_object_store
    assert defaults.data_plane.backend.tq_storage == "RayObjectStore"
    assert StoreBackend.transfer_queue.tq_storage == "SimpleStorage" and StoreBackend.memory.tq_storage is None


def test_load_run_config_accepts_the_memory_backend() -> None:
    """``data_plane.backend=memory`` loads as the memory backend."""
    assert load_run_config(["data_plane.backend=memory"]).data_plane.backend == StoreBackend.memory


# ---------------------------------------------------------------- overrides


def test_load_run_config_overrides_are_typed() -> None:
    """Overrides are parsed and typed by the schema: an int stays an int, ``false`` becomes ``False``."""
    config = load_run_config(["grpo.num_steps=5", "data_plane.enabled=false", "grpo.temperature=2"])
    assert type(config.grpo.num_steps) is int and config.grpo.num_steps == 5
    assert config.data_plane.enabled is False
    assert type(config.grpo.temperature) is float and config.grpo.temperature == 2.0


@given(
    st.sampled_from(
        [
            ("grpo.num_steps", st.integers(1, 10**6)),
            ("seed", st.integers(0, 2**31)),
            ("grpo.temperature", st.floats(1e-3, 10.0)),
            ("grpo.leave_one_out", st.booleans()),
            ("ray.address", st.sampled_from(["auto", "10.0.0.1:6379"])),
            ("policy.layout.pipeline_parallel", st.sampled_from([1, 2])),
            ("grpo.async.max_staleness", st.integers(0, 10**3)),
            ("grpo.async.is_cap", st.floats(1.0, 100.0)),
            ("grpo.async.enabled", st.booleans()),
        ]
    ).flatmap(lambda case: st.tuples(st.just(case[0]), case[1]))
)
def test_load_run_config_an_override_changes_exactly_its_key(defaults: RunConfig, case: tuple[str, Any]) -> None:
    """``key=value`` sets that key to the value and leaves every other key at its default."""
    key, value = case
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    config = load_run_config([f"{key}={text}"])
    assert select(config, key) == value
    expected = copy.deepcopy(run_config_to_dict(defaults))
    *parents, leaf = key.split(".")
    branch = expected
    for part in parents:
        branch = branch[part]
    branch[leaf] = value
    assert run_config_to_dict(config) == expected


def test_parse_overrides_parses_dotted_keys() -> None:
    """``a.b=1`` becomes the nested config ``{a: {b: 1}}`` with YAML-typed scalars."""
    parsed = parse_overrides(["grpo.num_steps=3", "data_plane.enabled=false", "run.dir=null"])
    assert parsed == {"grpo": {"num_steps": 3}, "data_plane": {"enabled": False}, "run": {"dir": None}}


@pytest.mark.parametrize("item", ["grpo.num_steps", "=5", "data_plane.enabled"])
def test_parse_overrides_rejects_an_override_without_equals(item: str) -> None:
    """An override that is not ``key=value`` is a ConfigError naming it and showing the right form."""
    with pytest.raises(ConfigError, match=rf"config key '{re.escape(item)}': overrides must look like key=value") as info:
        load_run_config([item])
    assert info.value.key == item


# ---------------------------------------------------------------- bad keys and values


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("nope=1", "nope"),  # unknown key, top level
        ("grpo.nope=1", "grpo.nope"),  # unknown key, nested
        ("grpo.dapo.nope=1", "grpo.dapo.nope"),  # unknown key, two levels down
        ("grpo.num_steps=abc", "grpo.num_steps"),  # ill-typed
        ("grpo.num_steps=1.5", "grpo.num_steps"),
        ("seed=true", "seed"),
        ("data_plane.enabled=maybe", "data_plane.enabled"),
        ("policy.learning_rate=fast", "policy.learning_rate"),
        ("task.name=", "task.name"),  # null for a str
        ("data_plane.backend=redis", "data_plane.backend"),  # enum value not allowed
        ("run.progress=loud", "run.progress"),
        ("policy.fetch_policy=gossip", "policy.fetch_policy"),
        ("grpo.async.nope=1", "grpo.async.nope"),  # unknown key under the keyword section
        ("grpo.async_.enabled=true", "grpo.async_"),  # the attribute name is not a key
        ("grpo.async.enabled=maybe", "grpo.async.enabled"),
        ("grpo.async.max_staleness=1.5", "grpo.async.max_staleness"),
        ("grpo.async.buffer_groups=many", "grpo.async.buffer_groups"),
        ("grpo.async.is_cap=big", "grpo.async.is_cap"),
        ("policy.model.num_experts=many", "policy.model.num_experts"),
        ("policy.model.moe_topk=1.5", "policy.model.moe_topk"),
        ("policy.router_replay=r2", "policy.router_replay"),
        ("policy.router_replay=true", "policy.router_replay"),
        ("rollout.precision=fp16", "rollout.precision"),
        ("rollout.nope=1", "rollout.nope"),
        ("policy.device=gpu", "policy.device"),
        ("policy.device=cuda:0", "policy.device"),
    ],
)
def test_load_run_config_rejects_unknown_keys_and_ill_typed_values(override: str, key: str) -> None:
    """An unknown key, a value of the wrong type or an enum value not allowed is a ConfigError naming the key."""
    with _raises_naming(key) as info:
        load_run_config([override])
    assert info.value.key == key


def test_load_run_config_rejects_a_scalar_for_a_section_naming_it() -> None:
    """A scalar where a section is expected is a ConfigError naming the section."""
    with _raises_naming("grpo.dapo") as info:
        load_run_config(["grpo.dapo=1"])
    assert info.value.key == "grpo.dapo"


# Each check of the schema: overrides of a well-typed but impossible value, and the key named.
IMPOSSIBLE = [
    (["seed=-1"], "seed"),
    (["run.checkpoint_every=-1"], "run.checkpoint_every"),
    (["run.samples_to_log=-1"], "run.samples_to_log"),
    (["run.memory_every=-1"], "run.memory_every"),
    (["run.memory_rise_limit=-1.0"], "run.memory_rise_limit"),
    (["run.memory_rise_limit=inf"], "run.memory_rise_limit"),
    (["run.memory_rise_window=1"], "run.memory_rise_window"),
    (["ray.num_cpus=0"], "ray.num_cpus"),
    (["grpo.num_steps=0"], "grpo.num_steps"),
    (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step"),
    (["grpo.num_generations_per_prompt=-2"], "grpo.num_generations_per_prompt"),
    (["grpo.temperature=0"], "grpo.temperature"),
    (["grpo.temperature=-1.0"], "grpo.temperature"),
    (["grpo.dapo.max_generation_batches=0"], "grpo.dapo.max_generation_batches"),
    (["grpo.loss.clip_low=1.5"], "grpo.loss.clip_low"),
    (["grpo.loss.clip_low=-0.1"], "grpo.loss.clip_low"),
    (["grpo.loss.clip_high=-0.1"], "grpo.loss.clip_high"),
    (["grpo.loss.kl_coef=-0.5"], "grpo.loss.kl_coef"),
    (["grpo.async.max_staleness=-1"], "grpo.async.max_staleness"),
    (["grpo.async.buffer_groups=0"], "grpo.async.buffer_groups"),
    (["grpo.async.is_cap=0.5"], "grpo.async.is_cap"),
    (["grpo.async.is_cap=0"], "grpo.async.is_cap"),
    (["policy.layout.data_parallel=0"], "policy.layout.data_parallel"),
    (["policy.layout.tensor_parallel=0"], "policy.layout.tensor_parallel"),
    (["policy.layout.pipeline_parallel=0"], "policy.layout.pipeline_parallel"),
    (["policy.model.hidden_size=0"], "policy.model.hidden_size"),
    (["policy.model.num_layers=0"], "policy.model.num_layers"),
    (["policy.model.num_attention_heads=0"], "policy.model.num_attention_heads"),
    (["policy.model.max_sequence_length=0"], "policy.model.max_sequence_length"),
    (["policy.model.hidden_size=66", "policy.model.num_attention_heads=4"], "policy.model.hidden_size"),
    (["policy.layout.tensor_parallel=3", "policy.model.num_attention_heads=4"], "policy.layout.tensor_parallel"),
    (["policy.layout.pipeline_parallel=3", "policy.model.num_layers=2"], "policy.layout.pipeline_parallel"),
    (["policy.model.num_experts=1"], "policy.model.num_experts"),
    (["policy.model.num_experts=-2"], "policy.model.num_experts"),
    (["policy.model.moe_topk=0"], "policy.model.moe_topk"),
    (["policy.model.num_experts=4", "policy.model.moe_topk=5"], "policy.model.moe_topk"),
    (["policy.router_replay=r3"], "policy.router_replay"),
    (["policy.learning_rate=0"], "policy.learning_rate"),
    (["policy.micro_batch_tokens=-1"], "policy.micro_batch_tokens"),
    (["policy.num_cpus_per_worker=0"], "policy.num_cpus_per_worker"),
    (["policy.timeout_s=0"], "policy.timeout_s"),
    (["policy.gpus_per_rank=0"], "policy.gpus_per_rank"),
    (["policy.gpus_per_rank=1.5"], "policy.gpus_per_rank"),
    (["policy.device=cuda", "policy.gpus_per_rank=0.5", "policy.layout.data_parallel=2"], "policy.gpus_per_rank"),
    (["task.name=''"], "task.name"),
    (["data_plane.partition=''"], "data_plane.partition"),
]


@pytest.mark.parametrize(("overrides", "key"), IMPOSSIBLE, ids=[" ".join(o) for o, _ in IMPOSSIBLE])
def test_load_run_config_rejects_impossible_values(overrides: list[str], key: str) -> None:
    """A well-typed but impossible value is a ConfigError whose key and message name that key."""
    with _raises_naming(key) as info:
        load_run_config(overrides)
    assert info.value.key == key


@pytest.mark.parametrize(("overrides", "key"), IMPOSSIBLE[:3] + IMPOSSIBLE[-8:], ids=[" ".join(o) for o, _ in IMPOSSIBLE[:3] + IMPOSSIBLE[-8:]])
def test_run_config_from_dict_rejects_an_impossible_merged_config(overrides: list[str], key: str) -> None:
    """Built from plain values (library use, not the command line), the config names the same key."""
    merged = _with(load_run_config(), overrides)
    with _raises_naming(key):
        run_config_from_dict(merged)


def test_run_config_from_dict_accepts_the_defaults(defaults: RunConfig) -> None:
    """The packaged defaults pass the checks when rebuilt from their values, and come back equal."""
    before = run_config_to_dict(defaults)
    assert run_config_from_dict(before) == defaults
    assert run_config_to_dict(defaults) == before


def test_load_run_config_accepts_a_layout_that_divides_the_model() -> None:
    """TP dividing the heads and PP dividing the layers load (the boundary of the divisibility checks)."""
    config = load_run_config(
        ["policy.layout.tensor_parallel=2", "policy.layout.pipeline_parallel=2", "policy.layout.data_parallel=4"]
    )
    assert (config.policy.layout.tensor_parallel, config.policy.layout.pipeline_parallel) == (2, 2)


# ---------------------------------------------------------------- asynchronous GRPO (grpo.async, read as config.grpo.async_)


def test_config_key_differs_from_the_attribute_name_only_for_a_keyword() -> None:
    """Every schema field's key is its attribute name, except a Python keyword, whose attribute is the key plus ``_``."""
    renamed = {}
    for cls in _sections():
        for key, field in schema_fields(cls).items():
            assert key == config_key(field)
            if key != field.name:
                renamed[f"{cls.PATH}{key}"] = field.name
                assert keyword.iskeyword(key) and field.name == f"{key}_", (key, field.name)
            else:
                assert not keyword.iskeyword(key), key
    assert renamed == {"grpo.async": "async_"}


def test_load_run_config_async_defaults_are_off(defaults: RunConfig) -> None:
    """The packaged config has async GRPO off, with its documented defaults, read as ``config.grpo.async_``."""
    assert defaults.grpo.async_ == AsyncSection(enabled=False, max_staleness=1, buffer_groups=96, is_cap=2.0)
    assert type(defaults.grpo.async_.is_cap) is float
    assert select(defaults, "grpo.async") is defaults.grpo.async_
    assert select(defaults, "grpo.async.buffer_groups") == 96
    shown = [(key, value) for key, value, _ in describe_keys(defaults) if key.startswith("grpo.async.")]
    assert shown == [("grpo.async.enabled", "false"), ("grpo.async.max_staleness", "1"),
                     ("grpo.async.buffer_groups", "96"), ("grpo.async.is_cap", "2.0")]


def test_load_run_config_async_overrides_set_their_keys() -> None:
    """``grpo.async.enabled=true grpo.async.max_staleness=0`` sets those keys (typed) and nothing else in the section."""
    config = load_run_config(["grpo.async.enabled=true", "grpo.async.max_staleness=0", "grpo.async.is_cap=3"])
    assert config.grpo.async_ == AsyncSection(enabled=True, max_staleness=0, buffer_groups=96, is_cap=3.0)
    assert type(config.grpo.async_.is_cap) is float
    assert parse_overrides(["grpo.async.enabled=true"]) == {"grpo": {"async": {"enabled": True}}}


def test_save_run_config_writes_the_async_key_and_reads_it_back(tmp_path: Path) -> None:
    """config.yaml says ``async:`` (never the attribute name ``async_``) and loads back equal."""
    config = load_run_config(["grpo.async.enabled=true", "grpo.async.max_staleness=0", "grpo.async.buffer_groups=32"])
    text = dump_run_config(config)
    assert "\n  async:\n    enabled: true\n    max_staleness: 0\n    buffer_groups: 32\n    is_cap: 2.0\n" in text
    assert "async_" not in text
    assert load_run_config(config_file=save_run_config(config, tmp_path / "config.yaml")) == config
    assert run_config_to_dict(config)["grpo"]["async"]["max_staleness"] == 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["grpo.async.buffer_groups=32"],  # = num_prompts_per_step: the boundary holds
        ["grpo.async.max_staleness=0", "grpo.async.is_cap=1"],
        ["data_plane.backend=memory"],
    ],
)
def test_load_run_config_accepts_async_relations_at_their_boundary(overrides: list[str]) -> None:
    """Async GRPO loads on the data plane, without DAPO, with a buffer of at least one step's groups."""
    config = load_run_config(["grpo.async.enabled=true", *overrides])
    assert config.grpo.async_.enabled is True


def test_load_run_config_checks_async_relations_only_when_enabled() -> None:
    """With async off, the legacy path, DAPO and a small buffer load as before."""
    config = load_run_config(["data_plane.enabled=false", "grpo.dapo.enabled=true", "grpo.async.buffer_groups=1"])
    assert (config.grpo.async_.enabled, config.grpo.async_.buffer_groups) == (False, 1)


# The relations of grpo.async.enabled=true: the overrides, the key named and the message after it.
ASYNC_RELATIONS = [
    (["data_plane.enabled=false"], "data_plane.enabled",
     "must be true when grpo.async.enabled is true (async GRPO moves rows through the store): got false"),
    (["grpo.dapo.enabled=true"], "grpo.dapo.enabled",
     "must be false when grpo.async.enabled is true (DAPO dynamic sampling and async GRPO are not supported "
     "together yet): got true"),
    (["grpo.async.buffer_groups=31"], "grpo.async.buffer_groups",
     "must be >= grpo.num_prompts_per_step (32; a step samples that many whole groups): got 31"),
    (["grpo.num_prompts_per_step=128"], "grpo.async.buffer_groups",
     "must be >= grpo.num_prompts_per_step (128; a step samples that many whole groups): got 96"),
]


@pytest.mark.parametrize(("overrides", "key", "message"), ASYNC_RELATIONS, ids=[" ".join(o) for o, _, _ in ASYNC_RELATIONS])
def test_load_run_config_rejects_async_relations(overrides: list[str], key: str, message: str) -> None:
    """With async on, each broken relation is a ConfigError naming the key, what was expected and what was got."""
    with _raises_naming(key) as info:
        load_run_config(["grpo.async.enabled=true", *overrides])
    assert (info.value.key, info.value.message) == (key, message)


@pytest.mark.parametrize(("overrides", "key", "message"), ASYNC_RELATIONS, ids=[" ".join(o) for o, _, _ in ASYNC_RELATIONS])
def test_run_config_from_dict_rejects_async_relations(overrides: list[str], key: str, message: str) -> None:
    """Built from plain values, or evolved from a valid config, the same relations name the same key."""
    with _raises_naming(key):
        run_config_from_dict(_with(load_run_config(), ["grpo.async.enabled=true", *overrides]))
    valid = load_run_config(overrides)  # async off: the relation is not checked
    with _raises_naming(key):
        attrs.evolve(valid, grpo=attrs.evolve(valid.grpo, async_=attrs.evolve(valid.grpo.async_, enabled=True)))


# ---------------------------------------------------------------- policy device


def test_load_run_config_policy_device_defaults_to_cpu_and_reaches_the_policy(defaults: RunConfig) -> None:
    """policy.device is cpu by default and cuda on request, and the PolicyConfig the trainer builds carries it."""
    assert defaults.policy.device == PolicyDevice.cpu
    assert {key: value for key, value, _ in describe_keys(defaults)}["policy.device"] == "cpu"
    config = load_run_config(["policy.device=cuda", "policy.layout.data_parallel=2"])
    assert config.policy.device == PolicyDevice.cuda
    built = policy_config(config, model_config(config, config.task.instance))
    assert (built.device, built.num_gpus_per_worker) == ("cuda", 1.0)
    assert policy_config(defaults, model_config(defaults, defaults.task.instance)).num_gpus_per_worker == 0.0
    assert "policy:\n" in dump_run_config(config) and "  device: cuda\n" in dump_run_config(config)
    shared = load_run_config(["policy.device=cuda", "policy.gpus_per_rank=0.5"])  # one rank: may share its GPU
    assert policy_config(shared, model_config(shared, shared.task.instance)).num_gpus_per_worker == 0.5
    # on CPU the share is unused: any layout loads with it
    assert load_run_config(["policy.gpus_per_rank=0.25", "policy.layout.data_parallel=2"]).policy.gpus_per_rank == 0.25


# ---------------------------------------------------------------- MoE, router replay and rollout precision


def test_load_run_config_moe_keys_default_to_a_dense_fp32_run(defaults: RunConfig) -> None:
    """The packaged config is dense (num_experts 0, moe_topk 2), without router replay, with an fp32 rollout."""
    model = defaults.policy.model
    assert (model.num_experts, model.moe_topk) == (0, 2)
    assert defaults.policy.router_replay == RouterReplayMode.off
    assert defaults.rollout == RolloutSection(precision=RolloutPrecision.fp32)
    shown = {key: value for key, value, _ in describe_keys(defaults)}
    assert [shown[k] for k in ("policy.model.num_experts", "policy.model.moe_topk", "policy.router_replay",
                               "rollout.precision")] == ["0", "2", "off", "fp32"]
    helps = {key: comment for key, _, comment in describe_keys(defaults)}
    assert "no expert parallelism" in helps["policy.model.num_experts"]


@pytest.mark.parametrize(("experts", "topk"), [(2, 1), (2, 2), (8, 2), (64, 8)])
def test_load_run_config_moe_reaches_the_model_config(experts: int, topk: int) -> None:
    """An MoE config with 1 <= moe_topk <= num_experts loads, with R3 and bf16, and its TinyGPTConfig is MoE alike."""
    config = load_run_config([f"policy.model.num_experts={experts}", f"policy.model.moe_topk={topk}",
                              "policy.router_replay=r3", "rollout.precision=bf16"])
    assert (config.policy.router_replay, config.rollout.precision) == (RouterReplayMode.r3, RolloutPrecision.bf16)
    model = model_config(config, config.task.instance)
    assert (model.num_experts, model.moe_topk, model.is_moe) == (experts, topk, True)
    assert not model_config(load_run_config(), config.task.instance).is_moe


# The MoE relations: the overrides, the key named and the message after it.
MOE_RELATIONS = [
    (["policy.router_replay=r3"], "policy.router_replay",
     "must be off for a dense model (policy.model.num_experts = 0; R3 replays MoE routing): got r3"),
    (["policy.model.num_experts=1"], "policy.model.num_experts",
     "must be 0 (a dense MLP) or >= 2 (experts per MoE layer): got 1"),
    (["policy.model.num_experts=4", "policy.model.moe_topk=5"], "policy.model.moe_topk",
     "must be in [1, policy.model.num_experts (4)]: got 5"),
    (["policy.model.num_experts=8", "policy.model.moe_topk=0"], "policy.model.moe_topk", "must be >= 1: got 0"),
]


@pytest.mark.parametrize(("overrides", "key", "message"), MOE_RELATIONS, ids=[" ".join(o) for o, _, _ in MOE_RELATIONS])
def test_load_run_config_rejects_moe_relations(overrides: list[str], key: str, message: str) -> None:
    """R3 on a dense model, one expert or a top-k above the experts is a ConfigError naming the key, expected and
    got."""
    with _raises_naming(key) as info:
        load_run_config(overrides)
    assert (info.value.key, info.value.message) == (key, message)
    with _raises_naming(key):
        run_config_from_dict(_with(load_run_config(), overrides))


def test_load_run_config_accepts_an_moe_model_under_tensor_parallel() -> None:
    """An MoE model loads under TP=2 (it trains with sequence parallelism), with R3 on."""
    config = load_run_config(
        ["policy.model.num_experts=4", "policy.layout.tensor_parallel=2", "policy.router_replay=r3"]
    )
    assert (config.policy.model.num_experts, config.policy.layout.tensor_parallel) == (4, 2)


def test_load_run_config_a_dense_model_ignores_moe_topk() -> None:
    """With num_experts 0, any moe_topk >= 1 loads (it is unused), and R3 stays rejected whatever the top-k."""
    assert load_run_config(["policy.model.moe_topk=64"]).policy.model.moe_topk == 64
    with _raises_naming("policy.router_replay"):
        load_run_config(["policy.model.moe_topk=1", "policy.router_replay=r3"])


def test_save_run_config_round_trips_the_moe_keys(tmp_path: Path) -> None:
    """config.yaml holds num_experts, moe_topk, router_replay and rollout.precision, and loads back equal."""
    config = load_run_config(["policy.model.num_experts=4", "policy.model.moe_topk=1", "policy.router_replay=r3",
                              "rollout.precision=bf16"])
    text = dump_run_config(config)
    assert "router_replay: r3" in text and "\nrollout:\n  precision: bf16\n" in text
    assert load_run_config(config_file=save_run_config(config, tmp_path / "config.yaml")) == config


def test_load_run_config_an_older_config_file_names_the_first_new_key(tmp_path: Path, defaults: RunConfig) -> None:
    """A run's config.yaml from before the MoE keys fails naming the first of them (every key is required, with no
    silent default), and loads once the keys are given as overrides."""
    data = run_config_to_dict(defaults)
    del data["policy"]["model"]["num_experts"], data["policy"]["model"]["moe_topk"]
    del data["policy"]["router_replay"], data["rollout"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError, match=rf"has no value: set it in {re.escape(str(path))} or as policy.model.num_experts=") as info:
        load_run_config(config_file=path)
    assert info.value.key == "policy.model.num_experts"
    upgrade = ["policy.model.num_experts=0", "policy.model.moe_topk=2", "policy.router_replay=off", "rollout.precision=fp32"]
    assert load_run_config(upgrade, config_file=path) == defaults


# ---------------------------------------------------------------- config files


def test_load_run_config_reads_another_yaml_file(tmp_path: Path, defaults: RunConfig) -> None:
    """A full YAML file (written by any YAML tool) replaces the packaged one and overrides still apply on top."""
    data = run_config_to_dict(defaults)
    data["grpo"]["num_steps"] = 11
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_run_config(["seed=9"], config_file=path)
    assert (config.grpo.num_steps, config.seed) == (11, 9)


def test_load_run_config_rejects_a_missing_file(tmp_path: Path) -> None:
    """A config file that does not exist is a ConfigError on ``--config`` naming the path."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=rf"config key '--config': no such file: {re.escape(str(path))}") as info:
        load_run_config(config_file=path)
    assert info.value.key == "--config"


def test_load_run_config_rejects_a_file_missing_a_key(tmp_path: Path) -> None:
    """A file that leaves a key unset is a ConfigError naming the first missing key and the file."""
    path = tmp_path / "partial.yaml"
    path.write_text("seed: 3\n")
    with pytest.raises(ConfigError, match=rf"has no value: set it in {re.escape(str(path))}") as info:
        load_run_config(config_file=path)
    everything = {key for key, _, _ in describe_keys()}
    assert info.value.key in everything and info.value.key != "seed"


def test_load_run_config_rejects_an_unknown_key_in_a_file(tmp_path: Path) -> None:
    """An unknown key in the YAML file is a ConfigError naming it."""
    path = tmp_path / "unknown.yaml"
    path.write_text("grpo:\n  bogus: 1\n")
    with _raises_naming("grpo.bogus") as info:
        load_run_config(config_file=path)
    assert info.value.key == "grpo.bogus"


@pytest.mark.parametrize("text", ["seed: [1, 2\n", "seed: 0\n\tgrpo: 1\n"], ids=["unclosed", "tab"])
def test_load_run_config_rejects_a_file_that_is_not_yaml(tmp_path: Path, text: str) -> None:
    """A file that is not valid YAML is a ConfigError naming the file."""
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with _raises_naming(str(path)) as info:
        load_run_config(config_file=path)
    assert info.value.key == str(path)


def test_load_run_config_rejects_a_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    """A YAML file whose top level is a list is a ConfigError naming the file."""
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with _raises_naming(str(path)) as info:
        load_run_config(config_file=path)
    assert info.value.key == str(path)


# ---------------------------------------------------------------- the loaded config


@pytest.mark.parametrize(("key", "value"), [("seed", 1), ("grpo.num_steps", 2), ("policy.layout.data_parallel", 2)])
def test_load_run_config_result_is_read_only(defaults: RunConfig, key: str, value: int) -> None:
    """Assigning to any key of the loaded config raises."""
    parent, _, leaf = key.rpartition(".")
    node = select(defaults, parent) if parent else defaults
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(node, leaf, value)




# ---------------------------------------------------------------- values as typed (YAML 1.1 does not guess)


@pytest.mark.parametrize("text", ["off", "on", "no", "yes", "12:30:00", "0777", "0x1F", "1e3", "null", "~", "#1", "a: b"])
def test_load_run_config_string_keys_keep_the_text_as_typed(text: str) -> None:
    """A string key holds the characters typed, even those YAML 1.1 reads as a bool, a number or syntax."""
    config = load_run_config([f"data_plane.partition={text}", "task.kwargs.max_operand=4"])
    assert config.data_plane.partition == text
    if text not in ("null", "~"):  # run.dir may be null: a plain null is None there (quote it: 'null')
        assert load_run_config([f"run.dir={text}"]).run.dir == text


@given(plain_override_texts)
def test_load_run_config_a_plain_override_keeps_its_characters(text: str) -> None:
    """``data_plane.partition=<text>`` holds exactly ``text``, whatever characters it has."""
    assert load_run_config([f"data_plane.partition={text}"]).data_plane.partition == text


def test_load_run_config_reads_enum_words_that_yaml_reads_as_booleans() -> None:
    """``run.progress=off`` is the documented value ``off`` (YAML 1.1 reads it as false)."""
    assert load_run_config(["run.progress=off"]).run.progress is ProgressMode.off
    with _raises_naming("run.progress") as info:
        load_run_config(["run.progress=False"])
    assert str(info.value) == "config key 'run.progress': must be one of auto, bar, plain, off: got 'False'"


def test_load_run_config_a_quoted_null_is_text() -> None:
    """A plain ``null`` is None for an optional string; quoted, it is the text."""
    assert load_run_config(["run.dir=null"]).run.dir is None
    assert load_run_config(["run.dir='null'"]).run.dir == "null"


def test_load_run_config_string_values_in_a_file_keep_their_text(tmp_path: Path, defaults: RunConfig) -> None:
    """In a YAML file too, ``progress: off`` and ``partition: no`` keep their words."""
    text = dump_run_config(defaults).replace("progress: auto", "progress: off").replace("partition: grpo", "partition: no")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    config = load_run_config(config_file=path)
    assert (config.run.progress, config.data_plane.partition) == (ProgressMode.off, "no")


@pytest.mark.parametrize("text", ["true", "True", "TRUE", "false", "False"])
def test_load_run_config_booleans_are_true_or_false(text: str) -> None:
    """A boolean key reads true/false in any case."""
    assert load_run_config([f"data_plane.enabled={text}"]).data_plane.enabled is (text.lower() == "true")


@pytest.mark.parametrize("text", ["2", "0", "1", "yes", "no", "on", "off", "y", ""])
def test_load_run_config_booleans_reject_everything_else(text: str) -> None:
    """``data_plane.enabled=2`` (or yes, on, 1, ...) is a ConfigError naming the key and the value as typed."""
    with _raises_naming("data_plane.enabled") as info:
        load_run_config([f"data_plane.enabled={text}"])
    assert "must be true or false" in str(info.value)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1e999"])
@pytest.mark.parametrize("key", ["policy.learning_rate", "grpo.temperature", "grpo.loss.kl_coef", "policy.timeout_s",
                                 "grpo.async.is_cap"])
def test_load_run_config_rejects_non_finite_numbers(key: str, value: str) -> None:
    """Infinity and NaN are rejected up front for every number, naming the key."""
    with _raises_naming(key) as info:
        load_run_config([f"{key}={value}"])
    assert "finite" in str(info.value)


def test_load_run_config_rejects_one_generation_per_prompt() -> None:
    """One response per prompt has advantage 0 (nothing to learn): the key must be >= 2."""
    with _raises_naming("grpo.num_generations_per_prompt"):
        load_run_config(["grpo.num_generations_per_prompt=1"])
    assert load_run_config(["grpo.num_generations_per_prompt=2"]).grpo.num_generations_per_prompt == 2


@pytest.mark.parametrize("address", ["garbage", "no", "off", "host", "host:", ":6379", "host:0", "host:65536",
                                     "ray://host:10001", "http://host:6379", "a b:1"])
def test_load_run_config_rejects_a_malformed_ray_address(address: str) -> None:
    """``ray.address`` is 'auto', host:port or null; anything else is a ConfigError naming it."""
    with _raises_naming("ray.address") as info:
        load_run_config([f"ray.address={address}"])
    assert "must be 'auto', host:port" in str(info.value)


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "head-node.local:6379", "[::1]:6379", "localhost:1"])
def test_load_run_config_accepts_ray_addresses(address: str) -> None:
    """'auto' and host:port (IPv6 in brackets) load as typed."""
    assert load_run_config([f"ray.address={address}"]).ray.address == address


def test_load_run_config_reads_placement_keys() -> None:
    """ray.placement, ray.worker_resource, data_plane.storage_units and data_plane.storage_resource load as typed."""
    config = load_run_config([
        "ray.address=auto", "ray.placement=spread", "ray.worker_resource=trainer",
        "data_plane.storage_units=3", "data_plane.storage_resource=store", "data_plane.backend=transfer_queue",
    ])
    assert (config.ray.placement.value, config.ray.worker_resource) == ("spread", "trainer")
    assert (config.data_plane.storage_units, config.data_plane.storage_resource) == (3, "store")
    defaults = load_run_config()
    assert (defaults.ray.placement.value, defaults.ray.worker_resource, defaults.data_plane.storage_resource) == ("pack", None, None)


@pytest.mark.parametrize("key", ["ray.worker_resource", "data_plane.storage_resource"])
def test_load_run_config_rejects_a_node_resource_on_an_embedded_cluster(key: str) -> None:
    """A custom node resource needs ray.address: an embedded cluster's one node has none, so nothing could be placed."""
    with _raises_naming(key) as info:
        load_run_config([f"{key}=store", "data_plane.backend=transfer_queue"])
    assert "must be null for an embedded cluster" in str(info.value)


def test_load_run_config_rejects_a_storage_resource_without_storage_parts() -> None:
    """data_plane.storage_resource places TransferQueue's parts: the memory store has none, so it is refused there."""
    with _raises_naming("data_plane.storage_resource") as info:
        load_run_config(["ray.address=auto", "data_plane.storage_resource=store", "data_plane.backend=memory"])
    assert "unless data_plane.backend is transfer_queue or tq_object_store" in str(info.value)


@pytest.mark.parametrize(("backend", "section"), [("transfer_queue", "SimpleStorage"), ("tq_object_store", "RayObjectStore")])
def test_storage_resource_places_each_transfer_queue_backend(backend: str, section: str) -> None:
    """The resource reaches the TransferQueue setting of the chosen backend, and only that one."""
    from shell.node_placement import transfer_queue_settings

    config = load_run_config(["ray.address=auto", "data_plane.storage_resource=store", f"data_plane.backend={backend}"])
    d = config.data_plane
    settings = transfer_queue_settings(d.backend.tq_storage, d.storage_units, d.storage_resource)["backend"]
    assert settings["storage_backend"] == section
    assert settings[section]["required_node_resource"] == "store"
    assert set(settings) == {"storage_backend", section}


@pytest.mark.parametrize(("override", "key"), [
    ("ray.placement=scatter", "ray.placement"),
    ("ray.worker_resource=CPU", "ray.worker_resource"),
    ("data_plane.storage_resource=' store'", "data_plane.storage_resource"),
    ("data_plane.storage_resource=CPU", "data_plane.storage_resource"),
    ("data_plane.storage_units=0", "data_plane.storage_units"),
])
def test_load_run_config_rejects_bad_placement_values(override: str, key: str) -> None:
    """An unknown placement, a built-in resource name, a padded name or no storage unit names its key."""
    with _raises_naming(key):
        load_run_config(["ray.address=auto", override])


# ---------------------------------------------------------------- round trip of config.yaml


@given(run_config_overrides())
def test_save_run_config_round_trips(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> None:
    """A config written by ``save_run_config`` (a run's config.yaml) loads back equal with ``--config``."""
    config = load_run_config(overrides)
    path = save_run_config(config, tmp_path_factory.mktemp("rt") / "config.yaml")
    assert load_run_config(config_file=path) == config


@given(run_config_overrides())
def test_run_config_to_dict_round_trips(overrides: list[str]) -> None:
    """``run_config_from_dict(run_config_to_dict(c)) == c``."""
    config = load_run_config(overrides)
    assert run_config_from_dict(run_config_to_dict(config)) == config


@given(st.lists(yaml_11_words, min_size=1, max_size=3))
def test_save_run_config_keeps_task_kwargs_strings(words: list[str]) -> None:
    """Free-form task arguments that are strings stay strings through config.yaml (quoted when YAML would misread them)."""
    config = load_run_config(["task.name=tests.property.task_plugins:KwargsEcho", *(f"task.kwargs.k{i}='{w}'" for i, w in enumerate(words) if "'" not in w)])
    text = dump_run_config(config)
    again = run_config_from_dict(yaml.safe_load(text))
    assert again.task.kwargs == config.task.kwargs


# ---------------------------------------------------------------- files


def test_load_run_config_rejects_a_binary_file_naming_it(tmp_path: Path) -> None:
    """A --config file that is not text is a ConfigError on --config naming the path."""
    path = tmp_path / "weights.pt"
    path.write_bytes(b"PK\x03\x04\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match=rf"config key '--config': {re.escape(str(path))} is not a text \(UTF-8\) YAML file"):
        load_run_config(config_file=path)


def test_load_run_config_rejects_a_folder(tmp_path: Path) -> None:
    """A --config that is a folder is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=rf"config key '--config': must be a YAML file: {re.escape(str(tmp_path))} is a folder"):
        load_run_config(config_file=tmp_path)


def test_load_run_config_rejects_a_repeated_key_in_a_file(tmp_path: Path, defaults: RunConfig) -> None:
    """A key given twice in one file is an error naming it (YAML would silently keep the last)."""
    path = tmp_path / "twice.yaml"
    path.write_text(dump_run_config(defaults) + "seed: 3\n")
    with _raises_naming("seed", ) as info:
        load_run_config(config_file=path)
    assert "given twice" in str(info.value)


def test_load_run_config_suggests_the_closest_key() -> None:
    """A misspelt key names the key it probably meant."""
    with _raises_naming("grpo.num_step") as info:
        load_run_config(["grpo.num_step=3"])
    assert "did you mean grpo.num_steps?" in str(info.value)


def test_load_run_config_overrides_apply_in_order() -> None:
    """A later override of the same key wins."""
    assert load_run_config(["seed=1", "seed=2"]).seed == 2


# ---------------------------------------------------------------- the task


def test_load_task_addition_and_import_path_build_the_same_task() -> None:
    """'addition' and its import path give equal tasks, with task.kwargs passed to the constructor."""
    short = load_run_config(["task.kwargs.max_new_tokens=3"]).task
    long = load_run_config(["task.name=core.addition:AdditionTask", "task.kwargs.max_new_tokens=3"]).task
    assert short.instance == long.instance == short.build() == load_task("addition", {"max_new_tokens": 3})


@pytest.mark.parametrize("name", sorted(BUILT_IN_TASKS))
def test_load_task_built_in_names_build_their_classes(name: str) -> None:
    """Each built-in name and its import path give equal tasks, named by the name, whose longest row fits the default model."""
    task = load_task(name, {})
    assert task == load_task(BUILT_IN_TASKS[name], {}) and task.name == name
    config = load_run_config([f"task.name={name}"])
    shape = probe_task(task, load_task(name, {}), seed=0, name=name)
    assert config.task.instance == task
    assert shape.longest_row <= config.policy.model.max_sequence_length


def test_load_task_reverse_passes_its_kwargs() -> None:
    """task.name=reverse builds core.reverse.ReverseTask with task.kwargs; its row is BOS + digits + '>' + digits + EOS."""
    config = load_run_config(["task.name=reverse", "task.kwargs.length=12", "task.kwargs.digits=10"])
    task = config.task.instance
    assert (type(task).__module__, type(task).__name__, task.length, task.digits) == ("core.reverse", "ReverseTask", 12, 10)
    assert probe_task(task, config.task.build(), seed=0, name="reverse").longest_row == 1 + 12 + 1 + 12 + 1


def test_load_run_config_malformed_task_name_lists_the_built_ins() -> None:
    """A task.name that is neither a built-in nor 'package.module:Class' is rejected with every choice named."""
    with _raises_naming("task.name") as info:
        load_run_config(["task.name=reversal"])
    assert "must be 'addition', 'reverse' or 'package.module:Class': got 'reversal'" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["task.name=no_such_module:Task"], "task.name", "cannot import"),
        (["task.name=core.addition:NoSuchClass"], "task.name", "cannot import"),
        (["task.name=core.addition"], "task.name", "package.module:Class"),
        (["task.name=core.frozen:FrozenDict"], "task.name", "does not implement core.task.Task"),
        (["task.name=tests.property.task_plugins:NotATask"], "task.name", "does not implement"),
        (["task.name=tests.property.task_import_raises:Task"], "task.name", "RuntimeError: this module needs a GPU"),
        (["task.kwargs.max_operand=12"], "task.kwargs", "rejected"),
        (["task.kwargs.no_such_arg=1"], "task.kwargs", "rejected"),
        (["task.name=tests.property.task_plugins:ConstructorRaises"], "task.kwargs", "RuntimeError: the dataset"),
        (["task.name=tests.property.task_plugins:TooFewRewards"], "task.name",
         "'TooFewRewards.rewards' must return one reward per response (2): got 1"),
        (["task.name=tests.property.task_plugins:PromptsRaise"], "task.name", "KeyError"),
    ],
)
def test_load_run_config_rejects_bad_tasks_naming_the_key(overrides: list[str], key: str, words: str) -> None:
    """An unimportable or raising module, a class that is not a Task, a constructor that raises (anything),
    or a task whose methods fail or return too few rewards is a ConfigError naming the key."""
    with _raises_naming(key) as info:
        load_run_config(overrides)
    assert info.value.key == key
    assert words in str(info.value)


def test_checked_rewards_names_the_task_when_too_few_come_back() -> None:
    """The rollout's check: a task returning fewer rewards than responses is named, with both counts."""
    task = load_task("tests.property.task_plugins:TooFewRewards", {})
    prompts = task.prompts(0, 1, 4)
    with pytest.raises(ValueError, match=r"^'TooFewRewards.rewards' must return one reward per response \(4\): got 1$"):
        checked_rewards(task, prompts, [(2,)] * 4)
    assert len(checked_rewards(load_task("addition", {}), prompts, [(2,)] * 4)) == 4


def test_load_run_config_rejects_a_context_too_short_for_the_task() -> None:
    """Prompt plus max_new_tokens longer than max_sequence_length is a ConfigError naming that key, with the sum."""
    with pytest.raises(ConfigError, match=r"policy.model.max_sequence_length.*longest prompt \d+ \+ max_new_tokens 4 = \d+"):
        load_run_config(["policy.model.max_sequence_length=6", "task.kwargs.max_new_tokens=4"])


def test_load_run_config_micro_batch_tokens_must_hold_the_longest_row() -> None:
    """``policy.micro_batch_tokens`` below the longest row (longest prompt + max_new_tokens) is rejected, at it is accepted."""
    task = load_task("addition", {})
    shape = probe_task(task, task, seed=0, name="addition")
    longest = shape.longest_row
    assert load_run_config([f"policy.micro_batch_tokens={longest}"]).policy.micro_batch_tokens == longest
    assert load_run_config(["policy.micro_batch_tokens=0"]).policy.micro_batch_tokens == 0
    for tokens in (1, longest - 1):
        with _raises_naming("policy.micro_batch_tokens") as info:
            load_run_config([f"policy.micro_batch_tokens={tokens}"])
        assert f"({shape.arithmetic()} tokens)" in str(info.value) and str(info.value).endswith(f"got {tokens}")


# ---------------------------------------------------------------- CPUs of the embedded cluster


@pytest.mark.parametrize(
    ("overrides", "arithmetic"),
    [
        (["ray.num_cpus=1", "data_plane.backend=transfer_queue"], "1 policy rank x 0.25 + 1 rollout engine x 0.25 + 3 for TransferQueue = 3.5"),
        (["policy.num_cpus_per_worker=7", "data_plane.backend=transfer_queue"], "1 policy rank x 7 + 1 rollout engine x 7 + 3 for TransferQueue = 17"),
        (["policy.layout.data_parallel=4", "ray.num_cpus=4", "data_plane.backend=transfer_queue"], "4 policy ranks x 0.25 + 1 rollout engine x 0.25 + 3 for TransferQueue = 4.25"),
        (["ray.num_cpus=2", "data_plane.backend=transfer_queue", "data_plane.storage_units=4"], "1 policy rank x 0.25 + 1 rollout engine x 0.25 + 5 for TransferQueue = 5.5"),
        (["ray.num_cpus=1", "data_plane.backend=tq_object_store"], "1 policy rank x 0.25 + 1 rollout engine x 0.25 + 1 for TransferQueue = 1.5"),
    ],
)
def test_load_run_config_rejects_actors_that_never_fit_the_embedded_cluster(overrides: list[str], arithmetic: str) -> None:
    """CPUs the run's actors need beyond ``ray.num_cpus`` is a ConfigError with the arithmetic (they would hang)."""
    with _raises_naming("ray.num_cpus") as info:
        load_run_config(overrides)
    assert arithmetic in str(info.value) and "policy.num_cpus_per_worker" in str(info.value)


def test_load_run_config_cpu_check_applies_only_to_an_embedded_cluster() -> None:
    """Joining a cluster (ray.address set) or the legacy path (no TransferQueue) needs fewer or unknown CPUs."""
    assert load_run_config(["ray.num_cpus=1", "ray.address=auto"]).ray.num_cpus == 1
    assert load_run_config(["ray.num_cpus=1", "data_plane.enabled=false", "policy.num_cpus_per_worker=0.5"])
    assert load_run_config(["ray.num_cpus=1", "data_plane.backend=memory", "policy.num_cpus_per_worker=0.5"])


@given(st.integers(1, 4), st.sampled_from([0.25, 0.5, 1.0, 2.0]), st.integers(1, 12), st.booleans(), st.integers(1, 4),
       st.sampled_from(["transfer_queue", "tq_object_store"]))
def test_load_run_config_accepts_exactly_the_layouts_that_fit(
    dp: int, each: float, cpus: int, plane: bool, units: int, backend: str
) -> None:
    """A config loads iff ``cluster_cpus`` (ranks x each + rollout x each + TransferQueue's controller, plus its
    storage units on SimpleStorage) <= ray.num_cpus."""
    overrides = [f"policy.layout.data_parallel={dp}", f"policy.num_cpus_per_worker={each}", f"ray.num_cpus={cpus}",
                 f"data_plane.enabled={str(plane).lower()}", "policy.train_global_batch_size=null",
                 f"data_plane.storage_units={units}", f"data_plane.backend={backend}"]
    store = TRANSFER_QUEUE_CONTROLLER_CPUS + units if backend == "transfer_queue" else TQ_OBJECT_STORE_CPUS
    needed = dp * each + each + (store if plane else 0)
    if needed <= cpus:
        assert cluster_cpus(load_run_config(overrides))[0] == needed
    else:
        with _raises_naming("ray.num_cpus"):
            load_run_config(overrides)


def test_transfer_queue_cpus_match_its_actors() -> None:
    """TransferQueue's controller takes TRANSFER_QUEUE_CONTROLLER_CPUS and each storage unit 1 CPU, as declared;
    the default data_plane.storage_units is TransferQueue's own default."""
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    from adapters.tq_system import resolve_config

    units = resolve_config().backend.SimpleStorage.num_data_storage_units
    controller = TransferQueueController._default_options["num_cpus"]
    unit = SimpleStorageUnit._default_options["num_cpus"]
    assert TRANSFER_QUEUE_CONTROLLER_CPUS == controller and unit == 1
    assert load_run_config().data_plane.storage_units == units


def test_run_config_cannot_be_built_invalid_by_evolve(defaults: RunConfig) -> None:
    """``attrs.evolve`` re-runs the checks: a copy with a bad value raises like the loader."""
    with _raises_naming("grpo.temperature"):
        attrs.evolve(defaults.grpo, temperature=math.inf)
    with _raises_naming("grpo.async.is_cap"):
        attrs.evolve(defaults.grpo.async_, is_cap=0.5)
    with _raises_naming("policy.layout.tensor_parallel"):
        attrs.evolve(defaults.policy, layout=attrs.evolve(defaults.policy.layout, tensor_parallel=3))
