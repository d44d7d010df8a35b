"""The run's figures: ``reward.png`` (reward per step, stacked phase seconds per step, each process's resident
memory per step when the records carry it, reward over wall-clock seconds) and a comparison of several runs
(reward per step and over wall-clock seconds, one line per run).

``plot_run`` and ``plot_compare`` read records (as :mod:`shell.run_log`
writes them) and draw them on their own Agg canvas, never through
``pyplot``'s global state. ``wall_clock`` gives the x of the wall-clock panels:
the cumulative ``step_time_s`` in step order, so a sync and an async run are
compared by the seconds of training they took.

Invariant: a run's figure depends only on its records as a set: they are drawn
in step order whatever order they come in, a missing or ``None`` value is a
gap, and the records are never changed.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shell.run_log import (
    MEMORY_KEY,
    REWARD_KEY,
    STEP_KEY,
    STEP_TIME_KEY,
    PathLike,
    phase_keys,
    phase_name,
    record_number,
    record_step,
)

__all__ = ["plot_compare", "plot_run", "wall_clock"]

Ordered = list[tuple[int, str, Mapping[str, Any]]]
"""Records in step order, each as ``(step, where, record)``; ``where`` names it in errors (``records[3]``)."""

CLOCK_LABEL = "training seconds (cumulative step_time_s)"


def _check_window(window: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"'window' must be an int number of steps: got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"'window' must be >= 1 step: got {window}")


def _ordered(records: Sequence[Mapping[str, Any]], name: str, required: tuple[str, ...]) -> Ordered:
    """``records`` checked (a non-empty sequence of mappings, each with the ``required`` keys) and sorted by step."""
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise TypeError(f"'{name}' must be a sequence of record mappings: got {type(records).__name__}")
    if len(records) == 0:
        raise ValueError(f"'{name}' must hold at least one record to plot: got 0")
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"'{name}[{i}]' must be a mapping: got {type(record).__name__}")
        for key in required:
            if key not in record:
                raise ValueError(f"'{name}[{i}]' must have a '{key}' key: got keys {sorted(record)}")
    return sorted((record_step(record, f"{name}[{i}]"), f"{name}[{i}]", record) for i, record in enumerate(records))


def _clock(ordered: Ordered) -> list[float]:
    """Cumulative ``step_time_s`` at each record, in step order; NaN (a gap) where the record has none."""
    total, out = 0.0, []
    for _, where, record in ordered:
        seconds = record_number(record, STEP_TIME_KEY, where)
        if math.isfinite(seconds):
            total += seconds
            out.append(total)
        else:
            out.append(math.nan)
    return out


def wall_clock(records: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """``(step, seconds of training so far)`` per record, in step order: the running sum of ``step_time_s``.

    A record without a finite ``step_time_s`` (missing, ``None``) is a gap: its
    seconds are NaN and it adds nothing to the sum.

    Args:
        records: a run's records, in any order, e.g. ``read_metrics(path)``.

    Returns:
        One pair per record, sorted by step.

    Raises:
        TypeError: ``records`` is not a sequence of mappings, or a step or ``step_time_s`` is not a number.
        ValueError: ``records`` is empty or a record lacks ``step``.

    Example:
        >>> wall_clock([{"step": 2, "step_time_s": 3.0}, {"step": 1, "step_time_s": 1.5}, {"step": 3}])
        [(1, 1.5), (2, 4.5), (3, nan)]
    """
    ordered = _ordered(records, "records", (STEP_KEY,))
    return [(step, seconds) for (step, _, _), seconds in zip(ordered, _clock(ordered))]


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values, ignoring NaN (NaN when all are)."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(math.fsum(finite) / len(finite) if finite else math.nan)
    return out


def _rewards(ordered: Ordered) -> list[float]:
    return [record_number(record, REWARD_KEY, where) for _, where, record in ordered]


def _memory(ordered: Ordered) -> dict[str, tuple[list[int], list[float]]]:
    """Process -> (steps, MiB) of its readings in the records' ``rss_mib``, in step order; a reading step where a
    process read ``None`` or is missing is a gap (NaN: its line breaks there; steps without readings are not), and
    processes come in the order they are first read."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step, where, record in ordered:
        readings = record.get(MEMORY_KEY)
        if readings is None:
            continue
        if not isinstance(readings, Mapping):
            raise TypeError(
                f"'{where}[{MEMORY_KEY!r}]' must map each process to its MiB: got {type(readings).__name__}"
            )
        for process in readings:
            mib = record_number(readings, process, f"{where}[{MEMORY_KEY!r}]")
            steps, values = series.setdefault(str(process), ([], []))
            steps.append(step)
            values.append(mib if math.isfinite(mib) else math.nan)
        for process, (steps, values) in series.items():
            if process not in readings:
                steps.append(step)
                values.append(math.nan)
    return series


