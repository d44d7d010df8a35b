"""MegatronGPTBackend on CPU: TP, PP and DP process groups (gloo) against a single-rank reference.

Each layout is one world of fresh processes (``torch.multiprocessing`` with a
fork server that has imported megatron once, a ``FileStore`` rendezvous, one
torch thread per rank) that runs every check for that layout
once and sends its results back; a module-scoped fixture caches each world, and
the tests assert on the results. The single-rank world is the reference: TP=2
must match it to float tolerance, PP=2 bitwise, and DP=2 x PP=2 (each replica
on its own micro-batch) must reach the single rank's state after one step on
both.

The MoE worlds (``MOE_CONFIG``) check routing record and replay: one rank
against itself (token order, replay, padding, bf16 rollouts), and TP=2 (with
sequence parallelism, on batches of odd and even width), PP=2 and TP=2 x PP=2
(sequence-parallel stages) against the single MoE rank.
"""

from __future__ import annotations

import inspect
import io
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapters.megatron import MegatronGPTBackend
from adapters.megatron_batch import padded_length
from adapters.megatron_cpu import apply_cpu_shim, cpu_shim_applied
from adapters.megatron_routing import merge_sequence_shards, ready_for_replay, to_router_order
from adapters.megatron_setup import SequenceParallelLayerNorm, transformer_config
from adapters.model_port import Generation, MicroBatch, PolicyBackend
from core.model_config import TinyGPTConfig
from core.routing import pad_routing_for_replay
from core.topology import NamedSharding

pytestmark = pytest.mark.e2e

CONFIG = TinyGPTConfig(vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=4, max_sequence_length=64)
SEED = 0
STEPS = 4
WORLD_TIMEOUT_S = 240.0
INPUT_IDS = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
LENGTHS = torch.tensor([12, 7, 3, 10])
MICRO_BATCHES: list[dict[str, torch.Tensor]] = [
    {"input_ids": INPUT_IDS[:2], "lengths": LENGTHS[:2]},
    {"input_ids": INPUT_IDS[2:, :10], "lengths": LENGTHS[2:].clamp(max=10)},  # a different shape on purpose
]
Results = dict[str, Any]
GEN_PROMPT_LENGTHS = torch.tensor([4, 2, 3, 4])
GEN_PROMPTS = torch.where(torch.arange(4)[None, :] < GEN_PROMPT_LENGTHS[:, None], INPUT_IDS[:, :4], 0)
GEN_NEW_TOKENS, GEN_EOS, GEN_VOCAB_LIMIT = 6, 3, 5
MOE_CONFIG = TinyGPTConfig(
    vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=4, max_sequence_length=64, num_experts=4, moe_topk=2
)
MOE_STEPS = 2


def _random_routing(rows: int, seq: int, lengths: torch.Tensor, seed: int) -> torch.Tensor:
    """A routing unrelated to any model: ``moe_topk`` distinct random experts per real token and layer, -1 at padding."""
    scores = torch.rand(rows, seq, MOE_CONFIG.num_layers, MOE_CONFIG.num_experts, generator=torch.Generator().manual_seed(seed))
    routed = scores.argsort(dim=-1)[..., : MOE_CONFIG.moe_topk].sort(dim=-1).values
    real = torch.arange(seq)[None, :] < lengths[:, None]
    return torch.where(real[:, :, None, None], routed, -1)


MOE_REPLAYED = _random_routing(*INPUT_IDS.shape, LENGTHS, seed=5)
MOE_MICRO_BATCHES: list[dict[str, torch.Tensor]] = [
    {**MICRO_BATCHES[0], "routed_experts": MOE_REPLAYED[:2]},
    # An odd width on purpose: TP=2 (sequence parallel) pads the forward to 12.
    {"input_ids": INPUT_IDS[2:, :11], "lengths": LENGTHS[2:], "routed_experts": MOE_REPLAYED[2:, :11]},
]
ODD_WIDTH = 11


