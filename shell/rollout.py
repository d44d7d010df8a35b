"""The rollout engine: a one-rank Ray worker that samples responses with the current policy weights.

``RolloutWorker`` holds a megatron tiny GPT (TP = PP = 1) whose weights the
policy workers push after every train step (``PolicyWorker.push_weights``).
For each prompt it samples ``num_generations`` responses at the configured
temperature, scores them with the task, and then either

* data plane (a ``partition_id``): does the step's single bulk write
  (:func:`shell.column_io.first_write`) under keys ``f"{uid}_g{i}"`` (with,
  for the async trainer, each key tagged with its ``weight_version`` and the
  behaviour policy's per-token ``generation_logprobs`` written beside the
  tokens) and returns only the receipt and the carry; with
  ``write_behind=True`` it returns them as soon as the batch is scored and
  makes the write on a thread of its own
  (:func:`shell.column_io.first_write_behind`), which ``wait_write`` waits
  for; or
* legacy (no partition): returns the same keys and lengths plus the bulk batch
  itself, which then travels through the driver.

Invariant: for the same weights, prompts, seed, step and batch index, both
modes build the same rows (same tokens, masks, lengths, rewards and entropies): the
sampling generator is seeded from ``(seed, step, batch_index)`` alone.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from adapters.model_port import PolicyBackend
from adapters.rows import build_tensordict
from core.fields import GENERATION_LOGPROBS, INPUT_IDS, LENGTHS, ROUTED_EXPERTS, TOKEN_MASK, WEIGHT_VERSION
from core.routing import encode_routing
from core.meta import KVBatchMeta
from core.model_config import TinyGPTConfig
from core.rollout_carry import RolloutCarry
from core.step_plan import LEGACY_PARTITION
from core.task import EOS_ID, Prompt, Task
from shell.column_io import first_write, first_write_behind
from shell.model_worker import ClientFactory, ModelWorker
from shell.metering import client_io
from shell.run_task import checked_rewards
from shell.step_rows import StepRows
from shell.worker import on_all_ranks

ROLLOUT_TOKEN_FIELDS: tuple[str, ...] = (INPUT_IDS, TOKEN_MASK, GENERATION_LOGPROBS, ROUTED_EXPERTS)
"""The per-token fields a rollout can write (``generation_logprobs`` only when asked to)."""

_SEED_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def sampling_seed(seed: int, step: int, batch_index: int) -> int:
    """A 63-bit generator seed that depends on ``(seed, step, batch_index)`` only (no Python ``hash``)."""
    mixed = 0
    for value, factor in zip((seed, step, batch_index), _SEED_MIX):
        mixed = (mixed ^ (value * factor)) * 0xD6E8FEB86659FD93 % 2**64
    return mixed % 2**63


def row_keys(uid: str, num_generations: int) -> tuple[str, ...]:
    """The store keys of one prompt instance's responses: ``f"{uid}_g{i}"``."""
    return tuple(f"{uid}_g{i}" for i in range(num_generations))


@attrs.frozen
class RolloutConfig:
    """What the rollout engine is built from.

    Args:
        model: the tiny GPT's shape (the policy's).
        seed: the run's seed (initial weights and sampling streams).
        task: the task that supplies prompt tokens and rewards (picklable).
        temperature: the sampling temperature (> 0).
        torch_threads: intra-op threads of the engine.
        precision: ``"fp32"`` or ``"bf16"``: the compute precision of the engine's forwards (training stays fp32).
        record_routing: write each token's MoE routing (``routed_experts``, the narrowest int dtype of
            :func:`core.routing.routing_dtype`) with the rows, for R3 replay (an MoE ``model`` only).
    """

    model: TinyGPTConfig = attrs.field(validator=attrs.validators.instance_of(TinyGPTConfig))
    seed: int = attrs.field(validator=attrs.validators.instance_of(int))
    task: Any = attrs.field()
    temperature: float = 1.0
    torch_threads: int = 1
    precision: str = attrs.field(default="fp32", validator=attrs.validators.in_(("fp32", "bf16")))
    record_routing: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.record_routing and not self.model.is_moe:
            raise ValueError("'record_routing' needs an MoE model (model.num_experts >= 2): got num_experts=0")

    @task.validator
    def _check_task(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, Task):
            raise TypeError(f"'task' must implement core.task.Task: got {type(value).__name__}")


