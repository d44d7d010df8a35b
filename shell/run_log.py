"""The run's per-step record: a JSON-lines metrics file, its plot and a progress display.

One training step produces one flat record (a mapping of str to JSON values):

  * ``step``: int, the step number; it strictly increases within one metrics
    file, also across runs that append to it (``--resume``);
  * ``reward_mean``, ``loss``, ...: scalars (numpy / torch scalars become
    ``float`` / ``int``; NaN and +-inf become ``null``, since JSON has no NaN);
  * ``phase_<name>_s``: seconds spent in phase ``<name>`` (``phase_fields``
    builds these from ``PhaseTimer.durations()``), and ``step_time_s``: the
    step's wall seconds.

``MetricsLog`` appends records, ``read_metrics`` reads them back,
``plot_run`` draws reward and phase times per step, and ``RunProgress``
shows a live bar on a terminal and one plain line per step elsewhere.

Invariant: ``read_metrics(path)`` returns exactly the records written, with
every value made JSON-ready, in step order.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

PHASE_PREFIX = "phase_"
PHASE_SUFFIX = "_s"
STEP_KEY = "step"
STEP_TIME_KEY = "step_time_s"
REWARD_KEY = "reward_mean"
LOSS_KEY = "loss"

Record = dict[str, Any]  # one step: str -> JSON value (None, bool, int, float, str, list, dict)
PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------- record keys


def phase_fields(durations: Mapping[str, float]) -> dict[str, float]:
    """The flat record keys for per-phase seconds: ``{"rollout": 1.5} -> {"phase_rollout_s": 1.5}``.

    Args:
        durations: phase name -> seconds, e.g. ``PhaseTimer.durations()``.

    Returns:
        A new dict, in the order of ``durations``.

    Raises:
        TypeError: a name is not a string or a value is not a real number.
        ValueError: a name is empty.

    Example:
        >>> phase_fields({"rollout": 1.5, "train": 0.25})
        {'phase_rollout_s': 1.5, 'phase_train_s': 0.25}
    """
    if not isinstance(durations, Mapping):
        raise TypeError(f"'durations' must be a mapping of phase name to seconds: got {type(durations).__name__}")
    fields: dict[str, float] = {}
    for name, seconds in durations.items():
        if not isinstance(name, str):
            raise TypeError(f"'durations' keys must be phase names (str): got {type(name).__name__} {name!r}")
        if not name:
            raise ValueError("'durations' keys must be non-empty phase names: got ''")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            raise TypeError(f"'durations[{name!r}]' must be seconds (a real number): got {type(seconds).__name__}")
        fields[f"{PHASE_PREFIX}{name}{PHASE_SUFFIX}"] = float(seconds)
    return fields


def _is_phase_key(key: object) -> bool:
    return (
        isinstance(key, str)
        and key.startswith(PHASE_PREFIX)
        and key.endswith(PHASE_SUFFIX)
        and len(key) > len(PHASE_PREFIX) + len(PHASE_SUFFIX)
    )


def phase_keys(record: Mapping[str, Any]) -> list[str]:
    """The ``phase_<name>_s`` keys of ``record``, in the record's order.

    Args:
        record: one step's record.

    Returns:
        The keys naming per-phase seconds (``step_time_s`` is not one).

    Raises:
        TypeError: ``record`` is not a mapping.

    Example:
        >>> phase_keys({"step": 3, "phase_rollout_s": 1.5, "step_time_s": 2.0})
        ['phase_rollout_s']
    """
    if not isinstance(record, Mapping):
        raise TypeError(f"'record' must be a mapping of str to values: got {type(record).__name__}")
    return [key for key in record if _is_phase_key(key)]


def phase_name(key: str) -> str:
    """The phase name inside a ``phase_<name>_s`` key (the inverse of ``phase_fields``).

    Args:
        key: a key such as ``"phase_rollout_s"``.

    Returns:
        The name, e.g. ``"rollout"``.

    Raises:
        ValueError: ``key`` is not of the form ``phase_<name>_s``.

    Example:
        >>> phase_name("phase_old_logprob_s")
        'old_logprob'
    """
    if not _is_phase_key(key):
        raise ValueError(f"'key' must be of the form '{PHASE_PREFIX}<name>{PHASE_SUFFIX}': got {key!r}")
    return key[len(PHASE_PREFIX) : -len(PHASE_SUFFIX)]


# ---------------------------------------------------------------- JSON values


def _json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON data; non-finite floats become ``None``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (np.ndarray, torch.Tensor)):
        size = value.size if isinstance(value, np.ndarray) else value.numel()
        if size != 1:
            raise TypeError(
                f"'{where}' must be a scalar: got a {type(value).__name__} of shape {tuple(value.shape)}; "
                "log a reduction such as .mean() or a list"
            )
        return _json_value(value.item(), where)
    if isinstance(value, np.generic):  # np.bool_, np.float16, ...: the matching Python scalar
        return _json_value(value.item(), where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"'{where}' keys must be str: got {type(key).__name__} {key!r}")
            out[key] = _json_value(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_json_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"'{where}' must be JSON data (None, bool, int, float, str, list, dict, or a numpy/torch scalar): "
        f"got {type(value).__name__}"
    )


def _step_of(record: Mapping[str, Any], where: str) -> int:
    if STEP_KEY not in record:
        raise ValueError(f"'{where}' must have an int '{STEP_KEY}': got keys {sorted(record)}")
    step = record[STEP_KEY]
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral):
        raise TypeError(f"'{STEP_KEY}' in '{where}' must be an int: got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"'{STEP_KEY}' in '{where}' must be >= 0: got {step}")
    return int(step)


def _parse_lines(text: str, path: Path) -> list[Record]:
    records: list[Record] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"'{path}' line {number} must be one JSON object: {error.msg} (got {line[:80]!r})") from None
        if not isinstance(record, dict):
            raise ValueError(f"'{path}' line {number} must be one JSON object: got {type(record).__name__}")
        records.append(record)
    return records


def read_metrics(path: PathLike) -> list[Record]:
    """Read a metrics file: one record per non-blank line, in file order.

    Args:
        path: a JSON-lines file, e.g. written by ``MetricsLog``.

    Returns:
        The records; NaN / inf were written as ``None`` and read back as ``None``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not one JSON object (the message names the line number).

    Example:
        >>> read_metrics("runs/gsm8k/metrics.jsonl")[-1]["step"]  # doctest: +SKIP
        60
    """
    path = Path(path)
    return _parse_lines(path.read_text(encoding="utf-8"), path)


# ---------------------------------------------------------------- the metrics file


def keep_steps_through(path: PathLike, last_step: int) -> int:
    """Rewrite the JSON-lines file ``path`` keeping only its records with ``step <= last_step`` (``--resume``).

    Used for ``metrics.jsonl`` and ``samples.jsonl``, so that a run resumed from
    the checkpoint of step ``last_step`` logs the later steps once. The file is
    replaced atomically, and only when a record is dropped.

    Args:
        path: the file; a missing file is left missing.
        last_step: the last step to keep.

    Returns:
        How many records were dropped.

    Raises:
        TypeError: ``last_step`` is not an int, or a record's ``step`` is not an int.
        ValueError: a line is not one JSON object, or a record has no ``step``.

    Example:
        >>> keep_steps_through("runs/demo/samples.jsonl", 40)  # doctest: +SKIP
        16
    """
    if isinstance(last_step, bool) or not isinstance(last_step, numbers.Integral):
        raise TypeError(f"'last_step' must be an int step: got {type(last_step).__name__}")
    path = Path(path)
    if not path.exists():
        return 0
    records = _parse_lines(path.read_text(encoding="utf-8"), path)
    kept = [r for i, r in enumerate(records) if _step_of(r, f"{path} record {i}") <= last_step]
    if len(kept) < len(records):
        scratch = path.with_name(path.name + ".tmp")
        with scratch.open("w", encoding="utf-8") as file:
            for record in kept:
                file.write(json.dumps(record, allow_nan=False) + "\n")
        os.replace(scratch, path)
    return len(records) - len(kept)




class MetricsLog:
    """Append-only JSON-lines metrics file, one record per step, flushed on every write.

    Opening an existing file appends to it (``--resume``): the last step
    already in the file is read so steps keep strictly increasing.

    Args:
        path: the file; its parent folders are created.
        drop_after: on resume from a checkpoint of step ``k``, pass ``k``: records
            with ``step > k`` (logged after the checkpoint, before a crash) are
            removed from the file first, so the resumed run can log them again.
            ``None`` keeps every record.

    Raises:
        ValueError: the existing file has a bad line, or a record without an int ``step``.

    Example:
        >>> with MetricsLog("runs/demo/metrics.jsonl") as log:  # doctest: +SKIP
        ...     log.write({"step": 1, "reward_mean": 0.25, **phase_fields(timer.durations())})
    """

    def __init__(self, path: PathLike, *, drop_after: int | None = None) -> None:
        if drop_after is not None and (isinstance(drop_after, bool) or not isinstance(drop_after, numbers.Integral)):
            raise TypeError(f"'drop_after' must be an int step or None: got {type(drop_after).__name__}")
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._last_step: int | None = None
        needs_newline = False
        if drop_after is not None:
            keep_steps_through(self._path, drop_after)
        if self._path.exists():
            text = self._path.read_text(encoding="utf-8")
            records = _parse_lines(text, self._path)
            steps = [_step_of(record, f"{self._path} record {i}") for i, record in enumerate(records)]
            needs_newline = bool(text) and not text.endswith("\n")
            self._last_step = steps[-1] if steps else None
        self._file: TextIO | None = self._path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")
            self._file.flush()

    @property
    def path(self) -> Path:
        """The metrics file."""
        return self._path

    @property
    def last_step(self) -> int | None:
        """The step of the last record in the file, or ``None`` for an empty file."""
        return self._last_step

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._file is None

    def write(self, record: Mapping[str, Any]) -> Record:
        """Append ``record`` as one JSON line and flush it.

        Args:
            record: str -> JSON data or numpy / torch scalars, with an int
                ``step`` greater than every step already in the file.

        Returns:
            The line written, as a dict: ``step`` first, scalars as Python
            numbers, NaN / inf as ``None``.

        Raises:
            TypeError: ``record`` is not a mapping, ``step`` is not an int, or a
                value is not JSON data (the message names the key).
            ValueError: ``step`` is missing or not greater than the previous
                step, or the log is closed.

        Example:
            >>> log.write({"step": 2, "loss": torch.tensor(float("nan"))})  # doctest: +SKIP
            {'step': 2, 'loss': None}
        """
        if self._file is None:
            raise ValueError(f"'MetricsLog' for {str(self._path)!r} is closed: open a new MetricsLog to append")
        if not isinstance(record, Mapping):
            raise TypeError(f"'record' must be a mapping of str to values: got {type(record).__name__}")
        step = _step_of(record, "record")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"'{STEP_KEY}' must strictly increase in {str(self._path)!r}: expected > {self._last_step}, got {step}"
            )
        rest = _json_value({k: v for k, v in record.items() if k != STEP_KEY}, "record")
        line: Record = {STEP_KEY: step, **rest}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()
        self._last_step = step
        return line

    def close(self) -> None:
        """Close the file; closing twice is a no-op."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()


