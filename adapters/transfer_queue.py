"""``TransferQueueStore``: the data-plane port over TransferQueue 0.1.11 (``import transfer_queue as tq``).

A store is a handle on one TransferQueue (TQ) system running on a Ray cluster:
a controller actor (named ``TransferQueueController`` in namespace
``transfer_queue``) that maps ``(partition, key)`` to rows and per-key tags, plus
storage (SimpleStorage units by default). :meth:`TransferQueueStore.start`
starts TQ and owns it; :meth:`TransferQueueStore.attach` joins a running TQ
from another process, a Ray actor, or the same process, and never stops it.

TQ keeps process globals: one TQ client per process (``tq.init`` /
``tq.get_client`` / ``tq.close``). Every store in a process shares that client;
this module keeps no state of its own beyond each store's flags and the caches
of its pure tag parsers.

Invariants (the port's semantics, see :mod:`adapters.store_port`, checked by
``tests/e2e/test_store_contract.py``):
  * shape-faithful round trips: every field comes back in the kind, dtype and
    shape it was put, restored from the :class:`adapters.rows.ColumnSpec` that
    each put records per key and field in the reserved tag ``__kvspec__``;
  * a rejected put writes nothing: arguments and every column are checked
    before the first TQ call, and keys a failed TQ put registered are cleared;
  * ``get``, ``clear`` and ``describe`` raise ``KeyError`` for unknown keys or
    missing fields instead of TQ's silent drops and empty results;
  * after ``close()`` every call but ``close()`` raises ``RuntimeError``; only
    the store that started TQ (and Ray) shuts them down.

Wire format: tensor columns travel whole, as TQ takes them (a dense ``(N, *shape)``
tensor, a jagged nested tensor), with no per-row work in this adapter. Each
user field ``name`` is stored under the *wire field* ``name@kind.dtype.shape``
(:func:`wire_name`, e.g. ``input_ids@jagged.int64.`` or ``hidden@dense.float16.5x3``):
TQ's controller allows one dtype per field and partition (a put that changes it
is accepted, but the controller only logs an error and skips the put's field
bookkeeping, leaving the field unreadable), and a wire field only ever holds
one spec, so a rewrite with another kind, dtype or shape goes to another wire
field and never conflicts. The reserved tag ``__kvspec__`` of each key is one
short string, the JSON list of its current wire fields (:func:`spec_tag`), parsed
once per distinct string (TQ deep-copies every key's tags on each call, so they
are kept flat). A rewrite with another spec leaves the old wire field behind
for that key, unreadable through this adapter, until the key is cleared (TQ
0.1.11 cannot clear one field of a key). Object columns (numpy object arrays,
``NonTensorStack``) travel as one pickle per row (jagged ``uint8``), since
msgpack would turn tuples and sets into lists.

TQ quirks hidden here, once (TQ 0.1.11 with tensordict 0.15.3):
  * Rectangular fields come back jagged (``(N, D)`` as rows ``(D,)``, ``(N,)``
    dense): :func:`decode_column` restores the put's kind and shape with
    whole-column ops (``values().reshape(N, *shape)``).
  * A selected field that some keys lack yields no error (TQ drops it), and
    unknown keys mixed with known ones are dropped: presence is checked
    against the reserved tags and the size of TQ's meta.
  * ``kv_batch_put`` registers keys before it validates them: this adapter
    validates first and uses TQ's low-level client, clearing keys it registered
    if the TQ put then fails.
  * Tags merge per key but shallowly, and a clear removes them: the reserved
    tags ``__kvspec__`` (wire fields) and ``__kvlen__`` (sequence length)
    are merged here and hidden from :meth:`TransferQueueStore.describe`. User
    tags stay native TQ tags (msgpack: tuples and sets come back as lists).

On the Mooncake backend (:data:`MOONCAKE`, a key/value store that rejects
zero-byte values and clears per field set) jagged tensor rows travel padded
by one token and zero-byte columns as their row lengths, clears go one field
set at a time, processes that attach lend Mooncake no memory (objects live in
the owner's segment, so they outlive workers), and the owner stops the
``mooncake_master`` that TQ starts but never stops.

Not transactional: puts of the same key from several processes race on the
key's tags (TQ merges tags on the client), and a TQ failure in the middle of a
put may leave keys that already existed partly rewritten.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict

from adapters.rows import (
    TENSOR_KINDS,
    ColumnSpec,
    build_tensordict,
    column_spec,
    common_spec,
    read_columns_of,
    stack_column,
)
from adapters.store_port import (
    Keys,
    SeqLens,
    Tags,
    missing_field_error,
    pick_tags,
    unknown_keys_error,
    validate_get,
    validate_put,
    validate_tag_names,
)
from core.frozen import thaw
from core.meta import KVBatchMeta

SPEC_TAG = "__kvspec__"
"""Reserved tag: the JSON list of the wire fields a key holds (:func:`spec_tag`), one per user field."""
LENGTH_TAG = "__kvlen__"
"""Reserved tag: the key's sequence length (an int), when a put gave one."""
RESERVED_TAGS = frozenset({SPEC_TAG, LENGTH_TAG})

MOONCAKE = "MooncakeStore"
"""The storage backend that rejects zero-byte values: its stores pad jagged rows on the wire."""

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
RAY_NAMESPACE = "rl-dataplane"
"""The Ray namespace of a cluster that :meth:`TransferQueueStore.start` starts itself."""

Config = Mapping[str, Any]
WireName = str
"""The TQ field a user field is stored under: ``name@kind.dtype.shape`` (:func:`wire_name`)."""
SpecTag = str
"""The value of the reserved tag :data:`SPEC_TAG`: a JSON list of wire names."""
StoredSpecs = Mapping[str, ColumnSpec]
"""Field name -> the spec of the row one key holds, in first-put order (read-only, shared)."""

