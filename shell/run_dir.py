"""The run folder: where a run writes its files, and the checkpoint ``--resume`` continues from.

:func:`plan_run_dir` decides, before anything starts and without writing:

* the folder: ``run.dir``, else the ``--resume`` folder, else a fresh ``runs/<timestamp>/``;
* with ``--resume``: the checkpoint (it must load and hold an int ``step`` and
  the weights) and the first step to run, ``step + 1`` (``grpo.num_steps``
  must be larger);
* without ``--resume``: a folder that already holds a run's files is refused
  (its metrics would be cut, its checkpoint replaced and its samples mixed),
  unless ``run.overwrite=true``.

:func:`prepare_run_dir` then creates the folder and makes it consistent:
with ``run.overwrite`` the earlier run's files are deleted, and on resume the
records of ``metrics.jsonl`` and ``samples.jsonl`` after the checkpoint's step
are dropped, so every step appears once. If the run then stops at a start-up
config error before its first step, :func:`discard_unstarted` takes back the
``config.yaml`` it wrote, unless it continues a run in that folder.

Invariant: every problem with the folder or the checkpoint is a
:class:`ConfigError` naming ``run.dir``, ``--resume`` or ``grpo.num_steps``,
raised by :func:`plan_run_dir` before the folder or anything else is touched.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from shell.config_error import ConfigError
from shell.config_schema import RunConfig
from shell.grpo_trainer import CHECKPOINT_FILE, build_task, load_checkpoint, model_config
from shell.run_config import run_config_from_text
from shell.run_log import keep_steps_through

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PLOT_FILE = "reward.png"
PROCESSES_FILE = "processes.json"
CONFIG_FILE = "config.yaml"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, CHECKPOINT_FILE, PLOT_FILE, PROCESSES_FILE)
"""The files a run writes in its folder."""


@attrs.frozen
class RunDir:
    """Where the run writes, and what it resumes.

    Attributes:
        path: the run folder.
        checkpoint: the loaded ``--resume`` checkpoint (``step``, ``weights``, ...), or None.
        first_step: the first step to run (1, or the checkpoint's step + 1).
        overwrite: the folder holds an earlier run whose files are deleted first.
        continues: ``--resume`` continues the run in this folder (its checkpoint's own).
    """

    path: Path
    checkpoint: Mapping[str, Any] | None = attrs.field(default=None, eq=False, repr=False)
    first_step: int = 1
    overwrite: bool = False
    continues: bool = False


def plan_run_dir(config: RunConfig, resume: str | None) -> RunDir:
    """Check the run folder and the ``--resume`` checkpoint; write nothing.

    Raises:
        ConfigError: ``run.dir`` is a file, lies under a file, or holds an earlier
            run (without ``--resume`` or ``run.overwrite``); the checkpoint is
            missing, unreadable or not a GRPO checkpoint, or its run's model differs
            from this config's (``--resume``); or ``grpo.num_steps`` does not exceed
            the checkpoint's step.
    """
    checkpoint, first = None, 1
    if resume is not None:
        checkpoint = read_checkpoint(resume)
        _check_same_model(config, checkpoint, _checkpoint_file(resume))
        step = checkpoint["step"]
        first = step + 1
        if config.grpo.num_steps < first:
            raise ConfigError(
                "grpo.num_steps",
                f"must exceed the checkpoint's step {step} to resume (steps {first}.. would run): "
                f"got {config.grpo.num_steps}; raise it, e.g. grpo.num_steps={step + config.grpo.num_steps}",
            )
    if config.run.dir is not None:
        path = Path(config.run.dir)
    elif resume is not None:
        path = Path(resume) if Path(resume).is_dir() else Path(resume).parent
    else:
        path = _fresh(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    _check_writable(path)
    earlier = [name for name in RUN_FILES if (path / name).exists()] if path.is_dir() else []
    continues = resume is not None and path.resolve() == _checkpoint_file(resume).parent.resolve()
    if earlier and not continues and not config.run.overwrite:
        how = f"continue it with --resume {path}, " if resume is None else ""
        raise ConfigError(
            "run.dir",
            f"{path} holds an earlier run ({', '.join(earlier)}): {how}choose a fresh run.dir, "
            f"or set run.overwrite=true to delete its files",
        )
    return RunDir(
        path=path, checkpoint=checkpoint, first_step=first, overwrite=bool(earlier) and not continues, continues=continues
    )


def discard_unstarted(plan: RunDir, config: RunConfig) -> None:
    """Undo what a run wrote before it stopped at a start-up config error: its ``config.yaml``, and the folder
    when it is then empty and the run named it itself (no ``run.dir``), so the same ``run.dir`` takes the
    corrected run without ``run.overwrite``. A run that continues the one in its folder (``plan.continues``)
    leaves it as it is. Best effort: a file it cannot remove stays (the caller is already reporting an error)."""
    if plan.continues:
        return
    with contextlib.suppress(OSError):
        (plan.path / CONFIG_FILE).unlink(missing_ok=True)
    if config.run.dir is None:
        with contextlib.suppress(OSError):  # not empty: something else is there, keep it
            plan.path.rmdir()


def prepare_run_dir(plan: RunDir) -> None:
    """Create the folder; delete an overwritten run's files; on resume, drop records after the checkpoint.

    Raises:
        ConfigError: the folder cannot be created (``run.dir``), or a metrics or samples file
            to cut holds a line that is not a step record (``--resume``).
    """
    try:
        plan.path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError("run.dir", f"cannot create {plan.path}: {error.strerror or error}") from None
    if plan.overwrite:
        for name in RUN_FILES:
            (plan.path / name).unlink(missing_ok=True)
    if plan.checkpoint is not None:
        for name in (METRICS_FILE, SAMPLES_FILE):
            try:
                keep_steps_through(plan.path / name, plan.first_step - 1)
            except (TypeError, ValueError) as error:
                raise ConfigError("--resume", f"cannot cut {plan.path / name} at the checkpoint: {error}") from None


def read_checkpoint(resume: str) -> Mapping[str, Any]:
    """The checkpoint ``--resume`` names (a run folder or its ``checkpoint.pt``), checked.

    Raises:
        ConfigError: naming ``--resume`` when there is no such file, it cannot be
            read (truncated, garbage), or it is not a GRPO checkpoint.
    """
    file = _checkpoint_file(resume)
    if not file.is_file():
        raise ConfigError("--resume", f"must name a run folder or its {CHECKPOINT_FILE}: no file {file}")
    try:
        data = load_checkpoint(file)
    except ValueError as error:  # readable, but not a GRPO checkpoint
        raise ConfigError("--resume", str(error)) from None
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for a bad file
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError("--resume", f"{file} is not a readable checkpoint ({type(error).__name__}: {text})") from None
    step, weights = data["step"], data["weights"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError("--resume", f"{file} is not a GRPO checkpoint: 'step' must be an int >= 1: got {step!r}")
    if not isinstance(weights, dict) or not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ConfigError("--resume", f"{file} is not a GRPO checkpoint: 'weights' must map names to tensors")
    return data


_MODEL_KEYS = {
    "hidden_size": "policy.model.hidden_size", "num_layers": "policy.model.num_layers",
    "num_attention_heads": "policy.model.num_attention_heads",
    "max_sequence_length": "policy.model.max_sequence_length", "num_experts": "policy.model.num_experts",
    "moe_topk": "policy.model.moe_topk",
}
"""The model's sizes set by a config key of the same name (``vocab_size`` comes from the task and the TP size)."""


def _check_same_model(config: RunConfig, checkpoint: Mapping[str, Any], file: Path) -> None:
    """Nothing when the checkpoint's run built the model ``config`` builds, with the same KL reference (or its
    config no longer reads: an older schema or a task that does not load here, and the weights are checked
    when they load); else a ConfigError naming ``--resume`` and every size that differs, with the keys that
    would match it, or naming ``seed`` when the KL term's reference (the initial policy of the seed; the
    checkpoint holds the policy only) would change."""
    stored = checkpoint.get("config")
    if not isinstance(stored, str) or not stored.strip():
        return
    try:
        theirs = run_config_from_text(stored, f"the config in {file}")
    except ConfigError:
        return
    if config.grpo.loss.kl_coef > 0 and config.seed != theirs.seed:
        raise ConfigError(
            "seed",
            f"must be the checkpoint's run's seed ({theirs.seed}) to resume with grpo.loss.kl_coef > 0: the KL "
            f"reference is the initial policy of the seed, and {file} holds the trained policy only: got "
            f"{config.seed}; pass seed={theirs.seed}, or grpo.loss.kl_coef=0 to train without the reference",
        )
    was, now = model_config(theirs, build_task(theirs)), model_config(config, build_task(config))
    if not was.is_moe and not now.is_moe:
        was = attrs.evolve(was, moe_topk=now.moe_topk)  # a dense model has no router: its top-k is unused
    if was == now:
        return
    differ = [name for name in attrs.fields_dict(type(now)) if getattr(was, name) != getattr(now, name)]
    set_by_keys = [name for name in differ if name in _MODEL_KEYS or name == "vocab_size"]
    differ = set_by_keys or differ  # sizes derived from those (ffn_hidden_size) only when nothing else differs
    sizes = ", ".join(f"{name} {getattr(was, name)} (checkpoint) vs {getattr(now, name)} (this config)" for name in differ)
    keys = [f"{_MODEL_KEYS[name]}={getattr(was, name)}" for name in differ if name in _MODEL_KEYS]
    if "vocab_size" in differ:
        keys.append("the checkpoint's task.name, task.kwargs and policy.layout.tensor_parallel (they set vocab_size)")
    raise ConfigError(
        "--resume",
        f"{file} holds a model of other sizes than this config builds: {sizes}; resume with " + ", ".join(keys),
    )


def _checkpoint_file(resume: str) -> Path:
    path = Path(resume)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def _fresh(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... if it exists (runs started in the same second)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _check_writable(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError("run.dir", f"must be a folder: {path} is a file")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("run.dir", f"cannot create {path}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("run.dir", f"cannot write in {existing} (permission denied)")
