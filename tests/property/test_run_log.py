"""Laws and error paths of ``shell.phases`` and ``shell.run_log``: phase timing, record keys and the metrics file."""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shell.phases import PhaseTimer
from shell.run_log import (
    MetricsLog,
    keep_steps_through,
    phase_fields,
    phase_keys,
    phase_name,
    read_metrics,
    record_number,
    record_step,
)
from tests.property.strategies import keys, reward_values


class FakeClock:
    """A clock that advances by the given ticks, one per call."""

    def __init__(self, *ticks: float) -> None:
        self._ticks: Iterator[float] = iter(ticks)
        self.now = 0.0

    def __call__(self) -> float:
        self.now += next(self._ticks)
        return self.now


# ---------------------------------------------------------------- PhaseTimer


def test_phase_timer_accumulates_per_phase_in_first_use_order() -> None:
    """Each phase's total is the sum of its blocks' clock deltas; keys keep first-use order."""
    timer = PhaseTimer(clock=FakeClock(0.0, 2.0, 0.0, 0.5, 0.0, 3.0))
    with timer.phase("train"):
        pass
    with timer.phase("rollout"):
        pass
    with timer.phase("train"):
        pass
    assert timer.durations() == {"train": 5.0, "rollout": 0.5}
    assert list(timer.durations()) == ["train", "rollout"]


def test_phase_timer_measures_wall_time_with_perf_counter() -> None:
    """With the default clock a sleeping phase lasts at least the sleep."""
    timer = PhaseTimer()
    with timer.phase("sleep"):
        time.sleep(0.01)
    assert timer.durations()["sleep"] >= 0.01


def test_phase_timer_records_time_when_block_raises() -> None:
    """A phase whose block raises is still counted, and the exception propagates."""
    timer = PhaseTimer(clock=FakeClock(0.0, 1.5))
    with pytest.raises(KeyError, match="boom"), timer.phase("rollout"):
        raise KeyError("boom")
    assert timer.durations() == {"rollout": 1.5}
    assert timer.running is None


def test_phase_timer_rejects_nested_phase() -> None:
    """Entering a phase inside another raises; the outer phase is still counted and the timer stays usable."""
    timer = PhaseTimer(clock=FakeClock(0.0, 1.0, 0.0, 2.0))
    with pytest.raises(ValueError, match="'train' cannot start while phase 'rollout' is running"), timer.phase("rollout"):
        with timer.phase("train"):
            pass
    assert timer.durations() == {"rollout": 1.0}
    with timer.phase("train"):
        pass
    assert timer.durations() == {"rollout": 1.0, "train": 2.0}


def test_phase_timer_rejects_bad_names() -> None:
    """A non-string or empty phase name is refused before any timing starts."""
    timer = PhaseTimer()
    with pytest.raises(TypeError, match="'name' must be a str: got int"), timer.phase(3):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="'name' must be a non-empty"), timer.phase(""):
        pass
    assert timer.durations() == {}


def test_phase_timer_reset_forgets_totals() -> None:
    """After reset the timer holds no phase, and durations() returned earlier are unaffected copies."""
    timer = PhaseTimer(clock=FakeClock(0.0, 1.0))
    with timer.phase("rollout"):
        pass
    before = timer.durations()
    before["rollout"] = 99.0
    assert timer.durations() == {"rollout": 1.0}
    timer.reset()
    assert timer.durations() == {}


def test_phase_timer_reset_rejects_running_phase() -> None:
    """reset() inside a phase raises rather than losing the running phase's time."""
    timer = PhaseTimer(clock=FakeClock(0.0, 1.0))
    with timer.phase("rollout"):
        with pytest.raises(ValueError, match="'reset' cannot run while phase 'rollout' is running"):
            timer.reset()
    assert timer.durations() == {"rollout": 1.0}


