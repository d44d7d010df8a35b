"""The run's progress display: a rich live bar on a terminal, one plain line per step elsewhere.

``RunProgress`` counts completed steps and shows each step record's
``reward_mean``, ``loss`` and ``step_time_s`` (records as :mod:`shell.run_log`
writes them).

Invariant: ``completed`` is ``start`` plus the steps advanced and never
exceeds ``total``; in plain mode each ``advance`` writes exactly one line,
and the display never changes a record.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from shell.run_log import LOSS_KEY, REWARD_KEY, STEP_TIME_KEY, record_number

__all__ = ["RunProgress"]


def _format(record: Mapping[str, Any], key: str, spec: str) -> str | None:
    """``record[key]`` formatted with ``spec``; ``None`` when absent or null."""
    value = record.get(key)
    if value is None:
        return None
    return format(record_number(record, key, "record"), spec)


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