def _draw_memory(axes: Axes, memory: Mapping[str, tuple[list[int], list[float]]]) -> None:
    """One line per process of its resident MiB over the steps (:func:`_memory`)."""
    lines = colormaps["tab10"]  # distinct hues (tab20 pairs a dark with a light one)
    for index, (process, (at, mib)) in enumerate(memory.items()):
        axes.plot(at, mib, "o-", markersize=2.5, linewidth=1.2, label=process, color=lines(index % lines.N))
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="process")
    axes.set_ylabel("resident MiB")
    axes.set_xlabel(STEP_KEY)
    axes.grid(True, alpha=0.3)


def _reward_limits(axes: Axes, rewards: Sequence[float]) -> None:
    """y from 0 to ``max(1, max reward)`` (down to the lowest reward when one is negative)."""
    finite = [r for r in rewards if math.isfinite(r)]
    low, high = min([0.0, *finite]), max([1.0, *finite])
    pad = 0.02 * (high - low)
    axes.set_ylim(low - pad, high + pad)
    axes.set_ylabel(REWARD_KEY)
    axes.grid(True, alpha=0.3)


def _no_clock(axes: Axes) -> None:
    axes.text(0.5, 0.5, f"no {STEP_TIME_KEY} in records", ha="center", va="center", transform=axes.transAxes)


def _save(figure: Figure, path: PathLike, dpi: int) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=dpi)
    return out


def plot_run(
    records: Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    title: str | None = None,
    window: int = 5,
    dpi: int = 100,
) -> Path:
    """Write a PNG of a run: reward per step (top), stacked phase seconds per step (middle), each process's
    resident memory per step (below it, only when a record has ``rss_mib``), reward over wall-clock seconds
    (bottom).

    Top: ``reward_mean`` per step as points plus a trailing rolling mean over
    ``window`` steps; y spans 0 to ``max(1, max reward)`` (down to the lowest
    reward when one is negative). Middle: one stacked bar per step of its
    ``phase_<name>_s`` seconds, plus an ``other`` segment for the part of
    ``step_time_s`` no phase covers. Bottom: the same rewards and rolling mean
    at :func:`wall_clock` seconds (cumulative ``step_time_s``), to compare runs
    of different speeds. Memory: one line per process of the MiB its
    ``rss_mib`` readings give (``run.memory_every``), where a leak shows as a
    steady climb. Records are drawn in step order; a missing or ``None`` value
    is a gap.

    Args:
        records: the run's records, e.g. ``read_metrics(path)``.
        path: the PNG to write (parent folders are created).
        title: the figure's title, e.g. the run name.
        window: the rolling-mean window, in steps.
        dpi: resolution; the figure is 9 x 8 inches, 9 x 10.5 with the memory panel.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: ``records`` is not a sequence of mappings, ``window`` is not an int, a
            plotted value is not a number, or an ``rss_mib`` is not a mapping.
        ValueError: ``records`` is empty, a record lacks ``step`` or ``reward_mean``, or ``window`` < 1.

    Example:
        >>> plot_run(read_metrics("runs/demo/metrics.jsonl"), "runs/demo/run.png", title="demo")  # doctest: +SKIP
        PosixPath('runs/demo/run.png')
    """
    ordered = _ordered(records, "records", (STEP_KEY, REWARD_KEY))
    _check_window(window)
    steps = [step for step, _, _ in ordered]
    rewards = _rewards(ordered)
    rolling = _rolling_mean(rewards, window)
    clock = _clock(ordered)
    phases: list[str] = []
    for _, _, record in ordered:
        phases.extend(key for key in phase_keys(record) if key not in phases)
    seconds = {key: [record_number(record, key, where) for _, where, record in ordered] for key in phases}
    seconds = {key: [v if math.isfinite(v) else 0.0 for v in values] for key, values in seconds.items()}
    step_times = [record_number(record, STEP_TIME_KEY, where) for _, where, record in ordered]
    covered = [math.fsum(values) for values in zip(*seconds.values())] if phases else [0.0] * len(ordered)
    other = [max(0.0, total - done) if math.isfinite(total) else 0.0 for total, done in zip(step_times, covered)]
    memory = _memory(ordered)

    figure = Figure(figsize=(9, 10.5 if memory else 8), dpi=dpi, layout="constrained")
    panels = figure.subplots(4 if memory else 3, 1, height_ratios=[3, 2, 2.5, 3] if memory else [3, 2, 3])
    top, middle, bottom = panels[0], panels[1], panels[-1]
    FigureCanvasAgg(figure)
    middle.sharex(top)
    top.tick_params(labelbottom=False)

    top.plot(steps, rewards, "o", markersize=3, alpha=0.6, label=REWARD_KEY)
    top.plot(steps, rolling, "-", linewidth=2, label=f"rolling mean ({window} steps)")
    _reward_limits(top, rewards)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")

    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * (min(gaps) if gaps else 1.0)
    segments = [(phase_name(key), seconds[key]) for key in phases]
    if any(v > 0.0 for v in other):
        segments.append(("other", other))
    cmap = colormaps["tab20"]
    base = [0.0] * len(ordered)
    for index, (name, values) in enumerate(segments):
        middle.bar(steps, values, width=width, bottom=base, label=name, color=cmap(index % cmap.N))
        base = [b + v for b, v in zip(base, values)]
    if segments:
        middle.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="phase")
    else:
        middle.text(0.5, 0.5, "no phase timings in records", ha="center", va="center", transform=middle.transAxes)
    middle.set_ylabel("seconds")
    middle.grid(True, axis="y", alpha=0.3)
    if memory:
        middle.tick_params(labelbottom=False)
        panels[2].sharex(top)
        _draw_memory(panels[2], memory)
    else:
        middle.set_xlabel(STEP_KEY)

    bottom.plot(clock, rewards, "o", markersize=3, alpha=0.6, label=REWARD_KEY)
    bottom.plot(clock, rolling, "-", linewidth=2, label=f"rolling mean ({window} steps)")
    _reward_limits(bottom, rewards)
    bottom.set_xlabel(CLOCK_LABEL)
    if not any(math.isfinite(c) for c in clock):
        _no_clock(bottom)
    if title is not None:
        figure.suptitle(_wrapped(title))
    return _save(figure, path, dpi)