def test_phase_timer_rejects_non_callable_clock() -> None:
    """The clock must be callable."""
    with pytest.raises(TypeError, match="'clock' must be a callable"):
        PhaseTimer(clock=1.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- record keys


@given(name=keys, seconds=reward_values)
def test_phase_fields_round_trip_through_phase_name(name: str, seconds: float) -> None:
    """phase_fields builds one phase key per phase; phase_keys finds it and phase_name inverts it."""
    fields = phase_fields({name: seconds})
    record = {"step": 1, "step_time_s": 2.0, **fields}
    assert phase_keys(record) == list(fields)
    assert [phase_name(key) for key in phase_keys(record)] == [name]
    assert fields[f"phase_{name}_s"] == float(seconds)


def test_phase_fields_rejects_bad_durations() -> None:
    """Non-string names, empty names and non-numeric seconds are refused."""
    with pytest.raises(TypeError, match="'durations' keys must be phase names"):
        phase_fields({1: 2.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'durations' keys must be non-empty"):
        phase_fields({"": 2.0})
    with pytest.raises(TypeError, match=r"'durations\['train'\]' must be seconds"):
        phase_fields({"train": "2s"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'durations' must be a mapping"):
        phase_fields([("train", 2.0)])  # type: ignore[arg-type]


def test_phase_keys_ignores_non_phase_keys() -> None:
    """step_time_s, an empty phase name and unrelated keys are not phase keys; record order is kept."""
    record = {"phase_b_s": 1.0, "step_time_s": 3.0, "phase__s": 0.0, "phase_a": 1.0, "reward_mean": 0.5, "phase_a_s": 2.0}
    assert phase_keys(record) == ["phase_b_s", "phase_a_s"]


def test_phase_keys_rejects_non_mapping() -> None:
    """phase_keys needs a mapping."""
    with pytest.raises(TypeError, match="'record' must be a mapping"):
        phase_keys(["phase_a_s"])  # type: ignore[arg-type]


def test_phase_name_rejects_non_phase_key() -> None:
    """phase_name refuses keys outside the phase_<name>_s convention."""
    with pytest.raises(ValueError, match="'key' must be of the form 'phase_<name>_s': got 'step_time_s'"):
        phase_name("step_time_s")


def test_record_step_and_record_number_read_one_field() -> None:
    """record_step gives the int step; record_number gives a float, NaN for a missing or null value."""
    record = {"step": np.int64(3), "loss": np.float32(0.5), "kl": torch.tensor(2.0), "reward_mean": None}
    assert record_step(record, "record") == 3 and type(record_step(record, "record")) is int
    assert record_number(record, "loss", "record") == 0.5
    assert record_number(record, "kl", "record") == 2.0
    assert math.isnan(record_number(record, "reward_mean", "record"))
    assert math.isnan(record_number(record, "absent", "record"))


def test_record_step_and_record_number_reject_bad_fields() -> None:
    """A missing, non-int or negative step, or a non-number field, raises naming the record."""
    with pytest.raises(ValueError, match=r"'records\[2\]' must have an int 'step': got keys \['loss'\]"):
        record_step({"loss": 1.0}, "records[2]")
    with pytest.raises(TypeError, match="'step' in 'record' must be an int: got bool True"):
        record_step({"step": True}, "record")
    with pytest.raises(ValueError, match="'step' in 'record' must be >= 0: got -1"):
        record_step({"step": -1}, "record")
    with pytest.raises(TypeError, match=r"'record\['loss'\]' must be a number: got str"):
        record_number({"loss": "low"}, "loss", "record")


# ---------------------------------------------------------------- MetricsLog and read_metrics


@given(reward=reward_values, loss=reward_values)
def test_metrics_log_round_trips_through_read_metrics(reward: float, loss: float) -> None:
    """read_metrics returns exactly the lines write returned, in order."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        with MetricsLog(path) as log:
            written = [
                log.write({"step": 1, "reward_mean": reward, "loss": loss, "tags": {"split": "train"}}),
                log.write({"step": 5, "reward_mean": loss, "lengths": [1, 2, 3]}),
            ]
        assert read_metrics(path) == written
        assert written[0] == {"step": 1, "reward_mean": float(reward), "loss": float(loss), "tags": {"split": "train"}}


def test_metrics_log_takes_any_metric_key_such_as_the_async_ones() -> None:
    """The record has no list of known keys: async GRPO's per-step metrics are written and read back as given."""
    record = {"step": 1, "version_lag_mean": 0.5, "version_lag_max": 1, "buffer_groups": 64, "groups_evicted": 0,
              "trainer_wait_s": 0.25, "collector_wait_s": 1.5, "generated_tokens_per_s": 812.5,
              "zero_variance_group_frac": 0.125, "entropy": 1.75}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        with MetricsLog(path) as log:
            assert log.write({**record, "buffer_groups": np.int64(64), "entropy": torch.tensor(1.75)}) == record
        assert read_metrics(path) == [record]


def test_metrics_log_converts_numpy_and_torch_scalars() -> None:
    """numpy and torch scalars are written as plain ints, floats and bools."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        with MetricsLog(path) as log:
            line = log.write(
                {
                    "step": np.int64(3),
                    "reward_mean": np.float32(0.5),
                    "loss": torch.tensor(-0.25),
                    "tokens": torch.tensor([7]),
                    "kept": np.bool_(True),
                    "count": np.int32(4),
                }
            )
        assert line == {"step": 3, "reward_mean": 0.5, "loss": -0.25, "tokens": 7, "kept": True, "count": 4}
        assert [type(v) for v in line.values()] == [int, float, float, int, bool, int]
        assert read_metrics(path) == [line]


def test_metrics_log_writes_nan_and_inf_as_null() -> None:
    """Non-finite floats (Python, numpy or torch) become JSON null, never the non-standard NaN token."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        with MetricsLog(path) as log:
            log.write({"step": 1, "loss": math.nan, "kl": np.float64("inf"), "grad_norm": torch.tensor(-math.inf)})
        text = path.read_text()
        assert "NaN" not in text and "Infinity" not in text
        assert json.loads(text) == {"step": 1, "loss": None, "kl": None, "grad_norm": None}
        assert read_metrics(path) == [{"step": 1, "loss": None, "kl": None, "grad_norm": None}]


def test_metrics_log_rejects_non_increasing_step(tmp_path: Path) -> None:
    """A step not greater than the previous one is refused and nothing is written."""
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        log.write({"step": 1})
        log.write({"step": 2})
        with pytest.raises(ValueError, match="'step' must strictly increase .*: expected > 2, got 2"):
            log.write({"step": 2})
        with pytest.raises(ValueError, match="expected > 2, got 1"):
            log.write({"step": 1})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_metrics_log_continues_step_check_after_reopen(tmp_path: Path) -> None:
    """Reopening an existing file appends to it and keeps steps strictly increasing across the two runs."""
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in (1, 2, 3):
            log.write({"step": step, "reward_mean": 0.1 * step})
    with MetricsLog(path) as log:
        assert log.last_step == 3
        with pytest.raises(ValueError, match="expected > 3, got 3"):
            log.write({"step": 3})
        log.write({"step": 4})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_metrics_log_drop_after_removes_later_steps(tmp_path: Path) -> None:
    """drop_after=k keeps the records with step <= k, so a run resumed from checkpoint k can log k+1 again."""
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in range(1, 6):
            log.write({"step": step})
    with MetricsLog(path, drop_after=3) as log:
        assert log.last_step == 3
        log.write({"step": 4, "resumed": True})
    assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3}, {"step": 4, "resumed": True}]


def test_metrics_log_drop_after_rejects_non_int(tmp_path: Path) -> None:
    """drop_after must be an int step."""
    with pytest.raises(TypeError, match="'drop_after' must be an int step or None: got float"):
        MetricsLog(tmp_path / "metrics.jsonl", drop_after=3.0)  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 9), max_size=12), st.integers(-1, 10))
