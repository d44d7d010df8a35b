"""``python -m shell.bench scale``: the two paths across Ray nodes, and as the batch grows.

Both parts run on one local cluster of ``--nodes`` nodes
(:mod:`shell.bench.nodes`: a head, where this driver runs, and worker nodes
with their own raylets and object stores). With two or more nodes, the policy
ranks, the rollout engine (or the row producer) and TransferQueue's storage
units go to the worker nodes (``ray.placement=spread`` and the worker nodes'
resource); TransferQueue's controller goes where Ray puts it.

* **Bytes per node** (``--steps`` GRPO steps per path, after one warm-up
  step; the run config is the default run's with DP=2, plus overrides): the
  bytes each node sent to and received from the other nodes during each step,
  read off the kernel's per-socket TCP counters (:mod:`shell.bench.traffic`),
  with the driver process counted on the head node and also on its own. On the
  data plane the driver's node carries only metadata: keys, lengths, per-row
  values and the calls themselves.
* **Row sweep** (``--rows``, DP=2): a GRPO step over synthetic rows with
  lognormal lengths (median 700, sigma 1, clipped to ``16..--max-len``, default
  1024: the clip keeps the median and bounds the attention cost): a row producer
  actor makes the batch (legacy: returns it to the driver; data plane: writes
  it to the store), then log-probs, the driver's advantages, one train call of
  two optimizer steps, and the end of the step, on a tiny GPT
  (:data:`SWEEP_MODEL`) with dynamic batching (attention costs the square of
  a row's length, so compute dominates at large N). Per N: the median step time of ``--repeats`` paired
  repeats (order alternated, after one warm-up pair), the median of the
  per-pair ratios data plane / legacy, the bytes through the driver (the
  transport's count; the TCP bytes of the driver's node: Ray moves a
  returned batch to the head's object store, and the driver reads it there
  through shared memory; and the same without the sockets of the head's GCS
  server, whose exchanges with the worker nodes' processes, such as their
  task events, go on for as long as a step lasts, on either path), and the driver's
  peak RSS during the step (``VmHWM`` of ``/proc/self/status``, reset before
  each step through ``/proc/self/clear_refs``) with its growth over the RSS
  the step started from. Before each step the driver frees its garbage and
  returns glibc's free pages (``malloc_trim``), so a step starts from the
  memory that lives on rather than what an earlier step of the other path
  left in the allocator; the growth is what the step itself needs in the
  driver. The table names the smallest N at which the data plane's step is
  faster than legacy's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import ray
import torch

from adapters import proc_memory
from shell.bench.nodes import NODE_RESOURCE, NodesConfig, describe, node_pids, start_cluster
from shell.bench.report import Report
from shell.bench.traffic import Traffic, node_traffic, snapshot
from shell.bench.workloads import lognormal_lengths

MAX_LEN = 1024
"""The default longest row of the sweep (lognormal lengths are clipped to 16..max_len)."""
ROOT = Path(__file__).resolve().parents[2]


def parse_rows(text: str) -> tuple[int, ...]:
    """``"256,1024,4096"`` as ``(256, 1024, 4096)``: distinct even counts >= 2, ascending.

    Raises:
        ValueError: an entry is not an int, is odd or below 2, or repeats.

    Example:
        >>> parse_rows("1024, 256")
        (256, 1024)
    """
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"'--rows' must be comma-separated ints, e.g. 256,1024,4096: got {text!r}") from None
    bad = [v for v in values if v < 2 or v % 2]
    if not values or bad:
        raise ValueError(f"'--rows' must be even row counts >= 2 (DP=2 splits them): got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"'--rows' must not repeat a count: got {text!r}")
    return tuple(sorted(values))


@attrs.frozen
class ScaleConfig:
    """Sizes of the scale benchmark (see the module docstring).

    Raises:
        ValueError: a count is out of range (naming its option).
    """

    nodes: int = 3
    steps: int = 3
    rows: tuple[int, ...] = (256, 1024, 4096)
    repeats: int = 3
    seed: int = 0
    object_store_mb: int = 512
    num_cpus: int = 4
    max_len: int = MAX_LEN
    backend: str = "tq_object_store"
    plot: str | None = None
    overrides: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name, low in (("nodes", 1), ("steps", 0), ("repeats", 1), ("seed", 0), ("num_cpus", 2), ("max_len", 701)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"'--{name.replace('_', '-')}' must be an int >= {low}: got {value!r}")
        if self.rows:
            parse_rows(",".join(str(r) for r in self.rows))
        NodesConfig(nodes=self.nodes, num_cpus=self.num_cpus, object_store_mb=self.object_store_mb)
        if self.backend not in ("tq_object_store", "transfer_queue"):
            raise ValueError(f"'--backend' must be tq_object_store or transfer_queue: got {self.backend!r}")
        if not self.steps and not self.rows:
            raise ValueError("'--steps' and '--rows' cannot both be empty: nothing to measure")


# ---------------------------------------------------------------- pure summaries


def paired_summary(legacy: Sequence[float], plane: Sequence[float]) -> tuple[float, float, float]:
    """Median legacy time, median data-plane time, and the median of the per-pair ratios plane / legacy.

    Raises:
        ValueError: the sequences are empty or of different lengths, or a legacy time is not > 0.

    Example:
        >>> paired_summary([2.0, 4.0, 3.0], [1.0, 4.0, 3.3])
        (3.0, 3.3, 1.0)
    """
    if not legacy or len(legacy) != len(plane):
        raise ValueError(f"'legacy' and 'plane' must be paired (same length >= 1): got {len(legacy)} and {len(plane)}")
    if min(legacy) <= 0:
        raise ValueError(f"'legacy' times must be > 0: got {min(legacy)}")
    ratios = [p / q for p, q in zip(plane, legacy)]
    return statistics.median(legacy), statistics.median(plane), statistics.median(ratios)


def crossover(rows: Sequence[int], ratios: Sequence[float]) -> str:
    """Where the data plane's step becomes faster than legacy's (ratio < 1), in words.

    Example:
        >>> crossover([256, 1024, 4096], [1.2, 0.95, 0.8])
        'data plane faster from N = 1024 on'
    """
    if len(rows) != len(ratios):
        raise ValueError(f"'rows' and 'ratios' must have the same length: got {len(rows)} and {len(ratios)}")
    below = [r < 1.0 for r in ratios]
    if all(below):
        return f"data plane faster at every N (already at N = {rows[0]})"
    for i in range(len(rows)):
        if all(below[i:]):
            return f"data plane faster from N = {rows[i]} on"
    return f"data plane not faster than legacy at N = {rows[-1]}" if rows else "no N measured"


def median_traffic(steps: Sequence[Traffic], names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per owner in ``names``, the median over ``steps`` of its bytes sent and received (0 where absent).

    Example:
        >>> median_traffic([{"a": (1, 2)}, {"a": (3, 4)}, {}], ["a", "b"])
        {'a': (1, 2), 'b': (0, 0)}
    """
    return {
        name: (
            statistics.median([s.get(name, (0, 0))[0] for s in steps]) if steps else 0,
            statistics.median([s.get(name, (0, 0))[1] for s in steps]) if steps else 0,
        )
        for name in names
    }


