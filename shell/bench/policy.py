"""``python -m shell.bench policy``: bytes through the driver and wall time, one ``Policy`` over its two transports.

Workload (``lengths``): ``"lognormal"`` (the default, issue 13's realistic
rows): ``rows`` (default 256) rows of lognormal lengths (median 700 tokens,
clipped to ``16..max_len``, default 1024; the scale sweep's rows,
:func:`shell.bench.scale.sweep_batch`) on the sweep's tiny GPT with dynamic
batching; ``"short"``: lengths uniform in 8..64 on the default tiny GPT (a
quick run). Either way a group of ``dp`` megatron workers (default 2), on CPU
over gloo (the default) or with ``device="cuda"`` one GPU each over NCCL
(:attr:`shell.policy.PolicyConfig.device`), and one GRPO train call of two
optimizer steps. The same :class:`shell.policy.Policy`
runs over :class:`shell.transport.LegacyTransport` ("legacy": the rows travel
through the driver) and :class:`shell.transport.DataPlaneTransport` ("data
plane": the ranks fetch them from TransferQueue); both drive the same group.

Bytes through the driver are the serialized (``cloudpickle``) sizes of what
each call hands to the workers (one rank input per DP rank, plus the common
keyword arguments) and of what comes back, measured at the group's
``call`` of a ``@sharded`` worker method. The rollout's one ``first_write``
into the store is not counted: it happens once per step in either design
(legacy keeps the batch on the driver instead). Wall time is the median of
``repeats`` calls after one warm-up call.

Model time is, per call, what its slowest rank spent in the model
(:data:`shell.policy_worker.COMPUTE_SECONDS`: the forwards, or the optimizer
steps), which no transport can take off the call. Its share of the legacy
call (the ``floor``) is the ratio data plane / legacy that a transport
costing nothing would reach: a goal below the floor is out of any
transport's reach on that machine. The time outside the model (wall less
model time, per call) is what the transport and the call's dispatch take;
its ratio data plane / legacy, paired per repeat, compares the two
transports free of the model's own time, which moves more than they do.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import cloudpickle
import torch
from tensordict import TensorDict

from adapters.transfer_queue import TransferQueueStore
from core.checks import check_int
from core.step_plan import legacy_meta
from core.topology import NamedSharding
from shell.bench.cluster import bench_cluster
from shell.bench.report import Report
from shell.column_io import first_write
from shell.loss import GRPOLoss
from shell.policy import DEVICES, Policy, PolicyConfig, build_group
from shell.policy_worker import slowest_compute
from shell.step_rows import StepRows
from shell.transport import DataPlaneTransport, LegacyTransport
from shell.worker import dispatch_of
from shell.worker_group import WorkerGroup


WORKLOADS = ("lognormal", "short")
"""The row lengths the bench can run: issue 13's realistic rows, or the quick short ones."""


@attrs.frozen
class PolicyBenchConfig:
    """What the policy benchmark runs: ``rows`` rows of ``lengths`` (see :data:`WORKLOADS`; ``"lognormal"`` rows
    are clipped to ``max_len``), ``repeats`` timed calls per path, on ``dp`` ranks on ``device`` (see
    :data:`shell.policy.DEVICES`; ``"cuda"``: a GPU per rank)."""

    rows: int = 256
    repeats: int = 3
    seed: int = 0
    lengths: str = attrs.field(default="lognormal", validator=attrs.validators.in_(WORKLOADS))
    max_len: int = 1024
    dp: int = 2
    device: str = attrs.field(default="cpu", validator=attrs.validators.in_(DEVICES))

    def __attrs_post_init__(self) -> None:
        check_int("dp", self.dp, minimum=1)
        # A train call makes two optimizer steps of rows // 2 rows each, split evenly over the DP ranks.
        if check_int("rows", self.rows, minimum=2) % (2 * self.dp):
            raise ValueError(
                f"'rows' must be a multiple of 2 * dp = {2 * self.dp} (two optimizer steps, each split over {self.dp} "
                f"DP ranks): got {self.rows}"
            )
        check_int("repeats", self.repeats, minimum=1)
        check_int("max_len", self.max_len, minimum=16)


