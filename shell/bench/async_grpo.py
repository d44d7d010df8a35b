"""Async GRPO benchmark: throughput and reward over wall-clock of async (``max_staleness`` 1, 2) against sync.

For each seed (a *paired repeat*) it runs, one after the other in fresh
processes, the synchronous trainer and async GRPO at each ``max_staleness``:
``python -m shell.run task.name=reverse task.kwargs.length=10
task.kwargs.digits=4 policy.micro_batch_tokens=0 seed=s grpo.num_steps=N ...``
(the generation-heavy task, unpacked, by default), rotating the order from seed to seed so no
variant always runs first. From each run's ``metrics.jsonl`` it reads:

* **throughput**: steps per second of training, ``N / sum(step_time_s)`` (the
  start-up, the same for every variant, is left out); the ratio of each async
  variant over the sync run of the same seed is one paired ratio, and the
  table gives their median and range;
* **time to reward**: the training seconds until the trailing 10-step mean
  reward first reaches ``target`` (``-`` if it never does);
* **quality**: the mean reward over the last 10 steps;
* **where the time goes**: per-phase seconds per step, the trainer's wait for
  data, the collector's wait, and the generated tokens per second.

It also draws every variant's reward per step and over training seconds (seed
``first_seed``) into one PNG with
:func:`shell.run_plot.plot_compare`.

Invariant: every number reported is read from the ``metrics.jsonl`` files of
runs of the current code made by this bench (or, with ``reuse``, found in
``runs_dir``); nothing is typed in.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from shell.bench.report import Report
from shell.bench.reward import ROOT, absolute_path, check_run_bench, cpu_name, spread, unset_defaults
from shell.run_log import read_metrics
from shell.run_plot import plot_compare

Records = Sequence[Mapping[str, Any]]
LAST = 10
"""Steps averaged for the final reward and for the trailing mean of the time-to-reward."""
TASK_OVERRIDES = ("task.name=reverse", "task.kwargs.length=10", "task.kwargs.digits=4")
"""The generation-heavy task (11-token responses over 4 digit values), as the bench runs it unless ``overrides``
set ``task.*`` themselves."""
PACKING_OVERRIDES = ("policy.micro_batch_tokens=0",)
"""No packing of the train micro-batches (the reverse task's recommended setting, ``docs/tasks.md``: 256-token bins
hold ~11 of its rows, so the policy phases run two dozen tiny micro-batches a step), unless ``overrides`` set
``policy.micro_batch_tokens`` themselves."""
PHASES = ("rollout", "wait", "advantages", "logprobs", "write", "train", "refit", "finish")


@attrs.frozen
class AsyncBenchConfig:
    """What the bench runs.

    Attributes:
        seeds: paired repeats (>= 1), seeds ``first_seed ..``.
        steps: steps per run (>= ``LAST``).
        staleness: the async variants' ``max_staleness`` values.
        target: the reward the time-to-reward is measured to.
        runs_dir: where the runs go (``<variant>-seed<s>`` each, with a ``.log``).
        plot: the PNG (default ``runs_dir/async_reward.png``).
        reuse: read the runs in ``runs_dir`` instead of running them.
        overrides: extra config overrides for every run.
    """

    seeds: int
    steps: int
    runs_dir: Path = attrs.field(converter=absolute_path)
    staleness: tuple[int, ...] = attrs.field(converter=tuple, default=(1, 2))
    target: float = 0.5
    first_seed: int = 0
    plot: Path | None = attrs.field(converter=attrs.converters.optional(absolute_path), default=None)
    reuse: bool = False
    overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        check_run_bench(
            seeds=self.seeds, steps=self.steps, first_seed=self.first_seed, overrides=self.overrides,
            reserved_prefixes=("grpo.async.",),
        )
        if not self.staleness or any(k < 0 for k in self.staleness):
            raise ValueError(f"'staleness' must hold at least one value >= 0: got {self.staleness}")

    @property
    def variants(self) -> dict[str, tuple[str, ...]]:
        """Variant name -> its overrides: ``sync``, then ``async-k<k>`` per staleness."""
        out: dict[str, tuple[str, ...]] = {"sync": ()}
        for k in self.staleness:
            out[f"async-k{k}"] = ("grpo.async.enabled=true", f"grpo.async.max_staleness={k}")
        return out

    @property
    def base_overrides(self) -> tuple[str, ...]:
        """The task (unless the overrides name one), no packing (unless they set it) and the overrides."""
        own_task = any(o.startswith("task.") for o in self.overrides)
        return (*(() if own_task else TASK_OVERRIDES), *unset_defaults(PACKING_OVERRIDES, self.overrides), *self.overrides)


def steps_per_second(records: Records) -> float:
    """``len(records) / sum(step_time_s)``: steps per second of training."""
    total = math.fsum(r["step_time_s"] for r in records)
    return len(records) / total


def time_to_reward(records: Records, target: float, window: int = LAST) -> float | None:
    """Training seconds (cumulative ``step_time_s``) until the trailing ``window``-step mean reward first
    reaches ``target``; None if it never does.

    Example:
        >>> rs = [{"step": i, "reward_mean": i / 10, "step_time_s": 1.0} for i in range(1, 11)]
        >>> time_to_reward(rs, 0.5, window=1)
        5.0
    """
    elapsed, rewards = 0.0, []
    for record in sorted(records, key=lambda r: r["step"]):
        elapsed += record["step_time_s"]
        rewards.append(record["reward_mean"])
        recent = rewards[-window:]
        if len(recent) == window and math.fsum(recent) / window >= target:
            return elapsed
    return None


def per_seed(values: Sequence[float]) -> str:
    """``"mean (lo-hi; per seed a / b / c)"`` of the per-seed ``values``, three decimals.

    Example:
        >>> per_seed([0.5, 0.25, 0.75])
        '0.500 (0.250-0.750; per seed 0.500 / 0.250 / 0.750)'
    """
    mean, lo, hi, _ = spread(list(values))
    return f"{mean:.3f} ({lo:.3f}-{hi:.3f}; per seed {' / '.join(f'{v:.3f}' for v in values)})"


def final_reward(records: Records) -> float:
    """Mean ``reward_mean`` of the last ``LAST`` steps."""
    tail = sorted(records, key=lambda r: r["step"])[-LAST:]
    return math.fsum(r["reward_mean"] for r in tail) / len(tail)


def mean_of(records: Records, key: str) -> float:
    """Mean of ``key`` over the records that have it (0.0 if none)."""
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return math.fsum(values) / len(values) if values else 0.0


def _order(names: Sequence[str], index: int) -> list[str]:
    """``names`` rotated by ``index`` (seed ``i`` starts with variant ``i mod n``)."""
    shift = index % len(names)
    return [*names[shift:], *names[:shift]]


def _run_one(cfg: AsyncBenchConfig, name: str, seed: int) -> None:
    folder = cfg.runs_dir / f"{name}-seed{seed}"
    command = [
        sys.executable, "-m", "shell.run", f"seed={seed}", f"grpo.num_steps={cfg.steps}", f"run.dir={folder}",
        "run.progress=plain", *cfg.base_overrides, *cfg.variants[name],
    ]
    log = cfg.runs_dir / f"{name}-seed{seed}.log"
    with log.open("w") as out:
        status = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise RuntimeError(f"{name} seed {seed}: python -m shell.run exited {status}; see {log}")


def run(cfg: AsyncBenchConfig, report: Report) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Run (or read) every variant for every seed, report the tables, write the PNG; the records by variant and seed.

    Raises:
        FileExistsError: a run folder exists and ``reuse`` is off.
        ValueError: a run holds another number of steps than ``steps``.
        RuntimeError: a run failed.
    """
    names = list(cfg.variants)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    folders = {(n, s): cfg.runs_dir / f"{n}-seed{s}" for n in names for s in seeds}
    if not cfg.reuse:
        existing = [str(f) for f in folders.values() if f.exists()]
        if existing:
            raise FileExistsError(f"'runs_dir' must not hold the runs yet (pass --reuse to read them): found {existing[:3]}")
    cfg.runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report.start(total=len(folders), description=f"{cfg.steps}-step runs")
    records: dict[str, dict[int, list[dict[str, Any]]]] = {n: {} for n in names}
    for index, seed in enumerate(seeds):
        for name in _order(names, index):
            if not cfg.reuse:
                _run_one(cfg, name, seed)
            rows = read_metrics(folders[name, seed] / "metrics.jsonl")
            if len(rows) != cfg.steps:
                raise ValueError(f"'{folders[name, seed]}' must hold {cfg.steps} steps: got {len(rows)}")
            records[name][seed] = rows
            report.advance()
    _tables(cfg, records, seeds, report, time.perf_counter() - started)
    plot = cfg.plot or cfg.runs_dir / "async_reward.png"
    first = seeds[0]
    plot_compare(
        {f"{name} (seed {first})": records[name][first] for name in names},
        plot,
        title=f"{' '.join(cfg.base_overrides)}: sync vs async, {cfg.steps} steps, seed {first}\n{cpu_name()}",
    )
    report.table("Figure", ["file"], [[str(plot)]])
    report.finish()
    return records