# ---------------------------------------------------------------- the cluster


@contextlib.contextmanager
def _cluster(cfg: ScaleConfig) -> Iterator[Any]:
    cluster = start_cluster(NodesConfig(nodes=cfg.nodes, num_cpus=cfg.num_cpus, object_store_mb=cfg.object_store_mb))
    try:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
                 namespace=f"scale-bench-{uuid.uuid4().hex[:6]}")
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def _labels(cluster: Any) -> dict[str, str]:
    """node id -> "head" / "worker <i>"."""
    out, i = {}, 0
    for node in describe(cluster):
        if node.head:
            out[node.node_id] = "head"
        else:
            i += 1
            out[node.node_id] = f"worker {i}"
    return out


def _owners(cluster: Any, labels: Mapping[str, str], *, driver: str | None) -> dict[int, str]:
    """pid -> node label for every process of the cluster, and this driver (on the head, or as ``driver``)."""
    owners = {pid: labels[node] for node, pids in node_pids(cluster).items() for pid in pids}
    owners[os.getpid()] = driver or "head"
    return owners


def leave_out(owners: Mapping[int, str], pids: Iterable[int]) -> dict[int, str]:
    """``owners`` without ``pids``: :func:`shell.bench.traffic.node_traffic` then counts none of their sockets.

    Raises ``ValueError`` when ``pids`` is empty or names a process ``owners`` does not hold: leaving out nothing
    would make the "without" column silently equal the whole node's.

    Example:
        >>> leave_out({1: "head", 2: "head", 3: "worker 1"}, [2])
        {1: 'head', 3: 'worker 1'}
    """
    gone = set(pids)
    if not gone:
        raise ValueError("leave_out: pids is empty; expected at least one process to leave out")
    unknown = sorted(gone - owners.keys())
    if unknown:
        raise ValueError(f"leave_out: pids {unknown} are not among the owners' processes {sorted(owners)}")
    return {pid: label for pid, label in owners.items() if pid not in gone}


