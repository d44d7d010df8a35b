"""Set-up of the megatron GPT backend: megatron's model-parallel state and the model on each rank.

:func:`init_parallel_state` lays megatron's model-parallel groups over the
default ``torch.distributed`` group, and :func:`build_gpt` builds one rank's
``GPTModel`` (local layer spec, fp32, no dropout) from
:func:`transformer_config`. :func:`int_arg` and :func:`check_divides` are the
argument checks the layout's sizes go through.

MoE (``config.is_moe``): every layer's MLP is megatron's ``MoELayer`` (local
spec, one ``SequentialMLP`` of per-expert MLPs, no grouped GEMM) with
``moe_topk`` experts per token, megatron's softmax top-k router, no aux loss,
no capacity (no token is dropped), expert parallel 1 (experts are split over
TP like a dense MLP), and ``moe_enable_routing_replay`` on, so each router owns
a ``RouterReplay`` (:mod:`adapters.megatron_routing` drives it). Under TP an
MoE model runs with megatron's sequence parallelism (:func:`sequence_parallel`).
megatron refuses to train an MoE layer under TP without it, and rightly: its
token dispatcher gathers the tokens of every TP rank for the experts, so
without it every TP rank would send the same tokens, and each expert's
gradient would count every token TP times. The sequence dimension is then
split over the TP ranks between the attention and MLP blocks, so a forward's
length must be a multiple of TP (the backend pads it, :mod:`adapters.megatron_batch`),
and every layer norm is :class:`SequenceParallelLayerNorm` (megatron's local
spec has no sequence-parallel norm without Apex). Linear layers
have no bias (``add_bias_linear=False``): megatron's expert MLP adds its bias
in place on an autograd view, which autograd rejects. The token dispatcher is
``alltoall`` for dense and MoE alike: it is the one megatron allows with
``variable_seq_lengths`` (which pipeline stages need to exchange each
micro-batch's shape); on CPU its CUDA streams are the shim's stand-ins
(:mod:`adapters.megatron_cpu`, patch 5). A dense model's config is as before.

Without Transformer Engine (this project installs none), megatron-core 0.16.1
leaves ``moe_utils.te_general_gemm`` unbound, yet its MoE router's gating reads
it (``te_general_gemm is not None``): every MoE forward would raise
``NameError``, on CPU and on CUDA alike (seen on an H100). :func:`build_gpt`
binds it to ``None`` first (:func:`bind_absent_te_gemm`), which selects the
gating's plain ``torch.mm`` path.

Rank layout: ``rank = ((pp * DP + dp) * CP + cp) * TP + tp`` (tensor parallel
fastest, as :mod:`core.topology`). megatron's default order ``"tp-cp-ep-dp-pp"``
lists axes fastest first and gives exactly this mapping (expert parallel is 1),
so :func:`init_parallel_state` passes it explicitly to pin the agreement.

Invariants: a process holds one model-parallel layout (a second set-up with
other sizes raises, one with the same sizes is a no-op); every model is built
from the same recipe, so the policy and its reference differ only in weights;
:func:`parallel_coords` is this rank's coordinate in the layout above.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from core.model_config import TinyGPTConfig

__all__ = [
    "ORDER", "SequenceParallelLayerNorm", "bind_absent_te_gemm", "build_gpt", "check_divides", "init_parallel_state",
    "int_arg", "parallel_coords", "sequence_parallel", "transformer_config",
]

ORDER = "tp-cp-ep-dp-pp"


def int_arg(name: str, value: Any) -> int:
    """``value`` when it is an int (not a bool); else ``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"'{name}' must be int: got {type(value).__name__} ({value!r})")
    return value


def check_divides(name: str, size: int, what: str, total: int) -> None:
    """Nothing when ``size`` divides ``total``; else ``ValueError`` naming the axis ``name`` and ``what`` it splits."""
    if total % size:
        raise ValueError(f"'{name}' ({size}) must divide {what}: got {what} = {total}")


def init_parallel_state(tp: int, pp: int, *, timeout_s: float | None = None) -> None:
    """Set up megatron's model-parallel groups in :data:`ORDER`; a no-op when set up with these sizes.

    ``timeout_s`` is every group's timeout (None: megatron's default, 30 minutes).

    Raises:
        RuntimeError: the state is already set up with other sizes.
    """
    if parallel_state.model_parallel_is_initialized():
        got = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if got != (tp, pp):
            raise RuntimeError(
                f"megatron's model-parallel state is already set up with (tensor_parallel, pipeline_parallel) "
                f"= {got}: expected ({tp}, {pp}); call parallel_state.destroy_model_parallel() first"
            )
        return
    timeout: dict[str, float] = {} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, order=ORDER, **timeout
    )


