"""``python -m shell.run`` with an MoE policy and R3 router replay, on both paths: parity, no leak, routing off the driver.

The rollout generates under bf16 (``rollout.precision=bf16``, the mismatch R3
exists to remove) and records each token's experts (``routed_experts``); the
policy replays them in its log-prob forwards and training. The legacy path
ships the routing through the driver, the data plane through the store, and
both must give bitwise the same step records.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from adapters.transfer_queue import TransferQueueStore
from shell import run as shell_run
from shell.run_log import read_metrics
from tests.e2e.conftest import SMALL_DP2_RUN

pytestmark = pytest.mark.e2e

STEPS = 3
MOE = [
    f"grpo.num_steps={STEPS}",
    *SMALL_DP2_RUN,
    "policy.model.num_experts=4",
    "policy.model.moe_topk=2",
    "policy.router_replay=r3",
    "rollout.precision=bf16",
    "grpo.loss.kl_coef=0.05",
    "run.progress=plain",
]
PARITY_KEYS = ("reward_mean", "entropy", "loss", "kl", "grad_norm")


@pytest.fixture(scope="module")
def partition() -> str:
    return f"moe-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def moe_runs(tq_store_session: TransferQueueStore, tmp_path_factory: pytest.TempPathFactory, partition: str) -> dict[str, Any]:
    """A short MoE + R3 run on each path (same seed and config; the data plane verifies digests), on the session's Ray
    and TransferQueue."""
    out: dict[str, Any] = {}
    for name, enabled in (("legacy", "false"), ("data_plane", "true")):
        run_dir: Path = tmp_path_factory.mktemp(f"moe-{name}")
        args = [*MOE, f"run.dir={run_dir}", f"data_plane.enabled={enabled}", f"data_plane.partition={partition}"]
        if enabled == "true":
            args.append("data_plane.verify_integrity=true")  # every row's digest, routed_experts included, checked at get
        status = shell_run.main(args)
        out[name] = {"status": status, "records": read_metrics(run_dir / "metrics.jsonl")}
    return out


def test_moe_r3_runs_finish_and_agree_bitwise(moe_runs: dict[str, Any]) -> None:
    """Both paths exit 0, and their rewards, losses, KL and grad norms are bitwise equal at every step."""
    legacy, plane = moe_runs["legacy"], moe_runs["data_plane"]
    assert legacy["status"] == 0 and plane["status"] == 0
    assert [r["step"] for r in plane["records"]] == list(range(1, STEPS + 1))
    for a, b in zip(legacy["records"], plane["records"], strict=True):
        assert {k: a[k] for k in PARITY_KEYS} == {k: b[k] for k in PARITY_KEYS}, f"step {a['step']}"
    assert any(r["grad_norm"] > 0 for r in plane["records"]), "the runs must actually train"


def test_moe_r3_data_plane_leaves_no_keys(moe_runs: dict[str, Any], partition: str) -> None:
    """After every step the store holds none of the run's keys, routing included."""
    assert [r["store_keys_outstanding"] for r in moe_runs["data_plane"]["records"]] == [0] * STEPS
    store = TransferQueueStore.attach()
    try:
        assert store.list_keys(partition) == ()
    finally:
        store.close()


def test_moe_r3_routing_stays_off_the_driver(moe_runs: dict[str, Any]) -> None:
    """Per step the data plane's driver moves at most 10% of the legacy path's bytes (which carry the routing)."""
    for a, b in zip(moe_runs["legacy"]["records"], moe_runs["data_plane"]["records"], strict=True):
        assert b["driver_bytes"] <= 0.10 * a["driver_bytes"], f"step {a['step']}: {b['driver_bytes']} vs {a['driver_bytes']}"
        assert a["data_plane_bytes"] == 0
