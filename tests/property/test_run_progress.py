"""Laws and error paths of ``shell.run_progress``: the live bar and the plain lines."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from shell.run_progress import RunProgress


def _plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def _output(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def test_run_progress_plain_prints_one_line_per_step() -> None:
    """Plain mode prints exactly one line per advance, with the step count, reward, loss and step time."""
    console = _plain_console()
    records = [
        {"step": 1, "reward_mean": 0.4124, "loss": -0.0012, "step_time_s": 1.234},
        {"step": 2, "reward_mean": 0.5},
        {"step": 3, "reward_mean": None, "step_time_s": 2.0},
    ]
    with RunProgress(total=60, console=console) as progress:
        assert progress.mode == "plain"
        for record in records:
            progress.advance(record)
    lines = _output(console).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/60 reward 0.412 loss -0.0012 step 1.23s elapsed ")
    assert lines[1].startswith("step 2/60 reward 0.500 elapsed ")
    assert lines[2].startswith("step 3/60 step 2.00s elapsed ")
    assert all(" eta " in line for line in lines)
    assert progress.completed == 3


def test_run_progress_counts_from_start_on_resume() -> None:
    """With start=k the first advance shows step k+1."""
    console = _plain_console()
    progress = RunProgress(total=10, start=4, console=console)
    progress.advance({"step": 5, "reward_mean": torch.tensor(0.25)})
    assert _output(console).startswith("step 5/10 reward 0.250 ")


def test_run_progress_picks_live_bar_only_on_terminal() -> None:
    """The default is a live bar on a terminal and plain lines elsewhere; enabled=False or plain=True force plain."""
    terminal = Console(file=io.StringIO(), force_terminal=True, width=200)
    assert RunProgress(5, console=terminal).mode == "live"
    assert RunProgress(5, console=terminal, enabled=False).mode == "plain"
    assert RunProgress(5, console=terminal, plain=True).mode == "plain"
    assert RunProgress(5, console=_plain_console()).mode == "plain"
    assert RunProgress(5, console=_plain_console(), plain=False).mode == "live"


def test_run_progress_live_bar_shows_last_record() -> None:
    """The live bar's final render shows the step count, the last reward and step time."""
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    with RunProgress(total=2, console=console) as progress:
        progress.advance({"step": 1, "reward_mean": 0.1, "step_time_s": 3.0})
        progress.advance({"step": 2, "reward_mean": 0.4124, "step_time_s": 1.234})
    output = _output(console)
    assert "step 2/2" in output and "reward 0.412" in output and "1.23 s/step" in output


def test_run_progress_rejects_advance_past_total() -> None:
    """Advancing more than total steps raises."""
    progress = RunProgress(total=1, console=_plain_console())
    progress.advance({"step": 1})
    with pytest.raises(ValueError, match="'advance' called for step 2: expected at most 'total'=1 steps"):
        progress.advance({"step": 2})


def test_run_progress_rejects_bad_arguments() -> None:
    """total must be an int >= 1, start in [0, total], records mappings with numeric fields."""
    with pytest.raises(ValueError, match="'total' must be >= 1 step: got 0"):
        RunProgress(total=0)
    with pytest.raises(ValueError, match=r"'start' must be in \[0, total=5\]: got 6"):
        RunProgress(total=5, start=6)
    with pytest.raises(TypeError, match="'total' must be an int: got float"):
        RunProgress(total=5.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'console' must be a rich.console.Console"):
        RunProgress(total=5, console=io.StringIO())  # type: ignore[arg-type]
    progress = RunProgress(total=5, console=_plain_console())
    with pytest.raises(TypeError, match="'record' must be a mapping"):
        progress.advance(0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'record\['reward_mean'\]' must be a number: got str"):
        progress.advance({"step": 1, "reward_mean": "good"})
    assert progress.completed == 0