def _loss_fn(logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean negative log-likelihood over the scored tokens (positions 1 .. length - 1)."""
    tokens = (micro_batch["lengths"] - 1).sum()
    return -logprobs.sum() / tokens, {"tokens": float(tokens)}


def _token_sum_loss_fn(logprobs: torch.Tensor, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Summed negative log-likelihood and its token count: the backend trains on the global token mean."""
    return -logprobs.sum(), (micro_batch["lengths"] - 1).sum(), {}


WHOLE_BATCH = [{"input_ids": INPUT_IDS, "lengths": LENGTHS}]  # MICRO_BATCHES' rows as one micro-batch


def _backend(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = SEED) -> MegatronGPTBackend:
    return MegatronGPTBackend(CONFIG, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, seed=seed)


def _reference_entropy(backend: MegatronGPTBackend, generation: Generation, vocab_limit: int | None) -> torch.Tensor:
    """Per row, the summed entropy of its response tokens' distributions, each read off by scoring every allowed next id."""
    ids = torch.arange(CONFIG.vocab_size if vocab_limit is None else vocab_limit)
    sums = []
    for row in range(len(GEN_PROMPTS)):
        total = 0.0
        for t in range(int(GEN_PROMPT_LENGTHS[row]), int(generation.lengths[row])):
            candidates = torch.cat([generation.sequences[row, :t].expand(len(ids), -1), ids[:, None]], dim=1)
            logp = backend.logprobs(candidates, torch.full((len(ids),), t + 1))[:, -1].double()
            logp = logp - torch.logsumexp(logp, dim=0)  # renormalised over the allowed ids
            total += float(-(logp.exp() * logp).sum())
        sums.append(total)
    return torch.tensor(sums, dtype=torch.float64)


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Doubles its input; its backward allocates as megatron's tensor-parallel Functions do (``device=`` the CUDA index)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty(grad.shape, device=torch.cuda.current_device()).copy_(grad * 2)


def _capture(call: Callable[[], object]) -> BaseException | None:
    """The exception ``call`` raises, or None; sent back so the parent can re-raise it under ``pytest.raises``."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - any exception is the result here
        return error
    return None


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


# -- scenarios: run on every rank of a world -----------------------------------------------------------


def _single_rank(rank: int, inputs: Results) -> Results:
    out: Results = {"shim_before": cpu_shim_applied()}
    apply_cpu_shim()
    depth = torch._C._len_torch_function_stack()  # the mode stack the shim pushes its remap onto
    apply_cpu_shim()
    out["shim_depth_change"] = torch._C._len_torch_function_stack() - depth
    out["shim_cuda_tensor_device"] = torch.zeros(1, device="cuda").device
    out["shim_current_device"] = torch.cuda.current_device()
    x = torch.ones(3, requires_grad=True)
    torch.autograd.backward(_AllocatesOnCudaInBackward.apply(x).sum())
    out["shim_backward_grad"] = x.grad

    backend = _backend()
    out["logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS)
    out["logprobs_again"] = backend.logprobs(INPUT_IDS, LENGTHS)
    from_thread: Results = {}
    worker = threading.Thread(target=lambda: from_thread.update(logprobs=backend.logprobs(INPUT_IDS, LENGTHS)))
    worker.start()
    worker.join()
    out["logprobs_from_other_thread"] = from_thread.get("logprobs")
    out["reference_logprobs"] = backend.reference_logprobs(INPUT_IDS, LENGTHS)
    prefix = INPUT_IDS[0, :5].expand(CONFIG.vocab_size, -1)
    continuations = torch.cat([prefix, torch.arange(CONFIG.vocab_size)[:, None]], dim=1)
    out["continuation_logprobs"] = backend.logprobs(continuations, torch.full((CONFIG.vocab_size,), 6))[:, -1]
    mutated = INPUT_IDS.clone()
    mutated[:, 6] = (mutated[:, 6] + 1) % CONFIG.vocab_size
    out["mutated_logprobs"] = backend.logprobs(mutated, LENGTHS)
    repadded = INPUT_IDS.clone()
    past_end = torch.arange(INPUT_IDS.shape[1])[None, :] >= LENGTHS[:, None]
    repadded[past_end] = (repadded[past_end] + 7) % CONFIG.vocab_size
    out["repadded_logprobs"] = backend.logprobs(repadded, LENGTHS)
    out["initial_state"] = backend.state_dict()

    twin, other = _backend(), _backend(seed=SEED + 1)
    out["twin_logprobs"] = twin.logprobs(INPUT_IDS, LENGTHS)
    out["other_seed_logprobs"] = other.logprobs(INPUT_IDS, LENGTHS)
    one_step = _backend()
    out["one_step"] = {"result": one_step.train_step(MICRO_BATCHES, _loss_fn), "state": one_step.state_dict()}

    # The token-mean law: one step on the rows split into micro-batches or not reaches one state.
    out["token_mean"] = {}
    for name, batches, loss_fn in (
        ("split", MICRO_BATCHES, _token_sum_loss_fn), ("whole", WHOLE_BATCH, _token_sum_loss_fn),
        ("mean_whole", WHOLE_BATCH, _loss_fn),
    ):
        stepped = _backend()
        out["token_mean"][name] = {"result": stepped.train_step(batches, loss_fn), "state": stepped.state_dict()}

    out["steps"] = [backend.train_step(MICRO_BATCHES, _loss_fn) for _ in range(STEPS)]
    out["twin_steps"] = [twin.train_step(MICRO_BATCHES, _loss_fn) for _ in range(STEPS)]
    out["trained_state"] = backend.state_dict()
    out["twin_trained_state"] = twin.state_dict()
    out["trained_logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS)
    out["reference_logprobs_after"] = backend.reference_logprobs(INPUT_IDS, LENGTHS)
    out["reference_state_after"] = backend.reference_state_dict()
    backend.load_state_dict(out["initial_state"])
    out["reloaded_logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS)

    sampler = _backend()
    for name, limit in (("generated", None), ("generated_again", None), ("generated_limited", GEN_VOCAB_LIMIT)):
        out[name] = sampler.generate(
            GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=GEN_NEW_TOKENS, eos_id=GEN_EOS,
            generator=torch.Generator().manual_seed(7), vocab_limit=limit,
        )
    out["generated_other_seed"] = sampler.generate(
        GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=GEN_NEW_TOKENS, eos_id=GEN_EOS,
        generator=torch.Generator().manual_seed(8),
    )
    out["generated_hot_limited"] = sampler.generate(
        GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=GEN_NEW_TOKENS, eos_id=GEN_EOS,
        generator=torch.Generator().manual_seed(9), vocab_limit=GEN_VOCAB_LIMIT, temperature=0.7,
    )
    generated = out["generated"]
    for name in ("generated", "generated_limited", "generated_hot_limited"):
        out[f"{name}_rescored"] = sampler.logprobs(out[name].sequences, out[name].lengths)
    out["reference_entropy"] = {
        name: _reference_entropy(sampler, out[name], limit)
        for name, limit in (("generated", None), ("generated_limited", GEN_VOCAB_LIMIT))
    }

    def generate(**kwargs: Any) -> object:
        args = {"max_new_tokens": GEN_NEW_TOKENS, "eos_id": GEN_EOS, "generator": torch.Generator(), **kwargs}
        return sampler.generate(GEN_PROMPTS, GEN_PROMPT_LENGTHS, **args)

    out["generate_errors"] = {
        "no_new_tokens": _capture(lambda: generate(max_new_tokens=0)),
        "zero_temperature": _capture(lambda: generate(temperature=0.0)),
        "too_long": _capture(lambda: generate(max_new_tokens=CONFIG.max_sequence_length)),
        "vocab_limit_zero": _capture(lambda: generate(vocab_limit=0)),
    }

    missing = dict(out["initial_state"])
    missing.pop("output_layer.weight")
    reshaped = {**out["initial_state"], "output_layer.weight": torch.zeros(3, 3)}
    out["errors"] = {
        "float_ids": _capture(lambda: backend.logprobs(INPUT_IDS.float(), LENGTHS)),
        "token_out_of_vocab": _capture(lambda: backend.logprobs(INPUT_IDS + CONFIG.vocab_size, LENGTHS)),
        "length_too_long": _capture(lambda: backend.logprobs(INPUT_IDS, LENGTHS + 1)),
        "lengths_wrong_count": _capture(lambda: backend.reference_logprobs(INPUT_IDS, LENGTHS[:3])),
        "float_lengths": _capture(lambda: backend.logprobs(INPUT_IDS, LENGTHS.float())),
        "empty_micro_batches": _capture(lambda: backend.train_step([], _loss_fn)),
        "micro_batch_without_lengths": _capture(
            lambda: backend.train_step([{"input_ids": INPUT_IDS}], _loss_fn)
        ),
        "loss_not_scalar": _capture(
            lambda: backend.train_step(MICRO_BATCHES[:1], lambda lp, mb: (lp.sum(dim=1), {}))
        ),
        "count_negative": _capture(lambda: backend.train_step(MICRO_BATCHES[:1], lambda lp, mb: (lp.sum(), -1, {}))),
        "count_float": _capture(
            lambda: backend.train_step(MICRO_BATCHES[:1], lambda lp, mb: (lp.sum(), torch.tensor(2.0), {}))
        ),
        "four_parts": _capture(lambda: backend.train_step(MICRO_BATCHES[:1], lambda lp, mb: (lp.sum(), 1, 2, {}))),
        "state_missing_key": _capture(lambda: backend.load_state_dict(missing)),
        "state_wrong_shape": _capture(lambda: backend.load_state_dict(reshaped)),
    }
    return out


def _model_parallel(rank: int, inputs: Results) -> Results:
    backend = _backend(tensor_parallel=inputs["tensor_parallel"], pipeline_parallel=inputs["pipeline_parallel"])
    out: Results = {
        "coords": backend.parallel_coords(),
        "logprobs": backend.logprobs(INPUT_IDS, LENGTHS),
        "reference_logprobs": backend.reference_logprobs(INPUT_IDS, LENGTHS),
        "initial_state": backend.state_dict(),
        "steps": [backend.train_step(MICRO_BATCHES, _loss_fn) for _ in range(STEPS)],
    }
    out["trained_state"] = backend.state_dict()
    out["trained_logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS)
    out["generate_error"] = _capture(
        lambda: backend.generate(GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=2, eos_id=GEN_EOS, generator=torch.Generator())
    )
    backend.load_state_dict(inputs["state"])
    out["loaded_logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS)
    return out


def _moe_backend(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> MegatronGPTBackend:
    return MegatronGPTBackend(MOE_CONFIG, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, seed=SEED)


def _moe_single_rank(rank: int, inputs: Results) -> Results:
    backend = _moe_backend()
    out: Results = {"initial_state": backend.state_dict()}
    gen = backend.generate(
        GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=GEN_NEW_TOKENS, eos_id=GEN_EOS,
        generator=torch.Generator().manual_seed(7),
    )
    out["generated"] = gen
    out["fresh_routing"] = backend.routing(gen.sequences, gen.lengths)
    out["row_alone_routing"] = [
        backend.routing(gen.sequences[row : row + 1, : int(gen.lengths[row])], gen.lengths[row : row + 1])[0]
        for row in range(len(gen.lengths))
    ]
    out["logprobs"] = backend.logprobs(gen.sequences, gen.lengths)
    out["replayed_logprobs"] = backend.logprobs(gen.sequences, gen.lengths, gen.routed_experts)
    # The rows cut to the shortest one's length: no padding, so a replay sends every token where its scores did.
    width = int(gen.lengths.min())
    unpadded_ids, unpadded_lengths = gen.sequences[:, :width].contiguous(), torch.full_like(gen.lengths, width)
    out["unpadded_logprobs"] = backend.logprobs(unpadded_ids, unpadded_lengths)
    out["unpadded_replayed_logprobs"] = backend.logprobs(
        unpadded_ids, unpadded_lengths, backend.routing(unpadded_ids, unpadded_lengths)
    )
    other = _random_routing(*gen.sequences.shape, gen.lengths, seed=3)
    out["other_routing"] = other
    out["other_observed"] = backend.routing(gen.sequences, gen.lengths, other)
    out["other_logprobs"] = backend.logprobs(gen.sequences, gen.lengths, other)
    junk = other.clone()
    junk[junk < 0] = 3  # padding holding a repeated, arbitrary expert
    out["junk_padding_logprobs"] = backend.logprobs(gen.sequences, gen.lengths, junk)
    out["reference_other_logprobs"] = backend.reference_logprobs(gen.sequences, gen.lengths, other)

    # Fixed batch, replayed: the MP worlds are checked against these.
    out["batch_routing"] = backend.routing(INPUT_IDS, LENGTHS)
    out["batch_replayed_observed"] = backend.routing(INPUT_IDS, LENGTHS, MOE_REPLAYED)
    out["batch_replayed_logprobs"] = backend.logprobs(INPUT_IDS, LENGTHS, MOE_REPLAYED)
    expected_loss = _loss_fn(out["batch_replayed_logprobs"][:2], MOE_MICRO_BATCHES[0])[0]
    out["first_micro_batch_loss_from_logprobs"] = float(expected_loss)
    out["steps"] = [backend.train_step(MOE_MICRO_BATCHES, _loss_fn) for _ in range(MOE_STEPS)]
    out["trained_state"] = backend.state_dict()
    out["reference_after"] = backend.reference_logprobs(gen.sequences, gen.lengths, other)

    # bf16 rollouts of a larger batch: how often the fp32 trainer routes a token elsewhere.
    prompts = torch.randint(0, MOE_CONFIG.vocab_size, (16, 8), generator=torch.Generator().manual_seed(2))
    bf16 = backend.generate(
        prompts, torch.full((16,), 8), max_new_tokens=16, eos_id=GEN_EOS,
        generator=torch.Generator().manual_seed(9), precision="bf16",
    )
    out["bf16_generated"] = bf16
    out["bf16_trainer_routing"] = backend.routing(bf16.sequences, bf16.lengths)
    out["bf16_replayed_routing"] = backend.routing(bf16.sequences, bf16.lengths, bf16.routed_experts)

    dense = _backend()
    bad_range = other.clone()
    bad_range[0, 0, 0, 0] = MOE_CONFIG.num_experts
    repeated = other.clone()
    repeated[0, 0, 0, :] = 1
    missing = other.clone()
    missing[1, 0, 1, 0] = -1
    out["errors"] = {
        "dense_routing": _capture(lambda: dense.routing(INPUT_IDS, LENGTHS)),
        "dense_replay": _capture(lambda: dense.logprobs(INPUT_IDS, LENGTHS, MOE_REPLAYED)),
        "wrong_shape": _capture(lambda: backend.logprobs(INPUT_IDS, LENGTHS, MOE_REPLAYED[:, :5])),
        "float_routing": _capture(lambda: backend.logprobs(INPUT_IDS, LENGTHS, MOE_REPLAYED.float())),
        "out_of_range": _capture(lambda: backend.logprobs(gen.sequences, gen.lengths, bad_range)),
        "repeated_expert": _capture(lambda: backend.logprobs(gen.sequences, gen.lengths, repeated)),
        "missing_route": _capture(lambda: backend.logprobs(gen.sequences, gen.lengths, missing)),
        "bad_micro_batch_routing": _capture(
            lambda: backend.train_step([{**MICRO_BATCHES[0], "routed_experts": MOE_REPLAYED}], _loss_fn)
        ),
        "bad_precision": _capture(
            lambda: backend.generate(GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=2, eos_id=GEN_EOS,
                                     generator=torch.Generator(), precision="fp16")
        ),
    }
    out["dense_generation_routing"] = dense.generate(
        GEN_PROMPTS, GEN_PROMPT_LENGTHS, max_new_tokens=2, eos_id=GEN_EOS, generator=torch.Generator()
    ).routed_experts
    return out


def _moe_model_parallel(rank: int, inputs: Results) -> Results:
    backend = _moe_backend(tensor_parallel=inputs["tensor_parallel"], pipeline_parallel=inputs["pipeline_parallel"])
    out: Results = {
        "initial_state": backend.state_dict(),
        "batch_routing": backend.routing(INPUT_IDS, LENGTHS),
        "batch_replayed_observed": backend.routing(INPUT_IDS, LENGTHS, MOE_REPLAYED),
        "batch_replayed_logprobs": backend.logprobs(INPUT_IDS, LENGTHS, MOE_REPLAYED),
    }
    odd_ids, odd_lengths = INPUT_IDS[:, :ODD_WIDTH], LENGTHS.clamp(max=ODD_WIDTH)
    out["odd_routing"] = backend.routing(odd_ids, odd_lengths)
    out["odd_replayed_observed"] = backend.routing(odd_ids, odd_lengths, MOE_REPLAYED[:, :ODD_WIDTH])
    out["odd_replayed_logprobs"] = backend.logprobs(odd_ids, odd_lengths, MOE_REPLAYED[:, :ODD_WIDTH])
    out["steps"] = [backend.train_step(MOE_MICRO_BATCHES, _loss_fn) for _ in range(MOE_STEPS)]
    out["trained_state"] = backend.state_dict()
    return out


def _data_parallel(rank: int, inputs: Results) -> Results:
    backend = _backend(pipeline_parallel=inputs["pipeline_parallel"])
    coords = backend.parallel_coords()
    result = backend.train_step([MICRO_BATCHES[coords["data_parallel"]]], _loss_fn)
    token_sum = _backend(pipeline_parallel=inputs["pipeline_parallel"])
    token_result = token_sum.train_step([MICRO_BATCHES[coords["data_parallel"]]], _token_sum_loss_fn)
    return {
        "coords": coords, "result": result, "state": backend.state_dict(), "data_parallel": backend.data_parallel,
        "token_sum": {"result": token_result, "state": token_sum.state_dict()},
    }


def _group_timeout(rank: int, inputs: Results) -> Results:
    """TP=2 with megatron's groups timing out after 3 s: rank 0 scores a batch, rank 1 never joins the all-reduce."""
    backend = MegatronGPTBackend(CONFIG, tensor_parallel=2, pipeline_parallel=1, seed=SEED, group_timeout_s=3.0)
    out: Results = {}
    if rank == 0:
        began = time.monotonic()
        out["error"] = _capture(lambda: backend.logprobs(INPUT_IDS, LENGTHS))
        out["seconds"] = time.monotonic() - began
    return out


SCENARIOS: dict[str, Callable[[int, Results], Results]] = {
    "group_timeout": _group_timeout,
    "single_rank": _single_rank,
    "model_parallel": _model_parallel,
    "data_parallel": _data_parallel,
    "moe_single_rank": _moe_single_rank,
    "moe_model_parallel": _moe_model_parallel,
}


# -- worlds --------------------------------------------------------------------------------------------


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank: int, world: int, store: str, scenario: str, inputs: bytes, results: Any) -> None:
    """One rank: join the gloo group through ``store``, run ``scenario``, send ``(rank, ok, payload)``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        payload = _dumps(SCENARIOS[scenario](rank, _loads(inputs)))
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - the traceback is the result
        results.put((rank, False, traceback.format_exc()))


def _run_world(world: int, scenario: str, tmp: Path, inputs: Results | None = None) -> list[Results]:
    """Run ``scenario`` on ``world`` fresh ranks; their results by rank. Fails the test on a rank's error or a hang."""
    context = mp.get_context("forkserver")
    # The fork server imports megatron once; each rank forks from it instead of importing it again.
    context.set_forkserver_preload([__name__])
    results = context.Queue()
    store = tmp / f"{scenario}-{world}-{time.monotonic_ns()}.store"
    ranks = [
        context.Process(target=_rank_main, args=(r, world, str(store), scenario, _dumps(inputs or {}), results))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    got: dict[int, Results] = {}
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    try:
        while len(got) < world:
            if time.monotonic() > deadline:
                pytest.fail(f"world {scenario!r} of {world} ranks did not finish in {WORLD_TIMEOUT_S:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"world {scenario!r}: a rank exited with code {dead[0]} before reporting")
                continue
            if not ok:
                pytest.fail(f"world {scenario!r}, rank {rank} raised:\n{payload}")
            got[rank] = _loads(payload)
        for process in ranks:
            process.join(timeout=30)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    return [got[r] for r in range(world)]


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for this module's rendezvous files."""
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def single(world_dir: Path) -> Results:
    """The single-rank world's results: the reference every other layout is checked against."""
    return _run_world(1, "single_rank", world_dir)[0]


@pytest.fixture(scope="module")
def tensor_parallel(world_dir: Path, single: Results) -> list[Results]:
    """Results of the TP=2 world, by rank; it also loads the single rank's trained state."""
    inputs = {"tensor_parallel": 2, "pipeline_parallel": 1, "state": single["trained_state"]}
    return _run_world(2, "model_parallel", world_dir, inputs)


@pytest.fixture(scope="module")
def pipeline_parallel(world_dir: Path, single: Results) -> list[Results]:
    """Results of the PP=2 world, by rank; it also loads the single rank's trained state."""
    inputs = {"tensor_parallel": 1, "pipeline_parallel": 2, "state": single["trained_state"]}
    return _run_world(2, "model_parallel", world_dir, inputs)


@pytest.fixture(scope="module")
def data_parallel(world_dir: Path) -> list[Results]:
    """Results of the DP=2 x PP=2 world: replica d takes one step on micro-batch d alone."""
    return _run_world(4, "data_parallel", world_dir, {"pipeline_parallel": 2})


@pytest.fixture(scope="module")
def moe_single(world_dir: Path) -> Results:
    """The single-rank MoE world's results."""
    return _run_world(1, "moe_single_rank", world_dir)[0]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
def moe_model_parallel(request: pytest.FixtureRequest, world_dir: Path) -> list[Results]:
    """Results of the MoE TP=2, PP=2 and TP=2 x PP=2 worlds, by rank."""
    tp, pp = request.param
    return _run_world(tp * pp, "moe_model_parallel", world_dir, {"tensor_parallel": tp, "pipeline_parallel": pp})


def _real(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """BoolTensor[B, S]: the positions before each row's length."""
    return torch.arange(seq)[None, :] < lengths[:, None]


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0.0, atol=atol) for k in a)


def _losses(steps: list[dict[str, Any]]) -> list[float]:
    return [step["loss"] for step in steps]


def _grad_norms(steps: list[dict[str, Any]]) -> list[float]:
    return [step["grad_norm"] for step in steps]


# -- in-process checks (no process group) --------------------------------------------------------------


def test_megatron_backend_implements_the_model_port() -> None:
    """MegatronGPTBackend is a PolicyBackend: every method of the port, with the port's parameters."""
    assert issubclass(MegatronGPTBackend, PolicyBackend)
    members = [name for name in vars(PolicyBackend) if not name.startswith("_") and callable(getattr(PolicyBackend, name))]
    assert {"logprobs", "reference_logprobs", "train_step", "state_dict", "load_state_dict", "generate"} <= set(members)
    for name in members:
        port = inspect.signature(getattr(PolicyBackend, name)).parameters
        assert inspect.signature(getattr(MegatronGPTBackend, name)).parameters.keys() == port.keys(), name


def test_backend_rejects_context_parallel() -> None:
    """context_parallel > 1 is refused: the local layer spec has no context-parallel attention."""
    with pytest.raises(ValueError, match=r"'context_parallel' must be 1 .*: got 2"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, context_parallel=2, seed=SEED)


def test_backend_rejects_sizes_that_do_not_divide_the_model() -> None:
    """TP must divide the heads and PP the layers."""
    with pytest.raises(ValueError, match=r"'tensor_parallel' \(3\) must divide num_attention_heads: got .* = 4"):
        MegatronGPTBackend(CONFIG, tensor_parallel=3, pipeline_parallel=1, seed=SEED)
    with pytest.raises(ValueError, match=r"'pipeline_parallel' \(4\) must divide num_layers: got num_layers = 2"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=4, seed=SEED)


def test_backend_rejects_unknown_device_and_bad_learning_rate() -> None:
    """device is "cpu" or "cuda"; learning_rate is a positive float."""
    with pytest.raises(ValueError, match=r"'device' must be one of \['cpu', 'cuda'\]: got 'tpu'"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED, device="tpu")
    with pytest.raises(TypeError, match=r"'learning_rate' must be float: got int \(1\)"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED, learning_rate=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'learning_rate' must be positive: got -0.1"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED, learning_rate=-0.1)


def test_backend_requires_initialised_process_group() -> None:
    """Without torch.distributed initialised the backend says which call is missing, and patches nothing."""
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch.distributed must be initialised .*init_process_group"):
        MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED)
    assert not cpu_shim_applied(), "a refused backend must not have patched this process"


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_to_router_order_shards_the_padded_sequence_and_merge_sequence_shards_joins_them(ranks: int) -> None:
    """Sequence-parallel rank r replays rows t * B + b of positions [r * S'/n, (r + 1) * S'/n) of the routing padded
    to S' = padded_length(S, n) (padding as experts 0 .. topk - 1); merging the n shards gives the routing back."""
    routed, lengths = MOE_REPLAYED[:, :ODD_WIDTH], LENGTHS.clamp(max=ODD_WIDTH)
    rows, topk = routed.shape[0], MOE_CONFIG.moe_topk
    replayed = pad_routing_for_replay(routed, lengths)
    per_rank = padded_length(ODD_WIDTH, ranks) // ranks
    for layer in range(MOE_CONFIG.num_layers):
        shards = [to_router_order(ready_for_replay(routed, lengths, ranks), layer, (r, ranks)) for r in range(ranks)]
        for r, shard in enumerate(shards):
            assert shard.shape == (per_rank * rows, topk)
            for t in range(per_rank):
                position = r * per_rank + t
                expected = replayed[:, position, layer] if position < ODD_WIDTH else torch.arange(topk).expand(rows, -1)
                assert torch.equal(shard[t * rows : (t + 1) * rows], expected), (r, t)
        assert torch.equal(merge_sequence_shards(shards, rows, ODD_WIDTH), replayed[:, :, layer])


# megatron-core 0.16.1 warns on building any TransformerConfig (its default cuda_graph_scope) and an MoE one.
_CONFIG_WARNINGS = (
    "ignore:full scope is deprecated:UserWarning",
    "ignore:moe_ffn_hidden_size is not set:UserWarning",
)


@pytest.mark.filterwarnings(*_CONFIG_WARNINGS)
def test_transformer_config_is_sequence_parallel_only_for_moe_under_tensor_parallel() -> None:
    """An MoE model under TP runs sequence parallel; a dense model (any TP) and an MoE model without TP do not."""
    assert transformer_config(MOE_CONFIG, 2, 1).sequence_parallel
    assert not transformer_config(MOE_CONFIG, 1, 2).sequence_parallel
    assert not transformer_config(CONFIG, 2, 1).sequence_parallel


@pytest.mark.filterwarnings(*_CONFIG_WARNINGS)
def test_sequence_parallel_layer_norm_flags_its_parameters_and_rejects_rms_norm() -> None:
    """The norm is torch's LayerNorm with both parameters flagged for megatron's TP gradient sum; RMSNorm is refused."""
    config = transformer_config(MOE_CONFIG, 2, 1)
    norm = SequenceParallelLayerNorm(config, MOE_CONFIG.hidden_size, eps=1e-5)
    assert type(norm) is torch.nn.LayerNorm and norm.normalized_shape == (MOE_CONFIG.hidden_size,)
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True, True]
    config.normalization = "RMSNorm"
    with pytest.raises(ValueError, match=r"'normalization' must be 'LayerNorm': got 'RMSNorm'"):
        SequenceParallelLayerNorm(config, MOE_CONFIG.hidden_size)


