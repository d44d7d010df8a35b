"""How the trainer reports a store that does not start: ``StoreStartError`` naming the store, the cause chained;
a ``ConfigError`` (the config does not fit the cluster) passes through as it is, so the run exits 2 on it."""

from __future__ import annotations

import pytest

from shell import grpo_trainer
from shell.config_error import ConfigError
from shell.run_config import load_run_config


def _trainer(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException, overrides: tuple[str, ...] = ()
) -> grpo_trainer.GRPOTrainer:
    monkeypatch.setattr(grpo_trainer, "connect_ray", lambda section, say: False)  # no cluster: the store fails first
    trainer = grpo_trainer.GRPOTrainer(load_run_config(["run.progress=off", *overrides]))

    def fail() -> None:
        raise failure

    monkeypatch.setattr(trainer, "_open_store", fail)
    return trainer


def test_a_store_that_does_not_start_is_named_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    cause = RuntimeError("TransferQueue did not start within 5 s; not started: TransferQueue controller.")
    trainer = _trainer(monkeypatch, cause)
    with pytest.raises(grpo_trainer.StoreStartError) as info:
        trainer.start()
    assert str(info.value) == f"the store failed to start: {cause}"
    assert info.value.__cause__ is cause
    assert trainer.policy is None and trainer.source is None  # nothing after the store was started


def test_a_config_error_from_the_store_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    cause = ConfigError("data_plane.storage_resource", "no alive node of the cluster has the resource 'x'")
    trainer = _trainer(monkeypatch, cause)
    with pytest.raises(ConfigError) as info:
        trainer.start()
    assert info.value is cause


def test_a_store_placed_by_a_resource_names_the_key_that_placed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cause = RuntimeError("TransferQueue did not start within 300 s; not answering: TransferQueue controller")
    trainer = _trainer(monkeypatch, cause, ("ray.address=auto", "data_plane.storage_resource=store"))
    with pytest.raises(grpo_trainer.StoreStartError) as info:
        trainer.start()
    assert str(info.value) == f"the store failed to start: {cause} (data_plane.storage_resource='store' placed its parts)"
