"""``python -m shell.bench dataplane``: store throughput and overheads against raw transports.

Payload: 256 rows with lognormal lengths (median 700, clipped to 16..2048) and
three per-token fields, jagged on the wire: ``input_ids`` int64,
``token_mask`` bool and ``logprobs`` float32.

Each transport puts the payload under fresh keys and gets it back, ``repeats``
times, interleaved round-robin so drift on the machine hits every transport
alike (the order rotates every round); MB/s is payload bytes over the median wall time. Transports:

* ``TransferQueueStore`` (this project's adapter), bare and wrapped in
  ``MeteredClient`` (integrity off and on);
* raw TransferQueue ``kv_batch_put`` / ``kv_batch_get`` on the same TensorDict;
* ``MemoryStore``;
* ``ray.put`` / ``ray.get`` of the same TensorDict (the legacy transport).

Also measured: the metering overhead per op against a client that does
nothing (isolates the wrapper's own cost), and, with ``--profile``, where the
adapter's put and get spend their time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
from tensordict import TensorDict

from adapters import transport_baselines as raw
from adapters.memory import MemoryStore
from adapters.rows import read_columns_of
from adapters.transfer_queue import TransferQueueStore
from core.codec import to_jagged
from core.integrity import tensor_row_digests
from core.meta import KVBatchMeta
from shell.bench.report import Report
from shell.metering import MeteredClient

FIELDS = ("input_ids", "token_mask", "logprobs")


@attrs.frozen
class DataplaneConfig:
    """Sizes of the data-plane benchmark."""

    rows: int = 256
    repeats: int = 9
    seed: int = 0
    profile: bool = False


def payload(cfg: DataplaneConfig) -> tuple[TensorDict, int]:
    """The benchmark TensorDict (jagged per-token fields) and its payload bytes."""
    rng = np.random.default_rng(cfg.seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(700), 1.0, cfg.rows)), 16, 2048).astype(int).tolist()
    width = max(lengths)
    g = torch.Generator().manual_seed(cfg.seed)
    td = TensorDict(
        {
            "input_ids": to_jagged(torch.randint(0, 32000, (cfg.rows, width), generator=g), lengths),
            "token_mask": to_jagged(torch.rand(cfg.rows, width, generator=g) > 0.1, lengths),
            "logprobs": to_jagged(torch.randn(cfg.rows, width, generator=g), lengths),
        },
        batch_size=[cfg.rows],
    )
    return td, sum(lengths) * (8 + 1 + 4)


class _NullClient:
    """A client that stores nothing and returns a fixed batch: isolates a wrapper's own cost."""

    def __init__(self, td: TensorDict, keys: list[str]) -> None:
        self.td, self.meta = td, KVBatchMeta("null", keys, fields=list(td.keys()))

    def put(self, keys: Any, partition_id: str, fields: TensorDict, **kw: Any) -> KVBatchMeta:
        return self.meta

    def get(self, keys: Any, partition_id: str, select_fields: Any) -> TensorDict:
        return self.td

    def clear(self, keys: Any, partition_id: str) -> None:
        return None


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _client_ops(client: Any) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    return (
        lambda keys, pid, td: client.put(keys, pid, td),
        lambda keys, pid: client.get(keys, pid, list(FIELDS)),
        lambda keys, pid: client.clear(keys, pid),
    )


