"""The scale bench's pure parts: parsing ``ss`` output, bytes between nodes, paired summaries, the crossover, options."""

from __future__ import annotations

import statistics
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shell.bench.nodes import NodesConfig
from shell.bench.scale import (
    ScaleConfig, crossover, leave_out, median_traffic, paired_summary, parse_rows, server_pids, sweep_batch, sweep_table,
)
from shell.bench.report import Report
from shell.bench.traffic import SocketStat, node_traffic, parse_ss
from tests.property.strategies import positive_times, socket_pairs

SS_SAMPLE = """\
ESTAB 0 0 192.0.2.2:41953 192.0.2.2:53942 users:(("gcs_server",pid=11,fd=4))
\t cubic wscale:10,10 rto:208 bytes_sent:1500 bytes_acked:1500 bytes_received:320 segs_out:9
ESTAB 0 0 192.0.2.2:53942 192.0.2.2:41953 users:(("raylet",pid=22,fd=7),("raylet",pid=23,fd=7))
\t cubic wscale:10,10 rto:208 bytes_received:1500 segs_out:4
CLOSE-WAIT 1 0 [::ffff:127.0.0.1]:5 [::ffff:127.0.0.1]:6
\t cubic rto:208
"""


def test_parse_ss_reads_addresses_owners_and_counters() -> None:
    """Each socket's addresses, every pid holding it, and its byte counters (0 where ss prints none)."""
    assert parse_ss(SS_SAMPLE) == [
        SocketStat("192.0.2.2:41953", "192.0.2.2:53942", (11,), 1500, 320),
        SocketStat("192.0.2.2:53942", "192.0.2.2:41953", (22, 23), 0, 1500),
        SocketStat("[::ffff:127.0.0.1]:5", "[::ffff:127.0.0.1]:6", (), 0, 0),
    ]
    assert parse_ss("") == []


@given(socket_pairs())
def test_node_traffic_what_one_node_sends_the_others_receive(case: tuple[list[Any], list[Any], dict[int, str]]) -> None:
    """Summed over nodes, bytes sent equal bytes received (each connection is seen from both ends)."""
    before, after, owners = case
    traffic = node_traffic(before, after, owners)
    assert sum(s for s, _ in traffic.values()) == sum(r for _, r in traffic.values())
    assert all(s >= 0 and r >= 0 for s, r in traffic.values())
    assert set(traffic) <= set(owners.values())


@given(socket_pairs())
def test_node_traffic_matches_a_per_connection_reference(case: tuple[list[Any], list[Any], dict[int, str]]) -> None:
    """Equal to a plain loop over connections: counter increase of each end whose peer is another node's."""
    before, after, owners = case
    old = {(s.local, s.peer): s for s in before}
    holder = {s.local: owners.get(s.pids[0]) for s in after}
    expected: dict[str, list[int]] = {}
    for s in after:
        mine, theirs = owners.get(s.pids[0]), holder.get(s.peer)
        if mine is None or theirs is None or mine == theirs:
            continue
        base = old.get((s.local, s.peer), SocketStat(s.local, s.peer, s.pids, 0, 0))
        total = expected.setdefault(mine, [0, 0])
        total[0] += s.sent - base.sent
        total[1] += s.received - base.received
    assert node_traffic(before, after, owners) == {k: tuple(v) for k, v in sorted(expected.items())}


def test_node_traffic_ignores_a_node_talking_to_itself_and_unknown_pids() -> None:
    """Sockets within one node, or with an unowned end, carry no traffic between nodes."""
    a, b = SocketStat("h:1", "h:2", (1,), 50, 60), SocketStat("h:2", "h:1", (2,), 60, 50)
    assert node_traffic([], [a, b], {1: "head", 2: "head"}) == {}
    assert node_traffic([], [a, b], {1: "head"}) == {}
    assert node_traffic([], [a, b], {1: "head", 2: "worker 1"}) == {"head": (50, 60), "worker 1": (60, 50)}


def _connection(a: tuple[str, int], b: tuple[str, int], a_sent: int, b_sent: int) -> list[SocketStat]:
    """Both ends of one TCP connection between address/pid ``a`` and ``b``, each having sent its bytes."""
    return [SocketStat(a[0], b[0], (a[1],), a_sent, b_sent), SocketStat(b[0], a[0], (b[1],), b_sent, a_sent)]


