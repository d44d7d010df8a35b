"""GPU checks for a lent device machine: ``python -m shell.bench.gpu_check``.

Runs in one process on one GPU, no Ray:

* **NCCL broadcast.** ``torch.distributed`` on NCCL (world size 1: one GPU
  holds one NCCL rank), then :func:`shell.broadcast.broadcast_tensors` of a
  dense and a jagged tensor to ``cuda``; checks they arrive bit for bit.
* **megatron-core on CUDA, without the CPU shim.** :class:`adapters.megatron.MegatronGPTBackend`
  with ``device="cuda"`` (the CPU shim is never applied in this process:
  checked), its log-probs of a seeded batch against the same backend on CPU
  (gloo, with the shim, in a child process), and the median wall time of a
  log-prob call and of a train step on each device.
* **An MoE policy on CUDA with R3.** The same backend with ``MOE_MODEL``
  (megatron's MoE layers, no Transformer Engine): the CPU child records its
  routing of the batch; on CUDA that routing is replayed (the experts CUDA
  dispatched must equal it), its log-probs compared with the CPU's replayed
  ones, and one train step taken with the routing replayed (the router's
  backward included).

Prints one Markdown table. Exits 1 when a check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.model_config import TinyGPTConfig

MODEL = {"vocab_size": 32, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "max_sequence_length": 64}
"""The checks' tiny GPT."""
MOE_MODEL = {**MODEL, "num_experts": 4, "moe_topk": 2}
"""The MoE check's GPT: the same sizes, each MLP megatron's MoE layer of 4 experts, top-2."""
ROWS, WIDTH, REPEATS = 16, 48, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())  # a fresh one: the CPU child inherits the parent's environment
    dist.init_process_group(backend, rank=0, world_size=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, WIDTH + 1, (ROWS,), generator=g)
    return torch.randint(0, MODEL["vocab_size"], (ROWS, WIDTH), generator=g), lengths


def _timed(fn: Any, device: str) -> float:
    times = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def _backend_run(device: str) -> tuple[torch.Tensor, float, float]:
    """Log-probs of the seeded batch, and median ms of a log-prob call and of a train step, on ``device``."""
    from adapters.megatron import MegatronGPTBackend
    from shell.loss import GRPOLoss

    backend = MegatronGPTBackend(TinyGPTConfig(**MODEL), tensor_parallel=1, pipeline_parallel=1, seed=0, device=device)
    ids, lengths = _batch()
    logprobs = backend.logprobs(ids, lengths)
    logprob_ms = _timed(lambda: backend.logprobs(ids, lengths), device)
    micro = _micro_batch(ids, lengths, logprobs)
    loss = GRPOLoss(kl_coef=0.0)
    train_ms = _timed(lambda: backend.train_step([micro], loss), device)
    return logprobs, logprob_ms, train_ms


def _moe_run(device: str, routed: torch.Tensor | None) -> dict[str, Any]:
    """The MoE backend on ``device``: the routing it dispatches (replaying ``routed`` when given), its log-probs
    under that routing, and the loss of one train step with that routing replayed."""
    from adapters.megatron import MegatronGPTBackend
    from shell.loss import GRPOLoss

    backend = MegatronGPTBackend(TinyGPTConfig(**MOE_MODEL), tensor_parallel=1, pipeline_parallel=1, seed=0, device=device)
    ids, lengths = _batch()
    routing = backend.routing(ids, lengths, routed)
    logprobs = backend.logprobs(ids, lengths, routing)
    micro = {**_micro_batch(ids, lengths, logprobs), "routed_experts": routing}
    result = backend.train_step([micro], GRPOLoss(kl_coef=0.0))
    return {"routing": routing, "logprobs": logprobs.cpu(), "loss": float(result["loss"])}


