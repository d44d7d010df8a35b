"""R3 benchmark: router replay on an MoE policy with a bf16 rollout: the mismatch it removes, and what it costs.

The setting is an MoE tiny GPT (``policy.model.num_experts=8``,
``policy.model.moe_topk=2`` unless ``overrides`` set them; every other size
from ``shell/grpo.yaml``) whose rollout runs in ``rollout.precision=bf16`` while
the trainer runs fp32, on the data plane with ``data_plane.backend=memory``
(each overridable). Four measurements:

1. **Mismatch** (same batches, replay off vs on), on two models: the run
   model above, and a routing-heavy *mismatch model* (``MISMATCH_DEFAULTS``:
   64 experts, top-8, 4 layers, a fine-grained expert ratio like OLMoE's,
   unless ``mismatch_overrides`` set them; its other settings are the run
   model's, so its prompts and batches are the same). The run model is too
   small for routing to be much of the gap, and the mismatch model too slow
   to train in this bench's budget, so only the run model trains. In one fresh
   worker process per seed and model, a backend built from the seed generates
   ``batches`` batches of the task's prompts at the rollout precision,
   recording each token's experts; the fp32 trainer forward then scores the
   same sequences without replay and with replay of the recorded routing. For
   each, the routing disagreement with the rollout
   (:func:`core.routing.routing_disagreement`) and the training-inference
   mismatch of the sampled tokens' log-probs
   (:func:`core.routing.logprob_mismatch`, over response tokens), pooled over
   every batch: for the run model at the initial weights and at the weights
   the ``off`` run of that seed ended with (its ``checkpoint.pt``), for the
   mismatch model at its initial weights only (no run trains it). The goal
   line says, from the numbers, which (model, weights) rows have an r3 / off
   mean absolute log-prob gap of at most ``GOAL_RATIO`` (:func:`goal_line`).
2. **Cost**, two ways:

   * *On the same batches* (the goal's measure): per seed, in one fresh
     process and one Ray, an ``off`` and an ``r3`` trainer
     (:class:`shell.grpo_trainer.GRPOTrainer`) run ``cost_steps`` steps side
     by side, step for step, the order alternating (off r3, r3 off, ...), at
     ``policy.learning_rate`` :data:`FROZEN_LEARNING_RATE`: each step does all
     of a training step's work, but the weights cannot drift apart, so both
     trainers sample the same batches (checked per step: reward, rows and
     tokens equal) and the ratio of their step times is R3's own cost. Each
     step after :data:`COST_WARMUP` is one paired ratio r3 / off; the bench
     reports their median per seed and pooled over the seeds, and the same
     for the rollout, log-prob and train phases.
   * *Over training*: paired ``python -m shell.run`` runs,
     ``policy.router_replay=off`` vs ``r3``, in fresh processes, the order
     rotated from seed to seed; the step time ratio r3 / off of each seed
     (mean ``step_time_s``) is one paired ratio, reported as their median
     and range. The two runs train apart, so their batches differ; and a run's
     processes are 10-15% faster or slower than another's here, so these
     ratios spread widely.
3. **Routing bytes**: short runs (``bytes_steps`` steps, seed ``first_seed``)
   of off and r3 on the legacy path (``data_plane.enabled=false``) and on the
   data plane. Per path the mean ``driver_bytes`` and ``data_plane_bytes`` per
   step of each, their difference r3 - off at step 1 (same weights, so the same
   rollout: the difference is the routing alone) and the routing a step holds,
   :func:`core.routing.routing_bytes` of its tokens. The data-plane runs must
   repeat, step for step, the driver and store bytes of the first steps of
   the cost runs of the same seed (the same command, so the same records).
4. **Trains**: from the cost runs, the mean reward of the last ``LAST`` steps
   per seed (mean and range over seeds) of off and r3, and both reward curves
   (seed ``first_seed``) in one PNG.

Invariant: every number reported is measured by this bench on the current
code (from the worker processes, or from the ``metrics.jsonl`` of runs it made,
or with ``reuse`` found in ``runs_dir``); nothing is typed in or tuned.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from core.routing import LogprobMismatch, RoutingDisagreement, routing_bytes
from shell.bench.async_grpo import final_reward, mean_of, per_seed
from shell.bench.report import Report
from shell.bench.reward import ROOT, RUN_KEYS, absolute_path, check_run_bench, cpu_name, unset_defaults
from shell.run_log import read_metrics
from shell.run_plot import plot_compare

Records = Sequence[Mapping[str, Any]]
LAST = 10
"""Steps averaged for the final reward."""
DEFAULTS = (
    ("policy.model.num_experts", "8"),
    ("policy.model.moe_topk", "2"),
    ("rollout.precision", "bf16"),
    ("data_plane.backend", "memory"),
)
"""The bench's setting, each applied unless ``overrides`` set that key."""
MISMATCH_DEFAULTS = (
    ("policy.model.num_experts", "64"),
    ("policy.model.moe_topk", "8"),
    ("policy.model.num_layers", "4"),
)
"""The mismatch model over the run model, each applied unless ``mismatch_overrides`` set that key."""
MISMATCH_PREFIX = "policy.model."
"""The only keys ``mismatch_overrides`` may set: the model alone, so both models see the same prompts and batches."""
MODELS = ("run", "mismatch")
"""The models of the mismatch table: the cost runs' model, and the routing-heavy mismatch model."""
GOAL_RATIO = 0.5
"""The issue's goal: r3's mean absolute log-prob gap at most this share of off's."""
BENCH_KEYS = (*RUN_KEYS, "policy.router_replay", "data_plane.enabled")
"""Keys the bench sets itself; ``overrides`` may not."""
VARIANTS: dict[str, tuple[str, ...]] = {"off": ("policy.router_replay=off",), "r3": ("policy.router_replay=r3",)}
"""Variant name -> its overrides."""
PATHS: dict[str, tuple[str, ...]] = {"legacy": ("data_plane.enabled=false",), "data plane": ()}
"""Transport name -> its overrides, for the routing-bytes runs."""
WEIGHTS = ("initial", "trained")
"""Where the mismatch is measured: the seed's initial weights, and the ``off`` cost run's final weights."""
REQUIRED = ("step", "step_time_s", "reward_mean", "driver_bytes", "data_plane_bytes", "rows", "sequence_tokens_mean")
"""Fields every step record must hold."""
WORKER_TIMEOUT_S = 1800.0
POLL_S = 1.0
"""How often the wait for a bench worker process checks that it is still alive."""
COST_WARMUP = 2
"""Steps of the same-batches cost measurement left out of its ratios (the first steps warm up)."""
FROZEN_LEARNING_RATE = "1e-30"
"""The same-batches cost measurement's ``policy.learning_rate``: Adam moves no weight by more than this, far below
the rounding of any weight that sets a token's probability, so both trainers keep sampling the same batches."""
SAME_BATCH_KEYS = ("reward_mean", "rows", "sequence_tokens_mean")
"""What must be equal, step for step, for two trainers to have stepped the same batches."""
COST_KEYS = ("step_time_s", "phase_rollout_s", "phase_logprobs_s", "phase_train_s")
"""The times the same-batches cost measurement compares."""
COST_GOAL = 1.05
"""The issue's goal: r3 / off step time at most this."""