# -- single rank ---------------------------------------------------------------------------------------


def test_apply_cpu_shim_is_idempotent_and_maps_cuda_to_cpu(single: Results) -> None:
    """The shim is off until applied; a second call pushes nothing more; CUDA allocations land on CPU, also inside
    a custom autograd Function's backward."""
    assert single["shim_before"] is False
    assert single["shim_depth_change"] == 0
    assert single["shim_cuda_tensor_device"] == torch.device("cpu")
    assert single["shim_current_device"] == 0
    assert torch.equal(single["shim_backward_grad"], torch.full((3,), 2.0))  # allocated on CPU inside backward


def test_logprobs_shape_sign_and_zero_convention(single: Results) -> None:
    """[B, S] float32, finite; 0 at position 0 and past each length, negative on every scored token."""
    logprobs = single["logprobs"]
    assert logprobs.shape == INPUT_IDS.shape and logprobs.dtype == torch.float32
    assert torch.isfinite(logprobs).all()
    positions = torch.arange(INPUT_IDS.shape[1])[None, :]
    scored = (positions >= 1) & (positions < LENGTHS[:, None])
    assert (logprobs[~scored] == 0).all()
    assert (logprobs[scored] < 0).all()


def test_logprobs_normalised_over_the_next_token(single: Results) -> None:
    """For a fixed prefix, the next-token probabilities over the whole vocabulary sum to 1."""
    total = torch.logsumexp(single["continuation_logprobs"], dim=0)
    assert abs(float(total)) < 1e-5


