"""The ``python -m shell.run`` command line: ``--help``, arguments, the run folder, and every bad input it
rejects with exit 2 and one line naming the key, before anything starts (no Ray is started here)."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shell.config_error import ConfigError
from shell.run_config import describe_keys, dump_run_config, load_run_config

# ---------------------------------------------------------------- arguments


def test_parse_args_help_lists_every_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` exits 0 and lists every key of ``describe_keys`` with its comment."""
    from shell.run import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key, value, comment in describe_keys():
        assert re.search(rf"^\s+{re.escape(key)}={re.escape(value)}\s+{re.escape(comment)}$", out, re.M), key


def test_parse_args_help_lists_the_async_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` lists the four ``grpo.async`` keys by their YAML names, with their defaults, in schema order."""
    from shell.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    shown = re.findall(r"^\s+(grpo\.async\.\w+=\S+)\s", out, re.M)
    assert shown == ["grpo.async.enabled=false", "grpo.async.max_staleness=1", "grpo.async.buffer_groups=96",
                     "grpo.async.is_cap=2.0"]
    assert "async_" not in out


def test_parse_args_collects_options_and_overrides() -> None:
    """Options go to their attributes and ``key=value`` items to ``overrides``, in order."""
    from shell.run import parse_args

    args = parse_args(["--config", "c.yaml", "grpo.num_steps=2", "seed=1"])
    assert (args.config, args.resume, args.overrides) == ("c.yaml", None, ["grpo.num_steps=2", "seed=1"])


def test_parse_args_takes_overrides_before_and_after_options() -> None:
    """Overrides may come before, between and after ``--config`` and ``--resume``, and keep their order."""
    from shell.run import parse_args

    args = parse_args(["seed=1", "--config", "c.yaml", "grpo.num_steps=2", "--resume", "runs/a", "run.progress=off"])
    assert (args.config, args.resume) == ("c.yaml", "runs/a")
    assert args.overrides == ["seed=1", "grpo.num_steps=2", "run.progress=off"]


# ---------------------------------------------------------------- bad input: exit 2, one line, nothing started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _checkpoint(path: Path, step: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "weights": {"w": torch.ones(2)}, "config": ""}, path / "checkpoint.pt")
    return path


def _other_model(tmp: Path) -> list[str]:
    run = tmp / "small"
    run.mkdir()
    config = dump_run_config(load_run_config(["policy.model.hidden_size=32", "policy.model.num_layers=3"]))
    torch.save({"step": 3, "weights": {"w": torch.ones(2)}, "config": config}, run / "checkpoint.pt")
    return ["--resume", str(run), "grpo.num_steps=8"]


def _truncated(tmp: Path) -> list[str]:
    data = (_checkpoint(tmp / "good") / "checkpoint.pt").read_bytes()
    (tmp / "cut").mkdir()
    (tmp / "cut" / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    return ["--resume", str(tmp / "cut")]


def _garbage(tmp: Path) -> list[str]:
    (tmp / "garbage.pt").write_bytes(b"\x00\x01 not a checkpoint at all " * 20)
    return ["--resume", str(tmp / "garbage.pt")]


def _foreign(tmp: Path) -> list[str]:
    torch.save({"model": {"w": torch.ones(1)}}, tmp / "other.pt")
    return ["--resume", str(tmp / "other.pt")]


def _earlier_run(tmp: Path) -> list[str]:
    (tmp / "old").mkdir()
    (tmp / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    return [f"run.dir={tmp / 'old'}"]


def _a_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("x")
    return [f"run.dir={tmp / 'file'}"]


def _binary_config(tmp: Path) -> list[str]:
    (tmp / "model.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return ["--config", str(tmp / "model.bin")]


def _around_config(tmp: Path) -> list[str]:
    (tmp / "c.yaml").write_text(dump_run_config(load_run_config()))
    return ["seed=1", "--config", str(tmp / "c.yaml"), "grpo.num_steps=0"]


Argv = Callable[[Path], list[str]]
BAD_INPUTS: list[tuple[str, Argv, str, str]] = [
    ("ray.address=garbage", lambda t: ["ray.address=garbage"], "ray.address", "must be 'auto', host:port"),
    ("ray.address=no", lambda t: ["ray.address=no"], "ray.address", "got 'no'"),
    ("ray.address=auto, no cluster", lambda t: ["ray.address=auto"], "ray.address", "no running Ray cluster was found"),
    ("ray.address=nobody listening", lambda t: [f"ray.address=127.0.0.1:{_free_port()}"], "ray.address",
     "no Ray cluster answers at 127.0.0.1:"),
    ("--resume truncated", _truncated, "--resume", "is not a readable checkpoint"),
    ("--resume garbage", _garbage, "--resume", "is not a readable checkpoint"),
    ("--resume not a checkpoint", _foreign, "--resume", "is not a GRPO checkpoint: expected keys step, weights"),
    ("--resume nothing there", lambda t: ["--resume", str(t / "nowhere")], "--resume", "must name a run folder"),
    ("--resume another model", _other_model, "--resume",
     "holds a model of other sizes than this config builds: hidden_size 32 (checkpoint) vs 64 (this config), "
     "num_layers 3 (checkpoint) vs 2 (this config); resume with policy.model.hidden_size=32, policy.model.num_layers=3"),
    ("--resume num_steps <= step", lambda t: ["--resume", str(_checkpoint(t / "r", step=5)), "grpo.num_steps=5"],
     "grpo.num_steps", "must exceed the checkpoint's step 5 to resume"),
    ("micro_batch_tokens=1", lambda t: ["policy.micro_batch_tokens=1"], "policy.micro_batch_tokens",
     "must hold the task's longest row (longest prompt"),
    ("learning_rate=.inf", lambda t: ["policy.learning_rate=.inf"], "policy.learning_rate", "finite"),
    ("learning_rate=.nan", lambda t: ["policy.learning_rate=.nan"], "policy.learning_rate", "finite"),
    ("temperature=.inf", lambda t: ["grpo.temperature=.inf"], "grpo.temperature", "finite"),
    ("num_generations_per_prompt=1", lambda t: ["grpo.num_generations_per_prompt=1"],
     "grpo.num_generations_per_prompt", "must be >= 2"),
    ("data_plane.enabled=2", lambda t: ["data_plane.enabled=2"], "data_plane.enabled", "must be true or false: got '2'"),
    ("run.progress=False", lambda t: ["run.progress=False"], "run.progress", "one of auto, bar, plain, off: got 'False'"),
    ("ray.num_cpus=1", lambda t: ["ray.num_cpus=1"], "ray.num_cpus", "+ 1 for TransferQueue = 1.5 CPUs, more than"),
    ("num_cpus_per_worker=7", lambda t: ["policy.num_cpus_per_worker=7"], "ray.num_cpus",
     "1 policy rank x 7 + 1 rollout engine x 7 + 1 for TransferQueue = 15 CPUs"),
    ("task module raises", lambda t: ["task.name=tests.property.task_import_raises:T"], "task.name", "RuntimeError"),
    ("task constructor raises", lambda t: ["task.name=tests.property.task_plugins:ConstructorRaises"], "task.kwargs",
     "RuntimeError: the dataset is not downloaded"),
    ("task returns too few rewards", lambda t: ["task.name=tests.property.task_plugins:TooFewRewards"], "task.name",
     "'TooFewRewards.rewards' must return one reward per response"),
    ("run.dir is a file", _a_file, "run.dir", "must be a folder"),
    ("run.dir holds a run", _earlier_run, "run.dir", "continue it with --resume"),
    ("binary --config", _binary_config, "--config", "model.bin is not a text (UTF-8) YAML file"),
    ("overrides around --config", _around_config, "grpo.num_steps", "must be >= 1: got 0"),
    ("grpo.async.enabled=maybe", lambda t: ["grpo.async.enabled=maybe"], "grpo.async.enabled",
     "must be true or false: got 'maybe'"),
    ("grpo.async.max_staleness=-1", lambda t: ["grpo.async.max_staleness=-1"], "grpo.async.max_staleness",
     "must be >= 0: got -1"),
    ("grpo.async.max_staleness=1.5", lambda t: ["grpo.async.max_staleness=1.5"], "grpo.async.max_staleness",
     "must be an integer: got '1.5'"),
    ("grpo.async.buffer_groups=0", lambda t: ["grpo.async.buffer_groups=0"], "grpo.async.buffer_groups",
     "must be >= 1: got 0"),
    ("grpo.async.is_cap=0.5", lambda t: ["grpo.async.is_cap=0.5"], "grpo.async.is_cap", "must be >= 1: got 0.5"),
    ("grpo.async.is_cap=.inf", lambda t: ["grpo.async.is_cap=.inf"], "grpo.async.is_cap", "finite"),
    ("grpo.async_ is not a key", lambda t: ["grpo.async_.enabled=true"], "grpo.async_", "did you mean grpo.async?"),
    ("grpo.async is a section", lambda t: ["grpo.async=true"], "grpo.async", "is a section with keys enabled,"),
    ("async without the data plane", lambda t: ["grpo.async.enabled=true", "data_plane.enabled=false"],
     "data_plane.enabled", "must be true when grpo.async.enabled is true (async GRPO moves rows through the store)"),
    ("async with DAPO", lambda t: ["grpo.async.enabled=true", "grpo.dapo.enabled=true"], "grpo.dapo.enabled",
     "are not supported together yet): got true"),
    ("router_replay=r3 on a dense model", lambda t: ["policy.router_replay=r3"], "policy.router_replay",
     "must be off for a dense model (policy.model.num_experts = 0; R3 replays MoE routing): got r3"),
    ("moe_topk above the experts", lambda t: ["policy.model.num_experts=2", "policy.model.moe_topk=3"],
     "policy.model.moe_topk", "must be in [1, policy.model.num_experts (2)]: got 3"),
    ("rollout.precision=fp16", lambda t: ["rollout.precision=fp16"], "rollout.precision", "one of fp32, bf16: got 'fp16'"),
    ("async buffer below a step", lambda t: ["grpo.async.enabled=true", "grpo.async.buffer_groups=16"],
     "grpo.async.buffer_groups", "must be >= grpo.num_prompts_per_step (32; a step samples that many whole groups): got 16"),
]


@pytest.mark.parametrize(("argv", "key", "words"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_main_rejects_bad_input_in_one_line_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: Argv, key: str, words: str
) -> None:
    """Each bad input of the command line exits 2 with one unwrapped line naming the key: no traceback,
    no run folder, and Ray as it was."""
    import ray

    import shell.grpo_trainer  # noqa: F401  (main imports it)
    from shell.run import EXIT_USAGE, main

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no `ray start` address file: 'auto' finds nothing
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = argv(tmp_path)
    if not any(a.startswith("run.dir=") for a in args):
        args.append(f"run.dir={tmp_path / 'never'}")
    was_initialized = ray.is_initialized()
    before = sorted(p.name for p in tmp_path.iterdir())
    status = main(args)
    err = capsys.readouterr().err
    assert status == EXIT_USAGE == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: config key '{key}': "), lines[0]
    assert words in lines[0], lines[0]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a rejected command line must not write"
    assert ray.is_initialized() == was_initialized, "a rejected command line must not start (or stop) Ray"


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


def test_main_error_lines_are_not_wrapped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An error longer than 80 columns stays one line (logs and grep see all of it)."""
    from shell.run import main

    assert main(["policy.num_cpus_per_worker=7", f"run.dir={tmp_path / 'x'}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert len(line) > 120


# ---------------------------------------------------------------- the run folder


def _records(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_prepare_run_dir_cuts_metrics_and_samples_at_the_checkpoint(tmp_path: Path) -> None:
    """On --resume from step k, metrics.jsonl and samples.jsonl keep only their records of steps <= k."""
    from shell.run_dir import plan_run_dir, prepare_run_dir

    run = _checkpoint(tmp_path / "run", step=3)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 6)))
    (run / "samples.jsonl").write_text("".join(json.dumps({"step": s, "response": "7"}) + "\n" for s in (1, 1, 2, 3, 4, 4, 5)))
    plan = plan_run_dir(load_run_config(["grpo.num_steps=8"]), str(run))
    assert (plan.path, plan.first_step, plan.checkpoint["step"]) == (run, 4, 3)  # type: ignore[index]
    prepare_run_dir(plan)
    assert _records(run / "metrics.jsonl") == [1, 2, 3]
    assert _records(run / "samples.jsonl") == [1, 1, 2, 3]


def test_plan_run_dir_resumes_a_checkpoint_file_in_its_folder(tmp_path: Path) -> None:
    """--resume RUN_DIR/checkpoint.pt continues in RUN_DIR, whose earlier files are expected there."""
    from shell.run_dir import plan_run_dir

    run = _checkpoint(tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    plan = plan_run_dir(load_run_config(), str(run / "checkpoint.pt"))
    assert (plan.path, plan.overwrite) == (run, False)


def test_plan_run_dir_refuses_an_earlier_run_without_resume(tmp_path: Path) -> None:
    """A run.dir holding a run's files is refused, naming --resume and a fresh folder, whichever file it holds."""
    from shell.run_dir import RUN_FILES, plan_run_dir

    for name in RUN_FILES:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("")
        with pytest.raises(ConfigError, match=rf"config key 'run.dir': .*holds an earlier run \({re.escape(name)}\): "
                                              rf"continue it with --resume .*choose a fresh run.dir.*run.overwrite=true"):
            plan_run_dir(load_run_config([f"run.dir={folder}"]), None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other" ).mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert plan_run_dir(load_run_config([f"run.dir={tmp_path / 'empty'}"]), None).path == tmp_path / "empty"
    assert plan_run_dir(load_run_config([f"run.dir={tmp_path / 'other'}"]), None).overwrite is False


def test_prepare_run_dir_overwrite_deletes_the_earlier_runs_files_only(tmp_path: Path) -> None:
    """With run.overwrite=true the earlier run's files are deleted before the new run; other files stay."""
    from shell.run_dir import RUN_FILES, plan_run_dir, prepare_run_dir

    for name in RUN_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    plan = plan_run_dir(load_run_config([f"run.dir={tmp_path}", "run.overwrite=true"]), None)
    prepare_run_dir(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_plan_run_dir_rejects_a_folder_under_a_file(tmp_path: Path) -> None:
    """A run.dir below a file cannot be created: a ConfigError naming run.dir and the file."""
    from shell.run_dir import plan_run_dir

    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=rf"config key 'run.dir': cannot create .*: {re.escape(str(tmp_path / 'f'))} is a file"):
        plan_run_dir(load_run_config([f"run.dir={tmp_path / 'f' / 'run'}"]), None)


def test_plan_run_dir_default_folder_is_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without run.dir, two runs started in the same second get two folders."""
    from shell.run_dir import plan_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261123-101500")
    first = plan_run_dir(load_run_config(), None).path
    first.mkdir(parents=True)
    (first / "metrics.jsonl").write_text("")
    second = plan_run_dir(load_run_config(), None).path
    assert (first.name, second.name) == ("20261123-101500", "20261123-101500-2")


def test_read_checkpoint_checks_its_fields(tmp_path: Path) -> None:
    """A checkpoint whose step is not an int >= 1 or whose weights are not tensors is rejected naming --resume."""
    from shell.run_dir import read_checkpoint

    for data, words in (({"step": "3", "weights": {"w": torch.ones(1)}}, "'step' must be an int >= 1"),
                        ({"step": 0, "weights": {"w": torch.ones(1)}}, "'step' must be an int >= 1"),
                        ({"step": 2, "weights": {}}, "'weights' must map names to tensors")):
        torch.save(data, tmp_path / "c.pt")
        with pytest.raises(ConfigError, match=rf"config key '--resume': .*{re.escape(words)}"):
            read_checkpoint(str(tmp_path / "c.pt"))
    assert read_checkpoint(str(_checkpoint(tmp_path / "ok")))["step"] == 3


def test_importing_the_run_command_leaves_matplotlib_for_the_plot() -> None:
    """``shell.run`` loads matplotlib only to plot a finished run: every start and ``--help`` skip its import."""
    import subprocess
    import sys

    code = "import json, sys, shell.run\nprint(json.dumps('matplotlib' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) is False


def test_plan_run_dir_resumes_a_checkpoint_of_the_same_model_and_names_another_vocabulary(tmp_path: Path) -> None:
    """A checkpoint whose run built this config's model resumes (other keys may change: num_steps, learning
    rate, a dense model's unused top-k, and the seed without a KL term, whose reference is the seed's initial
    policy); one whose task gave another vocabulary is refused, naming the keys that set it; one whose config
    no longer reads (an older schema) is left to the weights' own check at load."""
    from shell.run_dir import plan_run_dir

    run = tmp_path / "run"
    run.mkdir()
    saved = dump_run_config(load_run_config(["seed=3", "policy.learning_rate=0.01", "policy.model.moe_topk=1"]))
    torch.save({"step": 3, "weights": {"w": torch.ones(1)}, "config": saved}, run / "checkpoint.pt")
    assert plan_run_dir(load_run_config(["grpo.num_steps=8", "seed=3"]), str(run)).first_step == 4  # top-k unused
    assert plan_run_dir(load_run_config(["grpo.num_steps=8", "grpo.loss.kl_coef=0"]), str(run)).first_step == 4
    with pytest.raises(ConfigError, match=r"config key 'seed': must be the checkpoint's run's seed \(3\) to resume with "
                                          r"grpo.loss.kl_coef > 0: .* got 0; pass seed=3"):
        plan_run_dir(load_run_config(["grpo.num_steps=8"]), str(run))
    with pytest.raises(ConfigError, match=r"vocab_size 16 \(checkpoint\) vs 8 \(this config\); resume with the checkpoint's "
                                          r"task.name, task.kwargs and policy.layout.tensor_parallel"):
        plan_run_dir(load_run_config(["grpo.num_steps=8", "seed=3", "task.name=reverse"]), str(run))
    torch.save({"step": 3, "weights": {"w": torch.ones(1)}, "config": "grpo:\n  num_steps: 3\n"}, run / "checkpoint.pt")
    assert plan_run_dir(load_run_config(["grpo.num_steps=8"]), str(run)).first_step == 4


def test_a_resume_that_fails_at_start_up_keeps_the_continued_runs_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming in the run's own folder writes config.yaml only once the run has started: a start-up failure
    leaves the continued run's config.yaml as it was."""
    from shell.grpo_trainer import GRPOTrainer
    from shell.run import EXIT_USAGE, main

    run = _checkpoint(tmp_path / "run", step=3)
    (run / "config.yaml").write_text("# the continued run's own config\n")

    def start(self: GRPOTrainer, on_status: object = None) -> None:
        raise ConfigError("ray.num_cpus", "the cluster has too few CPUs for this layout (as a start-up check finds)")

    monkeypatch.setattr(GRPOTrainer, "start", start)
    monkeypatch.setattr(GRPOTrainer, "close", lambda self: None)
    assert main(["--resume", str(run), "grpo.num_steps=8", "run.progress=off"]) == EXIT_USAGE
    assert "too few CPUs" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == "# the continued run's own config\n"


def test_discard_unstarted_lets_the_same_run_dir_take_the_corrected_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a start-up config error a fresh run's config.yaml goes, so the same run.dir plans without
    run.overwrite; a folder the run named itself goes too when empty, a given one stays; a run resumed in its own
    folder keeps all, one resumed into another folder does not."""
    from shell.run_config import save_run_config
    from shell.run_dir import CONFIG_FILE, discard_unstarted, plan_run_dir, prepare_run_dir

    given = load_run_config([f"run.dir={tmp_path / 'given'}"])
    plan = plan_run_dir(given, None)
    prepare_run_dir(plan)
    save_run_config(given, plan.path / CONFIG_FILE)
    with pytest.raises(ConfigError, match="holds an earlier run"):
        plan_run_dir(given, None)
    discard_unstarted(plan, given)
    assert plan.path.is_dir() and list(plan.path.iterdir()) == []
    assert plan_run_dir(given, None).path == plan.path

    monkeypatch.chdir(tmp_path)
    named = load_run_config()
    plan = plan_run_dir(named, None)
    prepare_run_dir(plan)
    save_run_config(named, plan.path / CONFIG_FILE)
    discard_unstarted(plan, named)
    assert not plan.path.exists()

    run = _checkpoint(tmp_path / "resumed", step=3)
    save_run_config(named, run / CONFIG_FILE)
    resumed = plan_run_dir(load_run_config(["grpo.num_steps=8"]), str(run))
    assert resumed.continues
    discard_unstarted(resumed, named)
    assert (run / CONFIG_FILE).exists()  # the run it continues keeps its folder as it was

    elsewhere = load_run_config(["grpo.num_steps=8", f"run.dir={tmp_path / 'elsewhere'}"])
    moved = plan_run_dir(elsewhere, str(run))  # --resume into another folder: a new run there
    assert not moved.continues
    prepare_run_dir(moved)
    save_run_config(elsewhere, moved.path / CONFIG_FILE)
    discard_unstarted(moved, elsewhere)
    assert list(moved.path.iterdir()) == [] and plan_run_dir(elsewhere, str(run)).path == moved.path
