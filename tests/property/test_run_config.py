"""Laws and error paths of ``shell.run_config`` and the ``python -m shell.run`` command line (no Ray is started here)."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf, SCMode
from omegaconf.errors import ReadonlyConfigError

from shell.run_config import (
    ConfigError,
    StoreBackend,
    check_run_config,
    describe_keys,
    load_run_config,
    parse_overrides,
)

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
def defaults() -> DictConfig:
    """The packaged config, loaded once."""
    return load_run_config()


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of an instantiated config: a schema section (dataclass) is a branch, anything else a leaf."""
    keys: list[str] = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            keys += _leaf_keys(value, f"{prefix}{field.name}.")
        else:
            keys.append(f"{prefix}{field.name}")
    return keys


def _raises_naming(key: str) -> Any:
    """``pytest.raises`` for a ConfigError whose message names ``key``."""
    return pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}'")


# ---------------------------------------------------------------- the packaged defaults


def test_load_run_config_packaged_yaml_sets_every_key(defaults: DictConfig) -> None:
    """With no overrides the packaged YAML loads and leaves no key missing."""
    assert OmegaConf.missing_keys(defaults) == set()


def test_describe_keys_lists_exactly_the_leaf_keys_with_comments(defaults: DictConfig) -> None:
    """``describe_keys`` names every leaf of the loaded config once, in schema order, each with a non-empty comment."""
    rows = list(describe_keys())
    instance = OmegaConf.to_container(defaults, structured_config_mode=SCMode.INSTANTIATE)
    assert [key for key, _, _ in rows] == _leaf_keys(instance)
    assert all(comment.strip() for _, _, comment in rows), [key for key, _, comment in rows if not comment.strip()]


def test_describe_keys_shows_the_given_defaults(defaults: DictConfig) -> None:
    """The shown default of a key follows the config passed in (here: overridden values)."""
    config = load_run_config(["grpo.num_steps=7", "data_plane.backend=memory", "data_plane.enabled=false"])
    shown = {key: value for key, value, _ in describe_keys(config)}
    assert shown["grpo.num_steps"] == "7"
    assert shown["data_plane.backend"] == "memory"
    assert shown["data_plane.enabled"] == "false"
    assert {key: value for key, value, _ in describe_keys()}["grpo.num_steps"] == str(defaults.grpo.num_steps)


@pytest.mark.parametrize("key", SPEC_KEYS)
def test_load_run_config_has_the_spec_keys(defaults: DictConfig, key: str) -> None:
    """Each key the product spec requires exists under its name and is listed by ``describe_keys``."""
    sentinel = object()
    assert OmegaConf.select(defaults, key, default=sentinel) is not sentinel
    assert key in {k for k, _, _ in describe_keys(defaults)}


def test_load_run_config_data_plane_defaults_to_transfer_queue(defaults: DictConfig) -> None:
    """The data plane is on by default, on the TransferQueue backend."""
    assert defaults.data_plane.enabled is True
    assert defaults.data_plane.backend == StoreBackend.transfer_queue
    assert defaults.data_plane.backend.value == "transfer_queue"


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
        ]
    ).flatmap(lambda case: st.tuples(st.just(case[0]), case[1]))
)
def test_load_run_config_an_override_changes_exactly_its_key(defaults: DictConfig, case: tuple[str, Any]) -> None:
    """``key=value`` sets that key to the value and leaves every other key at its default."""
    key, value = case
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    config = load_run_config([f"{key}={text}"])
    assert OmegaConf.select(config, key) == value
    expected = OmegaConf.create(OmegaConf.to_container(defaults))
    OmegaConf.update(expected, key, value)
    assert OmegaConf.to_container(config) == OmegaConf.to_container(expected)


def test_parse_overrides_parses_dotted_keys() -> None:
    """``a.b=1`` becomes the nested config ``{a: {b: 1}}`` with YAML-typed scalars."""
    parsed = parse_overrides(["grpo.num_steps=3", "data_plane.enabled=false", "run.dir=null"])
    assert OmegaConf.to_container(parsed) == {"grpo": {"num_steps": 3}, "data_plane": {"enabled": False}, "run": {"dir": None}}


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


# Each ``_require`` of ``check_run_config``: overrides of a well-typed but impossible value, and the key named.
IMPOSSIBLE = [
    (["seed=-1"], "seed"),
    (["run.checkpoint_every=-1"], "run.checkpoint_every"),
    (["run.samples_to_log=-1"], "run.samples_to_log"),
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
    (["policy.learning_rate=0"], "policy.learning_rate"),
    (["policy.micro_batch_tokens=-1"], "policy.micro_batch_tokens"),
    (["policy.num_cpus_per_worker=0"], "policy.num_cpus_per_worker"),
    (["policy.timeout_s=0"], "policy.timeout_s"),
    (["task.name=''"], "task.name"),
    (["data_plane.partition=''"], "data_plane.partition"),
]