def server_pids(processes: Mapping[str, Sequence[Any]], name: str = "gcs_server") -> frozenset[int]:
    """The pids of the processes a Ray node started under ``name`` (``Node.all_processes``: name -> ``ProcessInfo``s).

    Raises ``ValueError`` naming the processes the node has when it has no live ``name`` process.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> server_pids({"gcs_server": [NS(process=NS(pid=7))], "raylet": [NS(process=NS(pid=8))]})
        frozenset({7})
    """
    pids = frozenset(info.process.pid for info in processes.get(name, ()) if info.process is not None)
    if not pids:
        raise ValueError(f"the head node runs no {name!r} process; it runs {sorted(processes)}")
    return pids


def _spread(cfg: ScaleConfig) -> list[str]:
    if cfg.nodes < 2:
        return []
    return ["ray.placement=spread", f"ray.worker_resource={NODE_RESOURCE}", f"data_plane.storage_resource={NODE_RESOURCE}"]


# ---------------------------------------------------------------- bytes per node per GRPO step


def _roles(nodes: Mapping[str, Any], store: Mapping[str, str]) -> dict[str, list[str]]:
    """node id -> what runs there (from ``GRPOTrainer.node_ids``, and the store's actors: role -> node id)."""
    out: dict[str, list[str]] = {}
    out.setdefault(nodes["driver"], []).append("driver")
    for role, node in store.items():
        out.setdefault(node, []).append(role)
    for rank, node in nodes.get("policy", {}).items():
        out.setdefault(node, []).append(f"rank {rank}")
    for role in ("rollout", "collector"):
        if role in nodes:
            out.setdefault(nodes[role], []).append(role)
    for name, node in nodes.get("storage", {}).items():
        out.setdefault(node, []).append("unit " + name.rsplit("#", 1)[-1])
    return out


def _store_nodes() -> dict[str, str]:
    """Where TransferQueue's controller and (on the object store) its index actor run: role -> node id."""
    from adapters.tq_object_store import INDEX_NAME, INDEX_NAMESPACE
    from adapters.tq_system import CONTROLLER_NAME, CONTROLLER_NAMESPACE
    from shell.node_placement import node_of

    out = {}
    for role, name, namespace in (("controller", CONTROLLER_NAME, CONTROLLER_NAMESPACE), ("index", INDEX_NAME, INDEX_NAMESPACE)):
        try:
            out[role] = node_of(ray.get_actor(name, namespace=namespace))
        except ValueError:  # not running (the legacy path, or SimpleStorage's index-free backend)
            pass
    return out