def test_keep_steps_through_keeps_exactly_the_records_up_to_the_step(steps: list[int], last: int) -> None:
    """The file keeps, in order, exactly its records with step <= last (repeated steps too: samples.jsonl)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "samples.jsonl"
        path.write_text("".join(json.dumps({"step": s, "i": i}) + "\n" for i, s in enumerate(steps)))
        dropped = keep_steps_through(path, last)
        kept = [{"step": s, "i": i} for i, s in enumerate(steps) if s <= last]
        assert read_metrics(path) == kept and dropped == len(steps) - len(kept)


def test_keep_steps_through_leaves_a_missing_file_missing(tmp_path: Path) -> None:
    """No file: nothing is created and nothing dropped."""
    assert keep_steps_through(tmp_path / "absent.jsonl", 3) == 0
    assert not (tmp_path / "absent.jsonl").exists()


def test_keep_steps_through_rejects_bad_input(tmp_path: Path) -> None:
    """A non-int step, or a file line without an int step, is an error naming it (the file is unchanged)."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"loss": 2}\n')
    with pytest.raises(TypeError, match="'last_step' must be an int step: got float"):
        keep_steps_through(path, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must have an int 'step'"):
        keep_steps_through(path, 0)
    assert path.read_text() == '{"step": 1}\n{"loss": 2}\n'


def test_metrics_log_creates_parent_folders_and_appends_on_new_line(tmp_path: Path) -> None:
    """Parent folders are created; a file without a final newline gets one before the next record."""
    path = tmp_path / "runs" / "demo" / "metrics.jsonl"
    with MetricsLog(path) as log:
        assert log.last_step is None
        log.write({"step": 0})
    path.write_text(path.read_text().rstrip("\n"))
    with MetricsLog(path) as log:
        log.write({"step": 1})
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]


