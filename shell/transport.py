"""How a step's rows travel: the ``Transport`` port and its two implementations, legacy and data plane.

A GRPO step is one script (:meth:`shell.grpo_trainer.GRPOTrainer.step`); the
transport is the only thing that differs between the two paths. The driver
always holds a :class:`StepRows`: the step's :class:`~core.meta.KVBatchMeta`
(keys, lengths, tags, ``extra_info``), plus, on the legacy path only, the bulk
batch itself. Both transports shard the same meta with the same core function
(:func:`core.step_plan.shard_step`); they differ in four places:

=====================  ==========================================  ==============================================
                       :class:`LegacyTransport`                    :class:`DataPlaneTransport`
=====================  ==========================================  ==============================================
rollout output         returned to the driver (``partition_id``    written once to the store under the keys
                       None)                                       (the sync trainer's engine writes behind: the
                                                                   transport waits for the write, ``admit``'s
                                                                   ``landed``, before a rank gets the keys)
rank inputs            driver slices and pads each rank's rows     a :class:`~shell.rank_input.StoreShard`: the
                       (:class:`~shell.rank_input.InlineShard`)    meta shard; the worker fetches by key
results                gathered through the driver into the batch  written back by each replica leader
end of step            nothing stored                              the step's keys are cleared
=====================  ==========================================  ==============================================

When the step's train call follows a log-prob call on the same rows, the
driver tells each data-plane rank which rows it will train on itself
(``rank_inputs(..., keep=...)``): their results stay on the rank, and only
the rows another rank trains on are written back.

Invariants:
  * the rank batch a worker computes on is byte-identical on both transports
    (``tests/e2e/test_policy_parity_data.py``);
  * a data-plane transport clears every key it was told about (``admit``) by
    ``finish``, ``discard`` or ``abort``: after a step, finished or failed,
    the store holds none of its keys;
  * no admitted write is in flight when a data-plane transport reads, writes
    or clears rows or hands a rank its keys: it waits for each write behind
    (``admit``'s ``landed``) first, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from tensordict import TensorDict

from adapters.rows import build_tensordict
from adapters.store_port import DataPlaneClient
from core.codec import is_jagged, repad, to_padded
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN, LENGTHS, is_token_field
from core.frozen import FrozenDict, freeze
from core.meta import KVBatchMeta
from core.sharding import shard_row_indices
from shell.column_io import clear_stored, read_columns, write_columns
from shell.metering import OPS, client_io, column_bytes
from shell.model_worker import ClientFactory
from shell.rank_input import InlineShard, RankInput, StoreShard
from shell.step_rows import StepRows


def tensor_bytes(value: Any) -> int:
    """Payload bytes of a tensor, or of every column of a TensorDict / mapping (0 for anything else).

    Each column is counted by :func:`shell.metering.column_bytes`, as the store's meter counts it.
    """
    if isinstance(value, (TensorDict, Mapping)):
        return sum(column_bytes(v) for v in value.values())
    return column_bytes(value)


@attrs.frozen
class TransportReport:
    """What a transport moved in one step.

    Attributes:
        driver_bytes: tensor bytes that crossed the driver (bulk rows on the
            legacy path; per-row values written by the driver on the data plane).
        store_ms: time in store calls, summed over the driver, the rollout and every rank.
        store_bytes: payload bytes of those store calls.
        keys_outstanding: keys of this run (those starting with the transport's ``key_prefix``) left in the
            step's partition after the step (0 on the legacy path); other runs' keys in a shared partition are not
            counted.
        store_ms_by_call: ``store_ms`` by process and operation, ``"<process> <op>"`` -> ms, where the process is
            ``rollout`` (the engine, or the async collector), ``policy`` (every rank) or ``driver``, and the op is
            ``put``, ``get`` or ``clear`` (empty on the legacy path): where the step's store time went.
    """

    driver_bytes: int = 0
    store_ms: float = 0.0
    store_bytes: int = 0
    keys_outstanding: int = 0
    store_ms_by_call: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze)


@runtime_checkable
class Transport(Protocol):
    """How rows reach the policy ranks and how results come back (see the module docstring)."""

    @property
    def partition_id(self) -> str | None:
        """Where the rollout writes its batch; None: the rollout returns it to the driver."""
        ...

    @property
    def client_factory(self) -> ClientFactory | None:
        """How each worker opens its store client (None: workers need none)."""
        ...

    def admit(
        self, rows: StepRows, store_io: Mapping[str, float], *, landed: Callable[[], Mapping[str, float]] | None = None
    ) -> None:
        """Note a generation batch the step now owns (its keys, its bulk bytes, the rollout's store I/O).

        ``landed``: the batch's write may still be in flight (the engine writes behind,
        :func:`shell.column_io.first_write_behind`); a call that waits until it is stored and returns the
        rollout's store I/O, or raises the write's error. The transport calls it once, before anything reads,
        writes or clears these rows, or hands their keys to a rank.
        """
        ...

    def discard(self, rows: StepRows) -> None:
        """Drop rows the step will not use (e.g. DAPO's filtered groups)."""
        ...

    def rank_inputs(
        self,
        rows: StepRows,
        shards: Sequence[KVBatchMeta],
        unsorted: Sequence[int],
        fields: Sequence[str],
        *,
        keep: Sequence[frozenset[str]] = (),
    ) -> list[RankInput]:
        """One rank input per DP shard, carrying (or pointing at) ``fields`` of the shard's rows.

        ``keep`` (one key set per shard, or empty): keys whose results a rank keeps for the step's train call
        rather than hands back (:func:`core.step_plan.kept_rows`); the legacy transport hands every result back.
        """
        ...

    def collect(
        self, rows: StepRows, results: Sequence[Mapping[str, Any]], unsorted: Sequence[int], names: Sequence[str]
    ) -> StepRows:
        """``rows`` with the per-rank results ``names`` now part of it (gathered, or already in the store)."""
        ...

    def write(self, rows: StepRows, columns: Mapping[str, torch.Tensor]) -> StepRows:
        """``rows`` with the driver's per-row ``columns`` (e.g. advantages) added."""
        ...

    def read(self, rows: StepRows, names: Sequence[str]) -> TensorDict:
        """``names`` of every row, in ``rows`` order.

        The data plane reads them from the store, per-token fields padded to the
        step's pad length; the legacy transport returns the batch's columns as
        the driver holds them (the rollout's fields at the rollout's width).
        """
        ...

    def finish(self, rows: StepRows) -> TransportReport:
        """End the step: release what it holds; what was moved."""
        ...

    def abort(self) -> None:
        """Release everything the open step holds (after a failure). Idempotent, best effort."""
        ...


# ---------------------------------------------------------------- legacy: rows through the driver


def slice_rank_batch(data: TensorDict, rows: Sequence[int], lengths: Sequence[int], *, fields: Sequence[str], pad_to: int) -> TensorDict:
    """Rows ``rows`` of ``data`` as a rank batch: ``fields`` (per-token fields trimmed to each row's length,
    then padded with 0 to ``pad_to``) plus ``lengths`` (LongTensor).

    This is the legacy half of the parity: it must equal what
    :func:`shell.policy_worker.fetch_rank_batch` reads for the same rows after ``first_write``.

    Raises:
        KeyError: a field is missing from ``data``.
        ValueError: a row is longer than ``pad_to``.
    """
    missing = [name for name in fields if name not in data.keys()]
    if missing:
        raise KeyError(f"'data' must hold {list(fields)}: missing {missing}")
    index = torch.tensor(list(rows), dtype=torch.long)
    row_lengths = [int(lengths[r]) for r in rows]
    columns: dict[str, Any] = {}
    for name in fields:
        value = data[name]
        if is_jagged(value) or is_token_field(name):
            dense = to_padded(value) if is_jagged(value) else value
            columns[name] = repad(dense[index], row_lengths, pad_to_length=pad_to)
        else:
            columns[name] = value[index]
    columns[LENGTHS] = torch.tensor(row_lengths, dtype=torch.long)
    return build_tensordict(columns, len(row_lengths))


class LegacyTransport:
    """Bulk rows through the driver: the rollout returns them, the driver slices each rank's share and gathers results."""

    partition_id: None = None  # the rollout returns its rows to the driver
    client_factory: None = None  # workers open no store client

    def __init__(self) -> None:
        self._bytes = 0

    def admit(
        self, rows: StepRows, store_io: Mapping[str, float], *, landed: Callable[[], Mapping[str, float]] | None = None
    ) -> None:
        if landed is not None:  # nothing of the legacy path is written; wait all the same, so no error is lost
            landed()
        self._bytes += tensor_bytes(rows.batch)

    def discard(self, rows: StepRows) -> None:
        """Nothing is stored: dropped rows are simply not kept."""

    def rank_inputs(
        self,
        rows: StepRows,
        shards: Sequence[KVBatchMeta],
        unsorted: Sequence[int],
        fields: Sequence[str],
        *,
        keep: Sequence[frozenset[str]] = (),
    ) -> list[RankInput]:
        """The driver slices each rank's rows; every result comes back through the driver, so ``keep`` changes
        nothing here."""
        data = rows.require_batch()
        lengths = rows.meta.sequence_lengths or ()
        pad = int(rows.meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN])
        inputs: list[RankInput] = [
            InlineShard(slice_rank_batch(data, r, lengths, fields=fields, pad_to=pad), shard.extra_info)
            for r, shard in zip(shard_row_indices(shards, unsorted), shards)
        ]
        self._bytes += sum(tensor_bytes(i.data) for i in inputs)  # type: ignore[union-attr]
        return inputs

    def collect(
        self, rows: StepRows, results: Sequence[Mapping[str, Any]], unsorted: Sequence[int], names: Sequence[str]
    ) -> StepRows:
        if not names:
            return rows
        order = torch.tensor(list(unsorted), dtype=torch.long)
        merged = {name: torch.cat([r["outputs"][name] for r in results])[order] for name in names}
        self._bytes += tensor_bytes(merged)
        return rows.with_columns(merged)

    def write(self, rows: StepRows, columns: Mapping[str, torch.Tensor]) -> StepRows:
        return rows.with_columns(columns)

    def read(self, rows: StepRows, names: Sequence[str]) -> TensorDict:
        data = rows.require_batch()
        return build_tensordict({name: data[name] for name in names}, len(rows))

    def finish(self, rows: StepRows) -> TransportReport:
        moved, self._bytes = self._bytes, 0
        return TransportReport(driver_bytes=moved)

    def abort(self) -> None:
        self._bytes = 0


# ---------------------------------------------------------------- data plane: rows through the store


HELD_ROW_BYTES = 256
"""A written column whose rows take at most this many bytes each stays on the driver (:meth:`DataPlaneTransport.write`)."""


def _row_bytes(column: torch.Tensor, n: int) -> int:
    return column.element_size() * column.numel() // max(n, 1) if not column.is_nested else HELD_ROW_BYTES + 1


class DataPlaneTransport:
    """Rows through a store: the rollout writes them once, workers fetch their shards by key and write back.

    Args:
        client: the driver's store client (a :class:`shell.metering.MeteredClient` also reports store time).
        client_factory: how each worker opens its own client (picklable).
        partition_id: the store partition of the run's rows.
        key_prefix: what every key of the run starts with (the run id): ``keys_outstanding`` counts only those,
            so other runs sharing the partition do not count.
    """

    def __init__(
        self,
        client: DataPlaneClient,
        client_factory: ClientFactory,
        *,
        partition_id: str,
        key_prefix: str = "",
    ) -> None:
        self.client = client
        self.client_factory: ClientFactory = client_factory
        self.partition_id: str = partition_id
        self.key_prefix: str = key_prefix
        self._open: dict[str, None] = {}  # keys written in the open step, in write order
        self._held: list[tuple[dict[str, int], dict[str, torch.Tensor]]] = []  # driver-held writes: (key -> row, columns)
        self._io = {"ms": 0.0, "bytes": 0.0}
        self._by_call: dict[str, float] = {}  # "<process> <op>" -> ms this step
        self._bytes = 0
        self._landing: list[Callable[[], Mapping[str, float]]] = []  # admitted writes still in flight, in order

    def admit(
        self, rows: StepRows, store_io: Mapping[str, float], *, landed: Callable[[], Mapping[str, float]] | None = None
    ) -> None:
        self._open.update(dict.fromkeys(rows.meta.keys))
        self._add_io(store_io, "rollout")
        if landed is not None:
            self._landing.append(landed)

    def _settle(self) -> None:
        """Wait for every admitted write still in flight (see ``admit``'s ``landed``), in order; count its I/O.

        Raises:
            Exception: the first write that failed, with its own error (the writes after it are still waited for,
                so none is in flight once this returns or raises).
        """
        failure: Exception | None = None
        while self._landing:
            io: Mapping[str, float] = {}
            try:
                io = self._landing[0]()
            except Exception as error:
                failure = failure or error
            self._landing.pop(0)  # not on an interrupt: ``abort`` then waits for this write again
            self._add_io(io, "rollout")
        if failure is not None:
            raise failure

    def discard(self, rows: StepRows) -> None:
        self._settle()
        self._clear(rows.meta.keys)

    def rank_inputs(
        self,
        rows: StepRows,
        shards: Sequence[KVBatchMeta],
        unsorted: Sequence[int],
        fields: Sequence[str],
        *,
        keep: Sequence[frozenset[str]] = (),
    ) -> list[RankInput]:
        """Each rank's meta shard, the driver-held columns of its rows, and the keys it keeps (not written back).

        Raises:
            ValueError: ``keep`` is not empty and has not one key set per shard.
        """
        if keep and len(keep) != len(shards):
            raise ValueError(f"'keep' must hold one key set per shard ({len(shards)}): got {len(keep)}")
        self._settle()  # a rank reads its shard as soon as it gets it
        inputs: list[RankInput] = []
        for r, shard in enumerate(shards):
            columns = {name: rows_ for name in fields if (rows_ := self._held_rows(shard.keys, name)) is not None}
            self._bytes += tensor_bytes(columns)
            inputs.append(StoreShard(shard, columns, keep[r] if keep else frozenset()))
        return inputs

    def collect(
        self, rows: StepRows, results: Sequence[Mapping[str, Any]], unsorted: Sequence[int], names: Sequence[str]
    ) -> StepRows:
        for result in results:
            self._add_io(result.get("data_plane") or {}, "policy")
        return rows.with_meta(rows.meta.with_fields(names)) if names else rows

    def write(self, rows: StepRows, columns: Mapping[str, torch.Tensor]) -> StepRows:
        """Small per-row columns (at most :data:`HELD_ROW_BYTES` a row) stay on the driver and travel with the
        next calls' rank inputs; larger ones are written to the store."""
        keys = rows.meta.keys
        held = {n: c for n, c in columns.items() if _row_bytes(c, len(keys)) <= HELD_ROW_BYTES}
        stored = {n: c for n, c in columns.items() if n not in held}
        meta = rows.meta
        if stored:
            self._settle()  # a write to the keys after their first write
            meta = write_columns(self.client, meta, stored, token_fields=())
            self._bytes += tensor_bytes(stored)
        if held:
            self._held.append(({key: i for i, key in enumerate(keys)}, dict(held)))
        return rows.with_meta(meta.with_fields(held) if held else meta)

    def read(self, rows: StepRows, names: Sequence[str]) -> TensorDict:
        keys = rows.meta.keys
        held = {name: column for name in names if (column := self._held_rows(keys, name)) is not None}
        stored = [name for name in names if name not in held]
        if stored:
            self._settle()
        out = read_columns(self.client, rows.meta, stored) if stored else build_tensordict({}, len(keys))
        for name, column in held.items():
            out.set(name, column)
        return out

    def _held_rows(self, keys: Sequence[str], name: str) -> torch.Tensor | None:
        """The latest driver-held write of ``name`` for each of ``keys``, in order; None unless every key has one."""
        picks = []
        for key in keys:
            found = next(
                ((b, positions[key]) for b in range(len(self._held) - 1, -1, -1)
                 if name in self._held[b][1] and key in (positions := self._held[b][0])),
                None,
            )
            if found is None:
                return None
            picks.append(found)
        if not picks:
            return None
        blocks = {b for b, _ in picks}
        if len(blocks) == 1:
            return self._held[blocks.pop()][1][name].index_select(0, torch.tensor([p for _, p in picks], dtype=torch.long))
        return torch.stack([self._held[b][1][name][p] for b, p in picks])

    def finish(self, rows: StepRows) -> TransportReport:
        self._settle()
        self._held = []
        self._clear(list(self._open))
        self._add_io(client_io(self.client), "driver")
        io, self._io = self._io, {"ms": 0.0, "bytes": 0.0}
        by_call, self._by_call = self._by_call, {}
        moved, self._bytes = self._bytes, 0
        return TransportReport(
            driver_bytes=moved,
            store_ms=io["ms"],
            store_bytes=int(io["bytes"]),
            keys_outstanding=sum(k.startswith(self.key_prefix) for k in self.client.list_keys(self.partition_id)),
            store_ms_by_call=by_call,
        )

    def abort(self) -> None:
        """Clear every admitted key still stored, once no admitted write is in flight (a failed write is the
        failure being aborted, or stored nothing: its error is not raised here)."""
        with contextlib.suppress(Exception):
            self._settle()
        self._held = []
        self._clear(list(self._open))

    def _clear(self, keys: Sequence[str]) -> None:
        clear_stored(self.client, keys, self.partition_id)
        for key in keys:
            self._open.pop(key, None)
            for positions, _columns in self._held:
                positions.pop(key, None)

    def _add_io(self, io: Mapping[str, float], process: str) -> None:
        """Add a process's store activity (``{"ms", "bytes"}`` and, when it reports them, ``put_ms``, ``get_ms``,
        ``clear_ms``) to the step's."""
        for name in self._io:
            self._io[name] += float(io.get(name, 0.0))
        for op in OPS:
            if f"{op}_ms" in io:
                call = f"{process} {op}"
                self._by_call[call] = self._by_call.get(call, 0.0) + float(io[f"{op}_ms"])