def _micro_batch(ids: torch.Tensor, lengths: torch.Tensor, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch of the whole batch with the fields the GRPO loss reads (seeded advantages; every token
    after the first is a response token)."""
    from core.fields import ADVANTAGES, PREV_LOGPROBS, TOKEN_MASK

    positions = torch.arange(ids.shape[1])[None, :]
    return {
        "input_ids": ids,
        "lengths": lengths,
        PREV_LOGPROBS: logprobs.detach(),
        ADVANTAGES: torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(1)),
        TOKEN_MASK: (positions >= 1) & (positions < lengths[:, None]),
    }


def _cpu_child(out: Path) -> None:
    _init("gloo")
    logprobs, logprob_ms, train_ms = _backend_run("cpu")
    moe = _moe_run("cpu", None)
    torch.save({"logprobs": logprobs, "logprob_ms": logprob_ms, "train_ms": train_ms, "moe": moe}, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shell.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_child is not None:
        _cpu_child(args.cpu_child)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU checks need one", file=sys.stderr)
        return 2
    from adapters.megatron_cpu import cpu_shim_applied
    from core.codec import to_jagged
    from shell.broadcast import broadcast_tensors

    rows: list[tuple[str, str, str]] = []
    failed = False
    _init("nccl")
    torch.cuda.set_device(0)
    ids, lengths = _batch()
    sent = {"dense": torch.randn(4, 5), "jagged": to_jagged(ids, lengths.tolist())}
    got = broadcast_tensors(sent, src=0, group=None, device="cuda")
    same = torch.equal(got["dense"].cpu(), sent["dense"]) and all(
        torch.equal(a.cpu(), b) for a, b in zip(got["jagged"].unbind(), sent["jagged"].unbind())
    )
    failed |= not same
    rows.append(("NCCL broadcast (dense + jagged) to cuda", "bit for bit" if same else "DIFFERS", "-"))

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cpu.pt"
        child = subprocess.run([sys.executable, "-m", "shell.bench.gpu_check", "--cpu-child", str(out)], check=False)
        if child.returncode != 0:
            print(f"the CPU reference run failed (exit {child.returncode})", file=sys.stderr)
            return 1
        cpu = torch.load(out)
    logprobs, logprob_ms, train_ms = _backend_run("cuda")
    unpatched = not cpu_shim_applied()
    failed |= not unpatched
    rows.append(("megatron-core on cuda without the CPU shim", "yes" if unpatched else "SHIM APPLIED", "-"))
    diff = float((logprobs.cpu() - cpu["logprobs"]).abs().max())
    close = diff < 1e-3
    failed |= not close
    rows.append(("log-probs, cuda vs cpu: max abs difference", f"{diff:.2e}", "< 1e-3"))
    rows.append(("log-prob call, ms (cuda / cpu)", f"{logprob_ms:.1f} / {cpu['logprob_ms']:.1f}", "-"))
    rows.append(("train step, ms (cuda / cpu)", f"{train_ms:.1f} / {cpu['train_ms']:.1f}", "-"))
    try:
        moe = _moe_run("cuda", cpu["moe"]["routing"])
    except Exception as error:  # the MoE rows report it; the checks above still print
        failed = True
        rows.append(("MoE (4 experts, top-2) on cuda with R3", f"FAILED: {type(error).__name__}: {error}", "-"))
    else:
        replayed = torch.equal(moe["routing"], cpu["moe"]["routing"])
        failed |= not replayed
        rows.append(("MoE on cuda: dispatched experts = the CPU's replayed routing", "equal" if replayed else "DIFFER", "-"))
        moe_diff = float((moe["logprobs"] - cpu["moe"]["logprobs"]).abs().max())
        failed |= not moe_diff < 1e-3
        rows.append(("MoE log-probs under R3, cuda vs cpu: max abs difference", f"{moe_diff:.2e}", "< 1e-3"))
        rows.append(("MoE train step with R3, loss (cuda / cpu)", f"{moe['loss']:.6f} / {cpu['moe']['loss']:.6f}", "-"))
    print(f"\n**GPU checks: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{ROWS} rows of up to {WIDTH} tokens; times are medians of {REPEATS} calls**\n")
    print("| check | result | bound |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