def test_logprobs_causal_and_blind_to_padding(single: Results) -> None:
    """Changing token t leaves positions < t bitwise unchanged and changes position t; padding never matters."""
    before, mutated = single["logprobs"], single["mutated_logprobs"]
    assert torch.equal(before[:, :6], mutated[:, :6])
    long_rows = LENGTHS > 6
    assert (before[long_rows, 6] != mutated[long_rows, 6]).all()
    assert torch.equal(single["repadded_logprobs"], before)


def test_logprobs_deterministic_for_a_seed(single: Results) -> None:
    """Same seed and inputs give bitwise the same log-probs (same backend or a new one); another seed differs."""
    assert torch.equal(single["logprobs_again"], single["logprobs"])
    assert torch.equal(single["twin_logprobs"], single["logprobs"])
    assert not torch.allclose(single["other_seed_logprobs"], single["logprobs"])


def test_logprobs_runs_on_a_thread_other_than_the_builder(single: Results) -> None:
    """The CPU remap is per thread; a call from another thread (as a Ray actor may make) still works, bitwise."""
    assert single["logprobs_from_other_thread"] is not None
    assert torch.equal(single["logprobs_from_other_thread"], single["logprobs"])


def test_reference_logprobs_equal_initial_policy_and_stay_frozen(single: Results) -> None:
    """The reference starts as the policy and training never moves it."""
    assert torch.equal(single["reference_logprobs"], single["logprobs"])
    assert torch.equal(single["reference_logprobs_after"], single["reference_logprobs"])
    assert _states_equal(single["reference_state_after"], single["initial_state"])