_PARSE_CACHE = 4096
"""Distinct tag strings and wire names whose parse is kept (one per field layout in practice)."""
_NO_FIELDS: StoredSpecs = MappingProxyType({})


# ---------------------------------------------------------------- configuration


def _default_config() -> DictConfig:
    return OmegaConf.load(resources.files("transfer_queue") / "config.yaml")  # type: ignore[return-value]


def known_backends() -> tuple[str, ...]:
    """The storage backends TQ 0.1.11 knows: the sections of ``backend`` in its default config."""
    return tuple(name for name in _default_config().backend if name != "storage_backend")


def resolve_config(config: Config | None = None) -> DictConfig:
    """TQ's default config with ``config`` merged over it, checked before anything starts.

    Args:
        config: a mapping or ``OmegaConf`` config of TQ settings, e.g.
            ``{"backend": {"storage_backend": "MooncakeStore"}}``; None for the
            defaults (SimpleStorage).

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: ``backend.storage_backend`` names a backend TQ does not know.

    Example:
        >>> resolve_config({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}).backend.storage_backend
        'SimpleStorage'
    """
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"'config' must be a mapping of TransferQueue settings or None: got {type(config).__name__}; "
            f"e.g. config={{'backend': {{'storage_backend': 'SimpleStorage'}}}}"
        )
    merged = OmegaConf.create({}, flags={"allow_objects": True})
    merged = OmegaConf.merge(merged, _default_config())
    if config:
        merged = OmegaConf.merge(merged, config)
    backend = merged.backend.storage_backend
    backends = known_backends()
    if backend not in backends:
        raise ValueError(f"'backend.storage_backend' must be one of {backends}: got {backend!r}")
    return merged  # type: ignore[return-value]


def is_running() -> bool:
    """Whether a TransferQueue controller is registered on this process's Ray cluster (False without Ray).

    Never starts Ray: without an initialised Ray there is no cluster to look in.
    """
    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return False
    return True



# ---------------------------------------------------------------- wire names and reserved tags (pure)


@functools.lru_cache(maxsize=_PARSE_CACHE)
def wire_name(name: str, spec: ColumnSpec) -> WireName:
    """The TQ field that holds user field ``name`` put with ``spec``: ``name@kind.dtype.shape``.

    Shape dims are joined with ``x`` (empty for ``()``), so ``(N,)`` and
    ``(N, 1)`` differ. The part after the last ``@`` never holds an ``@``, so
    :func:`parse_wire_name` inverts it for any ``name``.

    Example:
        >>> wire_name("hidden", ColumnSpec("dense", "float16", (5, 3)))
        'hidden@dense.float16.5x3'
    """
    return f"{name}@{spec.kind}.{spec.dtype}.{'x'.join(map(str, spec.shape))}"


@functools.lru_cache(maxsize=_PARSE_CACHE)
def parse_wire_name(wire: WireName) -> tuple[str, ColumnSpec]:
    """Inverse of :func:`wire_name`: ``(name, spec)``.

    Raises:
        ValueError: ``wire`` is not of the form ``name@kind.dtype.shape``.
    """
    name, at, code = wire.rpartition("@")
    parts = code.split(".")
    if not at or len(parts) != 3:
        raise ValueError(f"wire field {wire!r} must be of the form 'name@kind.dtype.shape'")
    kind, dtype, shape = parts
    try:
        dims = tuple(int(size) for size in shape.split("x")) if shape else ()
    except ValueError:
        raise ValueError(f"wire field {wire!r} must give its shape as ints joined by 'x': got {shape!r}") from None
    return name, ColumnSpec(kind, dtype, dims)  # type: ignore[arg-type]


def spec_tag(wires: Sequence[WireName]) -> SpecTag:
    """The reserved tag value that records ``wires`` (a compact JSON list of strings)."""
    return json.dumps(list(wires), separators=(",", ":"))


@functools.lru_cache(maxsize=_PARSE_CACHE)
def parse_spec_tag(tag: SpecTag) -> StoredSpecs:
    """Field -> spec for a :func:`spec_tag` value, in its order; cached, so equal tags parse once.

    Raises:
        ValueError: ``tag`` is not a JSON list of wire names.
    """
    try:
        wires = json.loads(tag)
    except json.JSONDecodeError:
        wires = None
    if not isinstance(wires, list) or not all(isinstance(w, str) for w in wires):
        raise ValueError(f"reserved tag {SPEC_TAG!r} must be a JSON list of wire field names: got {tag!r}")
    return MappingProxyType(dict(parse_wire_name(w) for w in wires))


@functools.lru_cache(maxsize=_PARSE_CACHE)
def merge_spec_tags(old: SpecTag | None, new: SpecTag) -> SpecTag:
    """A key's spec tag after a put that records ``new`` over ``old``: new fields win, first-put order kept."""
    if old is None:
        return new
    held = {**parse_spec_tag(old), **parse_spec_tag(new)}
    return spec_tag([wire_name(name, spec) for name, spec in held.items()])


def stored_specs(tags: Mapping[str, Any]) -> StoredSpecs:
    """The fields one key holds, in first-put order, with their specs (from its reserved tag).

    Raises:
        RuntimeError: the reserved tag was not written by this adapter.
    """
    tag = _spec_tag_of(tags)
    if tag is None:
        return _NO_FIELDS
    try:
        return parse_spec_tag(tag)
    except ValueError as e:
        raise RuntimeError(f"reserved tag {SPEC_TAG!r} was not written by TransferQueueStore: {e}") from None


def _spec_tag_of(tags: Mapping[str, Any]) -> SpecTag | None:
    tag = tags.get(SPEC_TAG)
    if tag is not None and not isinstance(tag, str):
        raise RuntimeError(
            f"reserved tag {SPEC_TAG!r} must be a string written by TransferQueueStore: got {type(tag).__name__}"
        )
    return tag


