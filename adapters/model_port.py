"""The model port: what a policy or rollout worker calls on its model backend.

A backend holds one rank's shard of the policy (and a frozen reference copy)
and runs its collectives itself; :class:`adapters.megatron.MegatronGPTBackend`
is the one implementation. The workers (``shell.policy_worker``,
``shell.rollout``) depend on :class:`PolicyBackend` only and build the
megatron backend in one function each, so megatron is one adapter behind this
port and its import stays inside the workers' processes.

Invariant: every method is collective over the backend's world (each rank
calls it with the same inputs within a replica), and its results are the same
on every rank of a replica; ``state_dict`` is layout-free (full-model weights
that any layout can load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

MicroBatch = Mapping[str, torch.Tensor]
"""One micro-batch: ``input_ids`` (LongTensor[B, S]), ``lengths`` (LongTensor[B]), optionally ``routed_experts``
(int tensor [B, S, num_layers, topk], an MoE routing to replay), plus any fields ``loss_fn`` reads."""
Metrics = dict[str, float]
LossFn = Callable[
    [torch.Tensor, MicroBatch], tuple[torch.Tensor, Any, Mapping[str, Any]] | tuple[torch.Tensor, Mapping[str, Any]]
]
"""``loss_fn(logprobs FloatTensor[B, S], micro_batch) -> (summed loss, count, metrics)``: the step trains on the
sum of every micro-batch's loss over the sum of their counts (int >= 0, e.g. tokens), over every DP rank; or
``-> (loss, metrics)``, which counts 1 per micro-batch (the mean over micro-batches and ranks). Metrics are scalars."""
StateDict = dict[str, torch.Tensor]
TrainStepResult = dict[str, Any]
"""``{"loss": float, "loss_sum": float, "loss_weight": float, "grad_norm": float, "metrics": list[Metrics]}``: the
replica's summed losses over its summed counts, those sums, the step's grad norm, one ``Metrics`` per micro-batch."""


@attrs.frozen
class Generation:
    """What :meth:`MegatronGPTBackend.generate` returns.

    Attributes:
        sequences: LongTensor[B, L], each row its prompt then its response, 0 past its length.
        lengths: LongTensor[B], prompt plus response tokens of each row (the EOS included).
        entropy: DoubleTensor[B], per row the summed entropy (nats) of the distributions its
            response tokens were drawn from (temperature applied, masked to ``vocab_limit``).
        logprobs: FloatTensor[B, L], the behaviour policy's log-probability of each response token as
            :meth:`PolicyBackend.logprobs` scores it (the model's whole vocabulary, no temperature), whatever
            ``temperature`` and ``vocab_limit`` the draw used, at the token's position; 0 at prompt and
            padding positions. (Before 2026-11-28 it was the log-probability under the distribution the
            token was drawn from, which an importance weight against the trainer's log-probs cannot use.)
        routed_experts: for an MoE policy, LongTensor[B, L, num_layers, topk]: the experts each token was
            routed to (ascending ids) in one forward over the final sequences at the rollout precision, -1 at
            padding positions; what :meth:`PolicyBackend.logprobs` and ``train_step`` replay. None for a
            dense policy.
    """

    sequences: torch.Tensor
    lengths: torch.Tensor
    entropy: torch.Tensor
    logprobs: torch.Tensor
    routed_experts: torch.Tensor | None = None


@runtime_checkable
class PolicyBackend(Protocol):
    """A rank's model backend: log-probs, train steps, weights, sampling and its place in the layout."""

    def parallel_coords(self) -> dict[str, int]:
        """This rank's coordinate on each axis of :data:`core.topology.AXES`."""
        ...

    def logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token log-probs FloatTensor[B, S] of the policy: ``out[b, t] = log p(x_t | x_<t)`` for
        ``1 <= t < lengths[b]``, 0 elsewhere; ``input_ids`` LongTensor[B, S], ``lengths`` LongTensor[B].
        ``routed_experts`` (MoE only, as :attr:`Generation.routed_experts`): every real token is routed to
        exactly these experts (R3 router replay) instead of by the router's scores."""
        ...

    def reference_logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token log-probs of the frozen reference model, as :meth:`logprobs` (replaying into the reference)."""
        ...

    def routing(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts each token of the policy's forward (as :meth:`logprobs`) was dispatched to: LongTensor
        [B, S, num_layers, topk], ascending ids, -1 at padding; read off the routers' outputs, so with
        ``routed_experts`` given it shows what the replay made the trainer do. MoE only."""
        ...

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> TrainStepResult:
        """Accumulate the gradient of the step's loss (every micro-batch's summed loss over the counts of every
        micro-batch of every data-parallel rank: :data:`LossFn`), then one optimizer step;
        ``{"loss", "loss_sum", "loss_weight", "grad_norm", "metrics"}``. A micro-batch's ``routed_experts`` is replayed in
        its forward (and so in its backward) as in :meth:`logprobs`."""
        ...

    def state_dict(self) -> StateDict:
        """The policy's full weights, the same on every rank."""
        ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights (as :meth:`state_dict` returns, from any layout) into the policy."""
        ...

    def generate(
        self, prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor, *, max_new_tokens: int, eos_id: int,
        generator: torch.Generator, temperature: float = 1.0, vocab_limit: int | None = None,
        precision: str = "fp32",
    ) -> Generation:
        """Sample continuations of right-padded prompts: the sequences, their lengths, per-row sampling entropy,
        and for an MoE policy each token's routing; ``precision`` ``"fp32"`` or ``"bf16"`` (the rollout's
        forward precision; training stays fp32)."""
        ...
