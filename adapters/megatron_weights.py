"""Layout-free weights of the megatron GPT: the full model under TP=1, PP=1 names, and each rank's shard of it.

A rank holds a slice of the model: its pipeline stage's layers (with local
layer indices) and, for tensor-parallel parameters, one chunk along the
parameter's ``partition_dim``. These functions map between that shard and
the *full* state (global layer indices, whole tensors): drawing the initial
full state (:func:`initial_state`, megatron's init scheme with one generator
per parameter seeded by ``(seed, name)``), loading a rank's slice of a full
state (:func:`load_full`), gathering the full state from the shards
(:func:`gather_full`, collective), and checking a full state against the
model's names and shapes (:func:`check_full_state`).

Invariant: the full state does not depend on the layout: ``gather_full``
after ``load_full(state)`` gives ``state`` back under any TP and PP, and
:func:`initial_state` draws the same tensors for every layout, so every layout
built with one seed starts from the same model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel

from adapters.model_port import StateDict

FullNames = dict[str, torch.Size]
"""Full-model parameter name -> full shape."""

_INIT_STD = 0.02
_LAYER_PREFIX = "decoder.layers."


def init_full_parameter(seed: int, name: str, shape: torch.Size, num_layers: int) -> torch.Tensor:
    """Parameter ``name`` of the full model, drawn from a generator seeded by ``(seed, name)``.

    megatron's init scheme: normal(0, 0.02) weights, output projections of each
    layer scaled by ``1 / sqrt(2 * num_layers)``, zero biases, unit norm weights.
    """
    if name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
    std = _INIT_STD
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = _INIT_STD / math.sqrt(2.0 * num_layers)
    return torch.randn(shape, generator=generator) * std


def initial_state(seed: int, names: FullNames, num_layers: int) -> StateDict:
    """The full initial state of the parameters ``names``, by :func:`init_full_parameter`."""
    return {name: init_full_parameter(seed, name, shape, num_layers) for name, shape in sorted(names.items())}


def global_name(model: GPTModel, local: str) -> str:
    """``local`` under full-model (PP=1) names: layer indices made global."""
    if not local.startswith(_LAYER_PREFIX):
        return local
    index, rest = local[len(_LAYER_PREFIX) :].split(".", 1)
    layer = model.decoder.layers[int(index)]
    return f"{_LAYER_PREFIX}{layer.layer_number - 1}.{rest}"


def full_shape(param: torch.Tensor, tensor_parallel: int) -> torch.Size:
    """The full-model shape of a (possibly tensor-parallel) parameter shard."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tensor_parallel
    return torch.Size(shape)


def canonical_names(model: GPTModel, tensor_parallel: int, pipeline_parallel: int, pp_group: Any) -> FullNames:
    """Full-model parameter name -> full shape, gathered over the pipeline stages (collective over ``pp_group``)."""
    local = {global_name(model, n): full_shape(p, tensor_parallel) for n, p in model.named_parameters()}
    stages: list[Any] = [None] * pipeline_parallel
    dist.all_gather_object(stages, local, group=pp_group)
    names: FullNames = {}
    for stage in stages:
        names.update(stage)
    return names


def load_full(model: GPTModel, state: Mapping[str, torch.Tensor], tensor_parallel: int) -> None:
    """Copy this rank's slice of the full-model ``state`` into ``model``."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for local, param in model.named_parameters():
            full = state[global_name(model, local)]
            if getattr(param, "tensor_model_parallel", False):
                full = full.chunk(tensor_parallel, dim=param.partition_dim)[tp_rank]
            param.copy_(full.to(param.device))


def gather_full(model: GPTModel, tensor_parallel: int, pipeline_parallel: int, tp_group: Any, pp_group: Any) -> StateDict:
    """The full-model state: TP shards concatenated, stages merged; CPU tensors, on every rank (collective)."""
    local: StateDict = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tensor_parallel > 1:
            shards = [torch.empty_like(value) for _ in range(tensor_parallel)]
            dist.all_gather(shards, value.contiguous(), group=tp_group)
            value = torch.cat(shards, dim=param.partition_dim)
        local[global_name(model, name)] = value.cpu().clone()
    stages: list[Any] = [None] * pipeline_parallel
    dist.all_gather_object(stages, local, group=pp_group)
    full: StateDict = {}
    for stage in stages:
        full.update(stage)
    return dict(sorted(full.items()))


def check_full_state(state: Any, names: FullNames) -> None:
    """Check that ``state`` holds exactly the full model's parameters, each a tensor of its full shape.

    Raises:
        TypeError: ``state`` is not a mapping of tensors.
        ValueError: a key is missing or unknown, or a tensor has the wrong shape.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"'state' must be a mapping of name -> tensor: got {type(state).__name__}")
    missing = sorted(set(names) - set(state))
    unknown = sorted(set(state) - set(names))
    if missing or unknown:
        raise ValueError(
            f"'state' must have exactly the model's {len(names)} keys: missing {missing}, unknown {unknown}"
        )
    for name, shape in names.items():
        value = state[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"'state[{name!r}]' must be a tensor: got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(f"'state[{name!r}]' must have shape {tuple(shape)}: got {tuple(value.shape)}")
