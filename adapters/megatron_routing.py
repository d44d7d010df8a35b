"""Routing of an MoE megatron GPT: read each token's experts, and replay given ones through megatron's ``RouterReplay``.

A routing is a LongTensor ``[B, S, num_layers, topk]`` aligned with a batch's
token ids: ``routed[b, t, l]`` holds the ``topk`` experts that layer ``l``
(global index) sent token ``t`` of row ``b`` to, in ascending id order (the
order within a token's choice changes nothing: megatron scatters each expert's
probability to its id), and ``-1`` at padding positions (``t >=
lengths[b]``).

Each MoE layer's router owns a ``RouterReplay`` (``moe_enable_routing_replay``).
:func:`layer_routers` collects them from one model's own modules: several
models live in one process (the policy and its reference), and megatron's
global list ``RouterReplay.global_router_replay_instances`` holds all of
their routers, so it never addresses the right model's layers alone.

Token order, checked by the tests against a forward of each row alone:
megatron's hidden states are ``[S, B, H]`` and a router flattens them to
``[S * B, H]``, so token ``(b, t)`` is row ``t * B + b`` of a router's indices
(sequence-major). :func:`to_router_order` and :func:`from_router_order` map
between the two. Under sequence parallelism (an MoE model under TP, see
:mod:`adapters.megatron_setup`) the forward is padded to a length ``S'``, a
multiple of TP, and TP rank ``r`` holds positions ``[r * S' / TP, (r + 1) *
S' / TP)``; sequence-major order makes its router's tokens the ``r``-th of TP
equal, contiguous blocks of the ``[S' * B]`` rows: a :data:`SequenceShard`
``(r, TP)`` selects that block for replay, and :func:`merge_sequence_shards`
joins the TP ranks' blocks back.

Invariants: replaying a routing makes every real token go to exactly its
given experts, in every layer of this pipeline stage; padding positions are
replayed as experts ``0 .. topk - 1`` whatever the routing holds there, and,
attention being causal and no token being dropped (no expert capacity), never
change a real token's routing or output; the routers are left with no action
and no indices after each forward (:func:`replaying`, :func:`recording`,
:func:`observing`), so a later forward routes by its own scores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from adapters.megatron_batch import padded_length
from core.model_config import TinyGPTConfig
from core.routing import NO_ROUTE, check_routing, pad_routing_for_replay

__all__ = [
    "WHOLE_SEQUENCE", "LayerRouter", "SequenceShard", "check_routed_experts", "from_router_order", "layer_routers",
    "merge_sequence_shards", "observing", "padded", "ready_for_replay", "recording", "replaying", "to_router_order",
]

LayerRouter = tuple[int, torch.nn.Module]
"""(global layer index, the layer's megatron router module, whose ``router_replay`` is its ``RouterReplay``)."""

SequenceShard = tuple[int, int]
"""(this rank's index, the number of ranks) of the sequence split under sequence parallelism: (TP rank, TP)."""

WHOLE_SEQUENCE: SequenceShard = (0, 1)
"""No sequence split: the router sees every token of the forward."""


def layer_routers(model: torch.nn.Module) -> list[LayerRouter]:
    """This stage's MoE routers of ``model`` (a ``GPTModel`` or a wrapper with ``.module``), in layer order.

    Empty for a dense model.
    """
    gpt = model
    while not hasattr(gpt, "decoder") and hasattr(gpt, "module"):
        gpt = gpt.module
    routers: list[LayerRouter] = []
    for layer in gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            if not isinstance(getattr(router, "router_replay", None), RouterReplay):
                raise ValueError(
                    f"layer {layer.layer_number - 1}'s router must have a RouterReplay "
                    "(TransformerConfig(moe_enable_routing_replay=True)): got none"
                )
            routers.append((layer.layer_number - 1, router))
    return routers


def check_routed_experts(
    config: TinyGPTConfig, routed: Any, input_ids: torch.Tensor, lengths: torch.Tensor, where: str
) -> torch.Tensor:
    """``routed`` as a LongTensor when it is a routing of this batch; errors name ``where`` (and the row, token
    and layer of a bad entry, by :func:`core.routing.check_routing`).

    Only real positions (``t < lengths[b]``) are checked: padding holds anything.

    Raises:
        ValueError: the model is dense, the shape is not ``[B, S, num_layers, topk]``, or a real token's
            experts are out of ``[0, num_experts)``, missing (-1) or repeat an expert.
        TypeError: ``routed`` is not an integer tensor.
    """
    name = f"{where}routed_experts"
    if not config.is_moe:
        raise ValueError(f"'{name}' needs an MoE model (num_experts >= 2): got a dense model (num_experts = 0)")
    if not isinstance(routed, torch.Tensor) or routed.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        got = routed.dtype if isinstance(routed, torch.Tensor) else type(routed).__name__
        raise TypeError(f"'{name}' must be an integer tensor [B, S, num_layers, topk]: got {got}")
    expected = (*input_ids.shape, config.num_layers, config.moe_topk)
    if tuple(routed.shape) != expected:
        raise ValueError(f"'{name}' must have shape {expected} ([B, S, num_layers, topk]): got {tuple(routed.shape)}")
    routed = routed.cpu()
    check_routing(
        routed, lengths.cpu(), num_layers=config.num_layers, topk=config.moe_topk, num_experts=config.num_experts,
        field=name,
    )
    return routed.to(torch.long)


def padded(experts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``experts`` ``[B, S, ...]`` with ``NO_ROUTE`` (-1) at every position ``t >= lengths[b]``."""
    real = torch.arange(experts.shape[1], device=experts.device)[None, :] < lengths.to(experts.device)[:, None]
    return torch.where(real.view(*real.shape, *([1] * (experts.dim() - 2))), experts, NO_ROUTE)


def ready_for_replay(routed: torch.Tensor, lengths: torch.Tensor, shards: int = 1) -> torch.Tensor:
    """``routed`` ``[B, S, L, K]`` widened to ``padded_length(S, shards)`` positions, with every position past a
    row's length routed to experts ``0 .. topk - 1`` (:func:`core.routing.pad_routing_for_replay`), on
    ``routed``'s device: what :func:`to_router_order` slices."""
    seq = routed.shape[1]
    extended = torch.nn.functional.pad(routed.cpu(), (0, 0, 0, 0, 0, padded_length(seq, shards) - seq), value=NO_ROUTE)
    return pad_routing_for_replay(extended, lengths.cpu()).to(routed.device)


def to_router_order(ready: torch.Tensor, layer: int, shard: SequenceShard = WHOLE_SEQUENCE) -> torch.Tensor:
    """Layer ``layer``'s experts of a routing ready for replay, in a router's token order (row ``t * B + b``).

    ``ready`` is ``[B, S', num_layers, topk]`` with a valid route at every position (no -1), ``S'`` a
    multiple of the shard count: :func:`ready_for_replay`. With ``shard = (r, n)`` the result is rows
    ``[r * S' * B / n, (r + 1) * S' * B / n)`` of the ``[S' * B, topk]`` order: the tokens of
    sequence-parallel rank ``r``. The whole sequence (``n = 1``): ``[S' * B, topk]``.
    """
    index, count = shard
    experts = ready[:, :, layer, :]  # [B, S', K]
    batch, width, topk = experts.shape
    if width % count:
        raise ValueError(f"'ready' must have a multiple of {count} positions (the shard count): got {width}")
    return experts.transpose(0, 1).reshape(width * batch, topk).chunk(count)[index].contiguous()


def from_router_order(indices: torch.Tensor, batch: int) -> torch.Tensor:
    """A router's per-token experts ``[S * B, topk]`` as ``[B, S, topk]``, each token's experts in ascending order."""
    tokens, topk = indices.shape
    return indices.reshape(tokens // batch, batch, topk).transpose(0, 1).sort(dim=-1).values.to(torch.long)


def merge_sequence_shards(shards: Sequence[torch.Tensor], batch: int, seq: int) -> torch.Tensor:
    """The ``[B, seq, topk]`` experts of a forward whose routers' tokens (``[tokens, topk]`` each, in router
    order) are ``shards``, by sequence-parallel rank; the forward's padding past ``seq`` is dropped.

    The inverse of :func:`to_router_order` over the ranks: one shard is the whole sequence.
    """
    return from_router_order(torch.cat(list(shards)), batch)[:, :seq]


def _reset(routers: Sequence[LayerRouter]) -> None:
    for _, router in routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def replaying(
    routers: Sequence[LayerRouter],
    routed: torch.Tensor | None,
    lengths: torch.Tensor,
    shard: SequenceShard = WHOLE_SEQUENCE,
) -> Iterator[None]:
    """Within: each of ``routers`` routes the next forward's tokens by ``routed`` (REPLAY_FORWARD); None: by scores.

    ``routed`` is a checked full-model routing ``[B, S, num_layers, topk]`` on the model's device; each router
    takes its own global layer's slice, and under sequence parallelism this rank's ``shard`` of the sequence
    (:func:`to_router_order`). The models here do not recompute activations in backward, so the
    forward's replay is the only one (REPLAY_BACKWARD is never reached).
    """
    _reset(routers)
    try:
        if routed is not None:
            ready = ready_for_replay(routed, lengths, shard[1])  # once for every layer
            for layer, router in routers:
                router.router_replay.set_target_indices(to_router_order(ready, layer, shard))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        _reset(routers)


@contextlib.contextmanager
def recording(routers: Sequence[LayerRouter], batch: int, out: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within: the routers choose by score and record (RECORD); on exit ``out[layer]`` is that layer's ``[B, S, topk]``.

    Records the last forward run within (each forward overwrites a router's record). For a model that is
    not sequence-parallel (the rollout's, one rank): each router then sees every token.
    """
    _reset(routers)
    try:
        for _, router in routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        yield
        for layer, router in routers:
            recorded = router.router_replay.get_recorded_indices()
            if recorded is None:
                raise RuntimeError(f"layer {layer}'s router recorded nothing: no forward ran within 'recording'")
            out[layer] = from_router_order(recorded.detach().cpu(), batch)
    finally:
        _reset(routers)


@contextlib.contextmanager
def observing(routers: Sequence[LayerRouter], out: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within: each router's routing map (the experts its tokens were dispatched to) lands in ``out[layer]``
    as ``[tokens, topk]`` in router order (this rank's tokens under sequence parallelism: join the ranks'
    with :func:`merge_sequence_shards`), whether the router chose by score or replayed; read by a forward
    hook, so it observes what megatron dispatched, not what ``RouterReplay`` was told."""

    def hook(layer: int) -> Any:
        def read(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            routing_map = output[1].detach().cpu()  # [tokens, E] bool, topk True per token
            tokens, experts = routing_map.shape
            out[layer] = torch.arange(experts).expand(tokens, experts)[routing_map].view(tokens, -1)

        return read

    handles = [router.register_forward_hook(hook(layer)) for layer, router in routers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
