"""Reward benchmark: the default run over several seeds, summarised as the figures the README quotes.

For each seed ``s`` in ``first_seed .. first_seed + seeds - 1`` it runs the real
default job in a fresh process, ``python -m shell.run seed=s grpo.num_steps=N
run.dir=RUNS/seed<s> run.progress=plain`` (plus any overrides), one seed after
the other so step times are not shared. Then it reads each ``metrics.jsonl``
and reports, per seed, the mean reward over the last 10 steps, the final
policy entropy and the median step time, with the mean, range and standard
deviation over seeds, and a digest of the run's per-step values (two runs
with equal digests gave bitwise the same rewards, entropies, losses, KL and
grad norms); a second table gives the mean reward per window of steps.
It draws every seed's reward and entropy per step into one PNG.

Invariant: every number reported is read from the ``metrics.jsonl`` files of
runs of the current code, and the PNG is drawn from the same records; with
``reuse`` the runs already in ``runs_dir`` are read instead of run again
(their step count must match).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shell.bench.report import Report
from shell.run_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
PLOT_FILE = "reward_curve.png"
"""The figure's name in ``runs_dir`` unless ``plot`` says otherwise (the README's is ``docs/img/reward_curve.png``)."""
LAST = 10
"""The README's headline: mean reward over the last this many steps."""
DIGEST_KEYS = ("reward_mean", "entropy", "loss", "kl", "grad_norm")
"""The per-step values a run's digest covers: equal digests mean bitwise-equal curves."""
Records = Sequence[Mapping[str, Any]]


RUN_KEYS = ("seed", "grpo.num_steps", "run.dir")
"""Config keys every bench that runs ``python -m shell.run`` sets for each run itself."""


def absolute_path(path: str | Path) -> Path:
    """``path`` made absolute (the converter of every bench's run folder and plot)."""
    return Path(path).resolve()


def check_run_bench(
    *, seeds: int, steps: int, first_seed: int, overrides: Sequence[str], reserved: Sequence[str] = RUN_KEYS,
    reserved_prefixes: Sequence[str] = (),
) -> None:
    """The checks of every bench that runs ``python -m shell.run`` once per seed.

    Raises:
        ValueError: ``seeds < 1``, ``steps < LAST`` (the final reward averages the last ``LAST``),
            ``first_seed < 0``, an override that is not ``key=value``, or one that sets a key the bench
            sets (``reserved``, or a key under one of ``reserved_prefixes``).

    Example:
        >>> check_run_bench(seeds=1, steps=10, first_seed=0, overrides=("seed=3",))
        Traceback (most recent call last):
        ...
        ValueError: 'overrides' must not set seed, grpo.num_steps or run.dir (the bench sets them): got ['seed=3']
    """
    if seeds < 1:
        raise ValueError(f"'seeds' must be >= 1: got {seeds}")
    if steps < LAST:
        raise ValueError(f"'steps' must be >= {LAST}: got {steps}")
    if first_seed < 0:
        raise ValueError(f"'first_seed' must be >= 0: got {first_seed}")
    malformed = [o for o in overrides if "=" not in o]
    if malformed:
        raise ValueError(f"'overrides' must be key=value items: got {malformed}")
    taken = [o for o in overrides if o.split("=", 1)[0] in reserved or o.startswith(tuple(reserved_prefixes))]
    if taken:
        names = [*reserved, *(f"{p}*" for p in reserved_prefixes)]
        listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        raise ValueError(f"'overrides' must not set {listed} (the bench sets them): got {taken}")


def unset_defaults(defaults: Sequence[str], overrides: Sequence[str]) -> tuple[str, ...]:
    """The ``key=value`` items of ``defaults`` whose key no item of ``overrides`` sets.

    Example:
        >>> unset_defaults(("a=1", "b=2"), ("b=3",))
        ('a=1',)
    """
    own = {o.split("=", 1)[0] for o in overrides}
    return tuple(d for d in defaults if d.split("=", 1)[0] not in own)


@attrs.frozen
class RewardBenchConfig:
    """What the bench runs: ``seeds`` runs of ``steps`` steps from ``first_seed``, into ``runs_dir``.

    Attributes:
        seeds: how many seeds (>= 1).
        steps: steps per run (>= ``LAST``).
        first_seed: the first seed; the others follow it.
        runs_dir: where the runs go, one folder ``seed<s>`` each (with ``seed<s>.log`` and
            ``seed<s>.wall_s`` beside it).
        plot: the PNG to write; None: ``runs_dir / PLOT_FILE``.
        reuse: read the runs already in ``runs_dir`` instead of running them.
        overrides: extra ``key=value`` config overrides for every run (none: the default run).
    """

    seeds: int
    steps: int
    runs_dir: Path = attrs.field(converter=absolute_path)
    plot: Path | None = attrs.field(converter=attrs.converters.optional(absolute_path), default=None)
    first_seed: int = 0
    reuse: bool = False
    overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        check_run_bench(seeds=self.seeds, steps=self.steps, first_seed=self.first_seed, overrides=self.overrides)

    @property
    def plot_path(self) -> Path:
        """Where the figure goes."""
        return self.runs_dir / PLOT_FILE if self.plot is None else self.plot

    @property
    def seed_list(self) -> list[int]:
        """The seeds, in run order."""
        return list(range(self.first_seed, self.first_seed + self.seeds))