@attrs.frozen
class RolloutResult:
    """One generation batch: the carry and the rows (the receipt of the bulk write, or the bulk batch itself).

    Attributes:
        carry: per-row rewards, lengths, groups, question ids and truncation flags.
        rows: the batch's meta (keys, lengths, fields) and, on the legacy path,
            its bulk batch: ``input_ids`` [N, S], ``token_mask`` [N, S], ``lengths`` [N].
        store_io: the engine's store activity (``{"ms", "bytes"}``; zeros on the legacy path, and for a write
            behind, whose activity :meth:`RolloutWorker.wait_write` returns).
        responses: the decoded response text of the first rows (for logging samples).
        entropy: per row, the summed entropy (nats) of the distributions its response tokens were drawn from.
        response_tokens: per row, the number of response tokens (the EOS included).
    """

    carry: RolloutCarry
    rows: StepRows
    store_io: Mapping[str, float]
    responses: tuple[str, ...]
    entropy: tuple[float, ...]
    response_tokens: tuple[int, ...]


class RolloutWorker(ModelWorker):
    """The rollout engine (see the module docstring); call ``setup`` once after the group starts.

    Args:
        config: the engine's settings.
        client_factory: builds the engine's store client in ``setup`` (data
            plane; None on the legacy path); must be picklable.
    """

    CONFIG = RolloutConfig
    config: RolloutConfig

    def __init__(self, config: Any, client_factory: ClientFactory | None = None) -> None:
        super().__init__(config, client_factory)
        self._writing: concurrent.futures.Future[KVBatchMeta] | None = None  # the write behind in flight
        self._write_pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on the first write behind

    @on_all_ranks
    def setup(self) -> None:
        """Build the engine's model (the seed's initial weights) and, for the data plane, open the store client."""
        self.set_up()

    def _build_backend(self) -> PolicyBackend:
        from adapters.megatron import MegatronGPTBackend  # the one adapter behind the port: megatron loads here

        return MegatronGPTBackend(self.config.model, tensor_parallel=1, pipeline_parallel=1, seed=self.config.seed)

    @on_all_ranks
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Refit: load the policy's full weights."""
        self.backend.load_state_dict(state)

    @on_all_ranks
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's full weights (to check a refit)."""
        return self.backend.state_dict()

    @on_all_ranks
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        step: int,
        batch_index: int,
        num_generations: int,
        partition_id: str | None,
        num_texts: int = 0,
        key_prefix: str = "",
        uids: Sequence[str] | None = None,
        weight_version: int | None = None,
        record_logprobs: bool = False,
        write_behind: bool = False,
    ) -> RolloutResult:
        """Sample ``num_generations`` responses per prompt, score them, and write or return the batch.

        Rows are prompt-major: row ``j * num_generations + i`` is response
        ``i`` of prompt ``j``, keyed ``f"{uid}_g{i}"`` with
        ``uid = f"{key_prefix}s{step}b{batch_index}p{j}"``.

        Args:
            prompts: the batch's prompts.
            step: the GRPO step (keys and the sampling seed).
            batch_index: the generation batch within the step (DAPO may take several).
            num_generations: responses per prompt (>= 1).
            partition_id: the store partition to write (data plane); None returns the batch (legacy).
            num_texts: decode the responses of the first ``num_texts`` rows (for logging).
            key_prefix: put before every key (e.g. a run id, so runs sharing a partition never collide).
            uids: one key stem per prompt instead of ``f"{key_prefix}s{step}b{batch_index}p{j}"``
                (the async collector's ``v{version}_b{seq}_p{j}``; ``key_prefix`` is not added).
            weight_version: tag every key with ``weight_version`` (the version of the weights sampling now).
            record_logprobs: also write (or return) ``generation_logprobs`` [N, S], each response
                token's log-probability under the distribution it was drawn from.
            write_behind: (data plane) return the receipt once the batch is scored and the write's input is
                checked, and write it on the engine's writer thread; the caller must call :meth:`wait_write`
                before anyone reads or clears the keys. A write behind that no ``wait_write`` collected is
                waited for (and its error raised) by the next ``generate``.

        Raises:
            ValueError: no prompts, ``num_generations`` < 1, ``uids`` not one per prompt, or a
                data-plane write without a client.
        """
        task: Task = self.config.task
        if not prompts:
            raise ValueError("'prompts' must hold at least one prompt: got 0")
        if num_generations < 1:
            raise ValueError(f"'num_generations' must be >= 1: got {num_generations}")
        if uids is not None and len(uids) != len(prompts):
            raise ValueError(f"'uids' must have {len(prompts)} entries (one per prompt): got {len(uids)}")
        if partition_id is not None and self._client is None:
            raise ValueError("a data-plane rollout needs a store client: build the worker with a client_factory")
        encoded = [task.prompt_ids(p) for p in prompts for _ in range(num_generations)]
        width = max(len(ids) for ids in encoded)
        prompt_ids = torch.zeros(len(encoded), width, dtype=torch.long)
        for row, ids in enumerate(encoded):
            prompt_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        prompt_lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
        generator = torch.Generator().manual_seed(sampling_seed(self.config.seed, step, batch_index))
        generation = self.backend.generate(
            prompt_ids,
            prompt_lengths,
            max_new_tokens=task.max_new_tokens,
            eos_id=EOS_ID,
            generator=generator,
            temperature=self.config.temperature,
            vocab_limit=task.tokenizer.vocab_size,
            precision=self.config.precision,
        )
        sequences, lengths = generation.sequences, generation.lengths
        entropy = tuple(generation.entropy.tolist())
        response_tokens = tuple((lengths - prompt_lengths).tolist())
        responses = [sequences[r, int(prompt_lengths[r]) : int(lengths[r])].tolist() for r in range(len(encoded))]
        row_prompts = [p for p in prompts for _ in range(num_generations)]
        rewards = checked_rewards(task, row_prompts, responses)
        positions = torch.arange(sequences.shape[1])
        token_mask = (positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])
        carry = RolloutCarry(
            rewards=rewards,
            lengths=lengths.tolist(),
            group_ids=[(batch_index * len(prompts) + j) for j in range(len(prompts)) for _ in range(num_generations)],
            prompt_ids=[p.prompt_id for p in row_prompts],
            truncated=[not r or r[-1] != EOS_ID for r in responses],
        )
        text = tuple(task.tokenizer.decode(r) for r in responses[:num_texts])
        columns = {INPUT_IDS: sequences, TOKEN_MASK: token_mask}
        if record_logprobs:
            columns[GENERATION_LOGPROBS] = generation.logprobs
        if self.config.record_routing:
            columns[ROUTED_EXPERTS] = encode_routing(generation.routed_experts, self.config.model.num_experts)
        stems = list(uids) if uids is not None else [f"{key_prefix}s{step}b{batch_index}p{j}" for j in range(len(prompts))]
        keys = [key for stem in stems for key in row_keys(stem, num_generations)]
        tags = None if weight_version is None else [{WEIGHT_VERSION: int(weight_version)} for _ in keys]
        if partition_id is None:
            batch = build_tensordict({**columns, LENGTHS: lengths}, len(encoded))
            meta = KVBatchMeta(LEGACY_PARTITION, keys, fields=list(columns), sequence_lengths=lengths.tolist(), tags=tags)
            return RolloutResult(carry, StepRows(meta, batch), {"ms": 0.0, "bytes": 0.0}, text, entropy, response_tokens)
        self._collect_write()  # writes land in order; one left uncollected raises here
        token_fields = [name for name in ROLLOUT_TOKEN_FIELDS if name in columns]
        if write_behind:
            meta, self._writing = first_write_behind(
                self._client,  # type: ignore[arg-type]
                columns,
                executor=self._writer(),
                keys=keys,
                partition_id=partition_id,
                lengths=lengths.tolist(),
                token_fields=token_fields,
                tags=tags,
            )
            return RolloutResult(carry, StepRows(meta), {"ms": 0.0, "bytes": 0.0}, text, entropy, response_tokens)
        meta = first_write(
            self._client,  # type: ignore[arg-type]
            columns,
            keys=keys,
            partition_id=partition_id,
            lengths=lengths.tolist(),
            token_fields=token_fields,
            tags=tags,
        )
        return RolloutResult(carry, StepRows(meta), client_io(self._client), text, entropy, response_tokens)

    @on_all_ranks
    def wait_write(self) -> dict[str, float]:
        """Wait until the last write behind (``generate(..., write_behind=True)``) is stored; the engine's store
        activity since it was last reported (``{"ms", "bytes", ...}``, as ``RolloutResult.store_io``).

        Returns at once when no write is in flight.

        Raises:
            Exception: the write's own error (the store then holds nothing of it).
        """
        self._collect_write()
        return client_io(self._client) if self._client is not None else {"ms": 0.0, "bytes": 0.0}

    def _collect_write(self) -> None:
        """Wait for the write behind in flight, if any, and raise its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _writer(self) -> concurrent.futures.ThreadPoolExecutor:
        """The engine's writer thread (one, so writes behind land in the order they were made)."""
        if self._write_pool is None:
            self._write_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="write-behind")
        return self._write_pool
