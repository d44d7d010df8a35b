"""GRPO step benchmark: the data-plane path against the legacy path on the same machine and config.

Each repeat starts a trainer of each path side by side in one process (fresh
workers per repeat, one Ray cluster and one TransferQueue for the whole bench)
and steps them in turn for ``steps`` steps with the same seed, the order
alternating from step to step (legacy first on odd steps). Both paths step
the same batches (the parity below), at the same moment on the machine, so
each step after ``warmup`` is one paired ratio data plane / legacy; the
bench reports their median pooled over the repeats, and the range of the
repeats' medians. (Runs in separate processes, one after the other, differ
here by 10-15% in speed from one process set to the next, which swamps a
few per cent.) Per path it also reports the median step time, the median
bytes through the driver per step and the store traffic. It checks parity:
per-step rewards, losses and grad norms must be bitwise equal between the
paths. And it reads every process's resident memory after each step
(``run.memory_every=1``: the driver, the policy ranks, the rollout engine,
the store's parts), with its growth per 100 steps: a long run (``--steps
300``) shows a leak in any of them as a steady slope. Per phase of the step
it reports each path's median milliseconds and the data plane's extra ones:
where the step's difference goes; per process (the trainers' and Ray's
raylet and GCS) the CPU milliseconds a step costs, on both paths: on a machine
of few cores CPU spent in any process lengthens the step.
"""

from __future__ import annotations

import contextlib
import operator
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from core.memory_trend import growth_per_100_steps
from shell.bench.cpu import cpu_per_call, cpu_seconds, named_pids, processes, ray_daemons
from shell.bench.report import Report
from shell.run_log import MEMORY_ERROR_KEY, MEMORY_KEY

PARITY_KEYS = ("reward_mean", "loss", "kl", "grad_norm")
CPU_KEY = "cpu_ms"
"""A step record's CPU by process (ms), which :func:`side_by_side` adds."""


@attrs.frozen
class GrpoBenchConfig:
    """What the bench runs: ``overrides`` on the packaged config, ``steps`` per run, ``repeats`` pairs of runs."""

    steps: int = 20
    warmup: int = 2
    repeats: int = 3
    overrides: tuple[str, ...] = ()


PATHS = ("legacy", "data plane")