def test_train_step_lowers_loss_on_a_repeated_batch(single: Results) -> None:
    """Repeating one batch, each step lowers the loss; grad norms are positive and finite; weights move."""
    losses = _losses(single["steps"])
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(0 < step["grad_norm"] < math.inf for step in single["steps"])
    assert not torch.allclose(single["trained_logprobs"], single["logprobs"])


def test_train_step_reports_mean_loss_and_per_micro_batch_metrics(single: Results) -> None:
    """loss is the mean of the micro-batch losses; each micro-batch reports its own metrics."""
    first = single["steps"][0]
    assert len(first["metrics"]) == len(MICRO_BATCHES)
    assert first["loss"] == pytest.approx(sum(m["loss"] for m in first["metrics"]) / len(MICRO_BATCHES))
    assert [m["tokens"] for m in first["metrics"]] == [float((mb["lengths"] - 1).sum()) for mb in MICRO_BATCHES]
    expected = _loss_fn(single["logprobs"][:2], MICRO_BATCHES[0])[0]
    assert first["metrics"][0]["loss"] == pytest.approx(float(expected), rel=1e-6)


def test_train_step_deterministic_for_a_seed(single: Results) -> None:
    """Two backends with one seed and one batch report bitwise-equal losses and grad norms and end equal."""
    assert single["twin_steps"] == single["steps"]
    assert _states_equal(single["twin_trained_state"], single["trained_state"])


def test_state_dict_round_trip_restores_logprobs(single: Results) -> None:
    """Loading the initial state back gives bitwise the initial log-probs."""
    assert torch.equal(single["reloaded_logprobs"], single["logprobs"])
    shapes = {name: tuple(t.shape) for name, t in single["initial_state"].items()}
    assert shapes["embedding.word_embeddings.weight"] == (CONFIG.vocab_size, CONFIG.hidden_size)
    assert shapes[f"decoder.layers.{CONFIG.num_layers - 1}.mlp.linear_fc1.weight"] == (
        CONFIG.ffn_hidden_size,
        CONFIG.hidden_size,
    )


def test_logprobs_rejects_malformed_batches(single: Results) -> None:
    """Float ids, tokens outside the vocabulary, and lengths out of range, of the wrong count or dtype are refused."""
    errors = single["errors"]
    with pytest.raises(TypeError, match=r"'input_ids' must be a LongTensor\[B, S\]: got torch.float32"):
        _reraise(errors["float_ids"])
    with pytest.raises(ValueError, match=r"'input_ids' must lie in \[0, 32\): got values in \[32, "):
        _reraise(errors["token_out_of_vocab"])
    with pytest.raises(ValueError, match=r"'lengths' must lie in \[1, 12\]: got \[13, 8, 4, 11\]"):
        _reraise(errors["length_too_long"])
    with pytest.raises(ValueError, match=r"'lengths' must have shape \(4,\) \(one per row\): got \(3,\)"):
        _reraise(errors["lengths_wrong_count"])
    with pytest.raises(TypeError, match=r"'lengths' must be an int tensor: got torch.float32"):
        _reraise(errors["float_lengths"])


