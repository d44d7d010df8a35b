"""``MegatronGPTBackend``: a megatron-core 0.16.1 policy backend for a tiny GPT (per-token log-probs and train steps).

One backend lives in each rank's process (e.g. a Ray policy worker); the caller
has already initialised ``torch.distributed`` (gloo on CPU, NCCL on GPU). The
backend lays megatron's model-parallel groups over that default group and
builds a policy ``GPTModel`` (:mod:`adapters.megatron_setup`, which also states
the rank layout) wrapped in megatron's ``DistributedDataParallel``, a frozen
reference copy of the initial policy, and megatron's Adam. Batches are checked
and scored by :mod:`adapters.megatron_batch`; sampling is
:mod:`adapters.megatron_generate`; an MoE model's routing is recorded and
replayed by :mod:`adapters.megatron_routing` (R3: the trainer replays the
experts the rollout chose, per token and layer).

Invariants:
  * every layout (any TP, PP) built with the same ``seed`` starts from the same
    model: weights are drawn once per parameter of the *full* model (TP=1, PP=1
    names) from a generator seeded by ``(seed, name)``, then sliced to the
    rank's shard (:mod:`adapters.megatron_weights`); replicas (DP ranks) are identical;
  * :meth:`~MegatronGPTBackend.logprobs` returns the same ``[B, S]`` tensor on
    every rank of a replica; position 0 and positions at or past a row's length
    are 0, position ``t`` holds ``log p(x_t | x_<t)``;
  * on CPU the same seed and inputs give bitwise the same log-probs, losses and
    weights after a step;
  * :meth:`~MegatronGPTBackend.state_dict` is layout-free: the full model under
    TP=1, PP=1 names, the same on every rank; any layout can load it;
  * MoE: a forward given ``routed_experts`` sends every real token to exactly
    those experts in every layer (each pipeline stage replays its own layers,
    through the routers of the model it runs, never another model's); a forward
    without routes by the routers' scores.

Wiring: TP splits heads, MLP and vocabulary (log-probs come from megatron's
vocab-parallel cross entropy, all-reduced over TP); an MoE model under TP also
splits the sequence between blocks (megatron's sequence parallelism, which its
MoE layer needs to train under TP: :mod:`adapters.megatron_setup`), so each
forward is padded to a multiple of TP, each TP rank's routers replay and report
their slice of the sequence, and the ranks' slices are joined for
:meth:`~MegatronGPTBackend.routing`; PP runs megatron's
``get_forward_backward_func()`` schedule (1F1B for training, ``forward_only``
for log-probs) and broadcasts the last stage's result over the PP group; DP
all-reduces (sums) gradients in megatron's DDP after the last micro-batch, and
megatron divides them by the step's loss count summed over the DP ranks (its
per-token loss), so a loss of summed tokens trains on the global token mean.
The optimizer is megatron's (``get_megatron_optimizer``: torch Adam in an
``FP32Optimizer``), without clipping; ``grad_norm`` is its ``get_grad_norm``,
which sums squares over TP and PP shards without double counting duplicates.

Limits: every method is collective (all ranks call it, with the same inputs
within a replica). An exception in ``loss_fn`` on the last stage leaves the
other stages waiting in the schedule: the caller tears the group down. The
state dict holds weights only, not Adam's moments. The ``"cuda"`` path runs
megatron without the CPU shim (``model_parallel_cuda_manual_seed``, NCCL; only
``build_gpt``'s binding of a name megatron leaves unbound without Transformer
Engine, on every device) and is exercised only on GPU machines
(``python -m shell.bench.gpu_check``); the tests here run the CPU path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from adapters import megatron_routing as routing
from adapters import megatron_setup as setup
from adapters import megatron_weights as weights
from adapters.megatron_batch import check_batch, logprobs_from_ce, padded_length, stage_forward, to_device
from adapters.megatron_cpu import apply_cpu_shim, cpu_device_remap
from adapters.megatron_generate import sample
from adapters.model_port import Generation, LossFn, Metrics, MicroBatch, StateDict, TrainStepResult
from core.model_config import TinyGPTConfig

__all__ = ["MegatronGPTBackend"]

_DEVICES = ("cpu", "cuda")


class MegatronGPTBackend:
    """A tiny-GPT policy (and frozen reference) on megatron-core with TP, PP and DP (a ``PolicyBackend``).

    Args:
        config: the model's shape.
        tensor_parallel: TP size; divides ``num_attention_heads`` and ``vocab_size``.
        pipeline_parallel: PP size; divides ``num_layers``.
        context_parallel: CP size; must be 1 (the local layer spec has no
            context-parallel attention).
        seed: the same on every rank; fixes the initial weights.
        device: ``"cpu"`` (applies :func:`adapters.megatron_cpu.apply_cpu_shim`
            in this process) or ``"cuda"`` (the caller has set this rank's device).
        learning_rate: Adam's step size (no weight decay, no clipping).
        group_timeout_s: the timeout (seconds) of megatron's own process groups (TP, PP, DP, ...), as
            the caller gave its world group; None leaves megatron's default, 30 minutes. A collective
            whose peer is gone fails after this long instead of blocking.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or megatron's
            model-parallel state is already set up with other sizes.
        TypeError: a size or the seed is not an int, ``learning_rate`` is not a float,
            or ``group_timeout_s`` is not a number.
        ValueError: a size does not divide what it splits, ``context_parallel``
            is not 1, ``device`` is unknown, ``learning_rate`` is not positive,
            or ``group_timeout_s`` is not finite and positive.

    Example, in each of 2 ranks after ``dist.init_process_group("gloo", ...)``::

        backend = MegatronGPTBackend(TinyGPTConfig(), tensor_parallel=2, pipeline_parallel=1, seed=0)
        backend.logprobs(torch.tensor([[1, 2, 3]]), torch.tensor([3]))  # FloatTensor[1, 3], same on both ranks
        backend.train_step([{"input_ids": ids, "lengths": lengths}], loss_fn)  # {"loss", "loss_sum", "loss_weight", ...}
    """

    def __init__(
        self,
        config: TinyGPTConfig,
        *,
        tensor_parallel: int,
        pipeline_parallel: int,
        context_parallel: int = 1,
        seed: int,
        device: str = "cpu",
        learning_rate: float = 1e-3,
        group_timeout_s: float | None = None,
    ) -> None:
        if not isinstance(config, TinyGPTConfig):
            raise TypeError(f"'config' must be TinyGPTConfig: got {type(config).__name__}")
        tp = setup.int_arg("tensor_parallel", tensor_parallel)
        pp = setup.int_arg("pipeline_parallel", pipeline_parallel)
        cp = setup.int_arg("context_parallel", context_parallel)
        seed = setup.int_arg("seed", seed)
        for name, size in (("tensor_parallel", tp), ("pipeline_parallel", pp)):
            if size < 1:
                raise ValueError(f"'{name}' must be a positive int: got {size}")
        if cp != 1:
            raise ValueError(
                "'context_parallel' must be 1 (megatron's local layer spec has no context-parallel attention): "
                f"got {cp}"
            )
        if device not in _DEVICES:
            raise ValueError(f"'device' must be one of {list(_DEVICES)}: got {device!r}")
        if not isinstance(learning_rate, float):
            raise TypeError(f"'learning_rate' must be float: got {type(learning_rate).__name__} ({learning_rate!r})")
        if not learning_rate > 0:
            raise ValueError(f"'learning_rate' must be positive: got {learning_rate!r}")
        if group_timeout_s is not None:
            if isinstance(group_timeout_s, bool) or not isinstance(group_timeout_s, (int, float)):
                raise TypeError(f"'group_timeout_s' must be a number of seconds or None: got {group_timeout_s!r}")
            if not 0 < group_timeout_s < float("inf"):
                raise ValueError(f"'group_timeout_s' must be finite and > 0: got {group_timeout_s!r}")
        setup.check_divides("tensor_parallel", tp, "num_attention_heads", config.num_attention_heads)
        setup.check_divides("tensor_parallel", tp, "vocab_size", config.vocab_size)
        setup.check_divides("pipeline_parallel", pp, "num_layers", config.num_layers)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed must be initialised before MegatronGPTBackend: "
                "call dist.init_process_group('gloo' or 'nccl', rank=..., world_size=...) first"
            )
        setup.check_divides("tensor_parallel * pipeline_parallel", tp * pp, "the world size", dist.get_world_size())

        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        self.tensor_parallel = tp
        self.pipeline_parallel = pp
        self._sequence_parallel = setup.sequence_parallel(config, tp)
        if device == "cpu":
            apply_cpu_shim()
        with self._device_scope():
            setup.init_parallel_state(tp, pp, timeout_s=group_timeout_s)
            self._tp_group = parallel_state.get_tensor_model_parallel_group()
            self._sequence_shard: routing.SequenceShard = (
                (parallel_state.get_tensor_model_parallel_rank(), tp) if self._sequence_parallel
                else routing.WHOLE_SEQUENCE
            )
            self._pp_group = parallel_state.get_pipeline_model_parallel_group()
            self._pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
            self._is_last_stage = parallel_state.is_pipeline_last_stage()
            self.data_parallel = parallel_state.get_data_parallel_world_size()
            self._build(learning_rate)

    def _device_scope(self) -> AbstractContextManager[Any]:
        """Where every megatron call runs: under the CPU device remap on this thread, or as is on CUDA."""
        return cpu_device_remap() if self.device.type == "cpu" else contextlib.nullcontext()

    def _build(self, learning_rate: float) -> None:
        """The policy (in DDP), the frozen reference and the optimizer, all from the layout-free initial state."""
        config, tp, pp = self.config, self.tensor_parallel, self.pipeline_parallel
        torch.manual_seed(self.seed)
        if self.device.type == "cuda":
            model_parallel_cuda_manual_seed(self.seed)
        initial = setup.build_gpt(config, tp, pp, self.device)
        self._full_names = weights.canonical_names(initial, tp, pp, self._pp_group)
        weights.load_full(initial, weights.initial_state(self.seed, self._full_names, config.num_layers), tp)
        self._reference = setup.build_gpt(config, tp, pp, self.device)
        self._reference.load_state_dict(initial.state_dict())
        self._reference.requires_grad_(False)
        self._reference.eval()
        self._policy_routers = routing.layer_routers(initial)
        self._reference_routers = routing.layer_routers(self._reference)

        self._policy = DistributedDataParallel(
            config=initial.config, ddp_config=DistributedDataParallelConfig(), module=initial
        )
        # The schedule defers DP grad sync to the last micro-batch, then all-reduces over DP.
        initial.config.no_sync_func = self._policy.no_sync
        initial.config.finalize_model_grads_func = finalize_model_grads
        self._optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=learning_rate, min_lr=learning_rate, weight_decay=0.0, clip_grad=0.0
            ),
            [self._policy],
        )

    def parallel_coords(self) -> dict[str, int]:
        """This rank's coordinate on each axis of :data:`core.topology.AXES`, as megatron assigned it."""
        return setup.parallel_coords()

    # -- state (layout-free: see adapters.megatron_weights) ------------------------------------------

    def _gather_full(self, model: GPTModel) -> StateDict:
        return weights.gather_full(model, self.tensor_parallel, self.pipeline_parallel, self._tp_group, self._pp_group)

    def state_dict(self) -> StateDict:
        """The policy's full weights under TP=1, PP=1 names (CPU tensors), the same on every rank.

        Collective: every rank of the world must call it. Optimizer moments are not included.
        """
        with self._device_scope():
            return self._gather_full(self._policy.module)

    def reference_state_dict(self) -> StateDict:
        """The frozen reference model's full weights, as :meth:`state_dict`. Collective."""
        with self._device_scope():
            return self._gather_full(self._reference)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full-model weights (as :meth:`state_dict` returns, from any layout) into the policy.

        Raises:
            TypeError: ``state`` is not a mapping of tensors.
            ValueError: a key is missing or unknown, or a tensor has the wrong shape.
        """
        weights.check_full_state(state, self._full_names)
        with self._device_scope():
            weights.load_full(self._policy.module, state, self.tensor_parallel)

    # -- the schedule --------------------------------------------------------------------------------

    def _run(
        self,
        model: torch.nn.Module,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_func: Callable[[dict[str, torch.Tensor], torch.Tensor], Any],
        *,
        forward_only: bool,
        routers: Sequence[routing.LayerRouter],
    ) -> list[Any]:
        """megatron's forward(-backward) schedule over ``micro_batches``; the last stage's per-micro-batch store.

        ``routers`` are ``model``'s own: a micro-batch with ``routed_experts`` is replayed through them.
        Under sequence parallelism each forward is padded to a multiple of TP; ``loss_func`` gets the last
        stage's output cut back to the micro-batch's ``S`` positions.
        """
        batches: Iterator[dict[str, torch.Tensor]] = iter(micro_batches)
        multiple = self._sequence_shard[1]

        def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], module: torch.nn.Module) -> Any:
            batch = next(data_iterator)
            with routing.replaying(routers, batch.get("routed_experts"), batch["lengths"], self._sequence_shard):
                output = stage_forward(module, batch, multiple)
            seq = batch["input_ids"].shape[1]

            def finish(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                return loss_func(batch, out[:, :seq], *args, **kwargs)

            return output, finish

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(padded_length(b["input_ids"].shape[1], multiple) for b in micro_batches),
            micro_batch_size=max(b["input_ids"].shape[0] for b in micro_batches),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def _broadcast_from_last_stage(self, payload: Any) -> Any:
        """``payload`` of the last pipeline stage, on every stage."""
        if self.pipeline_parallel == 1:
            return payload
        box = [payload if self._is_last_stage else None]
        dist.broadcast_object_list(box, src=self._pp_last_rank, group=self._pp_group, device=self._object_device())
        return box[0]

    def _object_device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else None

    def _checked_batch(
        self, input_ids: Any, lengths: Any, routed_experts: Any, where: str
    ) -> dict[str, torch.Tensor]:
        """The batch on this device, with ``routed_experts`` when given; checked (errors name ``where``)."""
        input_ids, lengths = check_batch(self.config, input_ids, lengths, where)
        batch = {"input_ids": input_ids, "lengths": lengths}
        if routed_experts is not None:
            batch["routed_experts"] = routing.check_routed_experts(
                self.config, routed_experts, input_ids, lengths, where
            )
        return to_device(batch, self.device)

    def _logprobs(
        self,
        model: torch.nn.Module,
        routers: Sequence[routing.LayerRouter],
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        routed_experts: torch.Tensor | None,
    ) -> torch.Tensor:
        batch = self._checked_batch(input_ids, lengths, routed_experts, "")

        def collect(micro_batch: dict[str, torch.Tensor], output: torch.Tensor, non_loss_data: bool = False) -> Any:
            return logprobs_from_ce(output, micro_batch["lengths"]).detach()

        was_training = model.training
        model.eval()
        try:
            with self._device_scope(), torch.no_grad():
                store = self._run(model, [batch], collect, forward_only=True, routers=routers)
                result = store[0].cpu() if self._is_last_stage else None
                return self._broadcast_from_last_stage(result)
        finally:
            model.train(was_training)

    def logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token log-probs of the policy: FloatTensor[B, S] on CPU, the same on every rank of a replica.

        ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``1 <= t < lengths[b]``; 0 elsewhere.
        Rows are right-padded; attention is causal, so padding never changes earlier positions.
        Collective over the replica (TP x PP ranks).

        Args:
            input_ids: LongTensor[B, S], tokens in ``[0, vocab_size)``, ``S <= max_sequence_length``.
            lengths: int tensor [B], each in ``[1, S]``.
            routed_experts: MoE only: int tensor [B, S, num_layers, topk] (as
                ``Generation.routed_experts``); each real token goes to exactly
                these experts in every layer (replayed with megatron's
                ``RouterReplay``); padding positions are ignored. None: the
                routers choose by score.

        Raises:
            TypeError: ``input_ids`` is not a 2-D LongTensor, ``lengths`` is not an int
                tensor, or ``routed_experts`` is not an integer tensor.
            ValueError: ``input_ids`` has no rows, a token, the sequence length or a row
                length is out of range, ``lengths`` has not one entry per row, or
                ``routed_experts`` is given to a dense model, has the wrong shape, or a
                real token's experts are out of range or repeat.
        """
        return self._logprobs(self._policy, self._policy_routers, input_ids, lengths, routed_experts)

    def reference_logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token log-probs of the frozen reference model, as :meth:`logprobs`.

        ``routed_experts`` is replayed into the reference's own routers (it has the
        policy's architecture), so a KL term compares the two models on the same experts.
        """
        return self._logprobs(self._reference, self._reference_routers, input_ids, lengths, routed_experts)

    def routing(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts each token was dispatched to in the policy's forward, as :meth:`logprobs` runs it.

        Read off each router's output (its routing map) by a forward hook, so it
        shows what megatron dispatched, also when ``routed_experts`` is replayed.
        Collective over the replica; each stage reads its own layers (under
        sequence parallelism each TP rank its slice of the sequence, and the TP
        ranks exchange them), then the stages exchange them.

        Returns:
            LongTensor[B, S, num_layers, topk] on CPU, each token's experts in
            ascending order, -1 at padding positions; the same on every rank of a replica.

        Raises:
            ValueError: the model is dense; otherwise as :meth:`logprobs`.
        """
        if not self.config.is_moe:
            raise ValueError("'routing' needs an MoE model (num_experts >= 2): got a dense model (num_experts = 0)")
        batch = self._checked_batch(input_ids, lengths, routed_experts, "")
        rows, seq = batch["input_ids"].shape
        seen: dict[int, torch.Tensor] = {}
        was_training = self._policy.training
        self._policy.eval()
        try:
            with self._device_scope(), torch.no_grad():
                with routing.observing(self._policy_routers, seen):
                    self._run(
                        self._policy, [batch], lambda mb, out, non_loss_data=False: None,
                        forward_only=True, routers=self._policy_routers,
                    )
                shards: list[Any] = [seen]
                if self._sequence_parallel:
                    shards = [None] * self.tensor_parallel
                    dist.all_gather_object(shards, seen, group=self._tp_group)
                stage = {
                    layer: routing.merge_sequence_shards([shard[layer] for shard in shards], rows, seq)
                    for layer in seen
                }
                stages: list[Any] = [None] * self.pipeline_parallel
                dist.all_gather_object(stages, stage, group=self._pp_group)
        finally:
            self._policy.train(was_training)
        layers: dict[int, torch.Tensor] = {}
        for stage in stages:
            layers.update(stage)
        routed = torch.stack([layers[layer] for layer in range(self.config.num_layers)], dim=2)
        return routing.padded(routed, batch["lengths"].cpu())

    # -- generation ----------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_lengths: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_id: int,
        generator: torch.Generator,
        temperature: float = 1.0,
        vocab_limit: int | None = None,
        precision: str = "fp32",
    ) -> Generation:
        """Sample continuations of right-padded prompts from the policy (no KV cache: one full forward per token).

        Row ``b`` continues ``prompt_ids[b, :prompt_lengths[b]]`` with up to
        ``max_new_tokens`` tokens drawn from ``softmax(logits / temperature)``
        with ``generator``, and stops after ``eos_id``. Causal attention makes
        the padding to the right of a row invisible to it, so rows of different
        lengths share each forward. The same weights, prompts and generator
        state give the same tokens. The entropy of each drawn token's
        distribution is read off the same probabilities and draws nothing, so
        it changes no token and no generator state.

        Args:
            prompt_ids: LongTensor[B, P], right-padded prompts.
            prompt_lengths: int tensor [B], each in ``[1, P]``.
            max_new_tokens: at most this many tokens per row (>= 1); ``P +
                max_new_tokens`` must not exceed ``max_sequence_length``.
            eos_id: the end-of-sequence token.
            generator: a CPU ``torch.Generator``; its state advances.
            temperature: > 0.
            vocab_limit: sample only ids below it (a tokenizer smaller than
                the model's padded vocabulary); None: the whole vocabulary.
            precision: the rollout's forward precision: ``"fp32"`` (the
                trainer's), or ``"bf16"`` (under ``torch.autocast(bfloat16)``;
                the weights stay fp32, training is unaffected).

        Returns:
            a :class:`Generation`: ``sequences`` LongTensor[B, L] (prompt then
            response, 0 past each row's length), ``lengths`` LongTensor[B]
            (prompt plus response tokens, the EOS included), ``entropy``
            DoubleTensor[B] (per row, the summed entropy of its response
            tokens' sampling distributions, in nats), ``logprobs``
            FloatTensor[B, L] (each response token's log-probability under the
            distribution it was drawn from, at its position; 0 elsewhere),
            ``routed_experts`` (MoE only, else None) LongTensor[B, L,
            num_layers, topk]: each token's experts (ascending) in one more
            forward over the final sequences at ``precision``, -1 at padding.

        Raises:
            ValueError: the backend is tensor- or pipeline-parallel (a rollout
                engine is one rank), a size or the temperature is out of range,
                or ``precision`` is not ``"fp32"`` or ``"bf16"``.
            TypeError: as :meth:`logprobs` for the prompts.
        """
        if self.tensor_parallel != 1 or self.pipeline_parallel != 1:
            raise ValueError(
                "'generate' needs tensor_parallel = pipeline_parallel = 1 (the rollout engine is one rank): "
                f"got ({self.tensor_parallel}, {self.pipeline_parallel})"
            )
        with self._device_scope():
            return sample(
                self._policy.module, self.config, prompt_ids, prompt_lengths, device=self.device,
                max_new_tokens=max_new_tokens, eos_id=eos_id, generator=generator,
                temperature=temperature, vocab_limit=vocab_limit, precision=precision,
                routers=self._policy_routers,
            )

    # -- training ------------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> TrainStepResult:
        """Accumulate gradients over ``micro_batches`` through megatron's schedule, then one Adam step.

        The gradient is that of ``sum(loss_i) / sum(count_i)`` over every micro-batch ``i`` of every DP
        rank: each micro-batch's loss is backpropagated as returned, DDP sums the gradients over the DP
        ranks, and megatron's ``finalize_model_grads`` divides them by the counts summed over the DP ranks
        (its ``calculate_per_token_loss``). A ``loss_fn`` that returns ``(summed loss, count, metrics)``
        (``count``: the tokens the sum is over) thus trains on the token mean over the global batch,
        whatever the split into micro-batches and ranks; one that returns ``(loss, metrics)`` counts 1
        per micro-batch, so the gradient is that of the mean over micro-batches and ranks.

        Args:
            micro_batches: each with ``input_ids`` (LongTensor[B, S]) and
                ``lengths`` (int tensor [B]), optionally ``routed_experts`` (MoE:
                replayed in that micro-batch's forward, as :meth:`logprobs`; the
                backward differentiates that same forward, no recompute), plus
                what ``loss_fn`` reads; shapes may differ between micro-batches.
            loss_fn: ``loss_fn(logprobs, micro_batch) -> (summed loss, count, metrics)``
                or ``-> (loss, metrics)``, called on the last pipeline stage with
                differentiable log-probs (as :meth:`logprobs`); ``count`` is an int
                (or integer scalar tensor) >= 0; metric values are scalars.

        Returns:
            ``loss``: this replica's ``sum(loss_i) / sum(count_i)`` (0.0 when every count is 0);
            ``loss_sum`` and ``loss_weight``: its ``sum(loss_i)`` and ``sum(count_i)``, so the global
            loss is the sum of ``loss_sum`` over replicas over the sum of ``loss_weight``; ``grad_norm``: L2 norm of the step's gradient over all parameters (all
            TP and PP shards), the same on every rank; ``metrics``: one dict per micro-batch, with
            ``"loss"`` that micro-batch's ``loss / max(count, 1)``. Collective over the world.

        Raises:
            TypeError: ``micro_batches`` is not a non-empty sequence of mappings,
                or ``loss_fn`` returns something other than (scalar tensor, [count,] mapping).
            ValueError: a micro-batch lacks ``input_ids`` or ``lengths`` or has
                out-of-range values or a bad ``routed_experts`` (as :meth:`logprobs`),
                or ``loss_fn``'s count is negative.
        """
        if isinstance(micro_batches, Mapping) or not isinstance(micro_batches, Sequence) or not micro_batches:
            raise TypeError(
                f"'micro_batches' must be a non-empty list of dicts: got {type(micro_batches).__name__}"
                f"{'' if not isinstance(micro_batches, Sequence) else f' of length {len(micro_batches)}'}; "
                f"e.g. train_step([{{'input_ids': ids, 'lengths': lengths}}], loss_fn)"
            )
        batches: list[dict[str, torch.Tensor]] = []
        for i, micro_batch in enumerate(micro_batches):
            if not isinstance(micro_batch, Mapping) or "input_ids" not in micro_batch or "lengths" not in micro_batch:
                got = sorted(micro_batch) if isinstance(micro_batch, Mapping) else type(micro_batch).__name__
                raise ValueError(f"'micro_batches[{i}]' must map 'input_ids' and 'lengths' to tensors: got {got}")
            checked = self._checked_batch(
                micro_batch["input_ids"], micro_batch["lengths"], micro_batch.get("routed_experts"),
                f"micro_batches[{i}].",
            )
            batches.append({**to_device(micro_batch, self.device), **checked})

        def loss_func(
            micro_batch: dict[str, torch.Tensor], output: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, tuple[Metrics, float, int]]:
            loss, count, metrics = _loss_parts(loss_fn(logprobs_from_ce(output, micro_batch["lengths"]), micro_batch))
            total = float(loss.detach())
            reported = {"loss": total / max(count, 1)}
            reported.update({str(k): float(v) for k, v in metrics.items()})
            # megatron sums the counts over micro-batches and DP ranks and divides the gradients by the total.
            return loss.reshape(()), torch.tensor(count, dtype=torch.int32, device=loss.device), (reported, total, count)

        with self._device_scope():
            self._policy.train()
            self._policy.zero_grad_buffer()
            self._optimizer.zero_grad()
            store = self._run(self._policy, batches, loss_func, forward_only=False, routers=self._policy_routers)
            parts = self._broadcast_from_last_stage(list(store) if self._is_last_stage else None)
            self._optimizer.prepare_grads()
            grad_norm = float(self._optimizer.get_grad_norm())
            self._optimizer.step_with_ready_grads()
        weight, summed = sum(count for _, _, count in parts), sum(total for _, total, _ in parts)
        return {
            "loss": summed / weight if weight else 0.0,
            "loss_sum": summed,
            "loss_weight": float(weight),
            "grad_norm": grad_norm,
            "metrics": [reported for reported, _, _ in parts],
        }


def _loss_parts(result: Any) -> tuple[torch.Tensor, int, Mapping[str, Any]]:
    """``loss_fn``'s result as ``(scalar loss, count, metrics)``; a ``(loss, metrics)`` result counts 1."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        (loss, metrics), count = result, 1
    elif isinstance(result, tuple) and len(result) == 3 and isinstance(result[2], Mapping):
        loss, count, metrics = result
        is_int_tensor = isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point()
        if not (is_int_tensor and count.dtype != torch.bool) and (isinstance(count, bool) or not isinstance(count, int)):
            got = f"{count.dtype} tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor) else type(count).__name__
            raise TypeError(f"'loss_fn' count must be an int or an integer scalar tensor: got {got}")
        count = int(count)
        if count < 0:
            raise ValueError(f"'loss_fn' count must be >= 0: got {count}")
    else:
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise TypeError(f"'loss_fn' must return (summed loss, count, metrics dict) or (loss, metrics dict): got {got}")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"'loss_fn' loss must be a scalar tensor: got {type(loss).__name__} "
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss, count, metrics
