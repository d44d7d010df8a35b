"""``shell.worker_errors``: a failure's first line names what failed (a rank of a role, or a single component)."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import RayActorError

from core.topology import NamedSharding
from shell.worker_errors import WorkerError, component_error, failure_error


def test_failure_error_names_the_role_before_the_dead_rank() -> None:
    """With role 'policy', the dead rank is 'policy rank r'; without a role, plain 'rank r'."""
    sharding = NamedSharding({"data_parallel": 2})
    failures = {1: RayActorError()}
    named = failure_error(sharding, "train", failures, still_running=0, called=2, role="policy")
    assert str(named).startswith("policy rank 1 (") and "died during 'train'" in str(named)
    plain = failure_error(sharding, "train", failures, still_running=0, called=2)
    assert str(plain).startswith("rank 1 (")
    assert (named.rank, named.failed_ranks, named.world_size) == (1, (1,), 2)


def test_component_error_starts_with_the_component_and_pickles() -> None:
    """component_error's message is '<component> failed in '<method>': <why>'; it survives pickling."""
    error = component_error("the rollout engine", "load_weights", "its actor is dead")
    assert str(error) == "the rollout engine failed in 'load_weights': its actor is dead"
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, WorkerError) and str(copy) == str(error) and copy.method == "load_weights"


def test_component_error_rejects_an_empty_component() -> None:
    """An empty component (or method) names nothing: ValueError."""
    with pytest.raises(ValueError, match=r"'component' and 'method' must be non-empty: got '', 'get'"):
        component_error("", "get", "gone")
