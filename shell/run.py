"""``python -m shell.run``: GRPO end to end on Ray, with progress, metrics, a plot and checkpoints.

Usage::

    python -m shell.run [--config FILE] [--resume RUN_DIR] [key=value ...]

With no arguments it starts an embedded Ray cluster, TransferQueue, the
megatron policy workers (CPU) and the rollout engine, trains the tiny GPT on
the addition task, and leaves in ``run.dir`` (default ``runs/<timestamp>/``):
``config.yaml``, ``metrics.jsonl`` (one record per step), ``samples.jsonl``,
``reward.png`` and ``checkpoint.pt``. ``--help`` lists every config key.

Exit status: 0 when the run finishes, 1 when a step fails (the message names
the step and the component that failed: a policy rank, the rollout engine or
collector, the replay buffer, or the store part that died; any other
component names itself through ``shell.worker_errors.component_error``), 2
for a bad command line, config, run folder, checkpoint or cluster address
(one line naming the key, before anything starts; an unreachable
``ray.address`` within seconds), 130 after SIGINT (Ctrl-C) or SIGTERM. On
every exit the run clears its store keys and stops what it started; that
clean-up is bounded (:mod:`shell.run_stop`): a second signal, or
:data:`shell.run_stop.CLEANUP_TIMEOUT_S`, kills the run's processes instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from shell.run_config import ConfigError, ProgressMode, describe_keys, load_run_config, save_run_config
from shell.run_log import MEMORY_ERROR_KEY, RISING_KEY, MetricsLog, read_metrics
from shell.run_progress import RunProgress
from shell.run_stop import EXIT_INTERRUPTED, RunStopper

EXIT_FAILED, EXIT_USAGE = 1, 2


def _help_epilog() -> str:
    rows = list(describe_keys())
    width = max(len(k) + len(v) for k, v, _ in rows) + 3
    lines = ["config keys (override with key=value; defaults from shell/grpo.yaml):"]
    lines += [f"  {f'{k}={v}':<{width}} {c}" for k, v, c in rows]
    lines += [
        "",
        "examples:",
        "  python -m shell.run                                    # the default run (about 3 minutes on 2 CPUs)",
        "  python -m shell.run data_plane.enabled=false           # the legacy path, same results",
        "  python -m shell.run policy.layout.tensor_parallel=2    # TP=2 policy workers",
        "  python -m shell.run ray.address=auto                   # join a running Ray cluster",
        "  python -m shell.run ray.address=auto ray.placement=spread policy.layout.data_parallel=2"
        "   # DP ranks on different nodes (docs/scaling.md)",
        "  python -m shell.run --resume runs/20261121-101500 grpo.num_steps=80",
        "  python -m shell.run --config runs/20261121-101500/config.yaml run.dir=runs/again",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line: options and ``key=value`` overrides."""
    parser = argparse.ArgumentParser(
        prog="python -m shell.run",
        description="GRPO on Ray with a data plane for the rollout batches (see README.md).",
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a YAML file replacing shell/grpo.yaml (e.g. a run's config.yaml)")
    parser.add_argument(
        "--resume", metavar="RUN_DIR", help="continue from RUN_DIR/checkpoint.pt (steps after it are logged again)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return parser.parse_intermixed_args(list(argv))  # overrides may come before and after the options


def _write_processes(trainer: Any, path: Path) -> dict[str, Any]:
    info = trainer.process_ids()
    info["nodes"] = trainer.node_ids()
    path.write_text(json.dumps(info, indent=1) + "\n")
    if not trainer.owns_store:  # a store the run joined is not the run's to kill on a hard stop
        return {key: value for key, value in info.items() if key != "store"}
    return info


def _worker_pids(info: Any) -> list[int]:
    """Every pid in ``processes.json``'s record but the driver's (roles may nest: ``{"policy": {"0": pid}}``)."""
    if isinstance(info, dict):
        return [pid for key, value in info.items() if key != "driver" for pid in _worker_pids(value)]
    if isinstance(info, (list, tuple)):
        return [pid for value in info for pid in _worker_pids(value)]
    return [info] if isinstance(info, int) and not isinstance(info, bool) else []


def main(argv: Sequence[str] | None = None) -> int:
    """Run GRPO as the command line says; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=True, soft_wrap=True)  # a message is one line, however long
    # megatron warns at import that optional fused kernels are absent; the local fallbacks are what we use.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed", category=UserWarning)
    from adapters import tq_system
    from shell.grpo_trainer import GRPOTrainer, StepError, StoreStartError  # heavy (megatron): after --help
    from shell.ray_cluster import check_address
    from shell.run_dir import (
        CONFIG_FILE, METRICS_FILE, PROCESSES_FILE, SAMPLES_FILE, discard_unstarted, plan_run_dir, prepare_run_dir,
    )
    from shell.worker_group import WorkerError

    try:
        config = load_run_config(args.overrides, config_file=args.config)
        plan = plan_run_dir(config, args.resume)
        check_address(config.ray)
        trainer = GRPOTrainer(config)
        prepare_run_dir(plan)
    except ConfigError as error:
        console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        return EXIT_USAGE
    run_dir, checkpoint, first = plan.path, plan.checkpoint, plan.first_step
    if not plan.continues:  # a continued run keeps its own config.yaml until this one has started
        save_run_config(config, run_dir / CONFIG_FILE)
    total = config.grpo.num_steps
    mode = config.run.progress
    path = "data plane (" + config.data_plane.backend.value + ")" if config.data_plane.enabled else "legacy"
    if config.grpo.async_.enabled:
        path += f", async (max_staleness={config.grpo.async_.max_staleness})"
    console.print(f"GRPO: {total} steps, {path}, output in {escape(str(run_dir))}", highlight=False)
    stopper = RunStopper(lambda message: console.print(f"[bold red]{escape(message)}[/]", highlight=False))
    step = first - 1
    status = 0
    with stopper.installed():
        try:
            try:
                trainer.start(on_status=lambda message: console.print(f"  {message}", highlight=False))
                console.print(f"  {_ready(trainer.start_seconds)}", highlight=False)
                tq_system.quiet_logs()
                stopper.track(_worker_pids(_write_processes(trainer, run_dir / PROCESSES_FILE)))
                if not trainer.owns_store:  # a joined store outlives a hard stop: the run's keys must not
                    stopper.before_exit(trainer.sweep_keys)
                if checkpoint is not None:
                    trainer.load_policy_state(checkpoint["weights"])
                    console.print(f"  resumed from step {checkpoint['step']}", highlight=False)
                if plan.continues:
                    save_run_config(config, run_dir / CONFIG_FILE)
                progress: Any = contextlib.nullcontext()
                if mode != ProgressMode.off:
                    progress = RunProgress(
                        total=total,
                        start=min(first - 1, total),
                        plain=None if mode == ProgressMode.auto else mode == ProgressMode.plain,
                    )
                every = config.run.checkpoint_every
                with MetricsLog(run_dir / METRICS_FILE, drop_after=first - 1) as log, progress, open(
                    run_dir / SAMPLES_FILE, "a", encoding="utf-8"
                ) as samples:
                    warned: set[str] = set()  # processes whose rising memory was shown (once each)
                    for step in range(first, total + 1):
                        record = trainer.step(step)
                        for sample in record.pop("samples"):
                            samples.write(json.dumps({"step": step, **sample}) + "\n")
                        samples.flush()
                        written = log.write(record)
                        if mode != ProgressMode.off:
                            progress.advance(written)
                        fresh = {p: v for p, v in (record.get(RISING_KEY) or {}).items() if p not in warned}
                        if fresh:
                            warned.update(fresh)
                            message = _rising_warning(step, fresh, config.run.memory_rise_limit, config.run.memory_rise_window)
                            console.print(message, highlight=False)  # above a live bar: rich redirects stderr
                        if MEMORY_ERROR_KEY in record:
                            console.print(
                                f"[yellow]warning:[/] step {step} finished, but its resident-memory reading failed: "
                                f"{escape(record[MEMORY_ERROR_KEY])}",
                                highlight=False,
                            )
                        if every and step % every == 0 and step < total:
                            trainer.save_checkpoint(run_dir, step)
                trainer.save_checkpoint(run_dir, total)
                console.print(f"done: {total} steps; checkpoint {escape(str(run_dir / 'checkpoint.pt'))}", highlight=False)
            except (WorkerError, StepError, StoreStartError) as error:
                where = f"at step {step}" if step >= first else "during start-up"
                console.print(f"[bold red]run failed[/] {where}: {escape(_summary(error))}", highlight=False)
                status = EXIT_FAILED
            except ConfigError as error:  # the config does not fit the cluster (found at start-up)
                console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
                status = EXIT_USAGE
                if step < first:
                    discard_unstarted(plan, config)  # no run happened: the same run.dir takes the corrected one
        except KeyboardInterrupt:  # the stopper's Interrupted, or Ray's in its stead (also while reporting a failure)
            name = f" ({stopper.signal_name})" if stopper.signal_name else ""
            where = f"during step {step}" if step >= first else "during start-up"
            console.print(f"[yellow]interrupted{name}[/] {where}: shutting down cleanly", highlight=False)
            status = EXIT_INTERRUPTED
        finally:
            with stopper.cleanup(status):
                try:
                    trainer.close()
                except Exception as error:  # report, but the run's own outcome decides the status
                    console.print(f"[yellow]warning:[/] shutdown: {escape(str(error))}", highlight=False)
                    status = status or EXIT_FAILED
                _plot(run_dir, console)
    return EXIT_INTERRUPTED if stopper.interrupted else status


def _rising_warning(step: int, rising: Mapping[str, float], limit: float, window: int) -> str:
    """The console line for processes whose resident memory grows faster than ``run.memory_rise_limit``."""
    from shell.run_dir import METRICS_FILE

    each = ", ".join(f"{process} +{slope:.1f}" for process, slope in sorted(rising.items()))
    return (
        f"[yellow]warning:[/] resident memory rising at step {step}: {escape(each)} MiB per 100 steps over the "
        f"last {window} readings (run.memory_rise_limit={limit:g}; a leak? rss_mib in {METRICS_FILE} has them)"
    )


def _ready(seconds: dict[str, float]) -> str:
    """The start-up line: ``ready in 11.8 s (Ray 2.8 s, store 3.8 s, workers 5.0 s)``."""
    parts = ", ".join(f"{'Ray' if name == 'ray' else name} {value:.1f} s" for name, value in seconds.items())
    return f"ready in {sum(seconds.values()):.1f} s ({parts})"


def _summary(error: BaseException) -> str:
    """The first line of an error (a worker's remote traceback stays out of the console)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _plot(run_dir: Path, console: Console) -> None:
    from shell.run_dir import METRICS_FILE, PLOT_FILE
    from shell.run_plot import plot_run  # matplotlib loads here, once the run is over: half a second off every start

    metrics = run_dir / METRICS_FILE
    if not metrics.exists():
        return
    records = read_metrics(metrics)
    if records:
        out = plot_run(records, run_dir / PLOT_FILE, title=f"GRPO {run_dir.name}")
        console.print(f"plot: {escape(str(out))}", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
