"""Token batches for the megatron GPT: checked on the way in, per-token log-probs on the way out.

A batch is right-padded rows of token ids with one length per row.
:func:`check_batch` accepts it only when it fits the model's shape;
:func:`stage_forward` runs one pipeline stage on it with the inputs shifted
left as labels, and :func:`logprobs_from_ce` turns the last stage's
next-token cross entropy into per-token log-probs. Under sequence parallelism
a forward's length must be a multiple of TP: :func:`stage_forward` pads the
batch on the right to :func:`padded_length`, and the caller keeps the first
``S`` positions of the last stage's output.

Invariants: a batch :func:`check_batch` accepts has at least one row, at most
``max_sequence_length`` positions, every token in ``[0, vocab_size)`` and
every length in ``[1, S]``; :func:`logprobs_from_ce` holds ``log p(x_t |
x_<t)`` at position ``t`` for ``1 <= t < length`` and 0 elsewhere, so padding
(a row's own or :func:`stage_forward`'s) never changes a row's log-probs
(attention is causal, and no MoE token is dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adapters.model_port import MicroBatch
from core.model_config import TinyGPTConfig

__all__ = ["check_batch", "logprobs_from_ce", "padded_length", "stage_forward", "to_device"]


def check_batch(
    config: TinyGPTConfig, input_ids: Any, lengths: Any, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, lengths as LongTensor[B])`` when they fit ``config``; errors name ``where`` + the field.

    Raises:
        TypeError: ``input_ids`` is not a 2-D LongTensor, or ``lengths`` is not an int tensor.
        ValueError: ``input_ids`` has no rows, a token, the sequence length or a row
            length is out of range, or ``lengths`` has not one entry per row.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"'{where}input_ids' must be a LongTensor[B, S]: got {type(input_ids).__name__}")
    if input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError(
            f"'{where}input_ids' must be a LongTensor[B, S]: "
            f"got {input_ids.dtype} of shape {tuple(input_ids.shape)}"
        )
    batch, seq = input_ids.shape
    if batch < 1:
        raise ValueError(f"'{where}input_ids' must have at least one row: got shape {tuple(input_ids.shape)}")
    if not 1 <= seq <= config.max_sequence_length:
        raise ValueError(
            f"'{where}input_ids' must have 1 to {config.max_sequence_length} positions: got {seq}"
        )
    if input_ids.min() < 0 or input_ids.max() >= config.vocab_size:
        raise ValueError(
            f"'{where}input_ids' must lie in [0, {config.vocab_size}): "
            f"got values in [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    lengths = torch.as_tensor(lengths)
    if lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"'{where}lengths' must be an int tensor: got {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(
            f"'{where}lengths' must have shape ({batch},) (one per row): got {tuple(lengths.shape)}"
        )
    if lengths.min() < 1 or lengths.max() > seq:
        raise ValueError(f"'{where}lengths' must lie in [1, {seq}]: got {lengths.tolist()}")
    return input_ids, lengths.to(torch.long)


def to_device(micro_batch: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """A copy of ``micro_batch`` with every tensor moved to ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in micro_batch.items()}


def padded_length(seq: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is at least ``seq`` (a forward's length under sequence parallelism)."""
    return -(-seq // multiple) * multiple


def stage_forward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], multiple: int = 1) -> torch.Tensor:
    """Stage output: hidden states, or on the last stage per-token cross entropy ``[B, padded_length(S, multiple)]``.

    Labels are the inputs shifted left, so ``out[:, t]`` is ``-log p(x_{t+1} | x_<=t)``;
    the wrapped-around last label only touches ``out[:, -1]``, which is dropped.
    With ``multiple > 1`` the batch is padded on the right to
    :func:`padded_length` with token 0 at position 0 and label 0 (position 0 is
    valid whatever ``max_sequence_length``); causal attention keeps those
    positions out of ``out[:, :S]``, the part the caller keeps.
    """
    input_ids = batch["input_ids"]
    seq = input_ids.shape[1]
    positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    pad = padded_length(seq, multiple) - seq
    if pad:
        input_ids, positions, labels = (torch.nn.functional.pad(t, (0, pad)) for t in (input_ids, positions, labels))
    return model(input_ids, positions, None, labels=labels)


def logprobs_from_ce(cross_entropy: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs ``[B, S]`` from next-token cross entropy; 0 at position 0 and past each length."""
    logprobs = torch.nn.functional.pad(-cross_entropy[:, :-1], (1, 0))
    positions = torch.arange(logprobs.shape[1], device=logprobs.device)
    valid = (positions >= 1) & (positions < lengths.to(logprobs.device)[:, None])
    return torch.where(valid, logprobs, torch.zeros_like(logprobs))