def test_train_step_rejects_malformed_micro_batches_and_losses(single: Results) -> None:
    """An empty list, a micro-batch without lengths, and a non-scalar loss are refused."""
    errors = single["errors"]
    with pytest.raises(TypeError, match=r"'micro_batches' must be a non-empty list of dicts: got list of length 0"):
        _reraise(errors["empty_micro_batches"])
    with pytest.raises(ValueError, match=r"'micro_batches\[0\]' must map 'input_ids' and 'lengths'.*: got \['input_ids'\]"):
        _reraise(errors["micro_batch_without_lengths"])
    with pytest.raises(TypeError, match=r"'loss_fn' loss must be a scalar tensor: got Tensor \(2,\)"):
        _reraise(errors["loss_not_scalar"])
    with pytest.raises(ValueError, match=r"'loss_fn' count must be >= 0: got -1"):
        _reraise(errors["count_negative"])
    with pytest.raises(TypeError, match=r"'loss_fn' count must be an int or an integer scalar tensor: got torch.float32"):
        _reraise(errors["count_float"])
    with pytest.raises(TypeError, match=r"'loss_fn' must return \(summed loss, count, metrics dict\) .*: got a tuple of 4"):
        _reraise(errors["four_parts"])


def test_a_summed_loss_trains_on_the_token_mean_whatever_the_micro_batch_split(single: Results) -> None:
    """With (summed loss, token count), one step on the rows in two micro-batches of unequal token counts takes the
    gradient of one step on them as one micro-batch; the mean-form loss (count 1 each) weights micro-batches, not
    tokens, so its gradient differs. The reported loss is the token mean, with the tokens as its weight.

    The grad norm is the check: Adam's first step is about ``lr * sign(grad)`` per weight, so the states show a
    weighting only where a gradient changes sign, and components whose gradient is 0 in exact arithmetic (the key
    bias) move by rounding noise; the states are compared at a tolerance (1e-4, a tenth of ``lr``) above that."""
    runs = single["token_mean"]
    tokens = [int((mb["lengths"] - 1).sum()) for mb in MICRO_BATCHES]
    assert tokens[0] != tokens[1]  # else the two reductions agree
    assert runs["split"]["result"]["grad_norm"] == pytest.approx(runs["whole"]["result"]["grad_norm"], rel=1e-6)
    assert runs["whole"]["result"]["grad_norm"] == pytest.approx(runs["mean_whole"]["result"]["grad_norm"], rel=1e-6)
    assert single["one_step"]["result"]["grad_norm"] != pytest.approx(runs["split"]["result"]["grad_norm"], rel=1e-2)
    assert _states_close(runs["split"]["state"], runs["whole"]["state"], atol=1e-4)
    assert runs["split"]["result"]["loss_weight"] == sum(tokens) == runs["whole"]["result"]["loss_weight"]
    split = runs["split"]["result"]
    assert split["loss"] == split["loss_sum"] / split["loss_weight"]
    assert runs["split"]["result"]["loss"] == pytest.approx(runs["whole"]["result"]["loss"], rel=1e-6)
    assert runs["whole"]["result"]["loss"] == pytest.approx(runs["mean_whole"]["result"]["loss"], rel=1e-6)
    per_micro_batch = [m["loss"] for m in runs["split"]["result"]["metrics"]]
    assert per_micro_batch == pytest.approx([m["loss"] for m in single["one_step"]["result"]["metrics"]], rel=1e-6)
    assert single["one_step"]["result"]["loss_weight"] == len(MICRO_BATCHES)


def test_load_state_dict_rejects_missing_keys_and_wrong_shapes(single: Results) -> None:
    """A state must have exactly the model's keys, each with its full shape."""
    errors = single["errors"]
    with pytest.raises(ValueError, match=r"'state' must have exactly the model's \d+ keys: missing \['output_layer.weight'"):
        _reraise(errors["state_missing_key"])
    with pytest.raises(ValueError, match=r"'state\['output_layer.weight'\]' must have shape \(32, 64\): got \(3, 3\)"):
        _reraise(errors["state_wrong_shape"])


# -- tensor, pipeline and data parallel ----------------------------------------------------------------


def test_generate_is_deterministic_for_a_generator_seed(single: Results) -> None:
    """The same weights, prompts and generator seed give the same tokens; another seed gives others."""
    first, again = single["generated"], single["generated_again"]
    assert torch.equal(first.sequences, again.sequences) and torch.equal(first.lengths, again.lengths)
    assert torch.equal(first.entropy, again.entropy)
    assert not torch.equal(first.sequences, single["generated_other_seed"].sequences)


def test_generate_keeps_prompts_and_stops_at_the_first_eos(single: Results) -> None:
    """Each row is its prompt, then 1..max_new_tokens sampled tokens ending at the first EOS, then zeros."""
    seqs, lengths = single["generated"].sequences, single["generated"].lengths
    assert lengths.dtype == torch.long and seqs.shape[1] == int(lengths.max())
    for row in range(len(GEN_PROMPTS)):
        start, end = int(GEN_PROMPT_LENGTHS[row]), int(lengths[row])
        assert torch.equal(seqs[row, :start], GEN_PROMPTS[row, :start])
        assert 1 <= end - start <= GEN_NEW_TOKENS
        response = seqs[row, start:end].tolist()
        assert GEN_EOS not in response[:-1]
        assert response[-1] == GEN_EOS or len(response) == GEN_NEW_TOKENS
        assert not seqs[row, end:].any()


def test_generate_samples_only_below_the_vocab_limit(single: Results) -> None:
    """With vocab_limit, every sampled token id is below it."""
    seqs, lengths = single["generated_limited"].sequences, single["generated_limited"].lengths
    for row in range(len(GEN_PROMPTS)):
        assert max(seqs[row, int(GEN_PROMPT_LENGTHS[row]) : int(lengths[row])].tolist()) < GEN_VOCAB_LIMIT


@pytest.mark.parametrize(("name", "vocab"), [("generated", CONFIG.vocab_size), ("generated_limited", GEN_VOCAB_LIMIT)])
def test_generate_entropy_matches_the_scored_distributions(single: Results, name: str, vocab: int) -> None:
    """Per row, the entropy is the summed entropy of each response token's (masked) distribution, in [0, n log V]."""
    generation: Generation = single[name]
    tokens = (generation.lengths - GEN_PROMPT_LENGTHS).double()
    assert generation.entropy.dtype == torch.float64 and generation.entropy.shape == (len(GEN_PROMPTS),)
    assert bool((generation.entropy >= 0).all()) and bool((generation.entropy <= tokens * math.log(vocab) + 1e-6).all())
    assert torch.allclose(generation.entropy, single["reference_entropy"][name], rtol=1e-4, atol=1e-5)


def test_generate_rejects_bad_arguments_and_model_parallel_layouts(
    single: Results, tensor_parallel: list[Results]
) -> None:
    """Out-of-range sizes, temperature and vocab limit are ValueErrors; a TP layout cannot generate."""
    errors = single["generate_errors"]
    for name, pattern in (
        ("no_new_tokens", "'max_new_tokens' must be >= 1"),
        ("zero_temperature", "'temperature' must be a number > 0"),
        ("too_long", "max_sequence_length"),
        ("vocab_limit_zero", "'vocab_limit' must be in"),
    ):
        with pytest.raises(ValueError, match=pattern):
            _reraise(errors[name])
    with pytest.raises(ValueError, match="tensor_parallel = pipeline_parallel = 1"):
        _reraise(tensor_parallel[0]["generate_error"])