# ---------------------------------------------------------------- put (pure)


@attrs.frozen(eq=False)
class PutPlan:
    """A validated put: its receipt, what TQ stores, and the spec tag it records.

    Attributes:
        receipt: the put's receipt (:func:`adapters.store_port.validate_put`).
        payload: batch ``[N]`` keyed by wire name: tensor columns as given
            (detached), object columns as jagged ``uint8`` pickles, one per row.
        tag: :func:`spec_tag` of the put's wire fields.
    """

    receipt: KVBatchMeta
    payload: TensorDict
    tag: SpecTag


def plan_put(
    keys: Keys,
    partition_id: str,
    fields: TensorDict,
    *,
    tags: Tags | None = None,
    sequence_lengths: SeqLens | None = None,
    pad_rows: bool = False,
) -> PutPlan:
    """Check a put completely (arguments, reserved tags, every column) and encode it for TQ.

    Tensor columns are checked whole (:func:`adapters.rows.column_spec`) and
    sent as they are: TQ serialises them before the put returns, so the
    store never aliases them. With ``pad_rows`` (a backend that rejects
    zero-byte values, :data:`MOONCAKE`) jagged tensor columns travel with one
    zero element appended to every row (:func:`pad_jagged_rows`), and a
    tensor column whose rows hold no bytes at all as its row lengths
    (:func:`zero_byte_placeholder`).

    Raises:
        TypeError: see :func:`adapters.store_port.validate_put` and :func:`adapters.rows.column_spec`.
        ValueError: see :func:`adapters.store_port.validate_put` and :func:`adapters.rows.column_spec`;
            a tag uses a reserved name.
    """
    receipt = validate_put(keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths)
    for i, tag in enumerate(receipt.tags or ()):
        reserved = sorted(RESERVED_TAGS.intersection(tag))
        if reserved:
            raise ValueError(
                f"'tags' entries must not use the reserved names {sorted(RESERVED_TAGS)}: got {reserved} at index {i}"
            )
    n = len(receipt)
    payload = {}
    for name, value in read_columns_of(fields).items():
        spec = column_spec(name, value, n)
        encoded = encode_column(spec, value)
        if pad_rows and zero_byte_rows(spec):
            encoded = zero_byte_placeholder(spec, encoded)
        elif pad_rows and spec.kind == "jagged":
            encoded = pad_jagged_rows(encoded)
        payload[wire_name(name, spec)] = encoded
    return PutPlan(receipt, TensorDict(payload, batch_size=[n]), spec_tag(list(payload)))


def encode_column(spec: ColumnSpec, value: Any) -> torch.Tensor:
    """What TQ stores for a checked column: a tensor column as is (detached), an object column as row pickles.

    Args:
        spec: the column's spec (:func:`adapters.rows.column_spec`).
        value: the column.

    Returns:
        The tensor column, or a jagged ``uint8`` tensor whose row ``i`` is the pickle of row ``i``.
    """
    if spec.kind in TENSOR_KINDS:
        return value.detach() if value.requires_grad else value
    if isinstance(value, NonTensorData):
        value = value.data
    rows = [value[i] for i in range(len(value))] if isinstance(value, np.ndarray) else value.tolist()
    blobs = [pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL) for row in rows]
    flat = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    offsets = torch.tensor([0, *(len(blob) for blob in blobs)], dtype=torch.int64).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


def pad_jagged_rows(column: torch.Tensor) -> torch.Tensor:
    """A contiguous jagged copy of ``column`` with one zero element (token) appended to every row.

    A backend that rejects zero-byte values (:data:`MOONCAKE`) can then store
    empty rows; :func:`unpad_jagged_rows` is the inverse. Holes between the
    input's rows are dropped.

    Example:
        >>> col = torch.nested.nested_tensor_from_jagged(torch.tensor([5, 6, 7]), torch.tensor([0, 2, 2, 3]))
        >>> pad_jagged_rows(col).values().tolist(), pad_jagged_rows(col).offsets().tolist()
        ([5, 6, 0, 0, 7, 0], [0, 3, 4, 6])
    """
    values, lens = _back_to_back(column)
    padded = _row_offsets(lens + 1)
    out = _with_zero_tokens(values, int(padded[-1]), padded[1:].numpy() - 1)
    return torch.nested.nested_tensor_from_jagged(out, padded)


def _back_to_back(column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, lengths)`` of a jagged column with its rows back to back from token 0 (as is when they already are)."""
    values, offsets, lengths = column.values(), column.offsets(), column.lengths()
    lens = offsets.diff() if lengths is None else lengths.to(torch.int64)
    if lengths is not None or int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
        values = torch.cat([values[a : a + n] for a, n in zip(offsets[:-1].tolist(), lens.tolist())])
    return values, lens


def _row_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets (``N + 1``, from 0) of rows of ``lengths`` laid back to back."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return offsets


def _with_zero_tokens(values: torch.Tensor, size: int, zeros: np.ndarray) -> torch.Tensor:
    """``size`` tokens: zero ones at positions ``zeros``, the tokens of ``values`` in order elsewhere."""
    if not values.numel():
        return values.new_zeros((size, *values.shape[1:]))
    tokens = _token_bytes(values)
    out = np.zeros((size, *tokens.shape[1:]), dtype=tokens.dtype)
    out[_token_mask(size, zeros)] = tokens
    return _from_token_bytes(out, values)


def _without_tokens(values: torch.Tensor, drop: np.ndarray) -> torch.Tensor:
    """The tokens of ``values`` except those at positions ``drop``, in order."""
    if not values.numel():
        return values.new_zeros((values.shape[0] - len(drop), *values.shape[1:]))
    tokens = _token_bytes(values)
    return _from_token_bytes(tokens[_token_mask(tokens.shape[0], drop)], values)


_TOKEN_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _token_bytes(values: torch.Tensor) -> np.ndarray:
    """``values`` (tokens along dim 0, non-empty) as a numpy view with one entry per token:
    ``(tokens,)`` unsigned words when a token is 1, 2, 4 or 8 bytes, else ``(tokens, bytes)`` uint8."""
    raw = values.contiguous().reshape(values.shape[0], -1).view(torch.uint8).numpy()
    word = _TOKEN_WORDS.get(raw.shape[1])
    return raw.view(word).reshape(-1) if word is not None else raw


def _from_token_bytes(tokens: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_token_bytes`: tokens of ``like``'s dtype and per-token shape."""
    if tokens.shape[0] == 0:
        return torch.empty((0, *like.shape[1:]), dtype=like.dtype)
    raw = np.ascontiguousarray(tokens).view(np.uint8).reshape(tokens.shape[0], -1)
    return torch.from_numpy(raw).view(like.dtype).reshape(tokens.shape[0], *like.shape[1:])