@attrs.frozen
class R3BenchConfig:
    """What the bench runs.

    Attributes:
        seeds: paired repeats (>= 1), seeds ``first_seed ..``.
        steps: steps per cost run (>= ``LAST``).
        runs_dir: where the runs go (``<variant>-seed<s>`` and ``bytes-<path>-<variant>`` each, with a ``.log``).
        batches: generation batches per seed in the mismatch measurement (>= 1).
        bytes_steps: steps of each routing-bytes run (in ``[1, steps]``).
        cost_steps: steps of each same-batches cost measurement (> ``COST_WARMUP``).
        first_seed: the first seed (>= 0).
        plot: the PNG (default ``runs_dir/r3_reward.png``).
        reuse: read the runs in ``runs_dir`` instead of running them (the mismatch is measured again).
        overrides: extra config overrides for every run and for both models of the mismatch measurement.
        mismatch_overrides: ``policy.model.*`` overrides of the mismatch model over ``MISMATCH_DEFAULTS`` (it must
            stay MoE, with ``moe_topk`` in ``[1, num_experts]``).
    """

    seeds: int
    steps: int
    runs_dir: Path = attrs.field(converter=absolute_path)
    batches: int = 4
    bytes_steps: int = 5
    cost_steps: int = 40
    first_seed: int = 0
    plot: Path | None = attrs.field(converter=attrs.converters.optional(absolute_path), default=None)
    reuse: bool = False
    overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())
    mismatch_overrides: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        check_run_bench(
            seeds=self.seeds, steps=self.steps, first_seed=self.first_seed, overrides=self.overrides, reserved=BENCH_KEYS
        )
        if self.batches < 1:
            raise ValueError(f"'batches' must be >= 1: got {self.batches}")
        if not 1 <= self.bytes_steps <= self.steps:
            raise ValueError(f"'bytes_steps' must be in [1, steps ({self.steps})]: got {self.bytes_steps}")
        if not (isinstance(self.cost_steps, int) and self.cost_steps > COST_WARMUP):
            raise ValueError(f"'cost_steps' must be an int > {COST_WARMUP} (the warm-up steps): got {self.cost_steps!r}")
        check_moe(self.setting, "overrides")
        malformed = [o for o in self.mismatch_overrides if "=" not in o]
        if malformed:
            raise ValueError(f"'mismatch_overrides' must be key=value items: got {malformed}")
        foreign = [o for o in self.mismatch_overrides if not o.startswith(MISMATCH_PREFIX)]
        if foreign:
            raise ValueError(
                f"'mismatch_overrides' must set {MISMATCH_PREFIX}* keys only (the mismatch model sees the run "
                f"model's prompts and batches): got {foreign}"
            )
        check_moe(self.mismatch_setting, "mismatch_overrides")

    @property
    def setting(self) -> dict[str, str]:
        """Key -> value of the bench's defaults and the overrides (the overrides win)."""
        return {**dict(DEFAULTS), **dict(o.split("=", 1) for o in self.overrides)}

    @property
    def base_overrides(self) -> tuple[str, ...]:
        """The defaults the overrides leave unset, then the overrides."""
        return (*unset_defaults([f"{k}={v}" for k, v in DEFAULTS], self.overrides), *self.overrides)

    @property
    def mismatch_setting(self) -> dict[str, str]:
        """Key -> value of the mismatch model: ``setting``, then ``MISMATCH_DEFAULTS``, then ``mismatch_overrides``."""
        return {**self.setting, **dict(MISMATCH_DEFAULTS), **dict(o.split("=", 1) for o in self.mismatch_overrides)}

    @property
    def mismatch_model_overrides(self) -> tuple[str, ...]:
        """The mismatch model's config overrides: ``base_overrides``, then the ``MISMATCH_DEFAULTS``
        ``mismatch_overrides`` leave unset, then ``mismatch_overrides`` (later items win)."""
        own = unset_defaults([f"{k}={v}" for k, v in MISMATCH_DEFAULTS], self.mismatch_overrides)
        return (*self.base_overrides, *own, *self.mismatch_overrides)

    @property
    def model_overrides(self) -> dict[str, tuple[str, ...]]:
        """Model of the mismatch table (``MODELS``) -> its config overrides."""
        return {"run": self.base_overrides, "mismatch": self.mismatch_model_overrides}

    @property
    def seed_list(self) -> list[int]:
        """The seeds, ``first_seed ..``."""
        return list(range(self.first_seed, self.first_seed + self.seeds))