def test_tensor_parallel_matches_single_rank(single: Results, tensor_parallel: list[Results]) -> None:
    """TP=2 starts from the same weights, agrees across its ranks, and tracks the single rank through training."""
    rank0, rank1 = tensor_parallel
    for key in ("logprobs", "trained_logprobs", "loaded_logprobs"):
        assert torch.equal(rank0[key], rank1[key]), key
    assert _states_equal(rank0["initial_state"], single["initial_state"])
    assert torch.allclose(rank0["logprobs"], single["logprobs"], rtol=0.0, atol=1e-5)
    assert torch.allclose(rank0["reference_logprobs"], single["reference_logprobs"], rtol=0.0, atol=1e-5)
    assert _losses(rank0["steps"]) == pytest.approx(_losses(single["steps"]), rel=1e-5)
    assert _grad_norms(rank0["steps"]) == pytest.approx(_grad_norms(single["steps"]), rel=1e-4)
    assert _states_close(rank0["trained_state"], single["trained_state"], atol=1e-4)
    assert torch.allclose(rank0["loaded_logprobs"], single["trained_logprobs"], rtol=0.0, atol=1e-5)


def test_pipeline_parallel_matches_single_rank_bitwise(single: Results, pipeline_parallel: list[Results]) -> None:
    """PP=2 gives bitwise the single rank's log-probs, losses and trained weights on both stages."""
    for rank in pipeline_parallel:
        for key in ("logprobs", "reference_logprobs", "trained_logprobs"):
            assert torch.equal(rank[key], single[key]), key
        assert torch.equal(rank["loaded_logprobs"], single["trained_logprobs"])
        assert _losses(rank["steps"]) == _losses(single["steps"])
        assert [m["metrics"] for m in rank["steps"]] == [m["metrics"] for m in single["steps"]]
        assert _grad_norms(rank["steps"]) == pytest.approx(_grad_norms(single["steps"]), rel=1e-6)
        assert _states_equal(rank["trained_state"], single["trained_state"])


def test_data_parallel_averages_gradients_and_keeps_replicas_identical(
    single: Results, data_parallel: list[Results]
) -> None:
    """Two 2-stage replicas stepping on one micro-batch each end identical, at the single rank's state after both."""
    assert all(rank["data_parallel"] == 2 for rank in data_parallel)
    for rank in data_parallel[1:]:
        assert _states_equal(rank["state"], data_parallel[0]["state"])
        assert rank["result"]["grad_norm"] == data_parallel[0]["result"]["grad_norm"]
    assert data_parallel[0]["result"]["grad_norm"] == pytest.approx(single["one_step"]["result"]["grad_norm"], rel=1e-5)
    own = [rank["result"]["loss"] for rank in data_parallel[:2]]  # ranks 0 and 1: stage 0 of replicas 0 and 1
    assert own == pytest.approx([m["loss"] for m in single["one_step"]["result"]["metrics"]], rel=1e-6)
    assert _states_close(data_parallel[0]["state"], single["one_step"]["state"], atol=1e-6)


def test_megatrons_groups_time_out_after_the_given_group_timeout(world_dir: Path) -> None:
    """A TP collective whose peer never comes fails after ``group_timeout_s`` (3 s), not megatron's 30 minutes."""
    rank0 = _run_world(2, "group_timeout", world_dir)[0]
    assert isinstance(rank0["error"], RuntimeError), rank0["error"]
    assert 2.5 < rank0["seconds"] < 30, rank0["seconds"]


def test_group_timeout_must_be_positive_seconds() -> None:
    """A non-positive, infinite or non-number group timeout is refused before anything is set up."""
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"'group_timeout_s' must be finite and > 0: got"):
            MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED, group_timeout_s=bad)
    for wrong in (True, "3"):
        with pytest.raises(TypeError, match=r"'group_timeout_s' must be a number of seconds or None: got"):
            MegatronGPTBackend(CONFIG, tensor_parallel=1, pipeline_parallel=1, seed=SEED, group_timeout_s=wrong)


def test_data_parallel_divides_a_summed_loss_by_the_token_count_over_every_rank(
    single: Results, data_parallel: list[Results]
) -> None:
    """Replicas stepping on one micro-batch each with (summed loss, tokens) reach the single rank's state after one
    step on the whole batch: the count is summed over the DP ranks, not each replica's own."""
    whole = single["token_mean"]["whole"]
    for rank in data_parallel:
        assert rank["token_sum"]["result"]["grad_norm"] == pytest.approx(whole["result"]["grad_norm"], rel=1e-6)
        assert _states_close(rank["token_sum"]["state"], whole["state"], atol=1e-4)  # see the token-mean law above
    own = [rank["token_sum"]["result"]["loss_weight"] for rank in data_parallel[:2]]
    assert own == [float((mb["lengths"] - 1).sum()) for mb in MICRO_BATCHES]


@pytest.mark.parametrize(
    ("world", "sizes"),
    [
        ("tensor_parallel", {"tensor_parallel": 2}),
        ("pipeline_parallel", {"pipeline_parallel": 2}),
        ("data_parallel", {"pipeline_parallel": 2, "data_parallel": 2}),
    ],
)
def test_parallel_coords_follow_the_topology_rank_order(
    world: str, sizes: dict[str, int], request: pytest.FixtureRequest
) -> None:
    """megatron's groups put each rank at NamedSharding's coordinates: rank = ((pp*DP + dp)*CP + cp)*TP + tp."""
    ranks = request.getfixturevalue(world)
    sharding = NamedSharding(sizes)
    assert len(ranks) == sharding.world_size
    assert [rank["coords"] for rank in ranks] == [dict(sharding.coords(r)) for r in range(sharding.world_size)]


@pytest.mark.parametrize("name", ["generated", "generated_limited", "generated_hot_limited"])
def test_generate_records_each_drawn_tokens_behaviour_logprob(single: Results, name: str) -> None:
    """``Generation.logprobs`` holds, at each response position, the drawn token's log-probability as the policy's
    own ``logprobs`` scores the sequences (to float tolerance: a different forward shape), whatever the draw's
    temperature (0.7) and vocabulary limit: an importance weight against the trainer's log-probs is then 1 for
    equal weights. It is 0 at prompt and padding positions and < 0 where a token was drawn."""
    generated: Generation = single[name]
    positions = torch.arange(generated.sequences.shape[1])[None, :]
    response = (positions >= GEN_PROMPT_LENGTHS[:, None]) & (positions < generated.lengths[:, None])
    assert generated.logprobs.shape == generated.sequences.shape and generated.logprobs.dtype == torch.float32
    assert torch.all(generated.logprobs[~response] == 0)
    assert torch.all(generated.logprobs[response] < 0)
    torch.testing.assert_close(generated.logprobs[response], single[f"{name}_rescored"][response], atol=1e-5, rtol=1e-5)


# -- MoE: routing record and replay ----------------------------------------------------------------------


def test_moe_model_has_per_layer_router_and_experts_drawn_by_name(moe_single: Results) -> None:
    """An MoE model has one router and num_experts expert MLPs per layer, no linear biases, each expert drawn apart."""
    state = moe_single["initial_state"]
    for layer in range(MOE_CONFIG.num_layers):
        prefix = f"decoder.layers.{layer}.mlp."
        assert state[prefix + "router.weight"].shape == (MOE_CONFIG.num_experts, MOE_CONFIG.hidden_size)
        experts = [state[f"{prefix}experts.local_experts.{e}.linear_fc1.weight"] for e in range(MOE_CONFIG.num_experts)]
        assert all(not torch.equal(experts[0], other) for other in experts[1:])
    assert not any(name.endswith("linear_qkv.bias") or ".linear_fc1.bias" in name for name in state)