def run(cfg: DataplaneConfig, report: Report) -> None:
    """Measure every transport into ``report``."""
    td, nbytes = payload(cfg)
    report.start(total=cfg.repeats + 2, description="data-plane benchmark")
    store = TransferQueueStore.start()
    try:
        memory = MemoryStore()
        transports: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
            "TransferQueueStore (ours)": _client_ops(store),
            "MeteredClient(TransferQueueStore)": _client_ops(MeteredClient(store)),
            "MeteredClient(TransferQueueStore, integrity)": _client_ops(MeteredClient(store, verify_integrity=True)),
            "raw TransferQueue kv_batch_put/get": (
                raw.raw_tq_put,
                lambda keys, pid: raw.raw_tq_get(keys, pid, FIELDS),
                raw.raw_tq_clear,
            ),
            "MemoryStore (ours)": _client_ops(memory),
        }
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in [*transports, "ray.put/ray.get"]}
        for rep in range(cfg.repeats + 1):  # the first round warms up and is not counted
            names = list(transports)
            shift = rep % len(names)  # rotate the order each round so no transport always runs first
            for name in names[shift:] + names[:shift]:
                put, get, clear = transports[name]
                keys = [f"r{rep}_{i}" for i in range(cfg.rows)]
                pid = f"bench-{abs(hash(name)) % 10_000}"
                start = time.perf_counter()
                put(keys, pid, td)
                mid = time.perf_counter()
                get(keys, pid)
                end = time.perf_counter()
                clear(keys, pid)
                if rep:
                    times[name][0].append(mid - start)
                    times[name][1].append(end - mid)
            start = time.perf_counter()
            ref = raw.ray_put(td)
            mid = time.perf_counter()
            raw.ray_get(ref)
            end = time.perf_counter()
            del ref
            if rep:
                times["ray.put/ray.get"][0].append(mid - start)
                times["ray.put/ray.get"][1].append(end - mid)
            report.advance()
        med = {name: (statistics.median(p), statistics.median(g)) for name, (p, g) in times.items()}
        raw_put, raw_get = med["raw TransferQueue kv_batch_put/get"]
        rows = []
        for name, (p, g) in med.items():
            rows.append([
                name, f"{nbytes / p / 1e6:.0f}", f"{nbytes / g / 1e6:.0f}", f"{p * 1e3:.1f}", f"{g * 1e3:.1f}",
                f"{p / raw_put:.2f}", f"{g / raw_get:.2f}",
            ])
        report.table(
            f"store throughput: {cfg.rows} rows, {nbytes / 1e6:.1f} MB payload, median of {cfg.repeats} runs",
            ["transport", "put MB/s", "get MB/s", "put ms", "get ms", "put time / raw TQ", "get time / raw TQ"],
            rows,
        )
        ours_put, ours_get = med["TransferQueueStore (ours)"]
        metered_get = med["MeteredClient(TransferQueueStore)"][1]
        integrity_get = med["MeteredClient(TransferQueueStore, integrity)"][1]
        keys = [f"n{i}" for i in range(cfg.rows)]
        null = _NullClient(td, keys)
        metered_null = MeteredClient(null)
        reps = max(200, cfg.repeats)
        overhead = {
            op: _median_us(lambda: getattr(metered_null, op)(keys, "null", *args), reps) - _median_us(lambda: getattr(null, op)(keys, "null", *args), reps)
            for op, args in (("put", (td,)), ("get", (list(FIELDS),)), ("clear", ()))
        }
        hash_keys = [f"h{i}" for i in range(cfg.rows)]
        store.put(hash_keys, "hash", td)
        columns = read_columns_of(store.get(hash_keys, "hash", list(FIELDS)))
        hash_s = _median_us(lambda: [tensor_row_digests(v) for v in columns.values()], cfg.repeats) / 1e6
        store.clear(hash_keys, "hash")
        report.advance()
        report.table(
            "overheads (goal in brackets)",
            ["measure", "value"],
            [
                ["adapter put time over raw TQ (<= 5%)", f"{100 * (ours_put / raw_put - 1):+.1f}%"],
                ["adapter get time over raw TQ (<= 5%)", f"{100 * (ours_get / raw_get - 1):+.1f}%"],
                *[[f"metering, integrity off, per {op} (<= 40 us)", f"{us:.1f} us"] for op, us in overhead.items()],
                ["integrity: hashing the read rows, share of a raw TQ get (<= 10%)", f"{100 * hash_s / raw_get:.1f}%"],
                ["integrity end to end (hashing + 3 digest columns), share of a metered TQ get", f"{100 * (integrity_get / metered_get - 1):.1f}%"],
                ["TQ adapter put time / ray.put", f"{ours_put / med['ray.put/ray.get'][0]:.1f}x"],
                ["TQ adapter get time / ray.get", f"{ours_get / med['ray.put/ray.get'][1]:.1f}x"],
            ],
        )
        if cfg.profile:
            _profile(store, td, report)
        report.advance()
    finally:
        store.close()
    report.finish()


def _profile(store: Any, td: TensorDict, report: Report) -> None:
    """Top functions by own time in the adapter's put and get (driver side)."""
    keys = [f"p{i}" for i in range(td.batch_size[0])]
    for op in ("put", "get"):
        prof = cProfile.Profile()
        for _ in range(5):
            if op == "put":
                prof.enable()
                store.put(keys, "profile", td)
                prof.disable()
            else:
                store.put(keys, "profile", td)
                prof.enable()
                store.get(keys, "profile", list(FIELDS))
                prof.disable()
            store.clear(keys, "profile")
        stats = pstats.Stats(prof)
        entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # type: ignore[attr-defined]
        report.table(
            f"where the adapter's {op} spends driver time (own time, 5 calls)",
            ["function", "calls", "own ms per op"],
            [[f"{fn[0].split('site-packages/')[-1]}:{fn[1]}({fn[2]})", str(v[1]), f"{v[2] * 1e3 / 5:.2f}"] for fn, v in entries],
        )
