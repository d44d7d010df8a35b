"""Laws and error paths of ``shell.run_plot``: the run's figure."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from shell.run_log import phase_fields
from shell.run_plot import plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(n: int) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "reward_mean": step / (n + 1),
            "loss": -0.001 * step,
            **phase_fields({"rollout": 1.0 + step % 3, "train": 0.5}),
            "step_time_s": 4.0,
        }
        for step in range(1, n + 1)
    ]


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    """The plot is a PNG of 900 x 600 pixels (9 x 6 inches at 100 dpi) with real content."""
    path = plot_run(_records(30), tmp_path / "plots" / "run.png", title="gsm8k-demo")
    data = path.read_bytes()
    assert path == tmp_path / "plots" / "run.png"
    assert data[:8] == PNG_SIGNATURE
    assert struct.unpack(">II", data[16:24]) == (900, 600)
    assert len(data) > 10_000


def test_plot_run_draws_gaps_and_records_without_phases(tmp_path: Path) -> None:
    """Null rewards, a single record, or records without phase keys still give a PNG."""
    records = [{"step": 3, "reward_mean": None}, {"step": 1, "reward_mean": 0.5}, {"step": 7, "reward_mean": 1.5, "step_time_s": 2.0}]
    assert plot_run(records, tmp_path / "gaps.png").read_bytes()[:8] == PNG_SIGNATURE
    assert plot_run([{"step": 0, "reward_mean": -0.5}], tmp_path / "one.png").read_bytes()[:8] == PNG_SIGNATURE


def test_plot_run_rejects_empty_records(tmp_path: Path) -> None:
    """An empty run has nothing to plot and writes no file."""
    with pytest.raises(ValueError, match="'records' must hold at least one record to plot: got 0"):
        plot_run([], tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


def test_plot_run_rejects_records_without_step_or_reward(tmp_path: Path) -> None:
    """Every record needs step and reward_mean; the message names the record."""
    with pytest.raises(ValueError, match=r"'records\[1\]' must have a 'reward_mean' key"):
        plot_run([{"step": 1, "reward_mean": 0.5}, {"step": 2}], tmp_path / "run.png")
    with pytest.raises(ValueError, match=r"'records\[0\]' must have a 'step' key"):
        plot_run([{"reward_mean": 0.5}], tmp_path / "run.png")
    with pytest.raises(TypeError, match=r"'records\[0\]\['reward_mean'\]' must be a number: got str"):
        plot_run([{"step": 1, "reward_mean": "high"}], tmp_path / "run.png")
    with pytest.raises(ValueError, match="'window' must be >= 1 step: got 0"):
        plot_run(_records(3), tmp_path / "run.png", window=0)
    with pytest.raises(TypeError, match="'window' must be an int number of steps: got float"):
        plot_run(_records(3), tmp_path / "run.png", window=2.5)  # type: ignore[arg-type]
