"""Placing TransferQueue's controller (``adapters.tq_system._controller_options``), whose ``init`` takes no placement.

Law: while the context is open, the actor class ``transfer_queue.interface`` names creates actors with the extra
options and the caller's (an option both set is refused); once it closes, normally or by an exception, the module
names the original class again. With no extra options nothing is swapped; a TQ without the class is refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import transfer_queue.interface as interface
from hypothesis import given
from hypothesis import strategies as st

from adapters import tq_system


class _FakeActorClass:
    """Records the options it is asked for (an actor class's ``options`` returns something to ``.remote`` on)."""

    def options(self, **options: Any) -> dict[str, Any]:
        return options

    label = "fake"


_names = st.text(alphabet="abcdefgh_", min_size=1, max_size=8)


@given(extra=st.dictionaries(_names, st.integers(), max_size=3), caller=st.dictionaries(_names, st.integers(), max_size=3))
def test_the_controller_class_adds_the_extra_options_then_is_restored(extra: dict[str, int], caller: dict[str, int]) -> None:
    fake = _FakeActorClass()
    original = interface.TransferQueueController
    interface.TransferQueueController = fake
    try:
        with tq_system._controller_options(extra):
            swapped = interface.TransferQueueController
            both = sorted(set(extra) & set(caller))
            if both:
                with pytest.raises(RuntimeError) as info:
                    swapped.options(**caller)
                assert str(both) in str(info.value) and f"controller.{tq_system.CONTROLLER_RESOURCE}" in str(info.value)
            else:
                assert swapped.options(**caller) == {**extra, **caller}
            assert swapped.label == "fake"  # everything else is the class's own
        assert interface.TransferQueueController is fake
        with pytest.raises(KeyError), tq_system._controller_options(extra):
            raise KeyError("init failed")
        assert interface.TransferQueueController is fake
    finally:
        interface.TransferQueueController = original


def test_no_extra_options_swap_nothing() -> None:
    original = interface.TransferQueueController
    with tq_system._controller_options({}):
        assert interface.TransferQueueController is original
    assert interface.TransferQueueController is original


def test_a_transfer_queue_without_the_controller_class_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(interface, "TransferQueueController")
    with pytest.raises(RuntimeError) as info, tq_system._controller_options({"resources": {"store": 0.001}}):
        pass
    assert f"controller.{tq_system.CONTROLLER_RESOURCE}" in str(info.value)
    assert not hasattr(interface, "TransferQueueController")


def test_the_settings_place_the_controller_with_the_storage_resource() -> None:
    from shell.node_placement import transfer_queue_settings

    for backend in ("SimpleStorage", "RayObjectStore"):
        conf = tq_system.resolve_config(transfer_queue_settings(backend, 2, "store"))
        assert conf.controller[tq_system.CONTROLLER_RESOURCE] == "store"
        assert conf.controller.sampler == "SequentialSampler"  # TQ's own controller settings are kept
    assert tq_system.resolve_config().controller[tq_system.CONTROLLER_RESOURCE] is None


# ---------------------------------------------------------------- the start's deadline (_init_within), without Ray


class _Probe:
    def remote(self) -> str:
        return "probe"


class _FakePart:
    __ray_ready__ = _Probe()


class _Context:
    namespace = "ours"


def _patched_start(monkeypatch: pytest.MonkeyPatch, init: Any) -> list[str]:
    """tq.init replaced by ``init``; one part (the controller) that never answers; killing the started parts
    (recorded, with the namespace asked for) releases a blocked ``init``."""
    events: list[str] = []
    monkeypatch.setattr(tq_system.tq, "init", init)
    monkeypatch.setattr(tq_system.ray, "get_runtime_context", lambda: _Context())
    monkeypatch.setattr(tq_system.ray, "wait", lambda refs, **kw: ([], list(refs)))

    def named(namespace: str | None = None) -> dict[str, Any]:
        events.append(f"listed {namespace}")
        return {"TransferQueue controller": _FakePart()}

    monkeypatch.setattr(tq_system, "_named_parts", named)
    return events


def test_a_start_past_its_deadline_names_the_silent_part_and_its_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    released = threading.Event()
    events = _patched_start(monkeypatch, lambda conf: released.wait(60))
    monkeypatch.setattr(tq_system, "_stop_started_parts", lambda: (events.append("killed"), released.set()))
    with pytest.raises(RuntimeError) as info:
        tq_system._init_within(None, 0.2, {"controller.required_node_resource": "store"})
    message = str(info.value)
    assert message.startswith("TransferQueue did not start within 0.2 s; not answering: TransferQueue controller;")
    assert "placed by controller.required_node_resource='store'" in message
    assert "had not ended" not in message  # the kill ended init's wait
    assert events == ["listed ours", "killed"]  # its own namespace's parts, then the kill


def test_a_start_within_its_deadline_returns_or_raises_what_init_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _patched_start(monkeypatch, lambda conf: None)
    assert tq_system._init_within(None, 5.0, {}) is None
    failure = ValueError("No alive Ray nodes provide custom resource 'x'")

    def fail(conf: Any) -> None:
        raise failure

    _patched_start(monkeypatch, fail)
    with pytest.raises(ValueError) as info:
        tq_system._init_within(None, 5.0, {})
    assert info.value is failure
    assert events == []  # nothing listed or killed when init ended in time


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_a_start_deadline_that_is_not_positive_seconds_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        tq_system.start(start_timeout_s=bad)
    assert "'start_timeout_s' must be a finite number of seconds > 0" in str(info.value)