def test_metrics_log_rejects_missing_or_non_int_step(tmp_path: Path) -> None:
    """Every record needs an int step >= 0 (not a float, not a bool)."""
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        with pytest.raises(ValueError, match="'record' must have an int 'step'"):
            log.write({"reward_mean": 0.5})
        with pytest.raises(TypeError, match="'step' in 'record' must be an int: got float"):
            log.write({"step": 1.0})
        with pytest.raises(TypeError, match="'step' in 'record' must be an int: got bool"):
            log.write({"step": True})
        with pytest.raises(ValueError, match="'step' in 'record' must be >= 0: got -1"):
            log.write({"step": -1})
        with pytest.raises(TypeError, match="'record' must be a mapping"):
            log.write([("step", 1)])  # type: ignore[arg-type]
        assert log.last_step is None


def test_metrics_log_rejects_non_json_values(tmp_path: Path) -> None:
    """A value that is not JSON data, or a tensor of more than one element, is refused, naming its key."""
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        with pytest.raises(TypeError, match=r"'record\.extra\.when' must be JSON data .*got object"):
            log.write({"step": 1, "extra": {"when": object()}})
        with pytest.raises(TypeError, match=r"'record\.loss' must be a scalar: got a Tensor of shape \(3,\)"):
            log.write({"step": 1, "loss": torch.zeros(3)})
        with pytest.raises(TypeError, match="'record' keys must be str: got int"):
            log.write({"step": 1, 7: 0.5})
        log.write({"step": 1})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1}]


def test_metrics_log_rejects_write_after_close(tmp_path: Path) -> None:
    """Writing to a closed log raises; closing twice is harmless."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.close()
    log.close()
    assert log.closed
    with pytest.raises(ValueError, match="'MetricsLog' for .* is closed"):
        log.write({"step": 1})


@pytest.mark.parametrize(
    ("reader", "text", "match"),
    [
        (MetricsLog, '{"step": 1}\n{"step": 2, "loss"\n', "line 2 must be one JSON object"),
        (MetricsLog, '{"step": 1}\n{"loss": 0.5}\n', "record 1' must have an int 'step'"),
        (read_metrics, '{"step": 1}\n{"step": 2\n', "line 2 must be one JSON object"),
        (read_metrics, '{"step": 1}\n[1, 2]\n', "line 2 must be one JSON object: got list"),
    ],
    ids=["log-bad-json", "log-no-step", "read-bad-json", "read-not-an-object"],
)
def test_metrics_readers_name_the_bad_line(tmp_path: Path, reader: Any, text: str, match: str) -> None:
    """Reopening (MetricsLog) or reading (read_metrics) a file with a bad line fails naming it, before appending."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        reader(path)


def test_read_metrics_skips_blank_lines(tmp_path: Path) -> None:
    """Blank lines are not records."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n  \n{"step": 2, "loss": null}\n')
    assert read_metrics(path) == [{"step": 1}, {"step": 2, "loss": None}]