def _token_mask(size: int, holes: np.ndarray) -> np.ndarray:
    """A boolean mask of ``size`` tokens, False at ``holes``."""
    mask = np.ones(size, dtype=bool)
    mask[holes] = False
    return mask


def zero_byte_rows(spec: ColumnSpec) -> bool:
    """Whether every row of a tensor column with ``spec`` holds zero bytes (a zero in its per-row shape)."""
    return spec.kind in TENSOR_KINDS and 0 in spec.shape


def zero_byte_placeholder(spec: ColumnSpec, column: torch.Tensor) -> torch.Tensor:
    """What a key/value backend stores for a column of zero-byte rows: each row's length as ``(N,)`` int64.

    The spec (dtype, shape) and these lengths determine the column, so
    :func:`from_zero_byte_placeholder` rebuilds it bit for bit.
    """
    if spec.kind == "jagged":
        offsets, lengths = column.offsets(), column.lengths()
        return (offsets.diff() if lengths is None else lengths).to(torch.int64)
    return torch.full((column.shape[0],), spec.shape[0], dtype=torch.int64)


def from_zero_byte_placeholder(name: str, spec: ColumnSpec, value: Any, n: int) -> torch.Tensor:
    """Inverse of :func:`zero_byte_placeholder` from what TQ returned (dense ``(N,)`` or rows of one element).

    Raises:
        RuntimeError: TQ returned another number of rows, or not an int64 tensor.
    """
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        raise RuntimeError(f"TransferQueue returned field {name!r} as {type(value).__name__}: expected int64 row lengths")
    lengths = value.values() if value.is_nested else value.reshape(-1)
    if lengths.shape[0] != n:
        raise RuntimeError(f"TransferQueue returned {lengths.shape[0]} rows of field {name!r}: expected {n}")
    if spec.kind == "dense":
        return torch.empty((n, *spec.shape), dtype=spec.torch_dtype)
    offsets = _row_offsets(lengths)
    values = torch.empty((int(offsets[-1]), *spec.shape), dtype=spec.torch_dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def unpad_jagged_rows(name: str, column: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_jagged_rows`: a contiguous jagged tensor without each row's last element.

    Raises:
        RuntimeError: a row is empty, so it cannot have been padded (names the field).
    """
    values, lens = _back_to_back(column)
    if bool((lens < 1).any()):
        raise RuntimeError(f"TransferQueue returned an empty row of field {name!r}, which was stored padded")
    out = _without_tokens(values, _row_offsets(lens)[1:].numpy() - 1)  # each row's last token
    return torch.nested.nested_tensor_from_jagged(out, _row_offsets(lens - 1))


def new_keys(plan: PutPlan, registered: Sequence[Mapping[str, Any]]) -> list[int]:
    """Positions of the keys this put registers: those without the reserved spec tag.

    Args:
        plan: the put.
        registered: each key's current tags, as ``kv_retrieve_meta(create=True)`` returned them.

    Raises:
        RuntimeError: TQ returned tags for another number of keys than the put has.
    """
    if len(registered) != len(plan.receipt):
        raise RuntimeError(
            f"TransferQueue registered {len(registered)} keys for a put of {len(plan.receipt)} keys "
            f"in partition {plan.receipt.partition_id!r}"
        )
    return [i for i, tags in enumerate(registered) if SPEC_TAG not in tags]


def tag_updates(plan: PutPlan, current: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What the put sets in each key's tags (TQ merges them shallowly into the current ones, new values win).

    The put's user tags, the merged spec tag and, if the put gave lengths, the length.
    """
    user = plan.receipt.tags
    lengths = plan.receipt.sequence_lengths
    merged: dict[SpecTag | None, SpecTag] = {}  # keys mostly share one old tag: merge once per distinct tag
    out = []
    for i, old in enumerate(current):
        prev = _spec_tag_of(old)
        tag = merged.get(prev)
        if tag is None:
            tag = merged[prev] = merge_spec_tags(prev, plan.tag)
        update = thaw(user[i]) if user is not None else {}
        update[SPEC_TAG] = tag
        if lengths is not None:
            update[LENGTH_TAG] = lengths[i]
        out.append(update)
    return out


# ---------------------------------------------------------------- get (pure)


def unknown_keys(keys: Sequence[str], found: Sequence[str]) -> list[str]:
    """The requested keys TQ did not find, in request order."""
    known = set(found)
    return [key for key in keys if key not in known]


def plan_get(
    keys: Sequence[str], partition_id: str, names: Sequence[str], tags: Sequence[Mapping[str, Any]]
) -> dict[str, ColumnSpec]:
    """The one spec of each selected field across ``keys``, from each key's tags (request order).

    Keys with equal spec tags share one parsed mapping, so the work is per
    distinct tag, not per key.

    Raises:
        KeyError: a selected field is missing for some keys (names the first such field and its keys).
        ValueError: a field is stored with different layouts across the keys.
    """
    held = [stored_specs(t) for t in tags]
    distinct = list({id(h): h for h in held}.values())  # equal tags parse to the same (cached) mapping
    for name in names:
        if any(name not in h for h in distinct):
            raise missing_field_error(name, partition_id, [key for key, h in zip(keys, held) if name not in h])
    out = {}
    for name in names:
        specs = {h[name] for h in distinct}
        out[name] = specs.pop() if len(specs) == 1 else common_spec(name, {k: h[name] for k, h in zip(keys, held)})
    return out


def check_fetchable(wires: Sequence[WireName], available: Sequence[str], ready: bool, partition_id: str) -> None:
    """Check that TQ agrees that every selected wire field is produced for every key.

    Raises:
        RuntimeError: TQ's meta lacks some fields the reserved tags record, or
            reports them not ready (a concurrent clear, or a foreign writer).
    """
    lacking = [wire for wire in wires if wire not in available]
    if lacking or not ready:
        raise RuntimeError(
            f"TransferQueue does not hold fields {lacking or list(wires)} ready for every requested key in "
            f"partition {partition_id!r} although their specs are recorded: were the keys cleared concurrently?"
        )


def select_wires(meta: tq.BatchMeta, specs: Mapping[str, ColumnSpec], partition_id: str) -> tq.BatchMeta:
    """The meta that fetches the wire fields of ``specs``, checked fetchable (see :func:`check_fetchable`).

    Builds what ``meta.select_fields(wires)`` builds (the selected fields'
    schemas, each key's backend meta narrowed to them, production status)
    without its deep copies and without the keys' tags, which fetching does
    not need: ``select_fields`` deep-copies every key's tags and every
    selected field's per-key shapes, about 1.2 ms of a 50 ms get of 256 rows.
    The schemas are shared with ``meta``, which the caller drops after the fetch.
    """
    wires = [wire_name(name, spec) for name, spec in specs.items()]
    wanted = set(wires)
    schema = meta.field_schema
    selected = tq.BatchMeta(
        global_indexes=meta.global_indexes,
        partition_ids=meta.partition_ids,
        field_schema={wire: schema[wire] for wire in wires if wire in schema},
        production_status=meta.production_status,
        extra_info=meta.extra_info,
        _custom_backend_meta=[
            {f: v for f, v in backend.items() if f.startswith("_") or f in wanted}
            for backend in meta._custom_backend_meta
        ],
    )
    check_fetchable(wires, selected.field_names, selected.is_ready, partition_id)
    return selected


def decode_columns(specs: Mapping[str, ColumnSpec], data: TensorDict, n: int, *, pad_rows: bool = False) -> TensorDict:
    """Rebuild the selected columns (``specs``, in selection order) from TQ's result, keyed by wire name.

    With ``pad_rows`` the columns were stored as :func:`plan_put` with
    ``pad_rows`` encodes them: jagged rows padded, zero-byte columns as
    their row lengths.

    Raises:
        RuntimeError: TQ's result lacks a field or has another number of rows.
        ValueError: a row does not fit its spec (see :func:`adapters.rows.stack_column`).
    """
    columns = {}
    for name, spec in specs.items():
        wire = wire_name(name, spec)
        if wire not in data.keys():
            raise RuntimeError(f"TransferQueue returned no field {wire!r}: got fields {sorted(data.keys())}")
        value = data.get(wire)
        if pad_rows and zero_byte_rows(spec):
            columns[name] = from_zero_byte_placeholder(name, spec, value, n)
            continue
        if pad_rows and spec.kind == "jagged" and isinstance(value, torch.Tensor) and value.is_nested:
            value = unpad_jagged_rows(name, value)
        columns[name] = decode_column(name, spec, value, n)
    return build_tensordict(columns, n)


def decode_column(name: str, spec: ColumnSpec, value: Any, n: int) -> Any:
    """One column in the kind ``spec`` records, from what TQ returned for its wire field.

    Whole-column ops only on the paths TQ takes: a dense ``(N,)`` field comes
    back dense (SimpleStorage) or as rows of one element (Mooncake); a
    rectangular one as a jagged tensor whose rows all have ``shape[0]``
    entries (checked on the offsets in one op), reshaped to ``(N, *shape)``
    (a view of TQ's fresh buffer); a jagged one as is; an
    object one as jagged ``uint8`` pickles. Any other form falls back to
    rows and :func:`adapters.rows.stack_column`, which checks every row.

    Raises:
        RuntimeError: TQ returned another number of rows, or not a tensor.
        ValueError: a row does not fit ``spec``.

    Example:
        >>> back = torch.nested.nested_tensor([torch.zeros(2), torch.ones(2)], layout=torch.jagged)
        >>> decode_column("x", ColumnSpec("dense", "float32", (2,)), back, 2).tolist()
        [[0.0, 0.0], [1.0, 1.0]]
    """
    if isinstance(value, torch.Tensor):
        # Each attribute of a jagged tensor costs a __torch_function__ call: read each once.
        shape, layout, dtype = value.shape, value.layout, value.dtype
        if not shape or shape[0] != n:
            got = shape[0] if shape else "a 0-d tensor, no"
            raise RuntimeError(f"TransferQueue returned {got} rows of field {name!r}: expected {n}")
        if layout == torch.jagged and value.lengths() is None:
            inner = tuple(shape[2:])
            if spec.kind == "jagged" and dtype == spec.torch_dtype and inner == spec.shape:
                return value
            width = spec.shape[0] if spec.shape else 1  # Mooncake returns an (N,) field as rows of one element
            if spec.kind == "dense" and dtype == spec.torch_dtype and inner == spec.shape[1:]:
                values = value.values()
                if values.shape[0] == n * width and bool((value.offsets().diff() == width).all()):
                    return values.reshape(n, *spec.shape)
            if spec.kind not in TENSOR_KINDS and dtype == torch.uint8 and not inner:
                flat = value.values().numpy().tobytes()
                bounds = value.offsets().tolist()
                return stack_column(name, spec, [pickle.loads(flat[a:b]) for a, b in zip(bounds, bounds[1:])])
        elif layout == torch.strided and not value.is_nested and spec.kind == "dense" and dtype == spec.torch_dtype:
            if shape[1:] == spec.shape:
                return value
    if spec.kind not in TENSOR_KINDS:
        return stack_column(name, spec, [pickle.loads(row.numpy().tobytes()) for row in _rows_of(name, value, n)])
    return stack_column(name, spec, _rows_of(name, value, n))


def _rows_of(name: str, value: Any, n: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        rows = list(value.unbind()) if value.is_nested else list(value.unbind(0))
    elif isinstance(value, NonTensorStack):
        rows = value.tolist()
    else:
        raise RuntimeError(
            f"TransferQueue returned field {name!r} as {type(value).__name__}: expected a tensor or NonTensorStack"
        )
    if len(rows) != n:
        raise RuntimeError(f"TransferQueue returned {len(rows)} rows of field {name!r}: expected {n}")
    return rows


def field_set_groups(tags: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Positions of keys grouped by the wire fields they hold (their spec tag), in first-seen order.

    Example:
        >>> field_set_groups([{SPEC_TAG: '["a@dense.int64."]'}, {}, {SPEC_TAG: '["a@dense.int64."]'}])
        [[0, 2], [1]]
    """
    groups: dict[str, list[int]] = {}
    for i, tag in enumerate(tags):
        groups.setdefault(_spec_tag_of(tag) or "", []).append(i)
    return list(groups.values())


def describe_meta(keys: Sequence[str], partition_id: str, tags: Sequence[Mapping[str, Any]]) -> KVBatchMeta:
    """What ``keys`` hold, from their tags: fields every key holds (first-put order), user tags, lengths."""
    specs = [stored_specs(t) for t in tags]
    names = dict.fromkeys(name for held in specs for name in held)
    lengths = [t.get(LENGTH_TAG) for t in tags]
    return KVBatchMeta(
        partition_id,
        keys,
        fields=[name for name in names if all(name in held for held in specs)],
        tags=[{k: v for k, v in t.items() if k not in RESERVED_TAGS} for t in tags],
        sequence_lengths=None if None in lengths else lengths,
    )


def _clear_keys(partition_id: str, keys: Keys) -> tuple[str, ...]:
    """The checked keys of a clear (TypeError for a single string, ValueError for repeats)."""
    return KVBatchMeta(partition_id, keys).keys


def _describe_keys(partition_id: str, keys: Keys) -> tuple[str, ...]:
    checked = KVBatchMeta(partition_id, keys).keys
    if not checked:
        raise ValueError("'keys' must name at least one row: got none")
    return checked


def _check_partition(partition_id: Any) -> None:
    if not isinstance(partition_id, str):
        raise TypeError(f"'partition_id' must be a str: got {type(partition_id).__name__}")


# ---------------------------------------------------------------- backend processes


def _prepare_mooncake(conf: DictConfig) -> None:
    """Check that Mooncake can run before anything starts, and put ``mooncake_master`` on ``PATH``.

    TQ starts the master by name; pip installs it inside the ``mooncake``
    package (and into the environment's ``bin``, which is not on ``PATH`` when
    Python is run by its full path), so that directory is appended to
    ``PATH`` when the name is not found.

    Raises:
        RuntimeError: the ``mooncake`` package is missing or cannot load, or
            TQ is to start the master and no ``mooncake_master`` exists.
    """
    hint = (
        "install it with pip install mooncake-transfer-engine (GPU machines) or "
        "mooncake-transfer-engine-non-cuda (CPU only); it needs the system libraries libibverbs1 and libnuma1"
    )
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"backend {MOONCAKE!r} needs the 'mooncake' package: {hint}")
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        raise RuntimeError(f"backend {MOONCAKE!r}: the 'mooncake' package is installed but cannot load ({e}): {hint}") from e
    if not conf.backend[MOONCAKE].auto_init or shutil.which("mooncake_master"):
        return
    for folder in list(spec.submodule_search_locations):
        if os.access(os.path.join(folder, "mooncake_master"), os.X_OK):
            os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH", ""), folder) if p)
            return
    raise RuntimeError(f"backend {MOONCAKE!r}: no 'mooncake_master' executable on PATH or in the mooncake package: {hint}")


async def _drop_registered(client: tq.TransferQueueClient, meta: tq.BatchMeta) -> None:
    """Undo the registration of keys whose first put failed; never raises.

    ``clear_samples`` removes whatever data reached storage. A key/value
    backend (Mooncake) refuses it when the keys hold no field yet, so the
    keys are then dropped from the controller alone (TQ's own two steps of a
    clear, without the storage step).
    """
    try:
        await client.async_clear_samples(meta)
    except Exception:
        with contextlib.suppress(Exception):
            await client._mark_clearing_in_controller(meta)
            await client._clear_meta_in_controller(meta)


def _backend_processes() -> tuple[subprocess.Popen, ...]:
    """The local processes TQ started for its storage backend in this process (the Mooncake master)."""
    started = getattr(getattr(tq, "interface", None), "_TQ_STORAGE", None) or {}
    found: list[Any] = []
    for resource in started.values():
        found.extend(resource.values() if isinstance(resource, Mapping) else [resource])
    return tuple(p for p in found if isinstance(p, subprocess.Popen))


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """Terminate ``processes`` (SIGTERM, then SIGKILL after 10 s) and reap them."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------- stores


class TransferQueueStore:
    """A :class:`adapters.store_port.DataPlaneClient` over TransferQueue; thread-safe.

    Build one with :meth:`start` (starts and owns TQ) or :meth:`attach` (joins a
    running TQ); the constructor only records ownership.

    Args:
        owns_transfer_queue: ``close()`` shuts TQ down (``tq.close()``).
        owns_ray: ``close()`` also shuts Ray down (``ray.shutdown()``).

    Example:
        >>> store = TransferQueueStore.start()  # doctest: +SKIP
        >>> store.put(["a"], "train", TensorDict({"x": torch.zeros(1, 3)}, batch_size=[1]))  # doctest: +SKIP
        >>> store.get(["a"], "train", ["x"])["x"].shape  # doctest: +SKIP
        torch.Size([1, 3])
        >>> store.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        owns_transfer_queue: bool = False,
        owns_ray: bool = False,
        kv_backend: bool = False,
        backend_processes: Sequence[subprocess.Popen] = (),
    ) -> None:
        self._owns_tq = owns_transfer_queue
        self._owns_ray = owns_ray
        self._kv_backend = kv_backend
        self._backend_processes = tuple(backend_processes)
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        role = "owner" if self._owns_tq else "attached"
        return f"TransferQueueStore({role}{', closed' if self._closed else ''})"

    @classmethod
    def start(cls, config: Config | None = None) -> TransferQueueStore:
        """Start TransferQueue on the current Ray cluster (or a local one) and own it.

        If Ray is not initialised, a local cluster is started with logical CPUs
        (``max(8, os.cpu_count())``, since TQ's controller and storage units
        each take one), no dashboard, namespace :data:`RAY_NAMESPACE`; the store
        then owns Ray too.

        Args:
            config: TQ settings merged over its defaults (see :func:`resolve_config`);
                SimpleStorage unless ``backend.storage_backend`` says otherwise.

        Raises:
            TypeError: ``config`` is not a mapping.
            ValueError: an unknown storage backend (checked before anything starts).
            RuntimeError: a TransferQueue already runs on this Ray cluster (use :meth:`attach`).
        """
        conf = resolve_config(config)
        mooncake = conf.backend.storage_backend == MOONCAKE
        if mooncake:
            _prepare_mooncake(conf)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, namespace=RAY_NAMESPACE)
        try:
            if is_running():
                raise RuntimeError(
                    f"a TransferQueue already runs on this Ray cluster (actor {CONTROLLER_NAME!r} in namespace "
                    f"{CONTROLLER_NAMESPACE!r}): join it with TransferQueueStore.attach()"
                )
            try:
                tq.init(conf)
            except BaseException:
                processes = _backend_processes()
                with contextlib.suppress(Exception):
                    tq.close()
                _stop(processes)
                raise
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        return cls(owns_transfer_queue=True, owns_ray=owns_ray, kv_backend=mooncake, backend_processes=_backend_processes())

    @classmethod
    def attach(cls) -> TransferQueueStore:
        """Join the TransferQueue running on this process's Ray cluster; closing the store leaves TQ running.

        Works from the driver that started TQ, another driver on the cluster, or
        any Ray actor or task. The process's TQ client is created on first use
        and shared (TQ keeps one per process).

        Raises:
            RuntimeError: Ray is not initialised in this process, or no
                TransferQueue runs on the cluster.
        """
        if not ray.is_initialized():
            raise RuntimeError(
                "Ray is not initialised in this process: connect to the cluster that runs TransferQueue first, "
                "e.g. ray.init(address='auto'), then call TransferQueueStore.attach()"
            )
        if not is_running():
            raise RuntimeError(
                f"no TransferQueue is running on this Ray cluster (no actor {CONTROLLER_NAME!r} in namespace "
                f"{CONTROLLER_NAMESPACE!r}): start one with TransferQueueStore.start()"
            )
        controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        conf = ray.get(controller.get_config.remote())
        backend = conf.backend.storage_backend
        if backend == MOONCAKE and tq.interface._TQ_CLIENT is None:
            # Lend no memory: objects then live in the owner's segment and outlive this process.
            conf.backend[MOONCAKE].global_segment_size = 0
            tq.interface._maybe_create_tq_client(conf)
        tq.init()
        return cls(kv_backend=backend == MOONCAKE)

    @property
    def owns_transfer_queue(self) -> bool:
        """Whether ``close()`` shuts TransferQueue down."""
        return self._owns_tq

    def put(
        self,
        keys: Keys,
        partition_id: str,
        fields: TensorDict,
        *,
        tags: Tags | None = None,
        sequence_lengths: SeqLens | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` (batch size ``len(keys)``) under ``keys`` in ``partition_id``.

        Semantics as :meth:`adapters.memory.MemoryStore.put`: last write wins per
        field, other fields are kept, ``tags[i]`` merge into key ``i``'s tags and
        ``sequence_lengths[i]`` replaces its length.

        Returns:
            The receipt of :func:`adapters.store_port.validate_put`.

        Raises:
            RuntimeError: the store is closed, or TQ is not running (its error chained).
            TypeError: ``fields`` is not a TensorDict, or a column is of an unsupported kind.
            ValueError: keys repeat or are empty; the batch size differs from the
                key count; tags or lengths are not 1:1 with keys; a tag uses a
                reserved name (``__kvspec__``, ``__kvlen__``).
        """
        self._check_open()
        plan = plan_put(keys, partition_id, fields, tags=tags, sequence_lengths=sequence_lengths, pad_rows=self._kv_backend)
        client = self._client()
        meta = client.kv_retrieve_meta(keys=list(plan.receipt.keys), partition_id=partition_id, create=True)
        fresh = new_keys(plan, meta.custom_meta)
        meta.update_custom_meta(tag_updates(plan, meta.custom_meta))
        try:
            client.put(plan.payload, metadata=meta)
        except BaseException:
            if fresh:
                with contextlib.suppress(Exception):  # e.g. TQ's event loop is gone too
                    client._run_coroutine(_drop_registered(client, meta.select_samples(fresh)))
            raise
        return plan.receipt

    def get(self, keys: Keys, partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """Read ``select_fields`` of ``keys`` as a TensorDict of batch size ``len(keys)``, in request order.

        Each field comes back in the kind it was put (dense, jagged, object
        array, NonTensorStack), bit for bit.

        Raises:
            RuntimeError: the store is closed, or TQ disagrees with the recorded specs.
            TypeError: ``select_fields`` is a single string.
            ValueError: keys repeat or are empty; no field is selected; a field
                was put with different layouts for the requested keys.
            KeyError: some keys are not stored; a selected field is missing for
                some keys (names the field and keys).
        """
        return self._get(keys, partition_id, select_fields, ())[0]

    def get_with_tags(
        self, keys: Keys, partition_id: str, select_fields: Sequence[str], tag_names: Sequence[str]
    ) -> tuple[TensorDict, tuple[dict[str, Any], ...]]:
        """:meth:`get` plus, per key, the tags of ``tag_names`` it holds, from the same meta lookup.

        Raises:
            Whatever :meth:`get` raises; ``TypeError`` if ``tag_names`` is a
            single string; ``ValueError`` if it names a reserved tag.
        """
        return self._get(keys, partition_id, select_fields, validate_tag_names(tag_names, RESERVED_TAGS))

    def _get(
        self, keys: Keys, partition_id: str, select_fields: Sequence[str], tag_names: tuple[str, ...]
    ) -> tuple[TensorDict, tuple[dict[str, Any], ...]]:
        self._check_open()
        keys, names = validate_get(keys, partition_id, select_fields)
        client = self._client()
        meta = client.kv_retrieve_meta(keys=list(keys), partition_id=partition_id, create=False)
        self._check_found(client, keys, partition_id, meta)
        specs = plan_get(keys, partition_id, names, meta.custom_meta)
        tags = pick_tags(meta.custom_meta, tag_names)
        selected = select_wires(meta, specs, partition_id)
        return decode_columns(specs, client.get_data(selected), len(keys), pad_rows=self._kv_backend), tags

    def clear(self, keys: Keys, partition_id: str) -> None:
        """Remove ``keys`` (all their fields, tags and lengths) from ``partition_id``.

        Exact (``"k1"`` never touches ``"k11"``) and all-or-nothing: if any key is
        not stored nothing is removed. Clearing no keys does nothing.

        Raises:
            RuntimeError: the store is closed.
            TypeError: ``keys`` is a single string.
            ValueError: keys repeat or are empty strings.
            KeyError: some keys are not stored in ``partition_id``.
        """
        self._check_open()
        keys = _clear_keys(partition_id, keys)
        if not keys:
            return
        client = self._client()
        meta = client.kv_retrieve_meta(keys=list(keys), partition_id=partition_id, create=False)
        self._check_found(client, keys, partition_id, meta)
        groups = field_set_groups(meta.custom_meta) if self._kv_backend else []
        if len(groups) <= 1:
            client.clear_samples(meta)
            return
        # A key/value backend removes (field, key) pairs of the fields every cleared key holds: one clear per field set.
        for group in groups:
            subset = [keys[i] for i in group]
            client.clear_samples(client.kv_retrieve_meta(keys=subset, partition_id=partition_id, create=False))

    def list_keys(self, partition_id: str) -> tuple[str, ...]:
        """The keys stored in ``partition_id``, in first-put order (empty if unknown).

        Raises:
            RuntimeError: the store is closed.
            TypeError: ``partition_id`` is not a str.
        """
        self._check_open()
        _check_partition(partition_id)
        return tuple(self._client().kv_list(partition_id).get(partition_id, {}))

    def describe(self, keys: Keys, partition_id: str) -> KVBatchMeta:
        """What is stored for ``keys``: fields every key holds (first-put order), each
        key's merged tags (reserved ones hidden), and lengths when every key has one.

        Raises:
            RuntimeError: the store is closed.
            ValueError: keys repeat or are empty.
            KeyError: some keys are not stored.
        """
        self._check_open()
        keys = _describe_keys(partition_id, keys)
        client = self._client()
        meta = client.kv_retrieve_meta(keys=list(keys), partition_id=partition_id, create=False)
        self._check_found(client, keys, partition_id, meta)
        return describe_meta(keys, partition_id, meta.custom_meta)

    def close(self) -> None:
        """Mark the store closed; the owner also shuts TQ (and Ray, if it started it) down. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._owns_tq:
                try:
                    tq.close()
                finally:
                    _stop(self._backend_processes)  # TQ leaves the Mooncake master running
        finally:
            if self._owns_ray:
                ray.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "TransferQueueStore is closed: attach a new one, e.g. store = TransferQueueStore.attach()"
            )

    def _client(self) -> tq.TransferQueueClient:
        try:
            client = tq.get_client()
        except AssertionError:
            client = None
        if client is None:
            raise RuntimeError(
                "TransferQueue is not running in this process (its owner closed it): "
                "start it again with TransferQueueStore.start()"
            )
        return client

    @staticmethod
    def _check_found(
        client: tq.TransferQueueClient, keys: Sequence[str], partition_id: str, meta: tq.BatchMeta
    ) -> None:
        if meta.size != len(keys):
            found = (
                client.kv_retrieve_keys(global_indexes=meta.global_indexes, partition_id=partition_id)
                if meta.size
                else []
            )
            raise unknown_keys_error(partition_id, unknown_keys(keys, found))