# ---------------------------------------------------------------- pure parts


def check_moe(setting: Mapping[str, str], field: str) -> None:
    """Check that ``setting`` (key -> value) is an MoE model router replay can run on.

    Raises:
        ValueError: ``policy.model.num_experts`` is not an integer >= 2, or ``policy.model.moe_topk`` (when set)
            is not an integer in ``[1, num_experts]``; the message names ``field``.
    """
    experts = setting.get("policy.model.num_experts", "")
    if not experts.strip().isdigit() or int(experts) < 2:
        raise ValueError(
            f"'{field}' must keep an MoE model (policy.model.num_experts >= 2; router replay needs one): got {experts!r}"
        )
    topk = setting.get("policy.model.moe_topk")
    if topk is not None and (not topk.strip().isdigit() or not 1 <= int(topk) <= int(experts)):
        raise ValueError(f"'{field}' must keep policy.model.moe_topk in [1, num_experts ({int(experts)})]: got {topk!r}")


def model_label(role: str, num_experts: int, topk: int, num_layers: int) -> str:
    """How the mismatch table names a model, e.g. ``"run: 8 experts top-2, 2 layers"``."""
    return f"{role}: {num_experts} experts top-{topk}, {num_layers} layer{'' if num_layers == 1 else 's'}"


def goal_line(ratios: Mapping[str, float], bound: float = GOAL_RATIO) -> str:
    """Which rows meet ``r3 / off <= bound`` and which do not, from their ratios (row name -> ratio).

    A ``nan`` ratio (no mismatch either way) does not meet it. Rows keep their order.

    Raises:
        ValueError: no rows.

    Example:
        >>> goal_line({"the run model at initial weights": 0.7, "the mismatch model at initial weights": 0.3})
        'goal r3 / off <= 0.5 (mean |log p_train - log p_rollout|): met by the mismatch model at initial weights (0.300); not met by the run model at initial weights (0.700)'
    """
    if not ratios:
        raise ValueError("'ratios' must hold at least one row: got 0")
    met = [f"{name} ({value:.3f})" for name, value in ratios.items() if value <= bound]
    missed = [f"{name} ({value:.3f})" for name, value in ratios.items() if not value <= bound]
    return (
        f"goal r3 / off <= {bound:g} (mean |log p_train - log p_rollout|): "
        f"met by {' and '.join(met) or 'none'}; not met by {' and '.join(missed) or 'none'}"
    )


def check_records(records: Records, steps: int, where: str) -> list[Mapping[str, Any]]:
    """``records`` in step order, checked: steps ``1 .. steps`` once each, each holding every ``REQUIRED`` field.

    Raises:
        ValueError: another number of steps, a step missing or repeated, or a field missing (naming ``where``).
    """
    ordered = sorted(records, key=lambda r: r.get("step", -1))
    numbers = [r.get("step") for r in ordered]
    if numbers != list(range(1, steps + 1)):
        shown = numbers if len(numbers) <= 6 else [*numbers[:3], "...", *numbers[-2:]]
        raise ValueError(f"'{where}' must hold steps 1..{steps} once each: got {len(numbers)} records, steps {shown}")
    for record in ordered:
        missing = [k for k in REQUIRED if record.get(k) is None]
        if missing:
            raise ValueError(f"'{where}' step {record['step']} must hold {list(REQUIRED)}: missing {missing}")
    return ordered


def mean_step_time(records: Records) -> float:
    """Mean ``step_time_s`` over the records."""
    return math.fsum(r["step_time_s"] for r in records) / len(records)


def paired_ratios(treated: Mapping[int, Records], baseline: Mapping[int, Records]) -> list[float]:
    """Per seed (in ``baseline``'s order), ``mean_step_time(treated) / mean_step_time(baseline)``.

    Raises:
        ValueError: the two hold other seeds.
    """
    if set(treated) != set(baseline):
        raise ValueError(f"'treated' must hold the seeds of 'baseline' ({sorted(baseline)}): got {sorted(treated)}")
    return [mean_step_time(treated[s]) / mean_step_time(baseline[s]) for s in baseline]


