"""The run's per-step record and its JSON-lines metrics file (``metrics.jsonl``).

One training step produces one flat record (a mapping of str to JSON values):

  * ``step``: int, the step number; it strictly increases within one metrics
    file, also across runs that append to it (``--resume``);
  * ``reward_mean``, ``loss``, ...: scalars (numpy / torch scalars become
    ``float`` / ``int``; NaN and +-inf become ``null``, since JSON has no NaN);
  * ``phase_<name>_s``: seconds spent in phase ``<name>`` (``phase_fields``
    builds these from ``PhaseTimer.durations()``), and ``step_time_s``: the
    step's wall seconds.

``MetricsLog`` appends records, ``read_metrics`` reads them back and
``keep_steps_through`` cuts a file back to a checkpoint's step;
``record_step`` and ``record_number`` read one field of a record. The figure
is :mod:`shell.run_plot`, the progress display :mod:`shell.run_progress`.

Invariant: ``read_metrics(path)`` returns exactly the records written, with
every value made JSON-ready, in step order.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np
import torch

PHASE_PREFIX = "phase_"
PHASE_SUFFIX = "_s"
STEP_KEY = "step"
STEP_TIME_KEY = "step_time_s"
REWARD_KEY = "reward_mean"
MEMORY_KEY = "rss_mib"
"""Every ``run.memory_every`` steps: each process's resident memory in MiB, by process (``GRPOTrainer.resident_memory``)."""
MEMORY_ERROR_KEY = "rss_error"
"""On a reading step whose reading failed (a process did not answer, e.g. it died after the step finished), in
place of ``rss_mib``: why. The step itself finished; its record stands."""
RISING_KEY = "rss_rising"
"""On a reading step: the processes whose memory grows faster than ``run.memory_rise_limit`` over their last
``run.memory_rise_window`` readings, each with its growth in MiB per 100 steps (:func:`core.memory_trend.rising`)."""
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


def record_step(record: Mapping[str, Any], where: str) -> int:
    """``record["step"]`` as an int >= 0; errors name the record as ``where``."""
    if STEP_KEY not in record:
        raise ValueError(f"'{where}' must have an int '{STEP_KEY}': got keys {sorted(record)}")
    step = record[STEP_KEY]
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral):
        raise TypeError(f"'{STEP_KEY}' in '{where}' must be an int: got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"'{STEP_KEY}' in '{where}' must be >= 0: got {step}")
    return int(step)


def record_number(record: Mapping[str, Any], key: str, where: str) -> float:
    """``record[key]`` as a float; missing or ``None`` reads as NaN; not a number: ``TypeError`` naming ``where``."""
    value = record.get(key)
    if value is None:
        return math.nan
    if isinstance(value, (bool, str)) or not isinstance(value, (numbers.Real, np.generic, np.ndarray, torch.Tensor)):
        raise TypeError(f"'{where}[{key!r}]' must be a number: got {type(value).__name__}")
    return float(value)


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
    kept = [r for i, r in enumerate(records) if record_step(r, f"{path} record {i}") <= last_step]
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
            steps = [record_step(record, f"{self._path} record {i}") for i, record in enumerate(records)]
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
        step = record_step(record, "record")
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
