"""``python -m shell.bench dataplane``: store throughput and overheads against raw transports.

Payload: 256 rows with lognormal lengths (median 700, clipped to 16..2048) and
three per-token fields, jagged on the wire: ``input_ids`` int64,
``token_mask`` bool and ``logprobs`` float32.

Transports:

* ``TransferQueueStore`` (this project's adapter), bare and wrapped in
  ``MeteredClient`` (integrity off and on);
* raw TransferQueue ``kv_batch_put`` / ``kv_batch_get`` on the same TensorDict;
* ``MemoryStore``;
* ``ray.put`` / ``ray.get`` of the same TensorDict (the legacy transport);
* the same plus a key table in an actor
  (:class:`adapters.transport_baselines.RefsByKey`): one ``ray.put`` and one
  call that keeps its ref by key per put, one call and a ``ray.get`` per
  get: the call to another process that a keyed store on Ray's object store
  makes per operation, as one Ray actor call, over the legacy transport's
  own format.

Paired rounds: every round puts the payload twice (under fresh keys) through
every transport, then gets both back, then clears. The two sides of a
comparison (adapter against raw TransferQueue, integrity on against off) run
back to back as A B B A, the pairs swap sides and the blocks rotate from round
to round, so drift on the machine hits both sides alike (:func:`round_order`).
A comparison is the ratio of the two sides' times *within* a round, and the report
gives the median of those per-round ratios with a distribution-free 95%
confidence interval of the median, the interquartile range and min..max. The
first round warms up and is not counted. The hashing share is measured each
round too: the digests ``MeteredClient`` computes on a verified get, over the
columns the adapter read back that round, divided by that round's raw get,
and by that round's metered get (so ``1 +`` that share's median is the least a
verified get's median can take of a metered one, whatever else it does).

Also measured: the metering overhead per op against a client that does
nothing (isolates the wrapper's own cost); the metering's ``step_delta`` after
:data:`GROWTH_STEPS` steps of puts that no one clears, with and without the
outstanding-bytes table (what a rollout engine's client sees over a run); the
CPU time a call costs in each process it touches (the caller, each of the
store's processes, the node's raylet, which holds Ray's object store), for the
adapter, raw TransferQueue and ``ray.put`` / ``ray.get`` (:mod:`shell.bench.cpu`;
on a 2-core machine CPU spent in any of them lengthens the step that waits on
the call); and, with ``--profile``, where the adapter's put and get spend their
time.
"""

from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import psutil
import torch
from tensordict import TensorDict

from adapters import transport_baselines as raw
from adapters.memory import MemoryStore
from adapters.rows import read_columns_of
from adapters.transfer_queue import TransferQueueStore
from core.codec import to_jagged
from core.integrity import digest_matrix
from core.meta import KVBatchMeta
from shell.bench.cpu import RAYLET, cpu_per_call, cpu_seconds, processes, ray_daemons
from shell.bench.report import Report
from shell.metering import MeteredClient

FIELDS = ("input_ids", "token_mask", "logprobs")
ADAPTER = "TransferQueueStore (ours)"
METERED = "MeteredClient(TransferQueueStore)"
INTEGRITY = "MeteredClient(TransferQueueStore, integrity)"
RAW_TQ = "raw TransferQueue kv_batch_put/get"
MEMORY = "MemoryStore (ours)"
RAY = "ray.put/ray.get"
KEYED = "ray.put/ray.get + a key table in an actor"


@attrs.frozen
class DataplaneConfig:
    """Sizes of the data-plane benchmark."""

    rows: int = 256
    repeats: int = 30
    seed: int = 0
    profile: bool = False
    tq_backend: str = "RayObjectStore"
    """TransferQueue's storage backend; ``MooncakeStore`` runs over TCP with segments sized by :data:`MOONCAKE_BENCH`."""


@attrs.frozen
class Transport:
    """How the benchmark drives one transport: ``put`` returns a handle that ``get`` and ``clear`` take."""

    put: Callable[[list[str], str, TensorDict], Any]
    get: Callable[[list[str], str, Any], Any]
    clear: Callable[[list[str], str, Any], None]


MOONCAKE_BENCH = {
    "backend": {
        "storage_backend": "MooncakeStore",
        "MooncakeStore": {"protocol": "tcp", "global_segment_size": 1 << 30, "local_buffer_size": 256 << 20},
    }
}
"""TransferQueue settings of ``--tq-backend MooncakeStore``: TCP, a 1 GiB segment (the rounds' keys are cleared as they go)."""


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