def measure_nodes(cfg: ScaleConfig, cluster: Any, report: Report) -> None:
    """The bytes-per-node tables: ``cfg.steps`` GRPO steps of each path on ``cluster``."""
    from shell.grpo_trainer import GRPOTrainer
    from shell.run_config import load_run_config

    labels = _labels(cluster)
    per_node: dict[str, dict[str, tuple[float, float]]] = {}
    summary: dict[str, dict[str, float]] = {}
    roles: dict[str, dict[str, list[str]]] = {}
    for path, enabled in (("legacy", "false"), ("data plane", "true")):
        config = load_run_config([
            "policy.layout.data_parallel=2", "run.progress=off", f"ray.address={cluster.address}",
            f"data_plane.enabled={enabled}", f"data_plane.partition=scale-{uuid.uuid4().hex[:6]}", f"seed={cfg.seed}",
            f"data_plane.backend={cfg.backend}",
            *_spread(cfg), *cfg.overrides,
        ])
        steps: list[Traffic] = []
        driver: list[Traffic] = []
        records: list[dict[str, Any]] = []
        with GRPOTrainer(config) as trainer:
            trainer.step(1)  # warm-up
            report.advance()
            roles[path] = _roles(trainer.node_ids(), _store_nodes() if enabled == "true" else {})
            nodes, alone = _owners(cluster, labels, driver=None), _owners(cluster, labels, driver="driver")
            for step in range(2, cfg.steps + 2):
                before = snapshot()
                records.append(trainer.step(step))
                after = snapshot()
                steps.append(node_traffic(before, after, nodes))
                driver.append(node_traffic(before, after, alone))
                report.advance()
        per_node[path] = median_traffic(steps, sorted(set(labels.values())))
        head = per_node[path]["head"]
        mine = median_traffic(driver, ["driver"])["driver"]
        summary[path] = {
            "node": head[0] + head[1],
            "driver": mine[0] + mine[1],
            "transport": statistics.median(r["driver_bytes"] for r in records),
            "store": statistics.median(r["data_plane_bytes"] for r in records),
            "time": statistics.median(r["step_time_s"] for r in records),
        }
    rows = []
    for path, nodes_bytes in per_node.items():
        by_label = {labels[n]: ", ".join(r) for n, r in roles[path].items()}
        for label, (sent, received) in nodes_bytes.items():
            rows.append([path, label, by_label.get(label, "-"), f"{sent:,.0f}", f"{received:,.0f}"])
    report.table(
        f"Bytes each node sent to / received from the other nodes per GRPO step ({cfg.nodes} nodes, DP=2, "
        f"median of {cfg.steps} steps; kernel TCP counters)",
        ["path", "node", "runs there", "sent B/step", "received B/step"],
        rows,
    )
    legacy, plane = summary["legacy"], summary["data plane"]
    report.table(
        "The driver's node per GRPO step (median): what crosses it, against the rows the store carried",
        ["path", "driver's node B/step", "driver process B/step", "transport driver_bytes", "store payload B/step", "step s"],
        [[p, f"{s['node']:,.0f}", f"{s['driver']:,.0f}", f"{s['transport']:,.0f}", f"{s['store']:,.0f}", f"{s['time']:.3f}"]
         for p, s in summary.items()]
        + [["data plane / legacy", f"{plane['node'] / max(legacy['node'], 1):.3f}",
            f"{plane['driver'] / max(legacy['driver'], 1):.3f}", f"{plane['transport'] / max(legacy['transport'], 1):.3f}",
            "-", f"{plane['time'] / legacy['time']:.2f}x"]],
    )


# ---------------------------------------------------------------- the row sweep


SWEEP_MODEL = {"vocab_size": 32, "hidden_size": 32, "num_layers": 1, "num_attention_heads": 2}
"""The sweep's tiny GPT (its positions: the longest row)."""


def sweep_batch(n: int, seed: int, max_len: int = MAX_LEN) -> dict[str, torch.Tensor]:
    """The sweep's padded rows: ``input_ids`` (N, S) int64, ``token_mask`` (N, S) bool (response tokens:
    after a 4-token prompt, within the row), ``lengths`` (N,) int64; S the longest row. Pure in ``(n, seed)``."""
    lengths = torch.from_numpy(np.minimum(lognormal_lengths(n, seed), max_len))
    width = int(lengths.max())
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(width)[None, :]
    return {
        "input_ids": torch.randint(0, SWEEP_MODEL["vocab_size"], (n, width), generator=g),
        "token_mask": (positions >= 4) & (positions < lengths[:, None]),
        "lengths": lengths,
    }


class RowProducer:
    """Stands in for the rollout engine: makes a step's rows on its node and hands them on."""

    def batch(self, n: int, seed: int, max_len: int) -> Any:
        """The rows, returned to the caller (the legacy path): token fields jagged, as a rollout returns them."""
        from tensordict import TensorDict

        from core.codec import to_jagged

        rows = sweep_batch(n, seed, max_len)
        lengths = rows["lengths"].tolist()
        return TensorDict(
            {"input_ids": to_jagged(rows["input_ids"], lengths), "token_mask": to_jagged(rows["token_mask"], lengths),
             "lengths": rows["lengths"]},
            batch_size=[n],
        )

    def write(self, n: int, seed: int, max_len: int, partition: str, prefix: str) -> Any:
        """The rows, written once to the store (the data plane); returns the receipt."""
        from adapters.transfer_queue import TransferQueueStore
        from shell.column_io import first_write

        rows = sweep_batch(n, seed, max_len)
        store = TransferQueueStore.attach()
        try:
            return first_write(
                store, {"input_ids": rows["input_ids"], "token_mask": rows["token_mask"]},
                keys=[f"{prefix}{i}" for i in range(n)], partition_id=partition,
                lengths=rows["lengths"].tolist(), token_fields=["input_ids", "token_mask"],
            )
        finally:
            store.close()