def parallel_coords() -> dict[str, int]:
    """This rank's coordinate on each axis of :data:`core.topology.AXES`, as megatron assigned it."""
    return {
        "pipeline_parallel": parallel_state.get_pipeline_model_parallel_rank(),
        "data_parallel": parallel_state.get_data_parallel_rank(),
        "context_parallel": parallel_state.get_context_parallel_rank(),
        "tensor_parallel": parallel_state.get_tensor_model_parallel_rank(),
    }


def sequence_parallel(config: TinyGPTConfig, tp: int) -> bool:
    """Whether the model runs with megatron's sequence parallelism: an MoE model under TP (a dense model never)."""
    return config.is_moe and tp > 1


class SequenceParallelLayerNorm:
    """A ``torch.nn.LayerNorm`` whose parameters carry megatron's ``sequence_parallel`` flag (a module class for specs).

    Under sequence parallelism each TP rank normalises its own slice of the
    sequence with the same (replicated) weights, so each rank's weight
    gradient is a partial sum; megatron's ``finalize_model_grads`` sums the
    gradients of flagged parameters over TP. The arithmetic is the layer norm
    of megatron's local spec (``WrappedTorchNorm``, which refuses sequence
    parallelism), and the parameter names are the same.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.LayerNorm:
        if config.normalization != "LayerNorm":
            raise ValueError(f"'normalization' must be 'LayerNorm': got {config.normalization!r}")
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def transformer_config(config: TinyGPTConfig, tp: int, pp: int) -> TransformerConfig:
    """megatron's config for one model; the policy's also carries its DDP hooks, so each model gets its own.

    A dense model's config does not depend on :func:`sequence_parallel` (it is off).
    """
    moe: dict[str, Any] = {}
    if config.is_moe:
        moe = {
            "num_moe_experts": config.num_experts,
            "moe_router_topk": config.moe_topk,
            "moe_grouped_gemm": False,
            "moe_aux_loss_coeff": 0.0,
            "moe_enable_routing_replay": True,
            "add_bias_linear": False,
        }
        if sequence_parallel(config, tp):
            moe["sequence_parallel"] = True
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        # Weights are drawn on CPU (then replaced by the layout-free initial state).
        use_cpu_initialization=True,
        # Micro-batches may differ in shape: pipeline stages exchange each one's shape first.
        variable_seq_lengths=True,
        # megatron rejects its default "allgather" with variable lengths (unused by a dense model).
        moe_token_dispatcher_type="alltoall",
        # The loss of a train step is a sum over micro-batches divided by one count over the global batch
        # (every micro-batch of every DP rank): DDP sums gradients, finalize_model_grads divides by the count.
        calculate_per_token_loss=True,
        **moe,
    )


def _layer_spec(config: TinyGPTConfig, megatron_config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """megatron's local layer spec; under sequence parallelism, this stage's block of it with every norm
    a :class:`SequenceParallelLayerNorm` (the block spec names the final norm too)."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_experts if config.is_moe else None, moe_grouped_gemm=False)
    if not megatron_config.sequence_parallel:
        return spec
    layer = dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            spec.submodules, input_layernorm=SequenceParallelLayerNorm, pre_mlp_layernorm=SequenceParallelLayerNorm
        ),
    )
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(megatron_config), layer_norm=SequenceParallelLayerNorm
    )


def bind_absent_te_gemm() -> None:
    """Bind megatron's ``moe_utils.te_general_gemm`` to ``None`` when Transformer Engine is absent; idempotent.

    megatron-core 0.16.1 binds the name only when Transformer Engine imports, and its router gating
    (``moe_utils.RouterGatingLinearFunction``) tests it against ``None``; ``None`` selects ``torch.mm``.
    """
    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def build_gpt(config: TinyGPTConfig, tp: int, pp: int, device: torch.device) -> GPTModel:
    """This rank's stage of a fresh GPT (its own :func:`transformer_config`), on ``device``."""
    bind_absent_te_gemm()
    megatron_config = transformer_config(config, tp, pp)
    model = GPTModel(
        config=megatron_config,
        transformer_layer_spec=_layer_spec(config, megatron_config),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    return model.to(device)
