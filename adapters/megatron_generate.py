"""Sampling from one rank's whole megatron GPT: continuations of right-padded prompts, no KV cache.

:func:`sample` runs one full forward per new token over every row at once
and draws each row's next token from ``softmax(logits / temperature)``
(masked to ``vocab_limit``) with the caller's generator, until every row has
drawn ``eos_id`` or ``max_new_tokens`` tokens.

Rollout precision: ``"fp32"`` runs the model as it is; ``"bf16"`` runs every
forward under ``torch.autocast(bfloat16)`` (matmuls, the routers' gating
included, in bf16 on bf16 copies of the fp32 weights; the weights themselves
are not touched), as a bf16 rollout engine would next to an fp32 trainer.

MoE routing: with routers given, one more forward over the final sequences
(same precision) records every token's experts (RECORD, see
:mod:`adapters.megatron_routing`). Without a KV cache each forward recomputes
every earlier token, and attention is causal, so this last forward gives each
token the routing a fresh forward of the whole sequence gives it (up to
floating-point differences between forward shapes); it is also the only
forward that sees each row's last drawn token.

Invariants: the same weights, prompts and generator state give the same
tokens; causal attention makes the padding to the right of a row invisible to
it, so rows of different lengths share each forward; the entropy of each
drawn token's distribution is read off the same probabilities and draws
nothing, so it changes no token and no generator state (so is each drawn
token's log-probability, recorded as the behaviour policy's); the model's training
mode is restored on return, also when sampling raises.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from adapters import megatron_routing as routing
from adapters.megatron_batch import check_batch
from adapters.megatron_setup import int_arg
from adapters.model_port import Generation
from core.entropy import categorical_entropy
from core.model_config import TinyGPTConfig

__all__ = ["PRECISIONS", "precision_scope", "sample"]

PRECISIONS = ("fp32", "bf16")


def precision_scope(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """Where a rollout forward runs: as is (``"fp32"``) or under bf16 autocast on ``device`` (``"bf16"``).

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"'precision' must be one of {list(PRECISIONS)}: got {precision!r}")
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sample(
    model: torch.nn.Module,
    config: TinyGPTConfig,
    prompt_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    generator: torch.Generator,
    temperature: float,
    vocab_limit: int | None,
    device: torch.device,
    precision: str = "fp32",
    routers: Sequence[routing.LayerRouter] = (),
) -> Generation:
    """Sample continuations of ``prompt_ids`` from ``model``, a whole GPT (one pipeline stage, no TP) on ``device``.

    Args, Returns and Raises as ``MegatronGPTBackend.generate``, which checks
    the layout and calls this under its device scope. ``routers``: the model's
    MoE routers (:func:`adapters.megatron_routing.layer_routers`); empty for a
    dense model, whose generation has no ``routed_experts``.
    """
    scope = precision_scope(precision, device)
    max_new_tokens = int_arg("max_new_tokens", max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"'max_new_tokens' must be >= 1: got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"'temperature' must be a number > 0: got {temperature!r}")
    if vocab_limit is not None and not 1 <= int_arg("vocab_limit", vocab_limit) <= config.vocab_size:
        raise ValueError(f"'vocab_limit' must be in [1, {config.vocab_size}]: got {vocab_limit}")
    prompt_ids, prompt_lengths = check_batch(config, prompt_ids, prompt_lengths, "prompt ")
    width = prompt_ids.shape[1] + max_new_tokens
    if width > config.max_sequence_length:
        raise ValueError(
            f"'max_new_tokens' ({max_new_tokens}) plus the prompt width ({prompt_ids.shape[1]}) must be at most "
            f"max_sequence_length = {config.max_sequence_length}: got {width}"
        )
    rows = prompt_ids.shape[0]
    sequences = torch.zeros(rows, width, dtype=torch.long)
    sequences[:, : prompt_ids.shape[1]] = prompt_ids
    lengths = prompt_lengths.clone()
    done = torch.zeros(rows, dtype=torch.bool)
    entropy = torch.zeros(rows, dtype=torch.float64)
    logprobs = torch.zeros(rows, width, dtype=torch.float32)
    index = torch.arange(rows)
    routed: torch.Tensor | None = None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), scope:
            for _ in range(max_new_tokens):
                span = int(lengths.max())
                tokens = sequences[:, :span].to(device)
                positions = torch.arange(span, device=device).expand_as(tokens)
                logits = model(tokens, positions, None)  # [B, span, V]
                raw = logits[index, lengths - 1].float().cpu()
                last = raw / temperature
                if vocab_limit is not None:
                    last[:, vocab_limit:] = -math.inf
                probs = torch.softmax(last, dim=-1)
                drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                live = ~done
                entropy += torch.where(live, categorical_entropy(last).double(), 0.0)
                # The drawn token's log-prob under the policy as the trainer scores it (the whole vocabulary, no
                # temperature), so that an importance weight against the trainer's log-probs is 1 for equal weights.
                drawn_logprob = torch.log_softmax(raw, dim=-1).gather(1, drawn[:, None]).squeeze(1)
                logprobs[index[live], lengths[live]] = drawn_logprob[live]
                sequences[index[live], lengths[live]] = drawn[live]
                lengths = lengths + live.long()
                done = done | (live & (drawn == eos_id))
                if bool(done.all()):
                    break
            span = int(lengths.max())
            if routers:
                recorded: dict[int, torch.Tensor] = {}
                tokens = sequences[:, :span].to(device)
                positions = torch.arange(span, device=device).expand_as(tokens)
                with routing.recording(routers, rows, recorded):
                    model(tokens, positions, None)
                routed = routing.padded(torch.stack([recorded[layer] for layer, _ in routers], dim=2), lengths)
    finally:
        model.train(was_training)
    return Generation(sequences[:, :span], lengths, entropy, logprobs[:, :span], routed)