class MeteredGroup:
    """Forwards to a ``WorkerGroup``, recording the serialized bytes its ``@sharded`` calls send and receive, and the
    model seconds of their slowest rank (:data:`shell.policy_worker.COMPUTE_SECONDS`)."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group
        self.sent = 0
        self.received = 0
        self.compute_s = 0.0

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if dispatch_of(method) != "sharded":
            return self._group.call(method, *args, **kwargs)
        shards, rest = args[0], args[1:]
        self.sent += sum(len(cloudpickle.dumps(s)) for s in shards)
        self.sent += sum(len(cloudpickle.dumps(v)) for v in (*rest, *kwargs.values()))
        results = self._group.call(method, *args, **kwargs)
        self.received += sum(len(cloudpickle.dumps(r)) for r in results)
        self.compute_s += slowest_compute(results)
        return results

    def take(self) -> tuple[int, int]:
        """The bytes sent and received since the last call (the model seconds since then are dropped)."""
        out = (self.sent, self.received)
        self.sent = self.received = 0
        self.compute_s = 0.0
        return out

    def take_compute(self) -> float:
        """The model seconds of the calls since the last ``take`` or ``take_compute``: per call, its slowest rank's."""
        out, self.compute_s = self.compute_s, 0.0
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def workload(cfg: PolicyBenchConfig) -> TensorDict:
    """The in-memory batch: ``input_ids`` and ``token_mask`` (N, S), ``advantages`` (N,), ``lengths`` (N,); pure in
    ``cfg``."""
    if cfg.lengths == "lognormal":
        from shell.bench.scale import sweep_batch

        rows = sweep_batch(cfg.rows, cfg.seed, cfg.max_len)
        g = torch.Generator().manual_seed(cfg.seed)
        rows["advantages"] = torch.randn(cfg.rows, generator=g)
        return TensorDict(rows, batch_size=[cfg.rows])
    g = torch.Generator().manual_seed(cfg.seed)
    lengths = torch.randint(8, 65, (cfg.rows,), generator=g)
    positions = torch.arange(64)[None, :]
    return TensorDict(
        {
            "input_ids": torch.randint(0, 32, (cfg.rows, 64), generator=g),
            "token_mask": (positions >= 4) & (positions < lengths[:, None]),
            "advantages": torch.randn(cfg.rows, generator=g),
            "lengths": lengths,
        },
        batch_size=[cfg.rows],
    )