@pytest.mark.parametrize(("overrides", "key"), IMPOSSIBLE, ids=[" ".join(o) for o, _ in IMPOSSIBLE])
def test_check_run_config_rejects_impossible_values(overrides: list[str], key: str) -> None:
    """A well-typed but impossible value is a ConfigError whose key and message name that key."""
    with _raises_naming(key) as info:
        load_run_config(overrides)
    assert info.value.key == key


@pytest.mark.parametrize(("overrides", "key"), IMPOSSIBLE[:3] + IMPOSSIBLE[-8:], ids=[" ".join(o) for o, _ in IMPOSSIBLE[:3] + IMPOSSIBLE[-8:]])
def test_check_run_config_rejects_an_impossible_merged_config(overrides: list[str], key: str) -> None:
    """Called directly on a merged (unchecked) config, ``check_run_config`` names the same key."""
    merged = OmegaConf.merge(load_run_config(), parse_overrides(overrides))
    with _raises_naming(key):
        check_run_config(merged)  # type: ignore[arg-type]


def test_check_run_config_accepts_the_defaults(defaults: DictConfig) -> None:
    """The packaged defaults pass the checks (returns None, changes nothing)."""
    before = OmegaConf.to_container(defaults)
    assert check_run_config(defaults) is None
    assert OmegaConf.to_container(defaults) == before


def test_load_run_config_accepts_a_layout_that_divides_the_model() -> None:
    """TP dividing the heads and PP dividing the layers load (the boundary of the divisibility checks)."""
    config = load_run_config(
        ["policy.layout.tensor_parallel=2", "policy.layout.pipeline_parallel=2", "policy.layout.data_parallel=4"]
    )
    assert (config.policy.layout.tensor_parallel, config.policy.layout.pipeline_parallel) == (2, 2)


# ---------------------------------------------------------------- config files


def test_load_run_config_reads_another_yaml_file(tmp_path: Path, defaults: DictConfig) -> None:
    """A full YAML file replaces the packaged one and overrides still apply on top."""
    data = OmegaConf.to_container(defaults, enum_to_str=True)
    data["grpo"]["num_steps"] = 11
    path = tmp_path / "mine.yaml"
    OmegaConf.save(OmegaConf.create(data), path)
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
def test_load_run_config_result_is_read_only(defaults: DictConfig, key: str, value: int) -> None:
    """Assigning to any key of the loaded config raises."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(defaults, parent) if parent else defaults
    with pytest.raises(ReadonlyConfigError, match="read-only"):
        setattr(node, leaf, value)


# ---------------------------------------------------------------- the command line (shell.run)


def test_parse_args_help_lists_every_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` exits 0 and lists every key of ``describe_keys`` with its comment."""
    from shell.run import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key, value, comment in describe_keys():
        assert re.search(rf"^\s+{re.escape(key)}={re.escape(value)}\s+{re.escape(comment)}$", out, re.M), key


def test_parse_args_collects_options_and_overrides() -> None:
    """Options go to their attributes and ``key=value`` items to ``overrides``, in order."""
    from shell.run import parse_args

    args = parse_args(["--config", "c.yaml", "grpo.num_steps=2", "seed=1"])
    assert (args.config, args.resume, args.overrides) == ("c.yaml", None, ["grpo.num_steps=2", "seed=1"])


@pytest.mark.parametrize(("argv", "key"), [(["grpo.nope=1"], "grpo.nope"), (["grpo.num_steps=0"], "grpo.num_steps")])
def test_main_rejects_a_bad_config_before_starting_anything(capsys: pytest.CaptureFixture[str], argv: list[str], key: str) -> None:
    """A bad key or value makes ``main`` return 2 within seconds, name the key on stderr, and leave Ray as it was."""
    import ray

    import shell.grpo_trainer  # noqa: F401  (main imports it; its import time is not what is measured)
    from shell.run import EXIT_USAGE, main

    was_initialized = ray.is_initialized()  # True when an e2e session cluster runs in this process
    start = time.monotonic()
    status = main(argv)
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert status == EXIT_USAGE == 2
    assert key in captured.err
    assert elapsed < 5.0
    assert ray.is_initialized() == was_initialized, "a rejected config must not start (or stop) Ray"
