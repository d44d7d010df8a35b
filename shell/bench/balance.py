"""``python -m shell.bench balance``: sharding and packing quality against baselines.

Three measurements on seeded workloads (see ``shell.bench.workloads``):

1. ``balanced_partition`` (equal size): max/mean rank tokens at N=512, dp=32,
   and runtime at N=4096, dp=32, beside sort-then-stride and verl-style
   Karmarkar-Karp.
2. ``pack_sequences`` (best fit decreasing): how often the bin count equals the
   lower bound ``ceil(sum/capacity)``, beside textbook best fit decreasing.
3. ``shard_meta_for_dp`` with packing (N=512, capacity 8192, dp=8): per-rank
   micro-batch count against ``ceil(lower_bound/dp)`` and the sync cost, beside
   round-robin dealing of the same bins.

Sync cost = sum over micro-batch steps of the slowest rank's tokens, divided by
total tokens / dp (1.0 is perfect lockstep).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from core.meta import KVBatchMeta
from core.packing import pack_sequences
from core.sharding import PackingSpec, balanced_partition, shard_meta_for_dp
from shell.bench import baselines
from shell.bench.report import Report
from shell.bench.workloads import WORKLOADS, lognormal_lengths

CAPACITY = 8192


@attrs.frozen
class BalanceConfig:
    """Sizes of the balance benchmark (defaults are the issue's workload)."""

    seeds: int = 20
    partition_n: int = 512
    partition_dp: int = 32
    runtime_n: int = 4096
    pack_sizes: tuple[int, ...] = (512, 2048)
    shard_n: int = 512
    shard_dp: int = 8
    capacity: int = CAPACITY


def _imbalance(weights: np.ndarray, parts: Sequence[Sequence[int]]) -> float:
    loads = [int(weights[list(p)].sum()) for p in parts]
    return max(loads) / (sum(loads) / len(loads))


def _median_ms(fn: Callable[[], Any], repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """``ceil(sum(lengths) / capacity)``: no packing can use fewer bins."""
    return max(1, math.ceil(int(lengths.sum()) / capacity))


def sync_cost(per_rank_loads: Sequence[Sequence[int]], total: int) -> float:
    """Sum over steps of the slowest rank's tokens, over total/dp.

    A rank with fewer micro-batches counts 0 tokens at the steps it lacks (in a
    real run it would deadlock there instead; the count column reports that).
    """
    slowest = sum(max(step) for step in itertools.zip_longest(*per_rank_loads, fillvalue=0))
    return slowest / (total / len(per_rank_loads))


def measure_partition(cfg: BalanceConfig, report: Report) -> None:
    """Section 1: balanced_partition vs sort-then-stride vs verl-style KK."""
    methods: dict[str, Callable[[Sequence[int], int], Any]] = {
        "balanced_partition (ours)": lambda w, k: balanced_partition(w, k, equal_size=True),
        "sort-then-stride": baselines.sort_then_stride,
        "karmarkar-karp, verl-style": baselines.karmarkar_karp_verl_style,
    }
    rows = []
    for name, fn in methods.items():
        ratios, times = [], []
        for seed in range(cfg.seeds):
            w = lognormal_lengths(cfg.partition_n, seed)
            ratios.append(_imbalance(w, fn(w.tolist(), cfg.partition_dp)))
            big = lognormal_lengths(cfg.runtime_n, seed).tolist()
            times.append(_median_ms(lambda: fn(big, cfg.partition_dp)))
        rows.append([name, f"{statistics.mean(ratios):.4f}", f"{max(ratios):.4f}", f"{statistics.median(times):.2f}"])
        report.advance()
    report.table(
        f"balanced_partition, equal size: N={cfg.partition_n}, dp={cfg.partition_dp} (ratio); "
        f"N={cfg.runtime_n}, dp={cfg.partition_dp} (runtime); {cfg.seeds} seeds, lognormal",
        ["method", "mean max/mean", "worst max/mean", "median ms"],
        rows,
    )


def measure_packing(cfg: BalanceConfig, report: Report) -> None:
    """Section 2: pack_sequences (best fit decreasing) vs textbook BFD, hits of the lower bound."""
    rows = []
    for dist, gen in WORKLOADS.items():
        for n in cfg.pack_sizes:
            for name, fn in (
                ("pack_sequences bfd (ours)", lambda l: pack_sequences(l, capacity=cfg.capacity)),
                ("textbook bfd", lambda l: baselines.best_fit_decreasing_plain(l, cfg.capacity)),
            ):
                hits, excess, times = 0, [], []
                for seed in range(cfg.seeds):
                    lengths = gen(n, seed)
                    as_list = lengths.tolist()
                    start = time.perf_counter()
                    bins = fn(as_list)
                    times.append((time.perf_counter() - start) * 1e3)
                    extra = len(bins) - lower_bound(lengths, cfg.capacity)
                    hits += extra == 0
                    excess.append(extra)
                rows.append([dist, str(n), name, f"{100 * hits / cfg.seeds:.0f}%", str(max(excess)), f"{statistics.median(times):.1f}"])
            report.advance()
    report.table(
        f"pack_sequences: capacity {cfg.capacity}, {cfg.seeds} seeds",
        ["lengths", "N", "method", "bins == lower bound", "worst bins - bound", "median ms"],
        rows,
    )


def measure_sharding(cfg: BalanceConfig, report: Report) -> None:
    """Section 3: shard_meta_for_dp with packing vs round-robin dealing of the same bins."""
    spec = PackingSpec(max_tokens_per_microbatch=cfg.capacity)
    dp = cfg.shard_dp
    ours_hits, ours_cost, rr_hits, rr_cost, times = 0, [], 0, [], []
    tb_uniform, tb_cost = 0, []
    for seed in range(cfg.seeds):
        lengths = lognormal_lengths(cfg.shard_n, seed)
        total = int(lengths.sum())
        target = math.ceil(lower_bound(lengths, cfg.capacity) / dp)
        meta = KVBatchMeta("bench", [f"k{i}" for i in range(cfg.shard_n)], sequence_lengths=lengths.tolist())
        start = time.perf_counter()
        shards, _ = shard_meta_for_dp(meta, dp_world=dp, packing=spec)
        times.append((time.perf_counter() - start) * 1e3)
        loads = [list(s.extra_info["micro_batch_lengths"][0]) for s in shards]
        ours_hits += all(len(r) == target for r in loads)
        ours_cost.append(sync_cost(loads, total))
        bins = pack_sequences(lengths.tolist(), capacity=cfg.capacity, bin_count_multiple=dp, min_bin_count=dp)
        rr = baselines.deal_round_robin([int(lengths[list(b)].sum()) for b in bins], dp)
        rr_hits += all(len(r) == target for r in rr)
        rr_cost.append(sync_cost(rr, total))
        plain = baselines.best_fit_decreasing_plain(lengths.tolist(), cfg.capacity)
        tb = baselines.deal_round_robin([int(lengths[list(b)].sum()) for b in plain], dp)
        tb_uniform += len({len(r) for r in tb}) == 1
        tb_cost.append(sync_cost(tb, total))
        report.advance()
    report.table(
        f"shard_meta_for_dp with packing: N={cfg.shard_n}, capacity {cfg.capacity}, dp={dp}, {cfg.seeds} seeds, lognormal",
        ["method", "count == ceil(bound/dp) on every rank", "mean sync cost", "worst sync cost", "median ms"],
        [
            ["shard_meta_for_dp (ours)", f"{100 * ours_hits / cfg.seeds:.0f}%", f"{statistics.mean(ours_cost):.4f}", f"{max(ours_cost):.4f}", f"{statistics.median(times):.1f}"],
            ["our bins, dealt round-robin", f"{100 * rr_hits / cfg.seeds:.0f}%", f"{statistics.mean(rr_cost):.4f}", f"{max(rr_cost):.4f}", "-"],
            ["textbook bfd bins, dealt round-robin", f"uniform count in {100 * tb_uniform / cfg.seeds:.0f}%", f"{statistics.mean(tb_cost):.4f}", f"{max(tb_cost):.4f}", "-"],
        ],
    )


def run(cfg: BalanceConfig, report: Report) -> None:
    """Run all three sections into ``report``."""
    report.start(total=3 + 2 * len(cfg.pack_sizes) + cfg.seeds, description="balance benchmark")
    measure_partition(cfg, report)
    measure_packing(cfg, report)
    measure_sharding(cfg, report)
    report.finish()