def _client(client: Any) -> Transport:
    return Transport(
        put=lambda keys, pid, td: client.put(keys, pid, td),
        get=lambda keys, pid, _: client.get(keys, pid, list(FIELDS)),
        clear=lambda keys, pid, _: client.clear(keys, pid),
    )


PAIRED_BLOCKS: tuple[tuple[str, ...], ...] = ((ADAPTER, RAW_TQ), (METERED, INTEGRITY), (MEMORY,), (RAY,), (KEYED,))
"""Transports compared with each other run back to back, in one block."""


def round_order(rep: int) -> list[str]:
    """The call order of round ``rep``: every transport twice, each compared pair as A B B A.

    The A B B A pattern cancels drift that is linear over the block. The blocks
    rotate by one each round and the pairs swap sides after each full
    rotation, so over ``2 * len(PAIRED_BLOCKS)`` rounds every block takes every
    position once with each side of its pair outside.

    Example:
        >>> [name.split()[0] for name in round_order(0)[:4]]
        ['TransferQueueStore', 'raw', 'raw', 'TransferQueueStore']
        >>> [name.split()[0] for name in round_order(5)[:4]]
        ['raw', 'TransferQueueStore', 'TransferQueueStore', 'raw']
    """
    shift = rep % len(PAIRED_BLOCKS)
    swap = (rep // len(PAIRED_BLOCKS)) % 2 == 1
    blocks = [block[::-1] if swap else block for block in PAIRED_BLOCKS[shift:] + PAIRED_BLOCKS[:shift]]
    return [name for block in blocks for name in (*block, *block[::-1])]


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: order statistics ``(x_(k), x_(n+1-k))``.

    ``k`` is the largest rank with ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2``;
    with fewer than 6 values no such rank exists and the interval is min..max.

    Example:
        >>> median_ci(list(range(1, 21)))
        (6, 15)
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("'values' must not be empty: got no values")
    tail = (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(Binomial(n, 1/2) <= k)
        if below > tail:
            break
        k += 1
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


def _ratio_row(label: str, ratios: Sequence[float], goal: float | None, *, percent: bool) -> list[str]:
    med = statistics.median(ratios)
    lo, hi = median_ci(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med, med, med)

    def fmt(x: float) -> str:
        return f"{100 * x:.1f}%" if percent else f"{x:.3f}"

    verdict = "-" if goal is None else ("yes" if med <= goal else "no") + (" (CI too)" if hi <= goal else "")
    return [label, fmt(med), f"{fmt(lo)} .. {fmt(hi)}", f"{fmt(q1)} .. {fmt(q3)}", f"{fmt(min(ratios))} .. {fmt(max(ratios))}",
            "-" if goal is None else f"<= {fmt(goal)}", verdict]


def run(cfg: DataplaneConfig, report: Report) -> None:
    """Measure every transport into ``report``."""
    td, nbytes = payload(cfg)
    report.start(total=cfg.repeats + 2, description="data-plane benchmark")
    keyed = raw.RefsByKey()
    try:
        store = TransferQueueStore.start(MOONCAKE_BENCH if cfg.tq_backend == "MooncakeStore" else {"backend": {"storage_backend": cfg.tq_backend}})
    except BaseException:
        keyed.close()
        raise
    try:
        memory = MemoryStore()
        transports: dict[str, Transport] = {
            ADAPTER: _client(store),
            METERED: _client(MeteredClient(store)),
            INTEGRITY: _client(MeteredClient(store, verify_integrity=True)),
            RAW_TQ: Transport(
                put=raw.raw_tq_put,
                get=lambda keys, pid, _: raw.raw_tq_get(keys, pid, FIELDS),
                clear=lambda keys, pid, _: raw.raw_tq_clear(keys, pid),
            ),
            MEMORY: _client(memory),
            RAY: Transport(put=lambda keys, pid, td: raw.ray_put(td), get=lambda keys, pid, ref: raw.ray_get(ref),
                           clear=lambda keys, pid, ref: None),
            KEYED: Transport(put=keyed.put, get=lambda keys, pid, _: keyed.get(keys, pid),
                             clear=lambda keys, pid, _: keyed.clear(keys, pid)),
        }
        names = list(transports)
        partitions = {name: f"bench-{i}" for i, name in enumerate(names)}
        puts: dict[str, list[float]] = {name: [] for name in names}
        gets: dict[str, list[float]] = {name: [] for name in names}
        clears: dict[str, list[float]] = {name: [] for name in names}
        hashing: list[float] = []
        for rep in range(cfg.repeats + 1):  # the first round warms up and is not counted
            calls, seen = [], dict.fromkeys(names, 0)
            for name in round_order(rep):  # (transport, which of its two calls)
                calls.append((name, seen[name]))
                seen[name] += 1
            keys = [[f"r{rep}_{occ}_{i}" for i in range(cfg.rows)] for occ in range(2)]
            handles: dict[tuple[str, int], Any] = {}
            took_put, took_get = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
            for name, occ in calls:
                start = time.perf_counter()
                handles[name, occ] = transports[name].put(keys[occ], partitions[name], td)
                took_put[name] += time.perf_counter() - start
            read = None
            for name, occ in calls:
                start = time.perf_counter()
                out = transports[name].get(keys[occ], partitions[name], handles[name, occ])
                took_get[name] += time.perf_counter() - start
                if name == ADAPTER:
                    read = out
            start = time.perf_counter()
            digest_matrix(list(read_columns_of(read).values()))  # what a verified get hashes
            took_hash = time.perf_counter() - start
            took_clear = dict.fromkeys(names, 0.0)
            for name, occ in calls:
                start = time.perf_counter()
                transports[name].clear(keys[occ], partitions[name], handles[name, occ])
                took_clear[name] += time.perf_counter() - start
            del handles, read
            if rep:
                for name in names:
                    puts[name].append(took_put[name] / 2)
                    gets[name].append(took_get[name] / 2)
                    clears[name].append(took_clear[name] / 2)
                hashing.append(took_hash)
            report.advance()

        med = {name: (statistics.median(puts[name]), statistics.median(gets[name])) for name in names}
        raw_put, raw_get = med[RAW_TQ]
        report.table(
            f"store throughput ({cfg.tq_backend}): {cfg.rows} rows, {nbytes / 1e6:.1f} MB payload, median over {cfg.repeats} rounds of 2 calls",
            ["transport", "put MB/s", "get MB/s", "put ms", "get ms", "clear ms", "put time / raw TQ", "get time / raw TQ"],
            [[name, f"{nbytes / p / 1e6:.0f}", f"{nbytes / g / 1e6:.0f}", f"{p * 1e3:.1f}", f"{g * 1e3:.1f}",
              f"{statistics.median(clears[name]) * 1e3:.1f}", f"{p / raw_put:.2f}", f"{g / raw_get:.2f}"]
             for name, (p, g) in med.items()],
        )

        def paired(a: list[float], b: list[float]) -> list[float]:
            return [x / y for x, y in zip(a, b)]

        report.table(
            f"paired per-round ratios over {cfg.repeats} rounds (A B B A pairs, order rotated; median, its 95% CI, IQR, range)",
            ["measure", "median", "95% CI of median", "IQR", "min .. max", "goal", "met"],
            [
                _ratio_row("adapter put time / raw TQ put", paired(puts[ADAPTER], puts[RAW_TQ]), 1.05, percent=False),
                _ratio_row("adapter get time / raw TQ get", paired(gets[ADAPTER], gets[RAW_TQ]), 1.05, percent=False),
                _ratio_row("adapter clear time / raw TQ clear", paired(clears[ADAPTER], clears[RAW_TQ]), None, percent=False),
                _ratio_row("hashing a get's rows / raw TQ get", paired(hashing, gets[RAW_TQ]), 0.10, percent=True),
                _ratio_row("integrity put / metered put (end to end)", paired(puts[INTEGRITY], puts[METERED]), 1.10, percent=False),
                _ratio_row("integrity get / metered get (end to end)", paired(gets[INTEGRITY], gets[METERED]), 1.10, percent=False),
                _ratio_row("adapter put time / ray.put", paired(puts[ADAPTER], puts[RAY]), 2.0, percent=False),
                _ratio_row("adapter get time / ray.get", paired(gets[ADAPTER], gets[RAY]), 2.0, percent=False),
                _ratio_row("ray.put + key table time / ray.put", paired(puts[KEYED], puts[RAY]), None, percent=False),
                _ratio_row("ray.get + key table time / ray.get", paired(gets[KEYED], gets[RAY]), None, percent=False),
                _ratio_row("adapter put time / ray.put + key table", paired(puts[ADAPTER], puts[KEYED]), None, percent=False),
                _ratio_row("adapter get time / ray.get + key table", paired(gets[ADAPTER], gets[KEYED]), None, percent=False),
                _ratio_row("hashing a get's rows / metered get", paired(hashing, gets[METERED]), None, percent=True),
            ],
        )
        stores = {ADAPTER: store, METERED: MeteredClient(store), MEMORY: memory}
        tiny = {name: _tiny_get_ms(client, partitions[name], max(50, cfg.repeats)) for name, client in stores.items()}
        tiny[RAW_TQ] = _tiny_get_ms(_RawTQ(), partitions[RAW_TQ], max(50, cfg.repeats))
        report.table(
            f"per-call latency: get of 1 key and 1 field (int64 scalar), median of {max(50, cfg.repeats)} calls ({cfg.tq_backend})",
            ["transport", "ms", "goal", "met"],
            [[name, f"{ms:.2f}", "<= 5.00" if name == ADAPTER else "-", ("yes" if ms <= 5.0 else "no") if name == ADAPTER else "-"]
             for name, ms in tiny.items()],
        )

        ours_put, ours_get = med[ADAPTER]
        keys = [f"n{i}" for i in range(cfg.rows)]
        null = _NullClient(td, keys)
        metered_null = MeteredClient(null)
        reps = max(200, cfg.repeats)
        overhead = {
            op: _median_us(lambda: getattr(metered_null, op)(keys, "null", *args), reps) - _median_us(lambda: getattr(null, op)(keys, "null", *args), reps)
            for op, args in (("put", (td,)), ("get", (list(FIELDS),)), ("clear", ()))
        }
        growth = {track: _step_delta_after_puts(td, keys, track, GROWTH_STEPS) for track in (True, False)}
        report.advance()
        report.table(
            "other overheads (goal in brackets)",
            ["measure", "value"],
            [
                *[[f"metering, integrity off, per {op} (<= 40 us)", f"{us:.1f} us"] for op, us in overhead.items()],
                *[[f"metering step_delta after {GROWTH_STEPS:,} steps of {cfg.rows}-key puts never cleared, "
                   f"track_outstanding={track}", f"{ms:.2f} ms"] for track, ms in growth.items()],
                ["hashing a get's rows (3 fields, median)", f"{statistics.median(hashing) * 1e3:.2f} ms"],
                ["TQ adapter put time / ray.put", f"{ours_put / med[RAY][0]:.1f}x"],
                ["TQ adapter get time / ray.get", f"{ours_get / med[RAY][1]:.1f}x"],
            ],
        )
        cpu_transports = {name: transports[name] for name in (ADAPTER, RAW_TQ, RAY, KEYED)}
        calls = cpu_calls(nbytes)
        report.table(
            f"CPU per call by process ({cfg.tq_backend}): {cfg.rows} rows, {nbytes / 1e6:.1f} MB, ms of CPU a call "
            f"costs, the mean over {calls} calls of each operation",
            *_cpu_table(cpu_transports, partitions, td, cfg.rows, _call_processes(store, keyed), calls),
        )
        if cfg.profile:
            _profile(store, td, report)
        report.advance()
    finally:
        keyed.close()
        store.close()
    report.finish()


class _RawTQ:
    """TransferQueue's own key/value calls, as a client."""

    def put(self, keys: Any, partition_id: str, fields: TensorDict) -> None:
        raw.raw_tq_put(keys, partition_id, fields)

    def get(self, keys: Any, partition_id: str, select_fields: Any) -> TensorDict:
        return raw.raw_tq_get(keys, partition_id, select_fields)

    def clear(self, keys: Any, partition_id: str) -> None:
        raw.raw_tq_clear(keys, partition_id)


GROWTH_STEPS = 1000
"""Steps of puts (under fresh keys, never cleared) before the metering's ``step_delta`` is timed."""


def _step_delta_after_puts(td: TensorDict, keys: list[str], track_outstanding: bool, steps: int) -> float:
    """Median ms of ``MeteredClient.step_delta()`` over the last 10 of ``steps`` steps, each a put of ``td`` under
    fresh keys that no one clears (what a rollout engine's client sees: the driver clears its rows), into a client
    that stores nothing."""
    null = _NullClient(td, keys)
    client = MeteredClient(null, track_outstanding=track_outstanding)
    times = []
    for step in range(steps):
        client.put([f"s{step}_{key}" for key in keys], "growth", td)
        start = time.perf_counter()
        client.step_delta()
        times.append(time.perf_counter() - start)
    return statistics.median(times[-10:]) * 1e3


def _tiny_get_ms(client: Any, partition: str, repeats: int) -> float:
    """Median wall time of a get of one key's one small field (among 3) from ``client``; one warm-up get first."""
    tiny = TensorDict({name: torch.zeros(1, dtype=torch.int64) for name in FIELDS}, batch_size=[1])
    client.put(["tiny"], partition, tiny)
    get = lambda: client.get(["tiny"], partition, [FIELDS[0]])  # noqa: E731
    try:
        get()
        return _median_us(get, repeats) / 1e3
    finally:
        client.clear(["tiny"], partition)


CPU_BLOCK = 10
"""The CPU table's calls go in blocks of this many puts, then as many gets, then as many clears (the store never
holds more than a block's rows)."""
CPU_BYTES = 1 << 30
"""The CPU table moves about this many payload bytes per transport and operation (:func:`cpu_calls`)."""


def cpu_calls(payload_bytes: int) -> int:
    """How many calls of each operation the CPU table times for a payload of ``payload_bytes``: :data:`CPU_BYTES`
    worth, in whole blocks of :data:`CPU_BLOCK`, at least 2 blocks and at most 200 calls (3 MB: 200; 64 MB: 20)."""
    fitting = CPU_BYTES // max(1, payload_bytes) // CPU_BLOCK * CPU_BLOCK
    return max(2 * CPU_BLOCK, min(200, fitting))


CALLER = "caller (this process)"
KEY_TABLE = "key-table actor"


def _call_processes(store: Any, keyed: raw.RefsByKey) -> dict[str, psutil.Process]:
    """The processes a store call can spend CPU in: this one (Ray's threads in it included), each part of ``store``
    (:meth:`adapters.store_health.ProbedActors.parts`), the key table of ``keyed`` and the raylet this process started (Ray's
    object store lives in it)."""
    out = {CALLER: psutil.Process()}
    out.update(processes({part.role: part.pid for part in store.parts() if part.pid is not None}))
    out.update(processes({KEY_TABLE: keyed.pid}))
    daemons = ray_daemons()
    if RAYLET in daemons:
        out[RAYLET] = daemons[RAYLET]
    return out


def _cpu_table(
    transports: Mapping[str, Transport], partitions: Mapping[str, str], td: TensorDict, rows: int,
    readers: Mapping[str, psutil.Process], calls: int,
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the CPU table: per transport and operation, the wall ms and each process's ms of CPU per
    call (:func:`cpu_per_call`) over ``calls`` calls (a multiple of :data:`CPU_BLOCK`; ``-`` for a process that a
    block's readings missed), and their sum. ``ray.put`` / ``ray.get`` has no clear: its objects go when their
    last reference does (the raylet's freeing of a block's objects counts in the next block's put)."""
    names = list(readers)
    lines = []
    for transport_name, transport in transports.items():
        ops = ("put", "get") if transport_name == RAY else ("put", "get", "clear")
        spent = {op: dict.fromkeys(names, 0.0) for op in ops}
        read = {op: dict.fromkeys(names, 0) for op in ops}  # blocks whose two readings hold the process
        wall = dict.fromkeys(ops, 0.0)
        for block in range(calls // CPU_BLOCK):
            keys = [[f"cpu{block}_{i}_{r}" for r in range(rows)] for i in range(CPU_BLOCK)]
            handles: list[Any] = []
            for op in ops:
                before, start = cpu_seconds(readers), time.perf_counter()
                for i in range(CPU_BLOCK):
                    if op == "put":
                        handles.append(transport.put(keys[i], partitions[transport_name], td))
                    elif op == "get":
                        transport.get(keys[i], partitions[transport_name], handles[i])
                    else:
                        transport.clear(keys[i], partitions[transport_name], handles[i])
                wall[op] += time.perf_counter() - start
                for name, ms in cpu_per_call(before, cpu_seconds(readers), calls).items():
                    spent[op][name] += ms
                    read[op][name] += 1
            del handles
        blocks = calls // CPU_BLOCK
        for op in ops:
            whole = [name for name in names if read[op][name] == blocks]  # a process missed in a block has no figure
            lines.append([transport_name, op, f"{wall[op] * 1e3 / calls:.2f}",
                          *[f"{spent[op][name]:.2f}" if name in whole else "-" for name in names],
                          f"{sum(spent[op][name] for name in whole):.2f}"])
    return ["transport", "call", "wall ms", *[f"{name} CPU ms" for name in names], "all CPU ms"], lines


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