def policy_config(cfg: PolicyBenchConfig) -> PolicyConfig:
    """The policy both paths run: ``cfg.dp`` ranks on ``cfg.device``; for ``"lognormal"`` rows, the scale sweep's
    tiny GPT (positions up to ``max_len``) with dynamic batching, as ``shell.bench scale`` runs them."""
    sharding = NamedSharding({"data_parallel": cfg.dp})
    if cfg.lengths == "short":
        return PolicyConfig(sharding=sharding, seed=cfg.seed, train_global_batch_size=cfg.rows // 2, device=cfg.device)
    from core.micro_batch import DynamicBatchingSpec
    from core.model_config import TinyGPTConfig
    from shell.bench.scale import SWEEP_MODEL

    return PolicyConfig(
        sharding=sharding,
        model=TinyGPTConfig(**SWEEP_MODEL, max_sequence_length=cfg.max_len),
        seed=cfg.seed,
        train_global_batch_size=cfg.rows // 2,
        dynamic_batching=DynamicBatchingSpec(max_tokens_per_microbatch=2 * cfg.max_len, sequence_length_round=64),
        device=cfg.device,
    )


def describe_workload(cfg: PolicyBenchConfig) -> str:
    """How the tables name the rows, e.g. ``"256 rows, lognormal lengths (median 700, <= 1024)"``."""
    if cfg.lengths == "short":
        return f"{cfg.rows} rows, lengths uniform in 8..64"
    return f"{cfg.rows} rows, lognormal lengths (median 700, <= {cfg.max_len})"


def describe_ranks(cfg: PolicyBenchConfig) -> str:
    """How the tables name the ranks: ``"DP=2"`` on CPU, ``"DP=1 on cuda"`` on GPUs."""
    return f"DP={cfg.dp}" if cfg.device == "cpu" else f"DP={cfg.dp} on {cfg.device}"


PATHS = ("legacy", "data plane")
"""The bench's two transports, as :func:`summarize` and the table name them."""


@attrs.frozen
class Measured:
    """One path of one call: the median wall seconds, model seconds (:func:`slowest_compute`) and seconds outside
    the model (wall less model, per call) of the timed calls, and the bytes one call sent and received through the
    driver."""

    wall_s: float
    compute_s: float
    outside_s: float
    sent: int
    received: int


@attrs.frozen
class Paired:
    """The paired repeats of one call: per repeat, the data plane's wall time over legacy's (``ratios``); the
    share of legacy's call that its slowest rank spent in the model (``floors``): the ratio a transport that cost
    nothing, and added no dispatch, would reach against it; and the data plane's time outside the model over
    legacy's (``outside_ratios``): what one transport costs a call against the other, free of the model's own
    time, which moves more than that from call to call."""

    ratios: tuple[float, ...]
    floors: tuple[float, ...]
    outside_ratios: tuple[float, ...]


def summarize(
    times: Mapping[str, Sequence[float]],
    computes: Mapping[str, Sequence[float]],
    bytes_of: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, Measured], Paired]:
    """Per path its :class:`Measured`, and the :class:`Paired` repeats, from each repeat's wall and model seconds
    (``times``, ``computes``: path -> one value per repeat, repeat ``i`` of both paths run back to back) and the
    bytes one call sent and received (``bytes_of``). Paths are ``"legacy"`` and ``"data plane"``.

    A repeat whose legacy call spent no time outside the model (model time equal to its wall time) has an
    outside ratio of ``inf``, or ``nan`` when the data plane's spent none either.

    Raises:
        ValueError: there is no repeat, the paths' repeats differ in number, or a call's model time exceeds its
            wall time (the model runs inside the call, so that is a measuring error).
    """
    counts = {
        f"{name} {kind}": len(source[name]) for name in PATHS for kind, source in (("wall", times), ("model", computes))
    }
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise ValueError(
            f"every path needs one wall and one model time per repeat, at least one repeat and as many for each: "
            f"got {counts}"
        )
    for name in PATHS:
        for repeat, (wall, model) in enumerate(zip(times[name], computes[name])):
            if model > wall:
                raise ValueError(
                    f"model time must be within the call's wall time: got {name!r} repeat {repeat} model {model:.6f} s, "
                    f"wall {wall:.6f} s"
                )
    outside = {name: [w - c for w, c in zip(times[name], computes[name])] for name in PATHS}
    measured = {
        name: Measured(
            statistics.median(times[name]), statistics.median(computes[name]), statistics.median(outside[name]),
            *bytes_of[name],
        )
        for name in PATHS
    }
    paired = Paired(
        ratios=tuple(d / legacy for legacy, d in zip(times["legacy"], times["data plane"])),
        floors=tuple(c / legacy for legacy, c in zip(times["legacy"], computes["legacy"])),
        outside_ratios=tuple(
            d / legacy if legacy > 0 else (math.inf if d > 0 else math.nan)
            for legacy, d in zip(outside["legacy"], outside["data plane"])
        ),
    )
    return measured, paired


def _measure(calls: dict[str, Callable[[], Any]], metered: MeteredGroup, repeats: int) -> tuple[dict[str, Measured], Paired]:
    """Per path: its :class:`Measured` over ``repeats`` calls (after a warm-up); and the :class:`Paired` repeats, the
    two paths run back to back in alternating order."""
    bytes_of = {}
    for name, call in calls.items():
        call()
        bytes_of[name] = metered.take()
    times: dict[str, list[float]] = {name: [] for name in calls}
    computes: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        order = list(calls) if repeat % 2 == 0 else list(calls)[::-1]
        for name in order:
            metered.take_compute()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
            computes[name].append(metered.take_compute())
    metered.take()
    return summarize(times, computes, bytes_of)


def _spread(values: Sequence[float], digits: int = 2) -> str:
    """``"0.99x (0.97-1.06)"``: the median and the range, to ``digits`` decimals."""
    return f"{statistics.median(values):.{digits}f}x ({min(values):.{digits}f}-{max(values):.{digits}f})"