def same_batches(a: Records, b: Records, keys: Sequence[str] = SAME_BATCH_KEYS) -> bool:
    """Whether ``a`` and ``b`` hold as many steps and ``a`` repeats ``b`` step for step (:func:`same_values`)."""
    return len(a) == len(b) and same_values(a, b, keys)


def step_ratios(treated: Records, baseline: Records, key: str, warmup: int = COST_WARMUP) -> list[float]:
    """Per step after the first ``warmup``, ``treated[key] / baseline[key]`` of the same step (records in step order).

    Raises:
        ValueError: the two hold other steps, or none is left after ``warmup``.
    """
    if [r["step"] for r in treated] != [r["step"] for r in baseline]:
        raise ValueError(
            f"'treated' must hold the steps of 'baseline' ({len(baseline)} records): got {len(treated)} records"
        )
    if len(baseline) <= warmup:
        raise ValueError(f"the records must hold more than {warmup} steps (the warm-up): got {len(baseline)}")
    return [t[key] / b[key] for t, b in zip(treated[warmup:], baseline[warmup:])]


def step_tokens(record: Mapping[str, Any]) -> int:
    """The tokens (prompt and response) of a step's rows: ``rows * sequence_tokens_mean``, rounded."""
    return round(record["rows"] * record["sequence_tokens_mean"])


def step_routing_bytes(record: Mapping[str, Any], *, num_layers: int, topk: int, num_experts: int) -> int:
    """The bytes of the ``routed_experts`` a step's rows hold (:func:`core.routing.routing_bytes` of its tokens)."""
    return routing_bytes(step_tokens(record), num_layers, topk, num_experts)


def same_values(short: Records, long: Records, keys: Sequence[str]) -> bool:
    """Whether every step of ``short`` has exactly the ``keys`` values of the same step of ``long``."""
    by_step = {r["step"]: r for r in long}
    return all(r["step"] in by_step and all(r[k] == by_step[r["step"]][k] for k in keys) for r in short)