def test_generate_records_moe_routing_aligned_with_tokens_and_padded(moe_single: Results) -> None:
    """routed_experts is [B, L, layers, topk] int64: distinct experts in range (ascending) at real tokens, -1 past each length."""
    gen = moe_single["generated"]
    routed = gen.routed_experts
    rows, seq = gen.sequences.shape
    assert routed.shape == (rows, seq, MOE_CONFIG.num_layers, MOE_CONFIG.moe_topk) and routed.dtype == torch.int64
    real = _real(gen.lengths, seq)
    assert bool((routed[~real] == -1).all())
    experts = routed[real]
    assert bool(((experts >= 0) & (experts < MOE_CONFIG.num_experts)).all())
    assert bool((experts[..., 1:] > experts[..., :-1]).all())
    assert moe_single["dense_generation_routing"] is None


def test_generate_routing_equals_a_fresh_forward_and_each_row_alone(moe_single: Results) -> None:
    """The recorded routing is a fresh fp32 forward's, and a row's routing is its own alone (token order t * B + b)."""
    gen = moe_single["generated"]
    assert torch.equal(moe_single["fresh_routing"], gen.routed_experts)
    for row, alone in enumerate(moe_single["row_alone_routing"]):
        assert torch.equal(alone, gen.routed_experts[row, : int(gen.lengths[row])]), row


def test_logprobs_replaying_the_recorded_routing_are_bitwise_unchanged(moe_single: Results) -> None:
    """Replaying the routing the same fp32 weights chose gives bitwise the log-probs of routing by score on a batch
    without padding, where every token goes where its scores sent it. On a padded batch the replay sends the
    padding to experts 0 .. topk-1, not where their scores would, so the experts' batch sizes change, and on some
    CPUs (an AVX-512 Xeon) so does the rounding of a few real tokens' log-probs: there they agree within float
    rounding."""
    assert torch.equal(moe_single["unpadded_replayed_logprobs"], moe_single["unpadded_logprobs"])
    torch.testing.assert_close(moe_single["replayed_logprobs"], moe_single["logprobs"], rtol=0.0, atol=1e-5)


def test_replay_routes_every_real_token_as_given_and_ignores_padding(moe_single: Results) -> None:
    """Under a replayed unrelated routing the trainer dispatches 100% of real tokens as given; padding ids change nothing."""
    gen = moe_single["generated"]
    other = moe_single["other_routing"]
    assert torch.equal(moe_single["other_observed"], other)
    assert not torch.equal(moe_single["other_logprobs"], moe_single["logprobs"])
    assert torch.equal(moe_single["junk_padding_logprobs"], moe_single["other_logprobs"])
    assert int(_real(gen.lengths, gen.sequences.shape[1]).sum()) > 0


def test_reference_logprobs_replay_into_the_reference_models_own_routers(moe_single: Results) -> None:
    """The frozen reference replays like the initial policy, and stays so after the policy trains on replayed batches."""
    assert torch.equal(moe_single["reference_other_logprobs"], moe_single["other_logprobs"])
    assert torch.equal(moe_single["reference_after"], moe_single["other_logprobs"])


def test_train_step_replays_each_micro_batchs_routing(moe_single: Results) -> None:
    """The first step's loss on a replayed micro-batch is the loss of the replayed log-probs; training lowers it."""
    steps = moe_single["steps"]
    first = steps[0]["metrics"][0]["loss"]
    assert first == pytest.approx(moe_single["first_micro_batch_loss_from_logprobs"], rel=1e-6)
    assert steps[1]["loss"] < steps[0]["loss"]
    assert all(math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0 for step in steps)


def test_bf16_rollout_routing_disagrees_with_the_trainer_until_replayed(moe_single: Results) -> None:
    """A bf16 rollout routes some tokens differently from the fp32 trainer; replay makes them agree on every real token."""
    gen = moe_single["bf16_generated"]
    real = _real(gen.lengths, gen.sequences.shape[1])
    recorded = gen.routed_experts[real]
    disagree = (moe_single["bf16_trainer_routing"][real] != recorded).any(dim=-1).float().mean()
    assert 0.0 < float(disagree) < 0.1, float(disagree)
    assert torch.equal(moe_single["bf16_replayed_routing"][real], recorded)


def test_moe_routing_rejects_dense_models_and_malformed_routings(moe_single: Results) -> None:
    """A dense model has no routing; a routing of the wrong shape or dtype, out of range, with a repeat or a missing
    route at a real token is refused, naming the row, token and layer."""
    errors = moe_single["errors"]
    for name, kind, pattern in (
        ("dense_routing", ValueError, r"'routing' needs an MoE model"),
        ("dense_replay", ValueError, r"'routed_experts' needs an MoE model"),
        ("wrong_shape", ValueError, r"'routed_experts' must have shape \(4, 12, 2, 2\) .*: got \(4, 5, 2, 2\)"),
        ("float_routing", TypeError, r"'routed_experts' must be an integer tensor .*: got torch.float32"),
        ("out_of_range", ValueError, r"^routed_experts row 0 token 0 layer 0: expected expert ids in \[0, 4\), got 4$"),
        ("repeated_expert", ValueError, r"^routed_experts row 0 token 0 layer 0: expected 2 distinct experts, got \[1, 1\]$"),
        ("missing_route", ValueError,
         r"^routed_experts row 1 token 0 layer 1: expected a route in each of the 2 top-k slots \(ids in \[0, 4\)\), "
         r"got -1 \(no route\) in slot 0$"),
        ("bad_micro_batch_routing", ValueError, r"'micro_batches\[0\]\.routed_experts' must have shape \(2, 12, 2, 2\)"),
        ("bad_precision", ValueError, r"'precision' must be one of \['fp32', 'bf16'\]: got 'fp16'"),
    ):
        with pytest.raises(kind, match=pattern):
            _reraise(errors[name])


def test_moe_model_parallel_replays_and_trains_like_the_single_rank(
    moe_single: Results, moe_model_parallel: list[Results]
) -> None:
    """TP=2 (sequence parallel), PP=2 and TP=2 x PP=2 MoE start from the single rank's weights, route as it does,
    replay every real token exactly and track its replayed log-probs, also on a batch of odd width (TP=2 pads it),
    and train as it does: the same losses and grad norms (no expert gradient counted once per TP rank), the same
    weights."""
    real = _real(LENGTHS, INPUT_IDS.shape[1])
    odd_real = _real(LENGTHS.clamp(max=ODD_WIDTH), ODD_WIDTH)
    for rank in moe_model_parallel:
        assert _states_equal(rank["initial_state"], moe_single["initial_state"])
        assert torch.equal(rank["batch_routing"], moe_single["batch_routing"])
        assert torch.equal(rank["batch_replayed_observed"][real], MOE_REPLAYED[real])
        assert bool((rank["batch_replayed_observed"][~real] == -1).all())
        assert torch.allclose(rank["batch_replayed_logprobs"], moe_single["batch_replayed_logprobs"], rtol=0.0, atol=1e-5)
        assert rank["odd_routing"].shape == (*INPUT_IDS[:, :ODD_WIDTH].shape, MOE_CONFIG.num_layers, MOE_CONFIG.moe_topk)
        assert torch.equal(rank["odd_routing"][odd_real], moe_single["batch_routing"][:, :ODD_WIDTH][odd_real])
        assert bool((rank["odd_routing"][~odd_real] == -1).all())
        assert torch.equal(rank["odd_replayed_observed"][odd_real], MOE_REPLAYED[:, :ODD_WIDTH][odd_real])
        assert torch.allclose(
            rank["odd_replayed_logprobs"], moe_single["batch_replayed_logprobs"][:, :ODD_WIDTH], rtol=0.0, atol=1e-5
        )
        assert _losses(rank["steps"]) == pytest.approx(_losses(moe_single["steps"]), rel=1e-5)
        assert _grad_norms(rank["steps"]) == pytest.approx(_grad_norms(moe_single["steps"]), rel=1e-4)
        assert _states_close(rank["trained_state"], moe_single["trained_state"], atol=1e-4)