@given(st.lists(st.integers(0, 10**6), min_size=4, max_size=4))
def test_leave_out_drops_exactly_the_left_out_processes_sockets(sizes: list[int]) -> None:
    """Partition law: the head's bytes with its GCS left out are those of its other processes' connections to the
    worker nodes; the GCS's own connection to a worker node makes up the rest of the node's bytes."""
    to_worker, from_worker, gcs_to_worker, driver_to_gcs = sizes
    owners = {10: "head", 11: "head", 20: "worker 1"}  # 10: the driver, 11: the head's GCS, 20: a rank
    after = [
        *_connection(("h:1", 10), ("w:1", 20), to_worker, from_worker),
        *_connection(("h:2", 11), ("w:2", 20), gcs_to_worker, 0),
        *_connection(("h:3", 10), ("h:4", 11), driver_to_gcs, 0),
    ]
    quiet = leave_out(owners, [11])
    assert quiet == {10: "head", 20: "worker 1"} and owners[11] == "head"  # the input is not changed
    assert node_traffic([], after, quiet).get("head", (0, 0)) == (to_worker, from_worker)
    assert node_traffic([], after, owners).get("head", (0, 0)) == (to_worker + gcs_to_worker, from_worker)


def test_leave_out_refuses_to_leave_out_nothing_or_an_unknown_process() -> None:
    """Leaving out no process, or one the owners do not hold, would make the "without" column silently the node's."""
    owners = {10: "head", 11: "head"}
    with pytest.raises(ValueError, match="pids is empty"):
        leave_out(owners, [])
    with pytest.raises(ValueError, match=r"pids \[12\] are not among the owners' processes \[10, 11\]"):
        leave_out(owners, [11, 12])


def test_server_pids_reads_the_named_processes_and_refuses_a_node_without_one() -> None:
    """The GCS's pids come from the head's process table; a head without a live GCS process is an error naming what it runs."""
    def info(pid: int | None) -> SimpleNamespace:
        return SimpleNamespace(process=None if pid is None else SimpleNamespace(pid=pid))

    table = {"gcs_server": [info(7), info(9)], "raylet": [info(8)]}
    assert server_pids(table) == {7, 9}
    assert server_pids(table, "raylet") == {8}
    with pytest.raises(ValueError, match=r"no 'gcs_server' process; it runs \['raylet'\]"):
        server_pids({"raylet": [info(8)]})
    with pytest.raises(ValueError, match="no 'gcs_server' process"):
        server_pids({"gcs_server": [info(None)]})


def test_sweep_table_gives_the_drivers_node_bytes_with_and_without_its_gcs(capsys: pytest.CaptureFixture[str]) -> None:
    """One row per N and path, with the node's bytes without its GCS beside all of them, and the crossover line."""
    report = Report(markdown=True)
    result = {"step_s": 1.0, "ratio": 0.9, "driver_bytes": 4, "driver_node_bytes": 3000, "driver_node_bytes_but_gcs": 1200,
              "peak_rss_mib": 400.0, "rss_growth_mib": 0.5}
    results = [{**result, "rows": n, "path": path} for n in (256, 1024) for path in ("legacy", "data plane")]
    sweep_table(ScaleConfig(rows=(256, 1024), repeats=3), results, report)
    report.finish()
    text = capsys.readouterr().out
    assert "the same but the GCS's" in text and "median of 3 paired repeats" in text
    assert text.count("| 3,000 | 1,200 |") == 4, text
    assert "data plane faster at every N (already at N = 256)" in text


@given(positive_times, st.data())
def test_paired_summary_medians_and_ratio(legacy: list[float], data: st.DataObject) -> None:
    """The medians of each path, and the median of per-pair ratios (1 when the paths are equal)."""
    plane = data.draw(st.lists(st.floats(0.01, 100.0), min_size=len(legacy), max_size=len(legacy)))
    lt, pt, ratio = paired_summary(legacy, plane)
    assert (lt, pt) == (statistics.median(legacy), statistics.median(plane))
    assert ratio == statistics.median([p / q for p, q in zip(plane, legacy)])
    assert paired_summary(legacy, legacy)[2] == 1.0


