"""Imperative shell: Ray workers, store I/O, trainers and entry points.

The public names a trainer author needs are re-exported here, and documented
in ``docs/api.md``. They load on first use (PEP 562), so ``python -m
shell.run --help`` and a config error answer before Ray or megatron-core is
imported.

Example:
    >>> from shell import GRPOTrainer, load_run_config  # doctest: +SKIP
    >>> with GRPOTrainer(load_run_config(["grpo.num_steps=2"])) as trainer:  # doctest: +SKIP
    ...     record = trainer.step(1)
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES: dict[str, str] = {
    # the run
    "GRPOTrainer": "shell.grpo_trainer",
    "StepError": "shell.grpo_trainer",
    "load_checkpoint": "shell.grpo_trainer",
    "RunConfig": "shell.run_config",
    "load_run_config": "shell.run_config",
    "ConfigError": "shell.run_config",
    # the policy and how rows travel
    "Policy": "shell.policy",
    "PolicyConfig": "shell.policy",
    "build_group": "shell.policy",
    "StepRows": "shell.step_rows",
    "Transport": "shell.transport",
    "LegacyTransport": "shell.transport",
    "DataPlaneTransport": "shell.transport",
    "TransportReport": "shell.transport",
    "GRPOLoss": "shell.loss",
    # workers
    "PolicyWorker": "shell.policy_worker",
    "RolloutWorker": "shell.rollout",
    "Worker": "shell.worker",
    "on_all_ranks": "shell.worker",
    "sharded": "shell.worker",
    "WorkerGroup": "shell.worker_group",
    "WorkerError": "shell.worker_errors",
    # store I/O
    "MeteredClient": "shell.metering",
    "first_write": "shell.column_io",
    "read_columns": "shell.column_io",
    "write_columns": "shell.column_io",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'shell' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
