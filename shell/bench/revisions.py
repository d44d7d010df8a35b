"""``python -m shell.bench revisions --base REV``: the GRPO step time of this tree against another git revision.

It answers "did my change slow the step down?" the way the benchmarks here
measure everything: medians of paired repeats, as ratios against a baseline
measured in the same run. The base revision is checked out into a temporary
git worktree; each repeat runs ``python -m shell.run`` (a fresh process, its
own embedded Ray) once per revision and transport, alternating which revision
goes first. Per repeat and transport it forms the ratio of median step times
(after ``warmup`` steps), this tree / base, and reports their median and range.
It also reports whether the two revisions agree bitwise on every step's
reward, loss, KL and grad norm (a refactor should).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from shell.bench.report import Report

PARITY_KEYS = ("reward_mean", "loss", "kl", "grad_norm")
TRANSPORTS = {"legacy": "false", "data plane": "true"}
ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class RevisionsConfig:
    """``base``: a git revision of this repository; ``steps`` per run; ``repeats`` paired runs per transport."""

    base: str
    steps: int = 20
    warmup: int = 2
    repeats: int = 3
    overrides: tuple[str, ...] = ()


def _run(tree: Path, run_dir: Path, transport: str, cfg: RevisionsConfig) -> list[dict[str, Any]]:
    """One ``python -m shell.run`` in ``tree``; its per-step records."""
    args = [
        sys.executable, "-m", "shell.run", *cfg.overrides,
        f"grpo.num_steps={cfg.steps}", f"data_plane.enabled={TRANSPORTS[transport]}",
        f"run.dir={run_dir}", "run.progress=plain",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"the run in {tree} ({transport}) exited {done.returncode}:\n{tail}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _step_time(records: Sequence[dict[str, Any]], warmup: int) -> float:
    return statistics.median(r["step_time_s"] for r in records[warmup:])


def run(cfg: RevisionsConfig, report: Report) -> None:
    """Measure this tree against ``cfg.base`` into ``report``.

    Raises:
        ValueError: ``steps`` does not exceed ``warmup``.
        RuntimeError: ``base`` is not a revision of this repository, or a run failed.
    """
    if cfg.steps <= cfg.warmup:
        raise ValueError(f"'steps' must exceed 'warmup' ({cfg.warmup}): got {cfg.steps}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-revisions-") as tmp:
        base_tree = Path(tmp) / "base"
        added = subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), cfg.base],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )
        if added.returncode != 0:
            raise RuntimeError(f"'--base' must be a revision of {ROOT}: git said {added.stderr.strip()}")
        trees = {"base": base_tree, "this tree": ROOT}
        records: dict[tuple[str, str], list[list[dict[str, Any]]]] = {
            (rev, t): [] for rev in trees for t in TRANSPORTS
        }
        report.start(total=cfg.repeats * len(trees) * len(TRANSPORTS), description="GRPO runs")
        try:
            for repeat in range(cfg.repeats):
                order = ("base", "this tree") if repeat % 2 == 0 else ("this tree", "base")
                for transport in TRANSPORTS:
                    for rev in order:
                        run_dir = Path(tmp) / f"run-{repeat}-{rev.replace(' ', '_')}-{transport.replace(' ', '_')}"
                        records[rev, transport].append(_run(trees[rev], run_dir, transport, cfg))
                        report.advance()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    rows = []
    for transport in TRANSPORTS:
        base_runs, head_runs = records["base", transport], records["this tree", transport]
        ratios = [_step_time(h, cfg.warmup) / _step_time(b, cfg.warmup) for h, b in zip(head_runs, base_runs)]
        equal = all(
            mine[k] == theirs[k]
            for head, base in zip(head_runs, base_runs)
            for mine, theirs in zip(head, base)
            for k in PARITY_KEYS
        )
        rows.append([
            transport,
            f"{statistics.median(_step_time(r, cfg.warmup) for r in base_runs):.3f}",
            f"{statistics.median(_step_time(r, cfg.warmup) for r in head_runs):.3f}",
            f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
            "bitwise equal" if equal else "DIFFER",
        ])
    overrides = " ".join(cfg.overrides) or "defaults"
    report.table(
        f"GRPO step time, this tree vs {cfg.base}: {cfg.steps} steps x {cfg.repeats} paired repeats per transport "
        f"({overrides}); medians after {cfg.warmup} warm-up steps; {time.perf_counter() - started:.0f} s in all",
        ["transport", "base step s", "this tree step s", "this tree / base", f"{', '.join(PARITY_KEYS)} per step"],
        rows,
    )
    report.finish()
