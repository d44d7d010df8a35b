"""GRPO step benchmark: the data-plane path against the legacy path on the same machine and config.

Each repeat runs both paths for ``steps`` steps with the same seed (fresh
workers per run, one Ray cluster and one TransferQueue for the whole bench),
alternating which path goes first. Per path it reports the median step time
(after ``warmup`` steps), the median bytes through the driver per step and the
store traffic; per repeat it forms the paired ratio data plane / legacy and
reports their median and range. It also checks parity: per-step rewards,
losses and grad norms must be bitwise equal between the paths.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import attrs

from shell.bench.report import Report

PARITY_KEYS = ("reward_mean", "loss", "kl", "grad_norm")


@attrs.frozen
class GrpoBenchConfig:
    """What the bench runs: ``overrides`` on the packaged config, ``steps`` per run, ``repeats`` pairs of runs."""

    steps: int = 20
    warmup: int = 2
    repeats: int = 3
    overrides: tuple[str, ...] = ()


def _run(overrides: Sequence[str], steps: int) -> list[dict[str, Any]]:
    from shell.grpo_trainer import GRPOTrainer
    from shell.run_config import load_run_config

    config = load_run_config([*overrides, f"grpo.num_steps={steps}"])
    with GRPOTrainer(config) as trainer:
        records = []
        for step in range(1, steps + 1):
            record = trainer.step(step)
            record.pop("samples", None)
            records.append(record)
    return records


def _median(records: Sequence[dict[str, Any]], key: str, warmup: int) -> float:
    return statistics.median(r[key] for r in records[warmup:])


def run(cfg: GrpoBenchConfig, report: Report) -> None:
    """Measure both paths into ``report`` (starts and stops its own Ray and TransferQueue)."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed", category=UserWarning)
    from shell.bench.cluster import bench_cluster  # Ray and TransferQueue load here, not on import

    if cfg.steps <= cfg.warmup:
        raise ValueError(f"'steps' must exceed 'warmup' ({cfg.warmup}): got {cfg.steps}")
    results: dict[str, list[list[dict[str, Any]]]] = {"legacy": [], "data plane": []}
    from shell.run_config import load_run_config

    storage = load_run_config(list(cfg.overrides)).data_plane.backend.tq_storage or "SimpleStorage"
    with bench_cluster("grpo", storage):
        report.start(total=2 * cfg.repeats, description="GRPO runs")
        started = time.perf_counter()
        for repeat in range(cfg.repeats):
            order = ("legacy", "data plane") if repeat % 2 == 0 else ("data plane", "legacy")
            for path in order:
                enabled = "true" if path == "data plane" else "false"
                results[path].append(_run([*cfg.overrides, f"data_plane.enabled={enabled}"], cfg.steps))
                report.advance()
    rows = []
    for path, runs in results.items():
        rows.append([
            path,
            f"{statistics.median(_median(r, 'step_time_s', cfg.warmup) for r in runs):.3f}",
            f"{statistics.median(_median(r, 'driver_bytes', cfg.warmup) for r in runs):,.0f}",
            f"{statistics.median(_median(r, 'data_plane_bytes', cfg.warmup) for r in runs):,.0f}",
            f"{statistics.median(_median(r, 'data_plane_ms', cfg.warmup) for r in runs):.1f}",
        ])
    time_ratios = [
        _median(d, "step_time_s", cfg.warmup) / _median(lg, "step_time_s", cfg.warmup)
        for d, lg in zip(results["data plane"], results["legacy"])
    ]
    byte_ratios = [
        _median(d, "driver_bytes", cfg.warmup) / _median(lg, "driver_bytes", cfg.warmup)
        for d, lg in zip(results["data plane"], results["legacy"])
    ]
    rows.append([
        "data plane / legacy",
        f"{statistics.median(time_ratios):.3f} (range {min(time_ratios):.3f}-{max(time_ratios):.3f})",
        f"{statistics.median(byte_ratios):.4f}",
        "",
        "",
    ])
    overrides = " ".join(cfg.overrides) or "defaults"
    report.table(
        f"GRPO step, {cfg.steps} steps x {cfg.repeats} repeats per path ({overrides}); medians after {cfg.warmup} warm-up steps",
        ["path", "step s", "driver bytes / step", "store bytes / step", "store ms / step"],
        rows,
    )
    parity = []
    for repeat, (d, lg) in enumerate(zip(results["data plane"], results["legacy"])):
        equal = all(a[k] == b[k] for a, b in zip(d, lg) for k in PARITY_KEYS)
        phases = sorted({k for r in d for k in r if k.startswith("phase_")})
        parity.append([str(repeat), "bitwise equal" if equal else "DIFFER", ", ".join(
            f"{k[6:-2]} {_median(d, k, cfg.warmup) / max(_median(lg, k, cfg.warmup), 1e-9):.2f}"
            for k in phases if all(k in r for r in lg)
        )])
    report.table(
        f"Parity of {', '.join(PARITY_KEYS)} per step, and phase time ratios (data plane / legacy); "
        f"{time.perf_counter() - started:.0f} s in all",
        ["repeat", "parity", "phase ratios"],
        parity,
    )
    report.finish()
