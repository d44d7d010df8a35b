"""Observability and integrity for any data-plane client: ``MeteredClient`` wraps a ``DataPlaneClient``.

Metering records, per operation (``put``, ``get``, ``clear``), the number of
calls, wall time (total and max, ms), keys and tensor payload bytes, plus the
bytes and keys still outstanding per partition (put and not yet cleared).
``snapshot()`` is cumulative; ``step_delta()`` gives the activity since the
previous ``step_delta()`` call, for per-step logging.

Outstanding bytes need a table of each ``(partition, field, key)`` this client
put and has not cleared, so the table lives as long as the rows do. A client
whose rows another process clears (a rollout engine's, a policy rank's: the
driver clears a step's keys) would only ever add to it; such a client is
built with ``track_outstanding=False`` and keeps no per-key state. The
outstanding totals are kept up to date as puts and clears settle, so a
snapshot costs O(partitions), not a pass over every row held.

With ``verify_integrity=True`` every put also computes, for each field ``f``
it writes, one 64-bit content digest per row (``core.integrity``: XXH3-64 of
the row's bytes) and stores it in the key's reserved tag ``__digest__.f``
(tags merge per key, new values win, so a later put of ``f`` under a key
replaces exactly that key's digest of ``f``, whichever process makes it).
The digests go through the inner client's ``put_with_reserved_tags``
(:class:`adapters.store_port.ReservedTagPutClient`): a plain ``put`` rejects
reserved tag names, so no caller can forge a digest.
Every get reads the digests back with the data, in one lookup when the inner
client is a :class:`adapters.store_port.TaggedGetClient` (every adapter here is;
on TransferQueue's ``RayObjectStore`` backend the index keeps them by key, and
the get needs no lookup) and with a ``describe`` otherwise, and raises
:class:`IntegrityError`, naming the keys and fields, when a row's content no
longer matches. The digests cover dtype, shape and every bit, so a changed
element, a truncated row, swapped rows, a permutation inside a row or a
constant row are all caught, and equal data never raises. A get needs no
state of the client that wrote: any process's ``MeteredClient`` verifies
what any other wrote.

Digests live in tags rather than in extra columns because a store like
TransferQueue pays per row and per field: one more column costs a get about
a quarter of its time, while the tags come with the meta lookup a get makes
anyway.

Invariant: the wrapper never changes what the inner client stores or returns
for user fields and user tags; the reserved digest tags are added on put and
hidden from receipts and ``describe``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from tensordict import TensorDict

from adapters.rows import read_columns_of
from adapters.store_port import (
    RESERVED_TAG_PREFIX,
    DataPlaneClient,
    Keys,
    ReservedTagPutClient,
    SeqLens,
    TagColumns,
    Tags,
    TaggedGetClient,
    validate_get,
)
from core.frozen import FrozenDict
from core.integrity import DigestMatrix, digest_matrix
from core.meta import KVBatchMeta

DIGEST_PREFIX = RESERVED_TAG_PREFIX
"""Reserved prefix: the tag ``__digest__.f`` of a key holds the digest of its row of field ``f``."""
OPS = ("put", "get", "clear")


class IntegrityError(RuntimeError):
    """Data read back from the store differs from what was written.

    Attributes:
        partition_id: the partition read.
        keys: the keys whose rows differ.
        fields: the fields that differ.
    """

    def __init__(self, partition_id: str, keys: Sequence[str], fields: Sequence[str]) -> None:
        self.partition_id = partition_id
        self.keys = tuple(keys)
        self.fields = tuple(fields)
        shown = list(self.keys[:5]) + (["..."] if len(self.keys) > 5 else [])
        super().__init__(
            f"integrity check failed in partition {partition_id!r}: fields {list(self.fields)} differ from what "
            f"was written for {len(self.keys)} keys {shown}"
        )


@attrs.frozen
class OpStats:
    """Counters of one operation kind."""

    calls: int = 0
    keys: int = 0
    bytes: int = 0
    total_ms: float = 0.0
    max_ms: float = 0.0


@attrs.frozen
class DataPlaneEvent:
    """One metered operation, as passed to ``on_event``."""

    op: str
    partition_id: str
    keys: int
    bytes: int
    wall_ms: float


@attrs.frozen
class DataPlaneStats:
    """A view of the counters: per-op stats and what is outstanding per partition."""

    ops: FrozenDict
    outstanding_bytes: FrozenDict
    outstanding_keys: FrozenDict

    def flat(self) -> dict[str, float]:
        """A flat dict for metrics logs: ``put_calls``, ``get_ms``, ..., ``outstanding_bytes``, ``outstanding_keys``."""
        out: dict[str, float] = {}
        for op, s in self.ops.items():
            out.update({f"{op}_calls": s.calls, f"{op}_keys": s.keys, f"{op}_bytes": s.bytes,
                        f"{op}_ms": s.total_ms, f"{op}_max_ms": s.max_ms})
        out["outstanding_bytes"] = sum(self.outstanding_bytes.values())
        out["outstanding_keys"] = sum(self.outstanding_keys.values())
        return out

    @property
    def total_ms(self) -> float:
        """Wall time over every operation."""
        return sum(s.total_ms for s in self.ops.values())

    @property
    def total_bytes(self) -> int:
        """Payload bytes moved by puts and gets."""
        return sum(s.bytes for op, s in self.ops.items() if op != "clear")


def _jagged_buffers(value: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(values, offsets, lengths)`` of a jagged nested tensor, else None.

    Reads the layout's own buffers: the public accessors (and even
    ``is_nested``) go through torch-function dispatch at 20-100 us a call,
    which would dominate the cost of metering.
    """
    offsets = getattr(value, "_offsets", None)
    if offsets is None:
        return None
    return value._values, offsets, value._lengths