def plot_compare(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: PathLike,
    *,
    title: str | None = None,
    window: int = 5,
) -> Path:
    """Write a PNG comparing runs: reward per step (top) and over wall-clock seconds (bottom), one line per run.

    Each run is drawn as the trailing rolling mean of its ``reward_mean`` over
    ``window`` steps, in step order, against its steps (top) and against its
    :func:`wall_clock` seconds (bottom), e.g. a sync and an async run of the
    same config. Colours and the legend follow the order of ``runs``; within a
    run, the order of its records does not matter. A missing or ``None`` value
    is a gap. The figure is 9 x 7 inches at 100 dpi.

    Args:
        runs: run label -> that run's records, e.g. ``{"sync": read_metrics(a), "async": read_metrics(b)}``.
        path: the PNG to write (parent folders are created).
        title: the figure's title.
        window: the rolling-mean window, in steps.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: ``runs`` is not a mapping of str labels to sequences of record mappings, ``window`` is
            not an int, or a plotted value is not a number.
        ValueError: ``runs`` is empty, a label is empty, a run has no records or a record lacks ``step`` or
            ``reward_mean``, or ``window`` < 1.

    Example:
        >>> plot_compare({"sync": read_metrics("runs/sync/metrics.jsonl"),  # doctest: +SKIP
        ...               "async": read_metrics("runs/async/metrics.jsonl")}, "docs/img/sync_async.png")
        PosixPath('docs/img/sync_async.png')
    """
    if not isinstance(runs, Mapping):
        raise TypeError(f"'runs' must be a mapping of run label to records: got {type(runs).__name__}")
    if len(runs) == 0:
        raise ValueError("'runs' must hold at least one run to plot: got 0")
    for label in runs:
        if not isinstance(label, str):
            raise TypeError(f"'runs' labels must be str: got {type(label).__name__} {label!r}")
        if not label:
            raise ValueError("'runs' labels must be non-empty: got ''")
    ordered = {label: _ordered(records, f"runs[{label!r}]", (STEP_KEY, REWARD_KEY)) for label, records in runs.items()}
    _check_window(window)

    dpi = 100
    figure = Figure(figsize=(9, 7), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1)
    cmap = colormaps["tab10"]
    every: list[float] = []
    clocked = False
    for index, (label, run) in enumerate(ordered.items()):
        rewards = _rewards(run)
        rolling = _rolling_mean(rewards, window)
        clock = _clock(run)
        color = cmap(index % cmap.N)
        top.plot([step for step, _, _ in run], rolling, "-", linewidth=2, color=color, label=label)
        bottom.plot(clock, rolling, "-", linewidth=2, color=color, label=label)
        every += rewards
        clocked = clocked or any(math.isfinite(c) for c in clock)
    for axes in (top, bottom):
        _reward_limits(axes, every)
    top.set_xlabel(STEP_KEY)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
               title=f"rolling mean ({window} steps)")
    bottom.set_xlabel(CLOCK_LABEL)
    if not clocked:
        _no_clock(bottom)
    if title is not None:
        figure.suptitle(_wrapped(title))
    return _save(figure, path, dpi)


def _wrapped(title: object, width: int = 80) -> str:
    """``title`` with each line wrapped at ``width`` characters, so a long title stays inside the figure."""
    return "\n".join(textwrap.fill(line, width) for line in str(title).splitlines())