def measure_rows(cfg: ScaleConfig, cluster: Any, report: Report) -> list[dict[str, Any]]:
    """The row sweep (see the module docstring); one result per N and path."""
    from adapters import tq_system
    from adapters.transfer_queue import TransferQueueStore
    from core.fields import ADVANTAGES
    from core.micro_batch import DynamicBatchingSpec
    from core.model_config import TinyGPTConfig
    from core.step_plan import legacy_meta
    from core.topology import NamedSharding
    from shell.config_schema import NodePlacement
    from shell.loss import GRPOLoss
    from shell.node_placement import rank_options, transfer_queue_settings
    from shell.policy import Policy, PolicyConfig, build_group
    from shell.step_rows import StepRows
    from shell.transport import DataPlaneTransport, LegacyTransport

    resource = NODE_RESOURCE if cfg.nodes > 1 else None
    placement = "spread" if cfg.nodes > 1 else "pack"
    from shell.config_schema import StoreBackend

    tq_storage = StoreBackend(cfg.backend).tq_storage
    store = TransferQueueStore.start(
        transfer_queue_settings(tq_storage, 2, resource)  # type: ignore[arg-type]
    )
    tq_system.quiet_logs()
    partition = f"scale-rows-{uuid.uuid4().hex[:6]}"
    loss = GRPOLoss(kl_coef=0.0)

    def policy_config(n: int) -> PolicyConfig:
        return PolicyConfig(
            sharding=NamedSharding({"data_parallel": 2}), model=TinyGPTConfig(**SWEEP_MODEL, max_sequence_length=cfg.max_len), seed=cfg.seed,
            train_global_batch_size=n // 2,
            dynamic_batching=DynamicBatchingSpec(max_tokens_per_microbatch=2 * cfg.max_len, sequence_length_round=64),
            placement=placement, worker_resource=resource,
        )

    results: list[dict[str, Any]] = []
    try:
        producer = ray.remote(RowProducer).options(
            num_cpus=0.25, **rank_options(NodePlacement(placement), resource, 1)[0]
        ).remote()
        with build_group(policy_config(cfg.rows[0]), client_factory=TransferQueueStore.attach) as group:
            owners = _owners(cluster, _labels(cluster), driver=None)  # the driver counts on the head node
            quiet = leave_out(owners, server_pids(cluster.head_node.all_processes))  # and without the GCS server's sockets
            for n in cfg.rows:
                transports = {
                    "legacy": LegacyTransport(),
                    "data plane": DataPlaneTransport(store, TransferQueueStore.attach, partition_id=partition),
                }
                policies = {p: Policy(policy_config(n), t, group=group) for p, t in transports.items()}
                advantages = torch.randn(n, generator=torch.Generator().manual_seed(cfg.seed))

                def step(path: str, seed: int) -> tuple[float, int, int, float, float, int]:
                    policy, transport = policies[path], transports[path]
                    proc_memory.settle()
                    before = snapshot()
                    proc_memory.reset_peak()
                    resident = proc_memory.resident_mib()
                    start = time.perf_counter()
                    if path == "legacy":
                        data = ray.get(producer.batch.remote(n, seed, cfg.max_len))
                        rows = StepRows(legacy_meta(data["lengths"].tolist()), data)
                    else:
                        rows = StepRows(ray.get(producer.write.remote(n, seed, cfg.max_len, partition, f"{seed}-{n}-")))
                    transport.admit(rows, {})
                    try:
                        rows = policy.logprobs(  # as the trainer's step calls it
                            policy.prepare(rows), prefetch=loss.input_fields, keep_for_train=True
                        )
                        rows = transport.write(rows, {ADVANTAGES: advantages})
                        policy.train(rows, loss)
                    finally:
                        moved = transport.finish(rows)
                    seconds = time.perf_counter() - start
                    peak = proc_memory.peak_resident_mib()
                    after = snapshot()
                    node = node_traffic(before, after, owners).get("head", (0, 0))
                    own = node_traffic(before, after, quiet).get("head", (0, 0))
                    return seconds, moved.driver_bytes, node[0] + node[1], peak, peak - resident, own[0] + own[1]

                for path in transports:  # warm-up pair
                    step(path, cfg.seed)
                report.advance()
                measured: dict[str, list[tuple[float, int, int, float, float, int]]] = {p: [] for p in transports}
                for r in range(cfg.repeats):
                    order = ("legacy", "data plane") if r % 2 == 0 else ("data plane", "legacy")
                    for path in order:
                        measured[path].append(step(path, cfg.seed + 1 + r))
                    report.advance()
                lt, pt, ratio = paired_summary([m[0] for m in measured["legacy"]], [m[0] for m in measured["data plane"]])
                for path, values in measured.items():
                    results.append({
                        "rows": n, "path": path, "step_s": lt if path == "legacy" else pt, "ratio": ratio,
                        "driver_bytes": statistics.median(m[1] for m in values),
                        "driver_node_bytes": statistics.median(m[2] for m in values),
                        "driver_node_bytes_but_gcs": statistics.median(m[5] for m in values),
                        "peak_rss_mib": statistics.median(m[3] for m in values),
                        "rss_growth_mib": statistics.median(m[4] for m in values),
                    })
    finally:
        store.close()
    return results