def _tables(cfg: AsyncBenchConfig, records: Mapping[str, Mapping[int, Records]], seeds: Sequence[int],
            report: Report, elapsed: float) -> None:
    names = list(records)
    setting = " ".join(cfg.base_overrides)
    rows = []
    for name in names:
        throughput = [steps_per_second(records[name][s]) for s in seeds]
        ratios = [throughput[i] / steps_per_second(records["sync"][s]) for i, s in enumerate(seeds)]
        reach = [time_to_reward(records[name][s], cfg.target) for s in seeds]
        reached = [t for t in reach if t is not None]
        final = [final_reward(records[name][s]) for s in seeds]
        rows.append([
            name,
            f"{statistics.median(throughput):.3f}",
            "1 (baseline)" if name == "sync" else f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})",
            (f"{statistics.median(reached):.0f}" if reached else "-") + f" ({len(reached)}/{len(seeds)} seeds)",
            per_seed(final),
            f"{max(r['version_lag_max'] for s in seeds for r in records[name][s])}",
        ])
    report.table(
        f"Async GRPO vs sync: {setting}, {cfg.steps} steps x {len(seeds)} paired seeds, order rotated; {elapsed:.0f} s in all; on {cpu_name()}",
        ["trainer", "steps / s (median)", "throughput vs sync: median of paired ratios",
         f"training s to reward {cfg.target} (trailing {LAST}, median)", f"final reward, last {LAST} (mean, range, per seed)",
         "max version lag"],
        rows,
    )
    present = [p for p in PHASES if any(f"phase_{p}_s" in r for n in names for s in seeds for r in records[n][s])]
    time_rows = []
    for name in names:
        flat = [r for s in seeds for r in records[name][s]]
        time_rows.append([
            name,
            f"{mean_of(flat, 'step_time_s'):.3f}",
            *(f"{mean_of(flat, f'phase_{p}_s'):.3f}" for p in present),
            f"{mean_of(flat, 'trainer_wait_s'):.3f}",
            f"{mean_of(flat, 'collector_wait_s'):.3f}",
            f"{mean_of(flat, 'generated_tokens_per_s'):.0f}",
        ])
    report.table(
        "Where the time goes (seconds per step, mean over every step of every seed)",
        ["trainer", "step", *present, "trainer wait", "collector wait", "generated tokens / s"],
        time_rows,
    )