def run(cfg: PolicyBenchConfig, report: Report) -> None:
    """Measure both paths into ``report`` (starts and stops its own Ray and TransferQueue)."""
    config = policy_config(cfg)
    with bench_cluster("policy") as store:
        report.start(total=5, description="policy benchmark")
        with build_group(config, client_factory=TransferQueueStore.attach) as group:
            report.advance()
            metered = MeteredGroup(group)
            plane_transport = DataPlaneTransport(store, TransferQueueStore.attach, partition_id="policy-bench")
            legacy = Policy(config, LegacyTransport(), group=metered)  # type: ignore[arg-type]
            plane = Policy(config, plane_transport, group=metered)  # type: ignore[arg-type]
            loss = GRPOLoss(kl_coef=0.0)
            data = workload(cfg)
            lengths = data["lengths"].tolist()
            meta = first_write(
                store,
                {name: data[name] for name in ("input_ids", "token_mask", "advantages")},
                keys=[f"b{i}" for i in range(cfg.rows)],
                partition_id="policy-bench",
                lengths=lengths,
                token_fields=["input_ids", "token_mask"],
            )
            stored = plane.prepare(StepRows(meta))
            plane_transport.admit(stored, {})  # the step owns the keys: finish clears them
            try:
                in_memory = legacy.prepare(StepRows(legacy_meta(lengths), data))
                rows: dict[str, dict[str, Measured]] = {}
                ratios: dict[str, Paired] = {}
                rows["logprobs"], ratios["logprobs"] = _measure(
                    {"legacy": lambda: legacy.logprobs(in_memory), "data plane": lambda: plane.logprobs(stored)},
                    metered, cfg.repeats,
                )
                report.advance()
                in_memory = legacy.logprobs(in_memory)
                stored = plane.logprobs(stored)
                metered.take()
                rows["train"], ratios["train"] = _measure(
                    {"legacy": lambda: legacy.train(in_memory, loss), "data plane": lambda: plane.train(stored, loss)},
                    metered, cfg.repeats,
                )
                as_in_a_step = {"prefetch": loss.input_fields, "keep_for_train": True}  # the trainer's step
                rows["logprobs + train, as in a step"], ratios["logprobs + train, as in a step"] = _measure(
                    {
                        "legacy": lambda: legacy.train(legacy.logprobs(in_memory, **as_in_a_step), loss),
                        "data plane": lambda: plane.train(plane.logprobs(stored, **as_in_a_step), loss),
                    },
                    metered, cfg.repeats,
                )
                report.advance()
            finally:
                plane_transport.finish(stored)
    table = []
    for call, paths in rows.items():
        legacy_path, plane_path = paths["legacy"], paths["data plane"]
        for name, m in paths.items():
            table.append([
                call, name, f"{m.sent:,}", f"{m.received:,}", f"{m.sent + m.received:,}", f"{m.wall_s * 1e3:.1f}",
                f"{m.compute_s * 1e3:.1f}", f"{m.outside_s * 1e3:.1f}",
            ])
        fewer = 1.0 - (plane_path.sent + plane_path.received) / (legacy_path.sent + legacy_path.received)
        paired = ratios[call]
        table.append([
            call, "data plane / legacy (paired)", f"{plane_path.sent / legacy_path.sent:.3f}",
            f"{plane_path.received / legacy_path.received:.3f}", f"{fewer:.1%} fewer", _spread(paired.ratios),
            f"floor {_spread(paired.floors, 3)}", _spread(paired.outside_ratios),
        ])
    report.table(
        f"Driver bytes and wall time per call ({describe_workload(cfg)}, {describe_ranks(cfg)}; time: median of {cfg.repeats} calls, "
        f"ratio: median and range of {cfg.repeats} paired repeats, order alternated; model: the slowest rank's "
        f"time in the model; floor: legacy's model time over its wall time, the ratio a transport that cost nothing "
        f"would reach; outside the model: wall less model time per call, the time the transport and the dispatch "
        f"take, and its ratio paired per repeat)",
        ["call", "path", "bytes sent", "bytes returned", "bytes total", "wall ms", "model ms", "outside the model ms"],
        table,
    )
    report.advance()
    report.finish()