def pool_disagreement(parts: Sequence[RoutingDisagreement]) -> RoutingDisagreement:
    """The disagreement of the union of the parts' tokens: every count summed.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("'parts' must hold at least one RoutingDisagreement: got 0")
    return RoutingDisagreement(
        tokens=sum(p.tokens for p in parts),
        decisions=sum(p.decisions for p in parts),
        differing_tokens=sum(p.differing_tokens for p in parts),
        differing_decisions=sum(p.differing_decisions for p in parts),
    )


def pool_mismatch(parts: Sequence[LogprobMismatch]) -> LogprobMismatch:
    """The mismatch over the union of the parts' tokens: each mean weighted by its token count.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("'parts' must hold at least one LogprobMismatch: got 0")
    tokens = sum(p.tokens for p in parts)
    if tokens == 0:
        return LogprobMismatch(mean_abs_diff=0.0, k3_kl=0.0, tokens=0)
    return LogprobMismatch(
        mean_abs_diff=math.fsum(p.mean_abs_diff * p.tokens for p in parts) / tokens,
        k3_kl=math.fsum(p.k3_kl * p.tokens for p in parts) / tokens,
        tokens=tokens,
    )


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; ``nan`` for 0 / 0 and ``inf`` for x / 0 with x > 0."""
    if denominator == 0:
        return math.nan if numerator == 0 else math.inf
    return numerator / denominator


# ---------------------------------------------------------------- mismatch: the worker process


Measured = dict[tuple[str, str], tuple[RoutingDisagreement, LogprobMismatch]]
"""(weights, variant) -> the routing disagreement and log-prob mismatch, pooled over the batches."""


def measure_mismatch(
    overrides: Sequence[str], seed: int, batches: int, checkpoint: Path | None = None, timeout_s: float = WORKER_TIMEOUT_S
) -> Measured:
    """Run the mismatch measurement for one seed in a fresh worker process (a one-rank gloo world).

    Args:
        overrides: the run config overrides (the model, task, batch sizes and rollout precision come from them).
        seed: the initial weights, the prompts and the sampling streams.
        batches: generation batches, each ``grpo.num_prompts_per_step`` prompts x ``grpo.num_generations_per_prompt``.
        checkpoint: also measure at these trained weights (a run's ``checkpoint.pt``), as weights ``"trained"``.
        timeout_s: give up after this long.

    Returns:
        ``(weights, variant) -> (disagreement, mismatch)`` for weights ``"initial"`` (and ``"trained"``) and
        variants ``"off"`` (the trainer routes itself) and ``"r3"`` (it replays the rollout's routing).

    Raises:
        RuntimeError: the worker raised, died or timed out.
    """
    with tempfile.TemporaryDirectory(prefix="r3-bench-") as tmp:
        store = Path(tmp) / "rendezvous"
        args = (tuple(overrides), seed, batches, None if checkpoint is None else str(checkpoint), str(store))
        return run_in_worker(_worker_main, args, timeout_s, f"the mismatch worker (seed {seed})")


def run_in_worker(target: Any, args: tuple[Any, ...], timeout_s: float, name: str, join_s: float = 60.0) -> Any:
    """``target(*args, results)`` in a fresh (spawned) process; the payload of the ``("ok", payload)`` it puts on
    ``results``.

    ``target`` puts ``("ok", payload)`` or ``("error", trace)`` once. The process is joined for up to ``join_s``
    after it answers, and killed if it is still alive.

    Raises:
        RuntimeError: the worker put an error (its trace in the message), or died or timed out (:func:`await_result`).
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=target, args=(*args, results), daemon=True)
    worker.start()
    try:
        status, payload = await_result(worker, results, timeout_s, name)
    finally:
        worker.join(timeout=join_s)
        if worker.is_alive():
            worker.kill()
    if status != "ok":
        raise RuntimeError(f"{name} raised:\n{payload}")
    return payload


def await_result(worker: Any, results: Any, timeout_s: float, name: str, poll_s: float = POLL_S) -> Any:
    """The first item ``worker`` puts on ``results``, waiting at most ``timeout_s``; fails at once if it dies first.

    ``worker`` needs ``is_alive()`` and ``exitcode`` (a ``multiprocessing.Process``), ``results`` a ``get(timeout=)``
    that raises ``queue.Empty``. A worker that exits without a result (killed, out of memory, a failed start) is
    reported within about ``poll_s`` instead of at the end of ``timeout_s``. What a worker put before it exited is
    still read.

    Raises:
        RuntimeError: the worker exited without a result (naming ``name`` and its exit code), or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        alive = worker.is_alive()
        try:
            return results.get(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
        except queue.Empty:
            pass
        if not alive:
            raise RuntimeError(f"{name} exited (exit code {worker.exitcode}) without a result")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{name} gave no result in {timeout_s:.0f} s")


def _worker_main(overrides: tuple[str, ...], seed: int, batches: int, checkpoint: str | None, store: str,
                 results: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        results.put(("ok", _measure(overrides, seed, batches, checkpoint)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the trace
        results.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(overrides: Sequence[str], seed: int, batches: int, checkpoint: str | None) -> Measured:
    import torch

    from adapters.megatron import MegatronGPTBackend  # megatron and its CPU shim load in this worker only
    from core.routing import logprob_mismatch, routing_disagreement
    from core.task import EOS_ID
    from shell.grpo_trainer import build_task, load_checkpoint, model_config
    from shell.rollout import sampling_seed
    from shell.run_config import load_run_config

    # The rollout samples from the full (padded) vocabulary here, not the tokenizer's ids only as shell.rollout
    # does, as it did when the recorded log-probs were those of the distribution the tokens were drawn from (a
    # vocab-limited draw then differed from the trainer's by the log of the mass on the allowed ids); they are
    # the trainer's distribution's since 2026-11-28 either way, and the published figures sampled so.
    config = load_run_config([*overrides, f"seed={seed}"])
    task = build_task(config)
    model = model_config(config, task)
    backend = MegatronGPTBackend(model, tensor_parallel=1, pipeline_parallel=1, seed=seed)
    states = {"initial": None}
    if checkpoint is not None:
        states["trained"] = load_checkpoint(checkpoint)["weights"]
    generations = config.grpo.num_generations_per_prompt
    out: Measured = {}
    for weights, state in states.items():
        if state is not None:
            backend.load_state_dict(state)
        parts: dict[str, list[tuple[RoutingDisagreement, LogprobMismatch]]] = {name: [] for name in VARIANTS}
        for batch in range(batches):
            prompts = task.prompts(seed, batch, config.grpo.num_prompts_per_step)
            encoded = [task.prompt_ids(p) for p in prompts for _ in range(generations)]
            prompt_ids = torch.zeros(len(encoded), max(len(ids) for ids in encoded), dtype=torch.long)
            for row, ids in enumerate(encoded):
                prompt_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            prompt_lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
            generation = backend.generate(
                prompt_ids, prompt_lengths, max_new_tokens=task.max_new_tokens, eos_id=EOS_ID,
                generator=torch.Generator().manual_seed(sampling_seed(seed, batch, 0)),
                temperature=config.grpo.temperature, vocab_limit=None,  # the trainer's distribution: see above
                precision=config.rollout.precision,
            )
            sequences, lengths, recorded = generation.sequences, generation.lengths, generation.routed_experts
            positions = torch.arange(sequences.shape[1])
            response = (positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])
            for name, replay in (("off", None), ("r3", recorded)):
                trainer = backend.routing(sequences, lengths, replay)
                logprobs = backend.logprobs(sequences, lengths, replay)
                parts[name].append((
                    routing_disagreement(recorded, trainer, lengths),
                    logprob_mismatch(logprobs, generation.logprobs, response),
                ))
        for name, pairs in parts.items():
            out[weights, name] = (pool_disagreement([d for d, _ in pairs]), pool_mismatch([m for _, m in pairs]))
    return out


# ---------------------------------------------------------------- cost on the same batches: the worker process


def measure_same_batch_cost(
    overrides: Sequence[str], seed: int, steps: int, timeout_s: float = WORKER_TIMEOUT_S
) -> dict[str, list[dict[str, Any]]]:
    """Step an ``off`` and an ``r3`` trainer side by side for one seed, in a fresh process (see the module doc).

    Args:
        overrides: the run config overrides (``seed``, ``grpo.num_steps`` and ``policy.learning_rate`` are set here).
        seed: the run seed of both trainers.
        steps: steps of each trainer (>= 1).
        timeout_s: give up after this long.

    Returns:
        variant (``VARIANTS``) -> its step records in step order, each with ``step`` and the ``SAME_BATCH_KEYS``
        and ``COST_KEYS`` values.

    Raises:
        ValueError: ``steps`` < 1.
        RuntimeError: the worker raised, died or timed out.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"'steps' must be an int >= 1: got {steps!r}")
    return run_in_worker(_cost_main, (tuple(overrides), seed, steps), timeout_s, f"the cost worker (seed {seed})")


