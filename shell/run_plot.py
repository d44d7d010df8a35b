"""The run's figure (``reward.png``): reward per step over stacked phase seconds per step.

``plot_run`` reads records (as :mod:`shell.run_log` writes them) and draws
them on its own Agg canvas, never through ``pyplot``'s global state.

Invariant: the figure depends only on the records as a set: they are drawn
in step order whatever order they come in, a missing or ``None`` value is a
gap, and the records are never changed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shell.run_log import (
    REWARD_KEY,
    STEP_KEY,
    STEP_TIME_KEY,
    PathLike,
    phase_keys,
    phase_name,
    record_number,
    record_step,
)

__all__ = ["plot_run"]


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values, ignoring NaN (NaN when all are)."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(math.fsum(finite) / len(finite) if finite else math.nan)
    return out


def plot_run(
    records: Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    title: str | None = None,
    window: int = 5,
    dpi: int = 100,
) -> Path:
    """Write a PNG of a run: reward per step (top) and stacked phase seconds per step (bottom).

    Top: ``reward_mean`` per step as points plus a trailing rolling mean over
    ``window`` steps; y spans 0 to ``max(1, max reward)`` (down to the lowest
    reward when one is negative). Bottom: one stacked bar per step of its
    ``phase_<name>_s`` seconds, plus an ``other`` segment for the part of
    ``step_time_s`` no phase covers. Records are drawn in step order; a missing
    or ``None`` value is a gap.

    Args:
        records: the run's records, e.g. ``read_metrics(path)``.
        path: the PNG to write (parent folders are created).
        title: the figure's title, e.g. the run name.
        window: the rolling-mean window, in steps.
        dpi: resolution; the figure is 9 x 6 inches.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: ``records`` is not a sequence of mappings, ``window`` is not an int, or a
            plotted value is not a number.
        ValueError: ``records`` is empty, a record lacks ``step`` or ``reward_mean``, or ``window`` < 1.

    Example:
        >>> plot_run(read_metrics("runs/demo/metrics.jsonl"), "runs/demo/run.png", title="demo")  # doctest: +SKIP
        PosixPath('runs/demo/run.png')
    """
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise TypeError(f"'records' must be a sequence of record mappings: got {type(records).__name__}")
    if len(records) == 0:
        raise ValueError("'records' must hold at least one record to plot: got 0")
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"'window' must be an int number of steps: got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"'window' must be >= 1 step: got {window}")
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"'records[{i}]' must be a mapping: got {type(record).__name__}")
        for key in (STEP_KEY, REWARD_KEY):
            if key not in record:
                raise ValueError(f"'records[{i}]' must have a '{key}' key: got keys {sorted(record)}")
    ordered = sorted(
        (record_step(record, f"records[{i}]"), f"records[{i}]", record) for i, record in enumerate(records)
    )
    steps = [step for step, _, _ in ordered]
    rewards = [record_number(record, REWARD_KEY, where) for _, where, record in ordered]
    phases: list[str] = []
    for _, _, record in ordered:
        phases.extend(key for key in phase_keys(record) if key not in phases)
    seconds = {key: [record_number(record, key, where) for _, where, record in ordered] for key in phases}
    seconds = {key: [v if math.isfinite(v) else 0.0 for v in values] for key, values in seconds.items()}
    step_times = [record_number(record, STEP_TIME_KEY, where) for _, where, record in ordered]
    covered = [math.fsum(values) for values in zip(*seconds.values())] if phases else [0.0] * len(ordered)
    other = [max(0.0, total - done) if math.isfinite(total) else 0.0 for total, done in zip(step_times, covered)]

    figure = Figure(figsize=(9, 6), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)

    top.plot(steps, rewards, "o", markersize=3, alpha=0.6, label=REWARD_KEY)
    top.plot(steps, _rolling_mean(rewards, window), "-", linewidth=2, label=f"rolling mean ({window} steps)")
    finite = [r for r in rewards if math.isfinite(r)]
    low, high = min([0.0, *finite]), max([1.0, *finite])
    pad = 0.02 * (high - low)
    top.set_ylim(low - pad, high + pad)
    top.set_ylabel(REWARD_KEY)
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")

    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * (min(gaps) if gaps else 1.0)
    segments = [(phase_name(key), seconds[key]) for key in phases]
    if any(v > 0.0 for v in other):
        segments.append(("other", other))
    cmap = colormaps["tab20"]
    base = [0.0] * len(ordered)
    for index, (name, values) in enumerate(segments):
        bottom.bar(steps, values, width=width, bottom=base, label=name, color=cmap(index % cmap.N))
        base = [b + v for b, v in zip(base, values)]
    if segments:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="phase")
    else:
        bottom.text(0.5, 0.5, "no phase timings in records", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylabel("seconds")
    bottom.set_xlabel(STEP_KEY)
    bottom.grid(True, axis="y", alpha=0.3)
    if title is not None:
        figure.suptitle(str(title))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi)
    return path