def test_paired_summary_rejects_unpaired_or_zero_times() -> None:
    """Unpaired lists or a zero legacy time raise naming the argument."""
    with pytest.raises(ValueError, match="'legacy' and 'plane' must be paired"):
        paired_summary([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="'legacy' times must be > 0"):
        paired_summary([0.0], [1.0])


def test_crossover_names_the_first_n_from_which_the_data_plane_stays_faster() -> None:
    """Faster from the first N after which every ratio is < 1; all faster; never faster."""
    assert crossover([256, 1024, 4096], [1.1, 0.9, 0.8]) == "data plane faster from N = 1024 on"
    assert crossover([256, 1024, 4096], [0.9, 1.1, 0.8]) == "data plane faster from N = 4096 on"
    assert crossover([256, 1024], [0.9, 0.8]) == "data plane faster at every N (already at N = 256)"
    assert crossover([256, 1024], [1.2, 1.1]) == "data plane not faster than legacy at N = 1024"
    with pytest.raises(ValueError, match="'rows' and 'ratios' must have the same length"):
        crossover([256], [])


def test_median_traffic_fills_absent_nodes_with_zero() -> None:
    """Per node, the median over steps of sent and received; a node absent from a step counts 0."""
    steps = [{"head": (10, 1)}, {"head": (30, 3), "worker 1": (5, 5)}, {"head": (20, 2)}]
    assert median_traffic(steps, ["head", "worker 1"]) == {"head": (20, 2), "worker 1": (0, 0)}


@given(st.lists(st.integers(1, 5000).map(lambda n: 2 * n), min_size=1, max_size=5, unique=True))
def test_parse_rows_round_trip(rows: list[int]) -> None:
    """Comma-separated even counts parse to the sorted tuple, in any order and spacing."""
    assert parse_rows(" , ".join(str(r) for r in rows)) == tuple(sorted(rows))


@pytest.mark.parametrize("text", ["", "abc", "256,257", "0", "256,256", "-2"])
def test_parse_rows_rejects_bad_lists(text: str) -> None:
    """Not ints, odd or below 2, or repeated counts name --rows."""
    with pytest.raises(ValueError, match="'--rows' must"):
        parse_rows(text)


def test_sweep_batch_is_seeded_lognormal_and_clipped() -> None:
    """The same (n, seed) gives the same rows; lengths are clipped to max_len with median near 700; the
    mask covers the response tokens of each row."""
    a, b = sweep_batch(512, 3, 1024), sweep_batch(512, 3, 1024)
    assert all((a[k] == b[k]).all() for k in a)
    lengths = a["lengths"]
    assert int(lengths.max()) <= 1024 and int(lengths.min()) >= 16
    assert 550 <= float(lengths.median()) <= 850
    assert (a["token_mask"].sum(1) == (lengths - 4).clamp(min=0)).all()
    assert a["input_ids"].shape == (512, int(lengths.max()))


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"nodes": 0}, "--nodes"), ({"repeats": 0}, "--repeats"), ({"steps": -1}, "--steps"),
    ({"max_len": 700}, "--max-len"), ({"num_cpus": 1}, "--num-cpus"), ({"rows": (3,)}, "--rows"),
])
def test_scale_config_rejects_bad_sizes(kwargs: dict[str, Any], option: str) -> None:
    """Each bad size names its option."""
    with pytest.raises(ValueError, match=f"'{option}' must"):
        ScaleConfig(**kwargs)


def test_scale_config_needs_something_to_measure() -> None:
    """No GRPO steps and no rows is refused; the defaults are accepted."""
    with pytest.raises(ValueError, match="'--steps' and '--rows' cannot both be empty"):
        ScaleConfig(steps=0, rows=())
    assert ScaleConfig().rows == (256, 1024, 4096)


def test_nodes_config_rejects_a_small_object_store() -> None:
    """An object store under Ray's 75 MiB minimum, or no node, is refused naming the field."""
    with pytest.raises(ValueError, match="'object_store_mb' must be an int >= 75"):
        NodesConfig(object_store_mb=10)
    with pytest.raises(ValueError, match="'nodes' must be an int >= 1"):
        NodesConfig(nodes=0)
