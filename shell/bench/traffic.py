"""Bytes between the nodes of a cluster, read off the kernel's per-socket TCP counters.

Every connection between two processes of a Ray cluster is a TCP socket
(object transfers between raylets, actor calls, TransferQueue's ZMQ, gloo),
and Linux keeps, per socket, the bytes it sent and received
(``tcpi_bytes_sent`` / ``tcpi_bytes_received`` of ``TCP_INFO``), which
``ss -tinp`` prints with the owning process. :func:`snapshot` takes them all;
:func:`node_traffic` charges each socket whose two ends belong to processes
of different nodes to its owner's node, as the difference between two
snapshots. On one machine every node shares the loopback device, so device
counters (``/proc/net/dev``) cannot tell nodes apart; the sockets can.

What it misses: a socket opened and closed between two snapshots (Ray's,
TransferQueue's and gloo's connections live as long as the processes), and
shared memory within a node, which is not traffic between nodes.

Invariant: :func:`node_traffic` is pure: the same snapshots and owners give the same bytes.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping

import attrs

_PID = re.compile(r"pid=(\d+)")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


@attrs.frozen
class SocketStat:
    """One TCP socket: its two addresses (``host:port``), the pids that hold it, and its byte counters."""

    local: str
    peer: str
    pids: tuple[int, ...]
    sent: int
    received: int


Traffic = dict[str, tuple[int, int]]
"""Owner (a node) -> (bytes sent to other owners, bytes received from them)."""


def parse_ss(text: str) -> list[SocketStat]:
    """The sockets of ``ss -tinpH`` output: a line per socket (state, queues, addresses, users) and an
    indented line of its TCP info (counters absent when zero).

    Example:
        >>> parse_ss('ESTAB 0 0 127.0.0.1:5 127.0.0.1:6 users:(("python",pid=7,fd=3))\\n\\t cubic bytes_sent:10 bytes_received:4')
        [SocketStat(local='127.0.0.1:5', peer='127.0.0.1:6', pids=(7,), sent=10, received=4)]
    """
    out: list[SocketStat] = []
    current: dict | None = None

    def close() -> None:
        if current is not None:
            out.append(SocketStat(**current))

    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            if current is not None:
                sent, received = _SENT.search(line), _RECEIVED.search(line)
                current["sent"] += int(sent.group(1)) if sent else 0
                current["received"] += int(received.group(1)) if received else 0
            continue
        close()
        parts = line.split()
        if len(parts) < 5:
            current = None
            continue
        users = " ".join(parts[5:])
        current = {
            "local": parts[3], "peer": parts[4], "pids": tuple(int(p) for p in _PID.findall(users)),
            "sent": 0, "received": 0,
        }
    close()
    return out


def snapshot() -> list[SocketStat]:
    """Every TCP socket of this machine with its counters and owners, now (``ss -tinpH``)."""
    done = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True, timeout=30)
    return parse_ss(done.stdout)


def node_traffic(before: Iterable[SocketStat], after: Iterable[SocketStat], owners: Mapping[int, str]) -> Traffic:
    """Bytes each owner sent to and received from other owners between the two snapshots.

    A socket counts when one of its pids has an owner and the socket at its
    peer address is held by a pid of another owner. Its bytes are its
    counters in ``after`` minus those in ``before`` (a socket new in
    ``after``, or whose counters went down because the address pair was
    reused, counts from zero). Each connection is seen from both ends, so
    what one owner sent is what the other received.

    Args:
        before: a :func:`snapshot` (or :func:`parse_ss` result) taken first.
        after: one taken later.
        owners: pid -> owner (e.g. the node a process belongs to); other pids are not counted.

    Example:
        >>> a = SocketStat("h:1", "h:2", (10,), 0, 0)
        >>> b = SocketStat("h:2", "h:1", (20,), 0, 0)
        >>> node_traffic([a, b], [attrs.evolve(a, sent=5), attrs.evolve(b, received=5)], {10: "n1", 20: "n2"})
        {'n1': (5, 0), 'n2': (0, 5)}
    """
    after = list(after)

    def owner(stat: SocketStat) -> str | None:
        return next((owners[p] for p in stat.pids if p in owners), None)

    at = {s.local: owner(s) for s in after}
    base = {(s.local, s.peer): s for s in before}
    totals: dict[str, list[int]] = {}
    for stat in after:
        mine, theirs = owner(stat), at.get(stat.peer)
        if mine is None or theirs is None or mine == theirs:
            continue
        old = base.get((stat.local, stat.peer))
        sent, received = stat.sent, stat.received
        if old is not None and old.sent <= stat.sent and old.received <= stat.received:
            sent, received = sent - old.sent, received - old.received
        total = totals.setdefault(mine, [0, 0])
        total[0] += sent
        total[1] += received
    return {name: (s, r) for name, (s, r) in sorted(totals.items())}
