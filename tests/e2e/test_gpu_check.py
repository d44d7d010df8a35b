"""``python -m shell.bench.gpu_check`` on a machine without CUDA: its CPU half, which the GPU run compares against.

The GPU half needs a lent device machine; here the CPU reference child runs
as the GPU run starts it (a process of its own, gloo, the CPU shim), and the
command without a GPU exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shell.bench.gpu_check import MOE_MODEL, ROWS, WIDTH

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run(
        [sys.executable, "-m", "shell.bench.gpu_check", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cpu_reference_records_the_moe_routing_the_gpu_run_replays(tmp_path: Path) -> None:
    """The child saves dense log-probs and timings, and for the MoE model the routing it dispatched (each real
    token to top-k distinct experts, -1 at padding), its log-probs and a finite train-step loss."""
    out = tmp_path / "cpu.pt"
    done = _run("--cpu-child", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    saved = torch.load(out)
    assert saved["logprobs"].shape == (ROWS, WIDTH) and torch.isfinite(saved["logprobs"]).all()
    moe = saved["moe"]
    routing = moe["routing"]
    layers, topk, experts = MOE_MODEL["num_layers"], MOE_MODEL["moe_topk"], MOE_MODEL["num_experts"]
    assert routing.shape == (ROWS, WIDTH, layers, topk)
    real = routing[..., 0] >= 0  # [rows, positions, layers]
    assert real.any() and (~real).any()
    assert ((routing >= 0) == real[..., None]).all()  # a token is routed in every slot or padding in every slot
    picked = routing[real]  # [tokens x layers, topk]
    assert ((picked >= 0) & (picked < experts)).all()
    assert (picked[:, 1:] > picked[:, :-1]).all()  # top-k distinct experts, in ascending order
    assert moe["logprobs"].shape == (ROWS, WIDTH) and torch.isfinite(moe["logprobs"]).all()
    assert torch.isfinite(torch.tensor(moe["loss"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks would run")
def test_gpu_check_without_cuda_exits_2_saying_why() -> None:
    done = _run()
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
