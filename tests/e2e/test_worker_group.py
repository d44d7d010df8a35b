"""WorkerGroup on real Ray with gloo: ranks and coords, collectives, declared dispatch, leader broadcast, failures, shutdown.

One group per layout (DP=2 x TP=2 and PP=2 x DP=2) is shared by the tests of
this module; tests that break a group (a timeout, a killed actor) build their
own small one. Ray itself is the session's (``ray_cluster``).
"""

from __future__ import annotations

import warnings

import os
import pickle
import time
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import pytest
import ray
import torch
import torch.distributed as dist

from ray.exceptions import RayActorError

from core.codec import is_jagged, to_jagged
from core.topology import NamedSharding
from shell.broadcast import broadcast_tensors, describe
from shell.worker import Worker, dispatch_of, on_all_ranks, sharded
from shell.worker_group import GPUShortageError, WorkerError, WorkerGroup, WorkerTimeoutError

pytestmark = pytest.mark.e2e

LAYOUTS: dict[str, dict[str, int]] = {
    "dp2xtp2": {"data_parallel": 2, "tensor_parallel": 2},
    "pp2xdp2": {"pipeline_parallel": 2, "data_parallel": 2},
}
CPUS = 0.25
"""Logical CPUs per actor: several groups' actors fit the session's cluster on a 2-core machine."""

Canonical = dict[str, tuple[Any, ...]]