# ---------------------------------------------------------------- the plot


def _number(record: Mapping[str, Any], key: str, where: str) -> float:
    """``record[key]`` as a float; missing or ``None`` reads as NaN."""
    value = record.get(key)
    if value is None:
        return math.nan
    if isinstance(value, (bool, str)) or not isinstance(value, (numbers.Real, np.generic, np.ndarray, torch.Tensor)):
        raise TypeError(f"'{where}[{key!r}]' must be a number: got {type(value).__name__}")
    return float(value)


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
    ordered = sorted((_step_of(record, f"records[{i}]"), f"records[{i}]", record) for i, record in enumerate(records))
    steps = [step for step, _, _ in ordered]
    rewards = [_number(record, REWARD_KEY, where) for _, where, record in ordered]
    phases: list[str] = []
    for _, _, record in ordered:
        phases.extend(key for key in phase_keys(record) if key not in phases)
    seconds = {key: [_number(record, key, where) for _, where, record in ordered] for key in phases}
    seconds = {key: [v if math.isfinite(v) else 0.0 for v in values] for key, values in seconds.items()}
    step_times = [_number(record, STEP_TIME_KEY, where) for _, where, record in ordered]
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


# ---------------------------------------------------------------- progress display


def _format(record: Mapping[str, Any], key: str, spec: str) -> str | None:
    """``record[key]`` formatted with ``spec``; ``None`` when absent or null."""
    value = record.get(key)
    if value is None:
        return None
    return format(_number(record, key, "record"), spec)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