def column_row_bytes(value: Any, n: int) -> np.ndarray:
    """Tensor payload bytes of each of the ``n`` rows of a column (object columns count 0).

    Example:
        >>> column_row_bytes(torch.zeros(2, 3, dtype=torch.int64), 2).tolist()
        [24, 24]
    """
    buffers = _jagged_buffers(value)
    if buffers is not None:
        values, offsets, lengths = buffers
        per_token = math.prod(values.shape[1:]) * values.element_size()
        rows = lengths if lengths is not None else offsets.diff()
        return rows.numpy().astype(np.int64) * per_token
    if isinstance(value, torch.Tensor):
        per_row = value.element_size() * (value.numel() // n if n else 0)
        return np.full(n, per_row, dtype=np.int64)
    return np.zeros(n, dtype=np.int64)


def _row_sizes(value: Any, n: int) -> int | tuple[torch.Tensor, bool, int]:
    """Bytes per row, cheaply: one int when every row has the same size, else
    ``(lengths_or_offsets, is_offsets, bytes_per_token)`` for :func:`_expand_row_sizes`."""
    buffers = _jagged_buffers(value)
    if buffers is not None:
        values, offsets, lengths = buffers
        per_token = math.prod(values.shape[1:]) * values.element_size()
        return (offsets, True, per_token) if lengths is None else (lengths, False, per_token)
    if isinstance(value, torch.Tensor):
        return value.element_size() * (value.numel() // n if n else 0)
    return 0


def column_bytes(value: Any) -> int:
    """Tensor payload bytes of a whole column (object columns count 0)."""
    buffers = _jagged_buffers(value)
    if buffers is not None:
        values, _, lengths = buffers
        if lengths is not None:
            return int(column_row_bytes(value, lengths.shape[0]).sum())
        return values.numel() * values.element_size()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


class MeteredClient:
    """A ``DataPlaneClient`` that meters every call and optionally verifies integrity.

    Args:
        inner: the client to wrap.
        on_event: called with a :class:`DataPlaneEvent` after each put, get and clear.
        verify_integrity: write per-row digests on put and check them on get.
        track_outstanding: keep the per-key table behind ``outstanding_bytes`` / ``outstanding_keys`` and the
            bytes a clear frees. Off, the client keeps no per-key state: both outstanding maps are empty and a
            clear counts 0 bytes (for a client whose rows another process clears, which would only add rows to
            the table).

    Example:
        >>> client = MeteredClient(MemoryStore(), verify_integrity=True)
        >>> meta = client.put(["a"], "p", TensorDict({"x": torch.ones(1, 3)}, batch_size=[1]))
        >>> client.snapshot().ops["put"].calls
        1
    """

    def __init__(
        self,
        inner: DataPlaneClient,
        *,
        on_event: Callable[[DataPlaneEvent], None] | None = None,
        verify_integrity: bool = False,
        track_outstanding: bool = True,
    ) -> None:
        if verify_integrity and not isinstance(inner, ReservedTagPutClient):
            raise TypeError(
                f"'inner' must be able to write the reserved digest tags (put_with_reserved_tags, see "
                f"adapters.store_port.ReservedTagPutClient) to verify integrity: got {type(inner).__name__}; "
                f"wrap an adapter of adapters/, or pass verify_integrity=False"
            )
        self.inner = inner
        self.on_event = on_event
        self.verify_integrity = verify_integrity
        self.track_outstanding = track_outstanding
        self._ops: dict[str, list[float]] = {op: [0, 0, 0, 0.0, 0.0] for op in OPS}
        self._mark: dict[str, list[float]] = {op: [0, 0, 0, 0.0, 0.0] for op in OPS}
        self._step_max: dict[str, float] = {op: 0.0 for op in OPS}
        self._row_bytes: dict[str, dict[str, dict[str, int]]] = {}  # partition -> field -> key -> bytes
        # Per partition, kept with _row_bytes as it settles: its total bytes, and the keys holding a field.
        self._held_bytes: dict[str, int] = {}
        self._held_keys: dict[str, set[str]] = {}
        self._pending: list[tuple[str, str, tuple[str, ...], list[tuple[str, Any]]]] = []  # puts/clears not yet settled

    # ------------------------------------------------------------------ port

    def put(
        self,
        keys: Keys,
        partition_id: str,
        fields: TensorDict,
        *,
        tags: Tags | None = None,
        sequence_lengths: SeqLens | None = None,
        require_stored: bool = False,
    ) -> KVBatchMeta:
        """Meter (and digest) a put; see ``DataPlaneClient.put``."""
        start = time.perf_counter()
        columns = read_columns_of(fields) if isinstance(fields, TensorDict) else {}
        n = len(keys)
        reserved = [name for name in columns if name.startswith(DIGEST_PREFIX)]
        if reserved:
            raise ValueError(f"field names starting with {DIGEST_PREFIX!r} are reserved for integrity digests: got {reserved}")
        if self.verify_integrity and columns and n and _rows_of(fields) == n:
            digests = digest_matrix([_digestible(name, v) for name, v in columns.items()])
            by_name = dict(zip([DIGEST_PREFIX + name for name in columns], digests.T.tolist()))
            receipt = self.inner.put_with_reserved_tags(  # type: ignore[attr-defined]
                keys,
                partition_id,
                fields,
                reserved_tags=TagColumns(by_name, n),  # a list per field, no mapping per key
                tags=tags,
                sequence_lengths=sequence_lengths,
                require_stored=require_stored,
            )
        else:  # the inner put checks the user tags, rejecting reserved names
            receipt = self.inner.put(
                keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, require_stored=require_stored
            )
        # Per-key accounting is deferred to the next snapshot (see _settle), keeping a put O(fields);
        # only row sizes are kept, never the payload.
        if self.track_outstanding:
            self._pending.append(("put", partition_id, tuple(keys), [(name, _row_sizes(v, n)) for name, v in columns.items()]))
        self._record("put", partition_id, n, sum(column_bytes(v) for v in columns.values()), start)
        return receipt

    def get(self, keys: Keys, partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """Meter (and verify) a get; see ``DataPlaneClient.get``."""
        start = time.perf_counter()
        if not self.verify_integrity:
            out = self.inner.get(keys, partition_id, select_fields)
            columns = read_columns_of(out)
        else:
            keys, select = validate_get(keys, partition_id, select_fields)
            names = [DIGEST_PREFIX + name for name in select]
            if isinstance(self.inner, TaggedGetClient):  # data and digests from one lookup
                out, tags = self.inner.get_with_tags(keys, partition_id, select, names)
            else:
                out = self.inner.get(keys, partition_id, select)
                tags = self.inner.describe(keys, partition_id).tags or [{}] * len(keys)
            columns = read_columns_of(out)
            stored = _stored_digests(keys, partition_id, tags, select)
            actual = digest_matrix([_digestible(name, columns[name]) for name in select])
            bad = stored != actual
            if bad.any():
                rows, cols = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
                raise IntegrityError(partition_id, [keys[i] for i in rows], [select[j] for j in cols])
        self._record("get", partition_id, len(keys), sum(column_bytes(v) for v in columns.values()), start)
        return out

    def clear(self, keys: Keys, partition_id: str) -> None:
        """Meter a clear; see ``DataPlaneClient.clear``."""
        start = time.perf_counter()
        self.inner.clear(keys, partition_id)
        if self.track_outstanding:
            self._pending.append(("clear", partition_id, tuple(keys), []))
        self._record("clear", partition_id, len(keys), 0, start)

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        """Pass-through (not metered)."""
        return self.inner.list_keys(partition_id)

    def describe(self, keys: Keys, partition_id: str) -> KVBatchMeta:
        """Pass-through without the reserved digest tags."""
        meta = self.inner.describe(keys, partition_id)
        if meta.tags is None:
            return meta
        return attrs.evolve(meta, tags=_strip_digest_tags(meta.tags))

    def close(self) -> None:
        """Close the inner client."""
        self.inner.close()

    # ------------------------------------------------------------------ metrics

    def snapshot(self) -> DataPlaneStats:
        """Cumulative counters since this client was built."""
        return self._stats(self._ops)

    def step_delta(self) -> DataPlaneStats:
        """Counters since the previous ``step_delta()`` (``max_ms`` is the max within the step).

        Outstanding bytes and keys are the current levels, not differences.
        """
        self._settle()
        delta = {
            op: [now[0] - then[0], now[1] - then[1], now[2] - then[2], now[3] - then[3], self._step_max[op]]
            for (op, now), then in zip(self._ops.items(), self._mark.values())
        }
        self._mark = {op: list(v) for op, v in self._ops.items()}
        self._step_max = {op: 0.0 for op in OPS}
        return self._stats(delta)

    def _settle(self) -> None:
        """Replay pending puts and clears into the per-(partition, field, key) byte table and the partitions' totals.

        A rewrite of a field under a key replaces its bytes; a clear frees them
        and adds them to the ``clear`` counter's bytes.
        """
        for op, partition_id, keys, sizes in self._pending:
            partition = self._row_bytes.setdefault(partition_id, {})
            held = self._held_keys.setdefault(partition_id, set())
            total = self._held_bytes.get(partition_id, 0)
            if op == "put":
                for name, rows in sizes:
                    if isinstance(rows, tuple):
                        counts, is_offsets, per_token = rows
                        per_key = ((counts.diff() if is_offsets else counts) * per_token).tolist()
                    else:
                        per_key = [rows] * len(keys)
                    table = partition.setdefault(name, {})
                    replaced = sum(size for size in map(table.get, keys) if size is not None)
                    total += sum(per_key) - replaced
                    table.update(zip(keys, per_key))
                if sizes:
                    held.update(keys)
            else:
                freed = sum(sum(map(table.pop, keys, itertools.repeat(0))) for table in partition.values())
                held.difference_update(keys)
                total -= freed
                self._ops["clear"][2] += freed
            self._held_bytes[partition_id] = total
        self._pending.clear()

    def _stats(self, ops: Mapping[str, list[float]]) -> DataPlaneStats:
        self._settle()
        return DataPlaneStats(
            ops=FrozenDict({op: OpStats(int(v[0]), int(v[1]), int(v[2]), v[3], v[4]) for op, v in ops.items()}),
            outstanding_bytes=FrozenDict(self._held_bytes),
            outstanding_keys=FrozenDict({partition: len(keys) for partition, keys in self._held_keys.items()}),
        )

    def _record(self, op: str, partition_id: str, keys: int, nbytes: int, start: float) -> None:
        wall_ms = (time.perf_counter() - start) * 1e3
        counters = self._ops[op]
        counters[0] += 1
        counters[1] += keys
        counters[2] += nbytes
        counters[3] += wall_ms
        counters[4] = max(counters[4], wall_ms)
        self._step_max[op] = max(self._step_max[op], wall_ms)
        if self.on_event is not None:
            self.on_event(DataPlaneEvent(op, partition_id, keys, nbytes, wall_ms))


def client_io(client: DataPlaneClient | None) -> dict[str, float]:
    """The store activity of ``client`` since the last call: ``{"ms", "bytes"}`` and the milliseconds of each
    operation, ``put_ms``, ``get_ms`` and ``clear_ms`` (zeros unless it is metered).

    A :class:`MeteredClient` reports its ``step_delta()``; any
    other client reports nothing measured.
    """
    delta = getattr(client, "step_delta", None)
    if delta is None:
        return {"ms": 0.0, "bytes": 0.0, **{f"{op}_ms": 0.0 for op in OPS}}
    stats = delta()
    by_op = {f"{op}_ms": float(stats.ops[op].total_ms) if op in stats.ops else 0.0 for op in OPS}
    return {"ms": float(stats.total_ms), "bytes": float(stats.total_bytes), **by_op}


def _rows_of(fields: TensorDict) -> int | None:
    return fields.batch_size[0] if len(fields.batch_size) else None


def _strip_digest_tags(tags: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in tag.items() if not k.startswith(DIGEST_PREFIX)} for tag in tags]


def _stored_digests(
    keys: Sequence[str], partition_id: str, tags: Sequence[Mapping[str, Any]], select: Sequence[str]
) -> DigestMatrix:
    """The ``(N, F)`` digests the keys' tags record for ``select``.

    Raises:
        KeyError: some keys have no digest of a field (it was written without integrity).
    """
    names = [DIGEST_PREFIX + name for name in select]
    if isinstance(tags, TagColumns):  # the store keeps them by name: one list per field, no mapping per key
        try:
            return np.array([tags.column(name) for name in names], dtype=np.int64).reshape(len(names), len(tags)).T
        except TypeError:  # a missing digest (None): say which field and keys below
            pass
    rows = [[tag.get(name) for name in names] for tag in tags]
    try:  # the common case: every digest present, one conversion
        return np.array(rows, dtype=np.int64).reshape(len(tags), len(names))
    except TypeError:  # a missing digest (None): say which field and keys below
        pass
    for j, name in enumerate(select):
        lacking = [key for key, row in zip(keys, rows) if row[j] is None]
        if lacking:
            shown = lacking[:5] + (["..."] if len(lacking) > 5 else [])
            raise KeyError(
                f"field {name!r} has no integrity digest in partition {partition_id!r} for {len(lacking)} keys "
                f"{shown}: it was written without verify_integrity=True"
            )
    return np.array(rows, dtype=np.int64).reshape(len(tags), len(names))


def _digestible(name: str, value: Any) -> torch.Tensor | list[Any]:
    """What ``core.integrity.digest_matrix`` digests for a column: a tensor as is, object rows as a list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return list(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"field {name!r}: cannot digest a column of type {type(value).__name__}")
