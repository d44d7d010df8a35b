"""Placing TransferQueue's controller (``adapters.tq_system._controller_options``), whose ``init`` takes no placement.

Law: while the context is open, the actor class ``transfer_queue.interface`` names creates actors with the extra
options under the caller's (the caller's win on a clash); once it closes, normally or by an exception, the module
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