def sample_tensors() -> dict[str, torch.Tensor]:
    """A leader's batch: a 1 MiB payload, every awkward dtype, 0-d, empty, non-contiguous and jagged tensors."""
    g = torch.Generator().manual_seed(7)
    return {
        "big_f32": torch.randn(256, 1024, generator=g),  # [256, 1024] float32: the 1 MiB payload
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(7, generator=g) > 0.5,  # [7] bool
        "int16": torch.arange(-4, 4, dtype=torch.int16),  # gloo cannot broadcast int16 as such
        "float8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25, dtype=torch.float64),  # 0-d
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "transposed": torch.arange(12).reshape(3, 4).t(),  # non-contiguous int64
        "jagged_ids": to_jagged(torch.randint(0, 100, (4, 6), generator=g), [6, 0, 2, 5]),
        "jagged_bf16": to_jagged(torch.randn(4, 6, 2, generator=g).to(torch.bfloat16), [1, 3, 0, 6]),
        "jagged_bool": to_jagged(torch.rand(4, 6, generator=g) > 0.5, [6, 0, 2, 5]),
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def canonical(tensors: dict[str, torch.Tensor]) -> Canonical:
    """Each tensor as (layout, dtype, shape, bytes...): equal iff names, order, layouts, dtypes, shapes and bytes agree."""
    out: Canonical = {}
    for name, t in tensors.items():
        if is_jagged(t):
            out[name] = ("jagged", str(t.dtype), tuple(t.values().shape), _bytes(t.values()), t.offsets().tolist())
        else:
            out[name] = ("dense", str(t.dtype), tuple(t.shape), _bytes(t))
    return out


class ProbeWorker(Worker):
    """A worker that reports where it sits and exercises collectives, dispatch and failures."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.last_shard: Any = None

    @on_all_ranks
    def whoami(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "coords": dict(self.coords),
            "is_replica_leader": self.is_replica_leader,
            "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
            "tag": self.tag,
            "env": os.environ.get("WG_TEST_FLAG"),
        }

    @on_all_ranks
    def world_sum(self) -> int:
        t = torch.tensor([self.rank + 1])
        dist.all_reduce(t)
        return int(t.item())

    @on_all_ranks
    def replica_sum(self) -> int:
        t = torch.tensor([self.rank + 1])
        group = self.replica_group()
        if group is not None:
            dist.all_reduce(t, group=group)
        return int(t.item())

    @sharded
    def take_shard(self, shard: Any, *, step: int) -> dict[str, Any]:
        self.last_shard = shard
        return {"rank": self.rank, "shard": shard, "step": step}

    @on_all_ranks
    def get_last_shard(self) -> Any:
        return self.last_shard

    @on_all_ranks
    def explode_on(self, ranks: Sequence[int]) -> int:
        if self.rank in ranks:
            raise ValueError(f"boom on rank {self.rank}")
        return self.rank

    @on_all_ranks
    def broadcast_without_leader(self) -> float:
        """Non-leaders wait in a broadcast on the replica group that its leader never joins: the seconds until the
        group's timeout failed it (-1.0: it returned); the leader returns 0.0 at once."""
        group = self.replica_group()
        if self.is_replica_leader or group is None:
            return 0.0
        started = time.monotonic()
        try:
            dist.broadcast(torch.zeros(1), src=dist.get_global_rank(group, 0), group=group)
        except Exception:
            return time.monotonic() - started
        return -1.0

    @on_all_ranks
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @on_all_ranks
    def broadcast_probe(self) -> dict[str, Any]:
        """Broadcast ``sample_tensors`` from the replica leader while no tensor may be pickled; report sizes and calls."""
        data = sample_tensors() if self.is_replica_leader else None
        descriptor_sizes: list[int] = []
        payload_calls: list[int] = []
        real_object_broadcast, real_broadcast = dist.broadcast_object_list, dist.broadcast

        def object_spy(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
            descriptor_sizes.append(len(pickle.dumps(object_list)))
            real_object_broadcast(object_list, *args, **kwargs)

        def tensor_spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            payload_calls.append(tensor.numel())
            real_broadcast(tensor, *args, **kwargs)

        def no_pickling(tensor: torch.Tensor, protocol: Any) -> Any:
            raise AssertionError("a tensor payload was pickled")

        with (
            mock.patch.object(dist, "broadcast_object_list", object_spy),
            mock.patch.object(dist, "broadcast", tensor_spy),
            mock.patch.object(torch.Tensor, "__reduce_ex__", no_pickling),
        ):
            out = self.broadcast_from_leader(data)
        return {
            "tensors": canonical(out),
            "jagged": sorted(name for name, t in out.items() if is_jagged(t)),
            "descriptor_sizes": descriptor_sizes,
            "payload_calls": payload_calls,
        }

    @on_all_ranks
    def broadcast_non_tensor(self) -> dict[str, Any]:
        """The leader offers a non-tensor: every rank of the replica group must raise, none may hang."""
        data: Any = {"ids": [1, 2, 3]} if self.is_replica_leader else None
        return self.broadcast_from_leader(data)

    @on_all_ranks
    def broadcast_from_non_leader(self) -> int:
        """Non-leaders pass data (a misuse): they raise before any communication; leaders do not take part."""
        if not self.is_replica_leader:
            broadcast_tensors({"x": torch.zeros(2)}, src=self.replica_leader, group=self.replica_group(), device="cpu")
        return self.rank

    def undeclared(self) -> int:
        """A public method without a dispatch declaration: the group must refuse to call it."""
        return self.rank


class OtherWorker(Worker):
    """Another worker class: its methods, even a declared one named like ProbeWorker's, are not ProbeWorker's."""

    @on_all_ranks
    def whoami(self) -> str:
        return "other"

    @on_all_ranks
    def elsewhere(self) -> str:
        return "other"


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def group(request: pytest.FixtureRequest, ray_cluster: None) -> Iterator[WorkerGroup]:
    """A 4-rank gloo group per layout, shared by this module's tests."""
    sharding = NamedSharding(LAYOUTS[request.param])
    with WorkerGroup(
        ProbeWorker,
        sharding,
        init_kwargs={"tag": request.param},
        backend="gloo",
        num_cpus_per_worker=CPUS,
        timeout_s=60,
        pg_timeout_s=60,
    ) as wg:
        yield wg


@pytest.fixture
def small_group(ray_cluster: None) -> Iterator[WorkerGroup]:
    """A 2-rank (DP=2) group of one's own, for a test that breaks it."""
    with WorkerGroup(ProbeWorker, NamedSharding({"data_parallel": 2}), num_cpus_per_worker=CPUS, pg_timeout_s=30) as wg:
        yield wg


# ---------------------------------------------------------------- placement and collectives


def test_call_reports_rank_world_and_coords_of_layout(group: WorkerGroup) -> None:
    """Actor r holds rank r, the world size and sharding.coords(r), matching torch.distributed's view."""
    s = group.sharding
    reports = group.call(ProbeWorker.whoami)
    assert len(reports) == s.world_size == 4
    for r, report in enumerate(reports):
        assert report["rank"] == r and report["world_size"] == 4
        assert report["coords"] == dict(s.coords(r))
        assert report["is_replica_leader"] == s.is_replica_leader(r)
        assert report["dist"] == (r, 4, "gloo")
    assert {report["tag"] for report in reports} == {next(k for k, v in LAYOUTS.items() if NamedSharding(v) == s)}


def test_call_all_reduce_spans_world(group: WorkerGroup) -> None:
    """A gloo all_reduce over the world sums every rank's value on every rank."""
    assert group.call(ProbeWorker.world_sum) == [1 + 2 + 3 + 4] * 4


def test_replica_group_all_reduce_spans_dp_replicas(group: WorkerGroup) -> None:
    """An all_reduce over replica_group() sums exactly the ranks sharing the caller's dp index."""
    s = group.sharding
    expected = [sum(q + 1 for q in s.dp_shard_ranks(s.dp_index(r))) for r in range(s.world_size)]
    assert group.call(ProbeWorker.replica_sum) == expected


# ---------------------------------------------------------------- dispatch


def test_call_sharded_sends_dp_shard_to_replicas_and_keeps_leaders(group: WorkerGroup) -> None:
    """Every rank gets its dp index's shard; one result per dp index comes back, the replica leader's."""
    s = group.sharding
    shards = [{"dp": d, "rows": list(range(3 * d, 3 * d + 3))} for d in range(s.axis_size("data_parallel"))]
    results = group.call(ProbeWorker.take_shard, shards, step=5)
    assert results == [{"rank": leader, "shard": shards[d], "step": 5} for d, leader in enumerate(s.dp_leaders())]
    assert group.call(ProbeWorker.get_last_shard) == [shards[s.dp_index(r)] for r in range(s.world_size)]


def test_call_sharded_rejects_wrong_shard_count(group: WorkerGroup) -> None:
    """A @sharded call needs one shard per dp index."""
    with pytest.raises(ValueError, match=r"'shards' must have 2 entries \(one per data_parallel index\): got 3"):
        group.call(ProbeWorker.take_shard, [1, 2, 3], step=0)


def test_call_sharded_rejects_a_call_without_shards(group: WorkerGroup) -> None:
    """A @sharded method called with no shards says how to call it."""
    with pytest.raises(TypeError, match=r"take_shard is @sharded: call it as group.call\(\.\.\., shards, \.\.\.\) with one shard per dp index"):
        group.call(ProbeWorker.take_shard, step=0)


def test_call_rejects_a_method_name_string(group: WorkerGroup) -> None:
    """A method is passed by reference: its name as a string is refused, with the corrected call shown."""
    with pytest.raises(TypeError, match=r"'method' must be a worker method, not its name: got 'whoami'; pass the function, e\.g\. group\.call\(MyWorker\.whoami, \.\.\.\)"):
        group.call("whoami")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'method' must be a worker method, not its name: got 'nap'"):
        group.submit("nap", 1.0)  # type: ignore[arg-type]


def test_call_rejects_an_undeclared_method(group: WorkerGroup) -> None:
    """A method without @on_all_ranks or @sharded cannot be called through a group (nor submitted)."""
    with pytest.raises(TypeError, match=r"'method' must be declared with @on_all_ranks or @sharded where it is defined: got ProbeWorker\.undeclared without one"):
        group.call(ProbeWorker.undeclared)
    with pytest.raises(TypeError, match=r"got ProbeWorker\.undeclared without one"):
        group.submit(ProbeWorker.undeclared)


def test_call_rejects_a_method_of_another_class(group: WorkerGroup) -> None:
    """A declared method of another worker class is refused, even when ProbeWorker has a method of that name."""
    with pytest.raises(ValueError, match=r"'method' must be a declared method of ProbeWorker: got OtherWorker\.whoami"):
        group.call(OtherWorker.whoami)
    with pytest.raises(ValueError, match=r"'method' must be a declared method of ProbeWorker: got OtherWorker\.elsewhere"):
        group.call(OtherWorker.elsewhere)
    with pytest.raises(ValueError, match=r"'method' must be a declared method of ProbeWorker: got OtherWorker\.whoami"):
        group.submit(OtherWorker.whoami)
    assert group.call(ProbeWorker.whoami)[0]["rank"] == 0  # refused before anything was sent: the group still works


def test_submit_rejects_a_sharded_method(group: WorkerGroup) -> None:
    """submit starts an @on_all_ranks method; a @sharded one must go through call, with its shards."""
    with pytest.raises(TypeError, match=r"'method' must be declared @on_all_ranks to be submitted: take_shard is @sharded"):
        group.submit(ProbeWorker.take_shard, [1, 2], step=0)


def test_call_accepts_a_declared_method_of_a_base_class(group: WorkerGroup) -> None:
    """A declared method inherited from a base class is called by the base's reference (Worker.process_id)."""
    pids = group.call(Worker.process_id)
    assert len(set(pids)) == group.world_size and os.getpid() not in pids


def test_dispatch_of_reads_the_declaration() -> None:
    """dispatch_of gives the declared dispatch, and refuses a name or an undeclared callable."""
    assert dispatch_of(ProbeWorker.whoami) == "on_all_ranks"
    assert dispatch_of(ProbeWorker.take_shard) == "sharded"
    with pytest.raises(TypeError, match=r"'method' must be a worker method, not its name: got 'whoami'"):
        dispatch_of("whoami")
    with pytest.raises(TypeError, match=r"got ProbeWorker\.undeclared without one"):
        dispatch_of(ProbeWorker.undeclared)


# ---------------------------------------------------------------- broadcast


def test_broadcast_from_leader_delivers_identical_bytes(group: WorkerGroup) -> None:
    """Every rank of every replica group ends with the leader's tensors, byte for byte, jagged ones still jagged."""
    expected = canonical(sample_tensors())
    reports = group.call(ProbeWorker.broadcast_probe)
    for r, report in enumerate(reports):
        assert list(report["tensors"]) == list(expected), f"rank {r}: names or order differ"
        for name, value in expected.items():
            assert report["tensors"][name] == value, f"rank {r}: {name!r} differs"
        assert report["jagged"] == ["jagged_bf16", "jagged_bool", "jagged_ids"]


def test_broadcast_tensors_never_pickles_payload(group: WorkerGroup) -> None:
    """The only pickled message is a descriptor far smaller than the 1 MiB payload; each tensor goes in one broadcast."""
    data = sample_tensors()
    wires = [w for t in data.values() for w in ((t.values(), t.offsets()) if is_jagged(t) else (t,)) if w.numel()]
    payload = sum(len(_bytes(w)) for w in wires)
    for r, report in enumerate(group.call(ProbeWorker.broadcast_probe)):
        assert len(report["descriptor_sizes"]) == 1, f"rank {r}"
        if group.sharding.is_replica_leader(r):
            assert report["descriptor_sizes"][0] < 4096 < payload
        # one broadcast per non-empty dense tensor, two (values, offsets) per jagged one, of its bytes
        assert report["payload_calls"] == [len(_bytes(w)) for w in wires], f"rank {r}"


def test_broadcast_tensors_fails_on_every_rank_when_source_rejects_data(group: WorkerGroup) -> None:
    """A source holding a non-tensor raises TypeError, and its receivers are told and raise too instead of hanging."""
    with pytest.raises(WorkerError, match=r"rank 0 \(.*\) raised in 'broadcast_non_tensor': TypeError: 'data\['ids'\]' must be a torch.Tensor: got list \[4 of 4 ranks failed") as info:
        group.call(ProbeWorker.broadcast_non_tensor)
    assert isinstance(info.value.__cause__, TypeError)
    assert group.call(ProbeWorker.replica_sum)  # the process groups are still in step


def test_broadcast_tensors_rejects_data_on_non_source(group: WorkerGroup) -> None:
    """A rank other than the source that passes data gets ValueError before anything is sent."""
    with pytest.raises(WorkerError, match=r"ValueError: 'data' must be None on every rank but the source \(\d\): got dict on rank \d; pass data only on the source \[2 of 4 ranks failed"):
        group.call(ProbeWorker.broadcast_from_non_leader)


def test_describe_lists_layout_dtype_and_shape() -> None:
    """describe names every tensor in order with its layout, dtype and (values') shape, and never its data."""
    descriptor = describe(sample_tensors())
    assert [d.name for d in descriptor] == list(sample_tensors())
    by_name = {d.name: d for d in descriptor}
    assert by_name["bf16"] == ("bf16", "dense", torch.bfloat16, (5, 3), None, None, None)
    assert by_name["jagged_ids"] == ("jagged_ids", "jagged", torch.int64, (13,), 5, torch.int64, 1)
    assert len(pickle.dumps(descriptor)) < 4096


def test_describe_rejects_non_tensor_values() -> None:
    """describe takes a dict of str -> tensor; strided nested tensors are refused with the jagged rebuild shown."""
    with pytest.raises(TypeError, match=r"'data\['x'\]' must be a torch.Tensor: got int"):
        describe({"x": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"'data' must be a dict of str -> torch.Tensor on the source rank: got list"):
        describe([torch.zeros(1)])  # type: ignore[arg-type]
    with warnings.catch_warnings():  # torch warns about strided nested tensors once per process
        warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage", category=UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match=r"must be dense or a torch.jagged nested tensor: got layout torch.strided"):
        describe({"rows": strided})


# ---------------------------------------------------------------- failures


def test_call_raises_worker_error_naming_lowest_failed_rank(group: WorkerGroup) -> None:
    """Several failing ranks give ONE WorkerError naming the lowest, its coords, the count and the remote traceback."""
    s = group.sharding
    with pytest.raises(WorkerError, match=r"rank 1 \(.*\) raised in 'explode_on': ValueError: boom on rank 1 \[2 of 4 ranks failed") as info:
        group.call(ProbeWorker.explode_on, [1, 3])
    error = info.value
    assert error.rank == 1 and error.failed_ranks == (1, 3) and error.method == "explode_on"
    assert error.coords == s.coords(1)
    assert "raise ValueError(f\"boom on rank {self.rank}\")" in error.remote_traceback
    assert "--- remote traceback of rank 1 ---" in str(error)
    assert group.call(ProbeWorker.explode_on, []) == [0, 1, 2, 3]  # the group is still usable


def test_collect_raises_timeout_naming_slow_ranks(group: WorkerGroup) -> None:
    """A call that outlives its timeout raises WorkerTimeoutError naming the lowest running rank, promptly."""
    refs = group.submit(ProbeWorker.nap, 1.0)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"rank 0 \(.*\) did not finish 'nap' within 0.3 s \[4 of 4 ranks still running"):
        group.collect(refs, ProbeWorker.nap, timeout_s=0.3)
    assert time.monotonic() - start < 1.0
    assert group.collect(refs, ProbeWorker.nap) == [0, 1, 2, 3]  # the naps still finish, and the group is still usable


def _wait_until_dead(actor: Any, *, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=2.0)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"actor still alive {limit_s} s after ray.kill")


def test_call_reports_killed_actor_within_bound(small_group: WorkerGroup) -> None:
    """A killed actor's rank is named by a WorkerError within a bounded time, and shutdown still completes."""
    ray.kill(small_group.actors[1], no_restart=True)
    _wait_until_dead(small_group.actors[1])  # ray.kill is asynchronous: a call racing it may still succeed
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(.*data_parallel=1.*\) died during 'whoami': its actor is dead \[1 of 2 ranks failed") as info:
        small_group.call(ProbeWorker.whoami)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and info.value.remote_traceback == ""
    small_group.shutdown()  # the dead rank's destroy call fails; shutdown still completes
    assert small_group.closed


def test_a_replica_group_times_out_after_the_groups_timeout(ray_cluster: None) -> None:
    """A replica group (TP=2 here) has the process-group timeout the group was built with: a non-leader waiting
    in a broadcast its leader never joins fails after pg_timeout_s (3 s), not torch's default for a new group
    (30 min on gloo)."""
    with WorkerGroup(
        ProbeWorker, NamedSharding({"tensor_parallel": 2}), backend="gloo", num_cpus_per_worker=CPUS,
        timeout_s=30, pg_timeout_s=3,
    ) as wg:
        leader, other = wg.call(ProbeWorker.broadcast_without_leader)
    assert leader == 0.0 and 2.5 < other < 20.0, other


# ---------------------------------------------------------------- shutdown and misuse


def test_shutdown_twice_is_noop(ray_cluster: None) -> None:
    """shutdown kills the actors, a second shutdown does nothing, and later calls are refused (a one-rank group with env)."""
    wg = WorkerGroup(ProbeWorker, NamedSharding({}), num_cpus_per_worker=CPUS, env={"WG_TEST_FLAG": "on"})
    try:
        assert wg.call(ProbeWorker.whoami)[0]["env"] == "on"  # merged with the session's env (the actor imports this module)
        assert wg.call(ProbeWorker.take_shard, ["only"], step=1) == [{"rank": 0, "shard": "only", "step": 1}]
        (report,) = wg.call(ProbeWorker.broadcast_probe)  # a replica group of one: the leader keeps its tensors, nothing is sent
        assert report["tensors"] == canonical(sample_tensors())
        assert report["descriptor_sizes"] == [] and report["payload_calls"] == []
    finally:
        wg.shutdown()
    actor = wg.actors[0]
    wg.shutdown()
    assert wg.closed
    with pytest.raises(RuntimeError, match=r"is shut down: build a new one"):
        wg.call(ProbeWorker.whoami)
    with pytest.raises(RayActorError, match=r"(?i)actor"):
        ray.get(actor.whoami.remote(), timeout=30)


@pytest.mark.parametrize(
    "value, literal",
    [
        (None, True), (3, True), (2.5, True), (True, True), ("grpo", True), (b"x" * 1024, True),
        (("input_ids", "token_mask"), True), (frozenset({"a", "b"}), True), (list(range(64)), True),
        ("x" * 1025, False), (list(range(65)), False), ((("nested",),), False), ({"a": 1}, False),
        (torch.zeros(3), False),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_an_argument_is_put_once_only_when_several_ranks_receive_it_and_it_is_not_a_small_literal(
    ray_cluster: None, value: Any, literal: bool
) -> None:
    """Law of ``_shared``: a value for one rank, or a small literal, travels as itself; anything else that
    several ranks receive becomes one object-store ref holding it; a ref passes through."""
    from shell.worker_group import _shared

    assert _shared(value, 1) is value
    shared = _shared(value, 2)
    if literal:
        assert shared is value
    else:
        assert isinstance(shared, ray.ObjectRef)
        got = ray.get(shared)
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
        assert _shared(shared, 2) is shared


def test_worker_group_rejects_non_worker_class() -> None:
    """WorkerGroup takes a Worker subclass and a str role; nccl without GPUs and unknown backends are refused before any
    actor starts."""
    sharding = NamedSharding({"data_parallel": 2})
    with pytest.raises(TypeError, match=r"'worker_cls' must be a subclass of shell.worker.Worker: got dict"):
        WorkerGroup(dict, sharding)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'num_gpus_per_worker' must be > 0 for backend 'nccl'"):
        WorkerGroup(ProbeWorker, sharding, backend="nccl")
    with pytest.raises(ValueError, match=r"'backend' must be one of \['gloo', 'nccl', 'auto'\]: got 'mpi'"):
        WorkerGroup(ProbeWorker, sharding, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'role' must be a str: got int"):
        WorkerGroup(ProbeWorker, sharding, role=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("per_rank", ["whole", 0.6, 0.5])
def test_worker_group_refuses_more_gpus_than_the_cluster_has(ray_cluster: None, per_rank: Any) -> None:
    """A group asking for more GPUs than the Ray cluster has fails at once naming both counts, instead of waiting
    for GPUs until its setup timeout; ranks of less than a GPU count as Ray places them (two of 0.6 take two GPUs,
    two of 0.5 one)."""
    have = ray.cluster_resources().get("GPU", 0.0)
    per_worker = have + 1 if per_rank == "whole" else per_rank
    need = {"whole": 2 * (have + 1), 0.6: 2, 0.5: 1}[per_rank]
    if have >= need:
        pytest.skip(f"this Ray cluster has {have:g} GPUs: the refusal needs fewer than {need:g}")
    start = time.monotonic()
    with pytest.raises(GPUShortageError, match=rf"the group's 2 ranks need {need:g} GPUs, the Ray cluster has {have:g}") as raised:
        WorkerGroup(ProbeWorker, NamedSharding({"data_parallel": 2}), num_gpus_per_worker=per_worker, setup_timeout_s=60)
    assert (raised.value.ranks, raised.value.need, raised.value.have) == (2, need, have)
    assert isinstance(raised.value, ValueError)
    assert time.monotonic() - start < 5.0


def test_worker_group_rank_options_place_each_rank(ray_cluster: None) -> None:
    """Each rank gets its own extra Ray options: pinned by node affinity (``spread``) to the session's one
    node, every rank reports that node."""
    from shell.config_schema import NodePlacement
    from shell.node_placement import driver_node, rank_options

    options = rank_options(NodePlacement.spread, None, 2)
    with WorkerGroup(ProbeWorker, NamedSharding({"data_parallel": 2}), num_cpus_per_worker=CPUS, rank_options=options) as wg:
        assert wg.call(Worker.node_id) == [driver_node()] * 2


def test_node_of_loads_nothing_into_the_actor_it_asks(ray_cluster: None) -> None:
    """``node_of`` answers the actor's node without making it import this project or torch: the run asks it of
    TransferQueue's object-store index, a process that never loads them otherwise."""
    from shell.node_placement import driver_node, node_of

    @ray.remote(num_cpus=0)
    class Bare:  # defined here, so Ray sends it by value: its process imports no test module
        def modules(self) -> list[str]:
            import sys

            return sorted(sys.modules)

    bare = Bare.remote()  # type: ignore[attr-defined]
    try:
        before = set(ray.get(bare.modules.remote()))
        assert "torch" not in before
        assert node_of(bare) == driver_node()
        loaded = set(ray.get(bare.modules.remote())) - before
        assert not {m for m in loaded if m.split(".")[0] in {"shell", "core", "adapters", "torch"}}, sorted(loaded)
    finally:
        ray.kill(bare)


def test_worker_group_rejects_bad_rank_options() -> None:
    """rank_options: one mapping per rank, never one of the group's own options; checked before any actor starts."""
    sharding = NamedSharding({"data_parallel": 2})
    with pytest.raises(ValueError, match=r"'rank_options' must have 2 entries \(one per rank\): got 1"):
        WorkerGroup(ProbeWorker, sharding, rank_options=[{}])
    with pytest.raises(TypeError, match=r"'rank_options' entries must be mappings: got str at rank 1"):
        WorkerGroup(ProbeWorker, sharding, rank_options=[{}, "spread"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"'rank_options' must be a sequence of mappings, one per rank: got dict"):
        WorkerGroup(ProbeWorker, sharding, rank_options={"resources": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'rank_options' must not set \['num_cpus'\] .*: got them at rank 0"):
        WorkerGroup(ProbeWorker, sharding, rank_options=[{"num_cpus": 2}, {}])


def test_worker_rank_before_setup_raises() -> None:
    """A worker has no rank until its group sets it up (e.g. inside __init__)."""
    with pytest.raises(RuntimeError, match=r"this worker has no rank yet"):
        _ = ProbeWorker().rank