class RunProgress:
    """Progress over a run's steps: a rich live bar on a terminal, one plain line per step elsewhere.

    Each ``advance(record)`` counts one completed step and shows its
    ``reward_mean`` (3 decimals), ``loss`` and ``step_time_s``. Plain mode
    prints, per step, e.g. ``step 12/60 reward 0.412 loss -0.0012 step 1.23s
    elapsed 0:00:15 eta 0:01:00``, so CI logs and files stay readable.

    Args:
        total: the run's number of steps.
        start: steps already completed before this process (``--resume``).
        enabled: ``False`` never shows the live bar (plain lines instead).
        console: where to write; a stdout ``Console`` if ``None``.
        plain: ``None`` (default) picks the live bar when ``console.is_terminal``
            and plain lines otherwise; ``True`` / ``False`` forces one.

    Raises:
        TypeError: ``total`` or ``start`` is not an int.
        ValueError: ``total`` < 1 or ``start`` is not in ``[0, total]``.

    Example:
        >>> with RunProgress(total=60) as progress:  # doctest: +SKIP
        ...     for step in range(1, 61):
        ...         progress.advance(log.write({"step": step, **train_step()}))
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        enabled: bool = True,
        console: Console | None = None,
        plain: bool | None = None,
    ) -> None:
        for name, value in (("total", total), ("start", start)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"'{name}' must be an int: got {type(value).__name__}")
        if total < 1:
            raise ValueError(f"'total' must be >= 1 step: got {total}")
        if not 0 <= start <= total:
            raise ValueError(f"'start' must be in [0, total={total}]: got {start}")
        if console is not None and not isinstance(console, Console):
            raise TypeError(f"'console' must be a rich.console.Console or None: got {type(console).__name__}")
        self._total = int(total)
        self._start = int(start)
        self._done = int(start)
        self._console = console if console is not None else Console()
        self._live = bool(enabled) and (plain is False or (plain is None and self._console.is_terminal))
        self._began = time.monotonic()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self._live:
            self._progress = Progress(
                TextColumn("step {task.fields[done]}/{task.fields[steps]}"),
                BarColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("{task.fields[step_time]} s/step"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self._console,
                speed_estimate_period=7 * 24 * 3600.0,  # average over the whole run: steps take minutes
            )
            self._task = self._progress.add_task(
                "run", total=self._total, completed=self._start, done=self._start, steps=self._total, reward="-", step_time="-"
            )

    @property
    def mode(self) -> str:
        """``"live"`` (rich bar) or ``"plain"`` (one line per step)."""
        return "live" if self._live else "plain"

    @property
    def completed(self) -> int:
        """Steps completed, ``start`` included."""
        return self._done

    def advance(self, record: Mapping[str, Any]) -> None:
        """Count one completed step and show ``record``'s reward, loss and step time.

        Args:
            record: the step's record (missing or ``None`` fields show as ``-`` or are left out).

        Raises:
            TypeError: ``record`` is not a mapping, or a shown field is not a number.
            ValueError: all ``total`` steps are already completed.

        Example:
            >>> RunProgress(2, plain=True).advance({"step": 1, "reward_mean": 0.5})  # doctest: +SKIP
            step 1/2 reward 0.500 ...
        """
        if not isinstance(record, Mapping):
            raise TypeError(f"'record' must be a mapping of str to values: got {type(record).__name__}")
        if self._done >= self._total:
            raise ValueError(f"'advance' called for step {self._done + 1}: expected at most 'total'={self._total} steps")
        reward = _format(record, REWARD_KEY, ".3f")
        loss = _format(record, LOSS_KEY, ".4g")
        step_time = _format(record, STEP_TIME_KEY, ".2f")
        self._done += 1
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, advance=1, done=self._done, reward=reward or "-", step_time=step_time or "-"
            )
            return
        parts = [f"step {self._done}/{self._total}"]
        if reward is not None:
            parts.append(f"reward {reward}")
        if loss is not None:
            parts.append(f"loss {loss}")
        if step_time is not None:
            parts.append(f"step {step_time}s")
        elapsed = time.monotonic() - self._began
        parts.append(f"elapsed {_clock(elapsed)}")
        parts.append(f"eta {_clock(elapsed / (self._done - self._start) * (self._total - self._done))}")
        self._console.out(" ".join(parts), highlight=False)

    def close(self) -> None:
        """Stop the live bar (leaving its last state on screen); a no-op in plain mode or when closed."""
        if self._progress is not None:
            self._progress.stop()

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()