def sweep_table(cfg: ScaleConfig, results: Sequence[Mapping[str, Any]], report: Report) -> None:
    """The sweep's table (and its crossover line) into ``report``."""
    rows = [
        [f"{r['rows']:,}", r["path"], f"{r['step_s']:.3f}", f"{r['ratio']:.2f}x" if r["path"] == "data plane" else "1.00x",
         f"{r['driver_bytes']:,.0f}", f"{r['driver_node_bytes']:,.0f}", f"{r['driver_node_bytes_but_gcs']:,.0f}",
         f"{r['peak_rss_mib']:,.0f}",
         f"{r['rss_growth_mib']:,.1f}"]
        for r in results
    ]
    ns = [r["rows"] for r in results if r["path"] == "data plane"]
    ratios = [r["ratio"] for r in results if r["path"] == "data plane"]
    report.table(
        f"Row sweep, DP=2, {cfg.nodes} node(s): lognormal lengths (median 700, <= {cfg.max_len}), one GRPO step "
        f"(median of {cfg.repeats} paired repeats; ratio: median of per-pair data plane / legacy). {crossover(ns, ratios)}",
        ["rows N", "path", "step s", "vs legacy", "transport driver_bytes", "driver's node TCP bytes",
         "the same but the GCS's", "peak driver RSS MiB", "driver RSS growth in the step MiB"],
        rows,
    )


def plot_sweep(results: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """A PNG of the sweep: step time, driver bytes and peak driver RSS against N, one line per path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, 3)
    for axes, key, label, log in zip(
        panels, ("step_s", "driver_bytes", "rss_growth_mib"),
        ("step time (s)", "bytes through the driver", "driver RSS growth in a step (MiB)"),
        (False, True, False),
    ):
        for index, name in enumerate(("legacy", "data plane")):
            mine = [r for r in results if r["path"] == name]
            xs = [r["rows"] for r in mine]
            axes.plot(xs, [max(r[key], 1) if log else r[key] for r in mine], "o-", color=f"C{index}",
                      label=f"{name} (transport)" if log else name)
            if log:
                axes.plot(xs, [max(r["driver_node_bytes"], 1) for r in mine], "s--", color=f"C{index}",
                          label=f"{name} (driver's node, TCP)")
                axes.plot(xs, [max(r["driver_node_bytes_but_gcs"], 1) for r in mine], "^:", color=f"C{index}",
                          label=f"{name} (driver's node but its GCS, TCP)")
        axes.set_xscale("log", base=2)
        if log:
            axes.set_yscale("log")
            axes.legend(fontsize="small")
        else:
            axes.set_ylim(bottom=0)
        axes.set_xlabel("rows N (median 700 tokens)")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
    panels[0].legend()
    figure.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def run(cfg: ScaleConfig, report: Report) -> None:
    """Measure into ``report`` (starts and stops its own local cluster)."""
    report.start(total=(cfg.steps + 1) * 2 * (cfg.steps > 0) + len(cfg.rows) * (cfg.repeats + 1), description="scale benchmark")
    with _cluster(cfg) as cluster:
        if cfg.steps:
            measure_nodes(cfg, cluster, report)
        results = measure_rows(cfg, cluster, report) if cfg.rows else []
    if results:
        sweep_table(cfg, results, report)
        if cfg.plot:
            plot_sweep(results, cfg.plot, title=f"Row sweep, DP=2, {cfg.nodes} node(s), median of {cfg.repeats} paired repeats")
    report.finish()