def side_by_side(configs: Mapping[str, Any], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Name -> step records (``samples`` dropped) of a trainer per run config, all started side by side in this
    process (on its Ray: started here unless one is up) and stepped in turn for ``steps`` steps, the order
    alternating: the configs' order on odd steps, reversed on even ones.

    Stepping in turn puts every trainer's step at the same moment on the machine, so per-step ratios compare like
    with like; separate runs here differ by 10-15% in speed from one process set to the next.

    When this process started Ray (so the trainers' processes are on this node), each record also holds
    :data:`CPU_KEY`: the milliseconds of CPU the step took in each process of its trainer
    (``GRPOTrainer.process_ids``, flattened: ``driver``, ``policy 0``, ``rollout``, ``store <role>``) and in the
    raylet and GCS this process started (:mod:`shell.bench.cpu`), read right before and after the step.
    """
    from shell.grpo_trainer import GRPOTrainer

    names = list(configs)
    trainers: dict[str, Any] = {}
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for name in names:
            trainers[name] = GRPOTrainer(configs[name])
            trainers[name].start()
        # Each step's CPU in its trainer's processes and in Ray's daemons, which serve whichever trainer steps; only
        # when this process started Ray, so that every process of the trainers is on this node.
        daemons = ray_daemons()
        readers = {name: {**processes(named_pids(trainers[name].process_ids())), **daemons} for name in names}
        for step in range(1, steps + 1):
            for name in names if step % 2 else names[::-1]:
                before = cpu_seconds(readers[name]) if daemons else {}
                record = trainers[name].step(step)
                if daemons:
                    record[CPU_KEY] = cpu_per_call(before, cpu_seconds(readers[name]), 1)
                record.pop("samples", None)
                records[name].append(record)
    finally:
        for trainer in trainers.values():
            with contextlib.suppress(Exception):
                trainer.close()
    return records


def cuda_shortage(overrides: Sequence[str]) -> str | None:
    """Why this machine cannot run the bench's two trainers side by side with ``overrides``' policy on CUDA
    (each path's policy ranks at ``policy.gpus_per_rank``, both at once), or None (CPU policy, or GPUs enough).

    Ray packs ranks of a share below one GPU on a device as :func:`core.gpu_share.gpus_needed` counts; on one GPU,
    ``policy.gpus_per_rank=0.5`` fits both paths' single rank.

    Raises:
        ConfigError: ``overrides`` do not load (it loads them as the bench will, so the CLI reports a bad override
            as a usage error before Ray starts).
    """
    from core.gpu_share import gpus_needed
    from shell.run_config import PolicyDevice, load_run_config

    policy = load_run_config(list(overrides)).policy
    if policy.device != PolicyDevice.cuda:
        return None
    import torch

    ranks = len(PATHS) * policy.layout.world_size
    need, have = gpus_needed(policy.gpus_per_rank, ranks), torch.cuda.device_count()
    if need <= have:
        return None
    return (
        f"policy.device=cuda: the bench runs both paths at once, {ranks} policy ranks at "
        f"policy.gpus_per_rank={policy.gpus_per_rank:g} need {need:g} GPU{'' if need == 1 else 's'}, torch sees {have}"
        + ("; on one GPU pass policy.gpus_per_rank=0.5" if ranks == 2 and have == 1 else "")
    )


def _run_pair(overrides: Sequence[str], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Path -> its step records, each with every process's resident memory (``rss_mib``): a trainer of each path
    side by side (:func:`side_by_side`)."""
    from shell.run_config import load_run_config

    return side_by_side({
        path: load_run_config([*overrides, f"data_plane.enabled={'true' if path == 'data plane' else 'false'}",
                               f"grpo.num_steps={steps}", "run.memory_every=1"])
        for path in PATHS
    }, steps)


def _median(records: Sequence[dict[str, Any]], key: str, warmup: int) -> float:
    return statistics.median(r[key] for r in records[warmup:])


def run(cfg: GrpoBenchConfig, report: Report) -> None:
    """Measure both paths into ``report`` (starts and stops its own Ray and TransferQueue)."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed", category=UserWarning)
    from shell.bench.cluster import bench_cluster  # Ray and TransferQueue load here, not on import

    if cfg.steps <= cfg.warmup:
        raise ValueError(f"'steps' must exceed 'warmup' ({cfg.warmup}): got {cfg.steps}")
    results: dict[str, list[list[dict[str, Any]]]] = {path: [] for path in PATHS}
    from shell.run_config import load_run_config

    storage = load_run_config(list(cfg.overrides)).data_plane.backend.tq_storage or "SimpleStorage"
    with bench_cluster("grpo", storage):
        report.start(total=cfg.repeats, description="GRPO runs (both paths side by side)")
        started = time.perf_counter()
        for _repeat in range(cfg.repeats):
            pair = _run_pair(cfg.overrides, cfg.steps)
            for path in PATHS:
                results[path].append(pair[path])
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
    step_ratios = [
        [a["step_time_s"] / b["step_time_s"] for a, b in zip(d[cfg.warmup:], lg[cfg.warmup:])]
        for d, lg in zip(results["data plane"], results["legacy"])
    ]
    per_repeat = [statistics.median(r) for r in step_ratios]
    byte_ratios = [
        _median(d, "driver_bytes", cfg.warmup) / _median(lg, "driver_bytes", cfg.warmup)
        for d, lg in zip(results["data plane"], results["legacy"])
    ]
    rows.append([
        "data plane / legacy",
        f"{statistics.median([x for r in step_ratios for x in r]):.3f} (per repeat {min(per_repeat):.3f}-{max(per_repeat):.3f})",
        f"{statistics.median(byte_ratios):.4f}",
        "",
        "",
    ])
    overrides = " ".join(cfg.overrides) or "defaults"
    report.table(
        f"GRPO step, {cfg.steps} steps x {cfg.repeats} repeats per path ({overrides}), both paths side by side, order "
        f"alternating per step; medians after {cfg.warmup} warm-up steps; data plane / legacy: median of per-step "
        f"paired ratios, pooled over the repeats",
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
    report.table(
        f"Phase times per path (ms; per path the median over the {cfg.repeats} repeats of each repeat's median after "
        f"{cfg.warmup} warm-up steps) and what the data plane adds to each (its ms minus legacy's); last, the "
        f"policy calls' time outside the model (their phase less the slowest rank's model time)",
        ["phase", "legacy ms", "data plane ms", "data plane - legacy ms"],
        phase_rows(results, cfg.warmup),
    )
    report.table(
        f"Store calls of the data plane per step, by process and operation (ms; the median over the {cfg.repeats} "
        f"repeats of each repeat's median after {cfg.warmup} warm-up steps; policy: every rank summed) and their "
        f"share of the step",
        ["process and call", "ms / step", "share of the step"],
        store_call_rows(results["data plane"], cfg.warmup),
    )
    if all(CPU_KEY in r for runs in results.values() for run in runs for r in run):
        report.table(
            f"CPU per step by process (ms of CPU, user + system, read around each step; per path the median over the "
            f"{cfg.repeats} repeats of each repeat's median after {cfg.warmup} warm-up steps; Ray's raylet and GCS "
            f"serve both paths and count for the path that steps) and what the data plane adds",
            ["process", "legacy ms", "data plane ms", "data plane - legacy ms"],
            cpu_rows(results, cfg.warmup),
        )
    report.table(
        f"Resident memory per process (MiB, VmRSS right after each step): at step {cfg.warmup + 1}, at step "
        f"{cfg.steps}, and its growth per 100 steps (least-squares slope over steps {cfg.warmup + 1}-{cfg.steps}); "
        f"medians over the {cfg.repeats} repeats, each with fresh workers (the driver, this process, serves every "
        f"repeat and both paths)",
        ["path", "process", f"step {cfg.warmup + 1}", f"step {cfg.steps}", "growth / 100 steps",
         "growth per repeat"],
        resident_rows(results, cfg.warmup),
    )
    report.finish()


def _after_warmup(
    results: Mapping[str, Sequence[Sequence[dict[str, Any]]]], warmup: int
) -> dict[str, list[Sequence[dict[str, Any]]]]:
    """Each path's runs without their first ``warmup`` records.

    Raises:
        ValueError: a path has no runs, or a run has no record after ``warmup``.
    """
    kept: dict[str, list[Sequence[dict[str, Any]]]] = {}
    for path in PATHS:
        runs = results.get(path, ())
        if not runs:
            raise ValueError(f"'results' must hold runs of path {path!r}: got none")
        kept[path] = [run[warmup:] for run in runs]
        if any(not run for run in kept[path]):
            raise ValueError(f"every run of path {path!r} must have a step after the {warmup} warm-up steps")
    return kept


def _median_of_medians(runs: Sequence[Sequence[dict[str, Any]]], value: Callable[[dict[str, Any]], float]) -> float:
    """The median over ``runs`` of each run's median ``value`` of its records."""
    return statistics.median(statistics.median(value(r) for r in run) for run in runs)


def cpu_rows(results: Mapping[str, Sequence[Sequence[dict[str, Any]]]], warmup: int) -> list[list[str]]:
    """The CPU table's rows from each path's runs of step records with :data:`CPU_KEY`: per process (in the order
    first seen, legacy's first), each path's median over its runs of each run's median after ``warmup`` steps,
    over the records that hold the process (a process some steps could not read has no figure for them), and the
    difference (``-`` where a path has no such process); last, every process summed per step.

    Raises:
        ValueError: a path has no runs, or a run has no record after ``warmup``.
    """
    kept = _after_warmup(results, warmup)
    names = list(dict.fromkeys(name for path in PATHS for run in kept[path] for r in run for name in r[CPU_KEY]))
    rows = []
    for name in [*names, None]:
        cells: list[float | None] = []
        for path in PATHS:
            if name is None:
                cells.append(_median_of_medians(kept[path], lambda r: sum(r[CPU_KEY].values())))
            else:
                held = [[r for r in run if name in r[CPU_KEY]] for run in kept[path]]
                held = [run for run in held if run]
                cells.append(_median_of_medians(held, lambda r, n=name: r[CPU_KEY][n]) if held else None)
        legacy, plane = cells
        rows.append([
            "all processes" if name is None else name,
            *["-" if c is None else f"{c:.1f}" for c in cells],
            f"{(plane or 0.0) - (legacy or 0.0):+.1f}",
        ])
    return rows


def phase_rows(results: Mapping[str, Sequence[Sequence[dict[str, Any]]]], warmup: int) -> list[list[str]]:
    """The phase table's rows from each path's runs of step records: one row per phase that every record after
    ``warmup`` of both paths times (``phase_<name>_s``), in the order the legacy records list them, then ``other``,
    the step's time outside every phase it timed (``step_time_s`` minus the sum of its ``phase_<name>_s``), then
    the whole step (``step_time_s``): per path the median over the runs of each run's median, in ms, and the data
    plane's minus legacy's. Where a step's extra time goes is the last column, in ms, which a ratio of two
    near-zero phase times does not show. (Medians do not add up: the rows' sum is not the step's median.)
    Last, for ``logprobs`` and ``train`` when every record holds the policy's time in the model
    (``model_<call>_s``), the phase's time outside the model (``phase_<call>_s`` minus it): what the call spends
    moving rows and dispatching, without the model's own time, which varies from step to step more than that.

    Raises:
        ValueError: a path has no runs, or a run has no record after ``warmup``.
    """
    kept = _after_warmup(results, warmup)
    every = [record for path in PATHS for run in kept[path] for record in run]
    phases = [k for k in kept["legacy"][0][0] if k.startswith("phase_") and all(k in r for r in every)]

    def other(record: dict[str, Any]) -> float:
        return record["step_time_s"] - sum(v for k, v in record.items() if k.startswith("phase_"))

    def outside(call: str) -> Callable[[dict[str, Any]], float]:
        return lambda record: record[f"phase_{call}_s"] - record[f"model_{call}_s"]

    def ms(path: str, value: Callable[[dict[str, Any]], float]) -> float:
        return 1e3 * _median_of_medians(kept[path], value)

    named: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        *((k[len("phase_"):].removesuffix("_s"), operator.itemgetter(k)) for k in phases),
        (OTHER, other),
        ("step", operator.itemgetter("step_time_s")),
        *(
            (f"{call} outside the model", outside(call))
            for call in MODEL_CALLS
            if all(f"phase_{call}_s" in r and f"model_{call}_s" in r for r in every)
        ),
    ]
    rows = []
    for name, value in named:
        legacy, plane = ms("legacy", value), ms("data plane", value)
        rows.append([name, f"{legacy:.1f}", f"{plane:.1f}", f"{plane - legacy:+.1f}"])
    return rows


MODEL_CALLS = ("logprobs", "train")
"""The phases whose records also hold the policy's time in the model (``model_<call>_s``)."""


OTHER = "other"
"""The phase table's row of a step's time outside its timed phases."""


def store_call_rows(runs: Sequence[Sequence[dict[str, Any]]], warmup: int) -> list[list[str]]:
    """The store-call table's rows from the data plane's runs of step records with ``data_plane_ms_by_call``: one
    row per process and operation that some record after ``warmup`` spent time in (a record that does not name it
    counts 0), busiest first, then ``all`` (``data_plane_ms``): the median over the runs of each run's median ms per step,
    and the share of the step (the median over the runs of each run's median ``ms / step_time_s``).

    Raises:
        ValueError: no runs, or a run has no record after ``warmup``.
    """
    kept = [run[warmup:] for run in runs]
    if not kept or any(not run for run in kept):
        raise ValueError(f"'runs' must hold at least one run, each with a step after the {warmup} warm-up steps")
    calls = sorted({call for run in kept for r in run for call, ms in r["data_plane_ms_by_call"].items() if ms > 0})

    def per_step(value: Any) -> tuple[float, float]:
        ms = statistics.median(statistics.median(value(r) for r in run) for run in kept)
        share = statistics.median(statistics.median(value(r) / (1e3 * r["step_time_s"]) for r in run) for run in kept)
        return ms, share

    rows = [(call, *per_step(lambda r, c=call: r["data_plane_ms_by_call"].get(c, 0.0))) for call in calls]
    rows.sort(key=lambda row: -row[1])
    rows.append(("all", *per_step(lambda r: r["data_plane_ms"])))
    return [[call, f"{ms:.1f}", f"{100 * share:.1f}%"] for call, ms, share in rows]


def _readings(run: Sequence[dict[str, Any]], process: str) -> list[float]:
    values = [r.get(MEMORY_KEY, {}).get(process) for r in run]
    for record, value in zip(run, values):
        if value is None:
            why = record.get(MEMORY_ERROR_KEY, "it did not answer")
            raise RuntimeError(f"no resident memory of {process!r} at step {record['step']}: {why}")
    return values


def _first_readings(run: Sequence[dict[str, Any]]) -> Mapping[str, Any]:
    """The first step's readings that the run has (a step whose reading failed has none)."""
    for record in run:
        if MEMORY_KEY in record:
            return record[MEMORY_KEY]
    why = run[0].get(MEMORY_ERROR_KEY, "its records have none") if run else "it has no steps"
    raise RuntimeError(f"no resident memory in the run: {why}")


def resident_rows(results: Mapping[str, Sequence[Sequence[dict[str, Any]]]], warmup: int) -> list[list[str]]:
    """The resident-memory table's rows from each path's runs of step records with ``rss_mib``
    (``GRPOTrainer.resident_memory``): one row per path and process, and one for the driver (read after the data
    plane's steps: one process serves both paths)."""
    rows = []
    for path, runs in results.items():
        processes = [name for name in _first_readings(runs[0]) if name != "driver"]
        if path == "data plane":
            processes.append("driver")
        for process in processes:
            kept = [run[warmup:] for run in runs]
            series = [_readings(run, process) for run in kept]
            growths = [growth_per_100_steps([r["step"] for r in run], mib) for run, mib in zip(kept, series)]
            rows.append([
                "both" if process == "driver" else path,
                process,
                f"{statistics.median(mib[0] for mib in series):.1f}",
                f"{statistics.median(mib[-1] for mib in series):.1f}",
                f"{statistics.median(growths):+.2f}",
                f"{min(growths):+.2f} to {max(growths):+.2f}",
            ])
    return rows