def _cost_main(overrides: tuple[str, ...], seed: int, steps: int, results: Any) -> None:
    try:
        results.put(("ok", _interleave(overrides, seed, steps)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the trace
        results.put(("error", traceback.format_exc()))


def _interleave(overrides: Sequence[str], seed: int, steps: int) -> dict[str, list[dict[str, Any]]]:
    import ray

    from shell.bench.grpo import side_by_side
    from shell.ray_cluster import connect
    from shell.run_config import load_run_config

    common = (*overrides, f"seed={seed}", f"grpo.num_steps={steps}", f"policy.learning_rate={FROZEN_LEARNING_RATE}")
    configs = {name: load_run_config([*common, *VARIANTS[name]]) for name in VARIANTS}
    owns_ray = connect(configs["off"].ray, lambda _message: None)  # one Ray for both trainers
    try:
        records = side_by_side(configs, steps)  # off first on odd steps, r3 first on even ones
    finally:
        if owns_ray:
            ray.shutdown()
    return {name: [{k: r[k] for k in ("step", *SAME_BATCH_KEYS, *COST_KEYS)} for r in runs] for name, runs in records.items()}


# ---------------------------------------------------------------- runs


def _order(names: Sequence[str], index: int) -> list[str]:
    """``names`` rotated by ``index`` (seed ``i`` starts with variant ``i mod n``)."""
    shift = index % len(names)
    return [*names[shift:], *names[:shift]]


def _run_one(cfg: R3BenchConfig, folder: Path, seed: int, steps: int, extra: Sequence[str]) -> None:
    command = [
        sys.executable, "-m", "shell.run", f"seed={seed}", f"grpo.num_steps={steps}", f"run.dir={folder}",
        "run.progress=plain", *cfg.base_overrides, *extra,
    ]
    log = folder.with_name(folder.name + ".log")
    with log.open("w") as out:
        status = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise RuntimeError(f"{folder.name}: python -m shell.run exited {status}; see {log}")


def run(cfg: R3BenchConfig, report: Report) -> dict[str, Any]:
    """Run (or read) every run, measure the mismatch, report the tables, write the PNG.

    Returns:
        ``{"runs": variant -> seed -> records, "bytes": (path, variant) -> records,
        "mismatch": model (``MODELS``) -> seed -> Measured, "same_batches": seed -> variant -> records}``.

    Raises:
        FileExistsError: a run folder exists and ``reuse`` is off.
        ValueError: a run's records are not ``steps`` (or ``bytes_steps``) whole steps.
        RuntimeError: a run or the mismatch worker failed.
    """
    from shell.grpo_trainer import build_task, model_config
    from shell.run_config import load_run_config

    seeds = cfg.seed_list
    names = list(VARIANTS)
    folders = {(n, s): cfg.runs_dir / f"{n}-seed{s}" for n in names for s in seeds}
    byte_folders = {
        (p, n): cfg.runs_dir / f"bytes-{p.replace(' ', '_')}-{n}-seed{cfg.first_seed}" for p in PATHS for n in names
    }
    if not cfg.reuse:
        existing = [str(f) for f in (*folders.values(), *byte_folders.values()) if f.exists()]
        if existing:
            raise FileExistsError(f"'runs_dir' must not hold the runs yet (pass --reuse to read them): found {existing[:3]}")
    config = load_run_config(cfg.base_overrides)
    model = model_config(config, build_task(config))
    mismatch_config = load_run_config(cfg.mismatch_model_overrides)
    labels = {
        role: model_label(role, m.num_experts, m.moe_topk, m.num_layers)
        for role, m in (("run", model), ("mismatch", model_config(mismatch_config, build_task(mismatch_config))))
    }
    cfg.runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report.start(
        total=len(folders) + len(byte_folders) + (len(MODELS) + 1) * len(seeds), description=f"R3 bench ({cfg.steps}-step runs)"
    )
    records: dict[str, dict[int, list[Mapping[str, Any]]]] = {n: {} for n in names}
    for index, seed in enumerate(seeds):
        for name in _order(names, index):
            if not cfg.reuse:
                _run_one(cfg, folders[name, seed], seed, cfg.steps, VARIANTS[name])
            rows = read_metrics(folders[name, seed] / "metrics.jsonl")
            records[name][seed] = check_records(rows, cfg.steps, str(folders[name, seed]))
            report.advance()
    byte_records: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for (path, name), folder in byte_folders.items():
        if not cfg.reuse:
            _run_one(cfg, folder, cfg.first_seed, cfg.bytes_steps, (*PATHS[path], *VARIANTS[name]))
        byte_records[path, name] = check_records(read_metrics(folder / "metrics.jsonl"), cfg.bytes_steps, str(folder))
        report.advance()
    runs_s = time.perf_counter() - started
    same: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for seed in seeds:
        same[seed] = measure_same_batch_cost(cfg.base_overrides, seed, cfg.cost_steps)
        report.advance()
    mismatch: dict[str, dict[int, Measured]] = {role: {} for role in MODELS}
    for seed in seeds:
        for role, overrides in cfg.model_overrides.items():
            trained = folders["off", seed] / "checkpoint.pt" if role == "run" else None  # no run trains the other
            mismatch[role][seed] = measure_mismatch(overrides, seed, cfg.batches, checkpoint=trained)
            report.advance()
    _mismatch_table(cfg, config, labels, mismatch, report)
    _same_batch_table(cfg, same, report)
    _cost_table(cfg, records, report, runs_s)
    _bytes_table(cfg, model, records, byte_records, report)
    plot = cfg.plot or cfg.runs_dir / "r3_reward.png"
    first = seeds[0]
    plot_compare(
        {f"router_replay={name} (seed {first})": records[name][first] for name in names},
        plot,
        title=f"{' '.join(cfg.base_overrides)}: R3 off vs r3, {cfg.steps} steps, seed {first}\n{cpu_name()}",
    )
    report.table("Figure", ["file"], [[str(plot)]])
    report.finish()
    return {"runs": records, "bytes": byte_records, "mismatch": mismatch, "same_batches": same}


# ---------------------------------------------------------------- tables


def _mismatch_table(cfg: R3BenchConfig, config: Any, labels: Mapping[str, str],
                    mismatch: Mapping[str, Mapping[int, Measured]], report: Report) -> None:
    rows = []
    goal: dict[tuple[str, str], float] = {}
    for role in MODELS:
        seeds = list(mismatch[role])
        for weights in (w for w in WEIGHTS if (w, "off") in mismatch[role][seeds[0]]):
            pooled = {
                name: (
                    pool_disagreement([mismatch[role][s][weights, name][0] for s in seeds]),
                    pool_mismatch([mismatch[role][s][weights, name][1] for s in seeds]),
                )
                for name in VARIANTS
            }
            for name, (routing, logprobs) in pooled.items():
                rows.append([
                    labels[role], weights, name, f"{routing.tokens:,}", f"{routing.token_share:.4%}",
                    f"{routing.decision_share:.4%}", f"{logprobs.tokens:,}", f"{logprobs.mean_abs_diff:.3e}",
                    f"{logprobs.k3_kl:.3e}",
                ])
            per_seed = [
                ratio(mismatch[role][s][weights, "r3"][1].mean_abs_diff, mismatch[role][s][weights, "off"][1].mean_abs_diff)
                for s in seeds
            ]
            pooled_ratio = ratio(pooled["r3"][1].mean_abs_diff, pooled["off"][1].mean_abs_diff)
            k3_ratio = ratio(pooled["r3"][1].k3_kl, pooled["off"][1].k3_kl)
            rows.append([
                labels[role], weights, "r3 / off", "", "", "", "",
                f"{pooled_ratio:.3f} (per seed {min(per_seed):.3f}-{max(per_seed):.3f})", f"{k3_ratio:.3f}",
            ])
            goal[role, weights] = pooled_ratio
    g = config.grpo
    seeds = cfg.seed_list
    report.table(
        f"Routing disagreement and training-inference mismatch, same batches, replay off vs r3: "
        f"{' '.join(cfg.base_overrides)}; mismatch model {' '.join(cfg.mismatch_model_overrides[len(cfg.base_overrides):])}; "
        f"{cfg.batches} batches x {g.num_prompts_per_step} prompts x {g.num_generations_per_prompt} per seed and model, "
        f"seeds {seeds[0]}..{seeds[-1]} pooled; trained = the run model's off run's weights after {cfg.steps} steps "
        f"(the mismatch model is measured at its initial weights only: no run trains it); "
        f"goal: r3 disagreement 0, r3 / off <= {GOAL_RATIO:g} (see the goal table)",
        ["model", "weights", "trainer routing", "real tokens", "tokens routed differently (>= 1 layer)",
         "router decisions differing", "response tokens", "mean |log p_train - log p_rollout|", "k3 KL(rollout || train)"],
        rows,
    )
    report.table(
        f"Mismatch {goal_line({f'the {role} model at {weights} weights': v for (role, weights), v in goal.items()})}",
        ["model", "weights", "r3 / off (pooled mean absolute log-prob gap)", f"meets r3 / off <= {GOAL_RATIO:g}"],
        [[labels[role], weights, f"{v:.3f}", "yes" if v <= GOAL_RATIO else "no"] for (role, weights), v in goal.items()],
    )


def _same_batch_table(cfg: R3BenchConfig, same: Mapping[int, Mapping[str, Records]], report: Report) -> None:
    rows = []
    pooled: dict[str, list[float]] = {key: [] for key in COST_KEYS}
    per_seed: list[float] = []
    for seed, runs in same.items():
        ratios = {key: step_ratios(runs["r3"], runs["off"], key) for key in COST_KEYS}
        for key, values in ratios.items():
            pooled[key].extend(values)
        per_seed.append(statistics.median(ratios["step_time_s"]))
        rows.append([
            str(seed),
            f"{statistics.median(r['step_time_s'] for r in runs['off'][COST_WARMUP:]):.3f}",
            f"{statistics.median(r['step_time_s'] for r in runs['r3'][COST_WARMUP:]):.3f}",
            *(f"{statistics.median(ratios[key]):.3f}" for key in COST_KEYS),
            "yes" if same_batches(runs["off"], runs["r3"]) else "NO",
        ])
    step = statistics.median(pooled["step_time_s"])
    rows.append([
        "all (pooled)", "", "", f"**{step:.3f}** (per seed {min(per_seed):.3f}-{max(per_seed):.3f})",
        *(f"{statistics.median(pooled[key]):.3f}" for key in COST_KEYS[1:]), "",
    ])
    verdict = "met" if step <= COST_GOAL else "not met"
    report.table(
        f"Cost of R3 on the same batches: an off and an r3 trainer stepped side by side in one process, order "
        f"alternating, policy.learning_rate={FROZEN_LEARNING_RATE} (the weights stay put, so both sample the same "
        f"batches); {cfg.cost_steps} steps x {len(same)} seeds, the first {COST_WARMUP} left out; r3 / off: median "
        f"of per-step paired ratios; on {cpu_name()}. Goal r3 / off step time <= {COST_GOAL:g}: {verdict} ({step:.3f})",
        ["seed", "off step s (median)", "r3 step s (median)", "step time r3 / off", "rollout r3 / off",
         "logprobs r3 / off", "train r3 / off", "same batches"],
        rows,
    )


def _cost_table(cfg: R3BenchConfig, records: Mapping[str, Mapping[int, Records]], report: Report, elapsed: float) -> None:
    seeds = cfg.seed_list
    ratios = paired_ratios(records["r3"], records["off"])
    rows = []
    for name in VARIANTS:
        times = [mean_step_time(records[name][s]) for s in seeds]
        final = [final_reward(records[name][s]) for s in seeds]
        flat = [r for s in seeds for r in records[name][s]]
        rows.append([
            name,
            f"{statistics.median(times):.3f}",
            "1 (baseline)" if name == "off" else f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
            per_seed(final),
            f"{mean_of(flat, 'phase_rollout_s'):.3f}",
            f"{mean_of(flat, 'phase_logprobs_s'):.3f}",
            f"{mean_of(flat, 'phase_train_s'):.3f}",
            f"{mean_of(flat, 'data_plane_bytes'):,.0f}",
        ])
    report.table(
        f"Cost and training, policy.router_replay off vs r3: {' '.join(cfg.base_overrides)}, {cfg.steps} steps x "
        f"{len(seeds)} paired seeds, order rotated; {elapsed:.0f} s of runs in all; on {cpu_name()} (the runs train apart, "
        f"so their batches differ: the cost goal is judged on the same-batches table)",
        ["router replay", "step s (median of per-run means)", "step time r3 / off: median of paired ratios",
         f"final reward, last {LAST} (mean, range, per seed)", "rollout s / step", "logprobs s / step",
         "train s / step", "data-plane bytes / step"],
        rows,
    )


def _bytes_table(cfg: R3BenchConfig, model: Any, records: Mapping[str, Mapping[int, Records]],
                 byte_records: Mapping[tuple[str, str], Records], report: Report) -> None:
    sizes = {"num_layers": model.num_layers, "topk": model.moe_topk, "num_experts": model.num_experts}
    rows = []
    for path in PATHS:
        off, r3 = byte_records[path, "off"], byte_records[path, "r3"]
        routing = [step_routing_bytes(r, **sizes) for r in r3]
        driver_step1 = r3[0]["driver_bytes"] - off[0]["driver_bytes"]
        store_step1 = r3[0]["data_plane_bytes"] - off[0]["data_plane_bytes"]
        if path == "data plane":
            keys = ("driver_bytes", "data_plane_bytes")
            repeat = all(same_values(byte_records[path, n], records[n][cfg.first_seed], keys) for n in VARIANTS)
            repeats = "yes" if repeat else "NO"
        else:
            repeats = "-"
        rows.append([
            path,
            f"{mean_of(off, 'driver_bytes'):,.0f}",
            f"{mean_of(r3, 'driver_bytes'):,.0f}",
            f"{driver_step1:,}",
            f"{mean_of(off, 'data_plane_bytes'):,.0f}",
            f"{mean_of(r3, 'data_plane_bytes'):,.0f}",
            f"{store_step1:,}",
            f"{routing[0]:,} (mean {statistics.fmean(routing):,.0f})",
            f"{ratio(driver_step1, routing[0]):.2f}",
            repeats,
        ])
    report.table(
        f"Routing bytes per step: {cfg.bytes_steps}-step runs, seed {cfg.first_seed}, off vs r3 on each path "
        f"({model.num_layers} layers x top-{model.moe_topk} of {model.num_experts} experts per token)",
        ["path", "driver bytes / step, off", "driver bytes / step, r3", "driver r3 - off, step 1",
         "store bytes / step, off", "store bytes / step, r3", "store r3 - off, step 1",
         "routing bytes, step 1 (routing_bytes of its tokens)", "driver difference / routing, step 1",
         "repeats the cost runs' first steps"],
        rows,
    )