@attrs.frozen
class SeedSummary:
    """One run's headline figures (see the module docstring)."""

    seed: int
    last_reward: float
    final_entropy: float
    median_step_s: float
    wall_s: float | None
    digest: str


def curve_digest(records: Records) -> str:
    """The first 12 hex digits of SHA-256 over each step's ``DIGEST_KEYS`` values (exact float reprs)."""
    values = [[r["step"], *(r.get(k) for k in DIGEST_KEYS)] for r in records]
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:12]


def cpu_name() -> str:
    """The CPU (model, family and model number from ``/proc/cpuinfo`` where there is one), cores and torch's kernels.

    Example: ``"AMD EPYC (family 26, model 2), 2 cores, torch AVX512"``.
    """
    name, ids = platform.processor() or platform.machine(), {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").split("\n\n", 1)[0].splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                name = value
            elif key in ("cpu family", "model"):
                ids[key.removeprefix("cpu ")] = value
    detail = f" ({', '.join(f'{k} {v}' for k, v in ids.items())})" if ids else ""
    return f"{name}{detail}, {os.cpu_count()} cores, torch {torch.backends.cpu.get_cpu_capability()}"


def summarize(seed: int, records: Records, *, wall_s: float | None = None, last: int = LAST) -> SeedSummary:
    """The headline figures of one run's records (in step order).

    Raises:
        ValueError: fewer than ``last`` records, or a record lacks ``reward_mean``, ``entropy`` or ``step_time_s``.
    """
    if len(records) < last:
        raise ValueError(f"'records' of seed {seed} must hold at least {last} steps: got {len(records)}")
    for key in ("reward_mean", "entropy", "step_time_s"):
        missing = [r.get("step") for r in records if r.get(key) is None]
        if missing:
            raise ValueError(f"'records' of seed {seed} must all have '{key}': missing at steps {missing[:5]}")
    return SeedSummary(
        seed=seed,
        last_reward=math.fsum(r["reward_mean"] for r in records[-last:]) / last,
        final_entropy=float(records[-1]["entropy"]),
        median_step_s=statistics.median(r["step_time_s"] for r in records),
        wall_s=wall_s,
        digest=curve_digest(records),
    )


def spread(values: Sequence[float]) -> tuple[float, float, float, float]:
    """``(mean, min, max, std)`` of ``values``; std is the sample standard deviation (0 for one value)."""
    values = list(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), min(values), max(values), std


def windows(steps: int, last: int = LAST) -> list[tuple[int, int]]:
    """Step windows ``(first, last)`` for the curve table: the first ``last`` steps, ten equal spans, the final ``last``.

    Spans are inclusive and distinct (a span equal to the first or the final
    window is listed once); with ``steps == last`` the first window is the final one.
    """
    width = max(1, steps // 10)
    first, final = (1, min(last, steps)), (max(1, steps - last + 1), steps)
    tiles = [(a, min(a + width - 1, steps)) for a in range(1, steps + 1, width)]
    return list(dict.fromkeys([first, *(t for t in tiles if t not in (first, final)), final]))


def window_mean(records: Records, span: tuple[int, int]) -> float:
    """The mean ``reward_mean`` over the records whose step lies in ``span`` (inclusive).

    Raises:
        ValueError: no record lies in ``span``.
    """
    values = [r["reward_mean"] for r in records if span[0] <= r["step"] <= span[1]]
    if not values:
        raise ValueError(f"'span' must cover at least one step: got {span}")
    return math.fsum(values) / len(values)


def plot_seeds(runs: Mapping[int, Records], path: Path, *, title: str, window: int = LAST, dpi: int = 100) -> Path:
    """Write a PNG: reward per step (top) and policy entropy per step (bottom), one colour per seed.

    Rewards are drawn as faint points with a trailing ``window``-step mean; entropy as a line.
    """
    figure = Figure(figsize=(9, 6), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    cmap = colormaps["tab10"]
    for index, (seed, records) in enumerate(sorted(runs.items())):
        color = cmap(index % cmap.N)
        steps = np.array([r["step"] for r in records], dtype=float)
        rewards = np.array([r["reward_mean"] for r in records], dtype=float)
        top.plot(steps, rewards, "o", markersize=2, alpha=0.3, color=color)
        if len(rewards) >= window:
            trailing = np.convolve(rewards, np.ones(window) / window, mode="valid")
            top.plot(steps[window - 1 :], trailing, "-", linewidth=2, color=color, label=f"seed {seed}")
        bottom.plot(steps, [r["entropy"] for r in records], "-", linewidth=1.5, color=color, label=f"seed {seed}")
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel(f"reward_mean\n(line: mean of last {window} steps)")
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    bottom.set_ylim(bottom=0.0)
    bottom.set_ylabel("entropy (nats / token)")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi)
    return path


def _command(cfg: RewardBenchConfig, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "shell.run", f"seed={seed}", f"grpo.num_steps={cfg.steps}",
        f"run.dir={cfg.runs_dir / f'seed{seed}'}", "run.progress=plain", *cfg.overrides,
    ]


def _wall_file(cfg: RewardBenchConfig, seed: int) -> Path:
    return cfg.runs_dir / f"seed{seed}.wall_s"


def _run_seed(cfg: RewardBenchConfig, seed: int) -> float:
    """Run one seed in a fresh process (output to ``seed<s>.log``, wall seconds to ``seed<s>.wall_s``); its wall seconds.

    Raises:
        RuntimeError: the run exited non-zero (the message names its log).
    """
    log = cfg.runs_dir / f"seed{seed}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        status = subprocess.run(_command(cfg, seed), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise RuntimeError(f"seed {seed}: python -m shell.run exited {status}; see {log}")
    wall = time.perf_counter() - started
    _wall_file(cfg, seed).write_text(f"{wall:.3f}\n")
    return wall


def _read_wall(cfg: RewardBenchConfig, seed: int) -> float | None:
    """The wall seconds the bench measured for a run it made (None for a run it did not time)."""
    path = _wall_file(cfg, seed)
    return float(path.read_text()) if path.is_file() else None


def run(cfg: RewardBenchConfig, report: Report) -> None:
    """Run (or with ``reuse`` read) every seed, report the tables into ``report`` and write the PNG.

    Raises:
        FileExistsError: a seed's run folder exists and ``reuse`` is off.
        FileNotFoundError: ``reuse`` is on and a seed's metrics are missing.
        ValueError: a run holds another number of steps than ``steps``.
        RuntimeError: a run failed.
    """
    folders = {seed: cfg.runs_dir / f"seed{seed}" for seed in cfg.seed_list}
    if not cfg.reuse:
        existing = [str(f) for f in folders.values() if f.exists()]
        if existing:
            raise FileExistsError(f"'runs_dir' must not hold the runs yet (pass --reuse to read them): found {existing}")
    cfg.runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    records: dict[int, list[dict[str, Any]]] = {}
    walls: dict[int, float | None] = {}
    report.start(total=len(folders), description=f"{cfg.steps}-step runs")
    for seed, folder in folders.items():
        walls[seed] = _read_wall(cfg, seed) if cfg.reuse else _run_seed(cfg, seed)
        records[seed] = read_metrics(folder / "metrics.jsonl")
        if len(records[seed]) != cfg.steps:
            raise ValueError(f"'{folder}' must hold {cfg.steps} steps: got {len(records[seed])}")
        report.advance()
    summaries = [summarize(seed, records[seed], wall_s=walls[seed]) for seed in cfg.seed_list]
    rows = [
        [str(s.seed), f"{s.last_reward:.3f}", f"{s.final_entropy:.3f}", f"{s.median_step_s:.2f}",
         "" if s.wall_s is None else f"{s.wall_s:.0f}", s.digest]
        for s in summaries
    ]
    if len(summaries) > 1:
        columns = ([s.last_reward for s in summaries], [s.final_entropy for s in summaries],
                   [s.median_step_s for s in summaries])
        stats = [(spread(values), spec) for values, spec in zip(columns, (".3f", ".3f", ".2f"))]
        rows.append(["mean", *(format(m, spec) for (m, _, _, _), spec in stats), "", ""])
        rows.append(["min-max", *(f"{lo:{spec}}-{hi:{spec}}" for (_, lo, hi, _), spec in stats), "", ""])
        rows.append(["std", *(format(sd, spec) for (_, _, _, sd), spec in stats), "", ""])
    setting = " ".join(cfg.overrides) or "the default run"
    seeds = f"seed {cfg.first_seed}" if cfg.seeds == 1 else f"seeds {cfg.seed_list[0]}-{cfg.seed_list[-1]}"
    report.table(
        f"{setting}, {cfg.steps} steps, {seeds}, on {cpu_name()}",
        ["seed", f"mean reward, last {LAST} steps", "final entropy (nats)", "median step s", "wall s", "curve digest"],
        rows,
    )
    spans = windows(cfg.steps)
    curve = [[str(seed), *(f"{window_mean(records[seed], sp):.3f}" for sp in spans)] for seed in cfg.seed_list]
    means = [spread([window_mean(records[seed], sp) for seed in cfg.seed_list]) for sp in spans]
    if len(summaries) > 1:
        curve.append(["mean", *(f"{m:.3f}" for m, _, _, _ in means)])
        curve.append(["min-max", *(f"{lo:.2f}-{hi:.2f}" for _, lo, hi, _ in means)])
    report.table(
        f"Mean reward per window of steps; {time.perf_counter() - started:.0f} s in all",
        ["steps", *(f"{a}-{b}" for a, b in spans)],
        curve,
    )
    plot_seeds(
        records, cfg.plot_path,
        title=f"{setting}: {seeds}, {cfg.steps} steps\n{cpu_name()}",
    )
    report.table("Figure", ["file"], [[str(cfg.plot_path)]])
    report.finish()
