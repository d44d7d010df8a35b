"""The TransferQueue wire format: how a user column, its spec and its key's length travel through TQ.

Tensor columns travel whole, as TQ takes them (a dense ``(N, *shape)`` tensor,
a jagged nested tensor), with no per-row work. Each user field ``name`` is
stored under the *wire field* ``name@kind.dtype.shape`` (:func:`wire_name`,
e.g. ``input_ids@jagged.int64.`` or ``hidden@dense.float16.5x3``): TQ's
controller allows one dtype per field and partition (a put that changes it is
accepted, but the controller only logs an error and skips the put's field
bookkeeping, leaving the field unreadable), and a wire field only ever holds
one spec, so a rewrite with another kind, dtype or shape goes to another wire
field and never conflicts. The reserved tag :data:`SPEC_TAG` of each key is
one short string, the JSON list of its current wire fields (:func:`spec_tag`),
parsed once per distinct string (TQ deep-copies every key's tags on each call,
so they are kept flat); :data:`LENGTH_TAG` holds its sequence length. Object
columns (numpy object arrays, ``NonTensorStack``) travel as one pickle per row
(jagged ``uint8``), since msgpack would turn tuples and sets into lists.

Everything here is pure: :func:`plan_put` checks and encodes a put, and
:func:`plan_get` / :func:`decode_columns` read the specs back from the tags
and rebuild the columns from what TQ returned. On the Mooncake backend
(``pad_rows``) the encodings of :mod:`adapters.tq_mooncake` apply on top.

Invariant: ``decode_columns(plan_get(...), <TQ's copy of plan_put(...).payload>)``
gives back every column in the kind, dtype and shape it was put, bit for bit,
and a wire field only ever holds one spec.
"""

from __future__ import annotations

import functools
import json
import pickle
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
import torch
import transfer_queue as tq
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
from adapters.store_port import TagColumns, missing_field_error, stored_meta
from adapters.tq_mooncake import (
    from_zero_byte_placeholder,
    pad_jagged_rows,
    unpad_jagged_rows,
    zero_byte_placeholder,
    zero_byte_rows,
)
from core.frozen import thaw
from core.jagged import jagged_parts
from core.meta import KVBatchMeta

SPEC_TAG = "__kvspec__"
"""Reserved tag: the JSON list of the wire fields a key holds (:func:`spec_tag`), one per user field."""
LENGTH_TAG = "__kvlen__"
"""Reserved tag: the key's sequence length (an int), when a put gave one."""
RESERVED_TAGS = frozenset({SPEC_TAG, LENGTH_TAG})

WireName = str
"""The TQ field a user field is stored under: ``name@kind.dtype.shape`` (:func:`wire_name`)."""
SpecTag = str
"""The value of the reserved tag :data:`SPEC_TAG`: a JSON list of wire names."""
StoredSpecs = Mapping[str, ColumnSpec]
"""Field name -> the spec of the row one key holds, in first-put order (read-only, shared)."""

_PARSE_CACHE = 4096
"""Distinct tag strings and wire names whose parse is kept (one per field layout in practice)."""
_NO_FIELDS: StoredSpecs = MappingProxyType({})


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


def plan_put(receipt: KVBatchMeta, fields: TensorDict, *, pad_rows: bool = False) -> PutPlan:
    """Check the rest of a put whose arguments passed :func:`adapters.store_port.validate_put` (its
    ``receipt``): TQ's reserved tag names and every column; then encode it for TQ.

    Tensor columns are checked whole (:func:`adapters.rows.column_spec`) and
    sent as they are: TQ serialises them before the put returns, so the
    store never aliases them. With ``pad_rows`` (a backend that rejects
    zero-byte values, :data:`adapters.tq_mooncake.MOONCAKE`) jagged tensor
    columns travel with one zero element appended to every row
    (:func:`adapters.tq_mooncake.pad_jagged_rows`), and a tensor column whose
    rows hold no bytes at all as its row lengths
    (:func:`adapters.tq_mooncake.zero_byte_placeholder`).

    Raises:
        TypeError: a column is of an unsupported kind (see :func:`adapters.rows.column_spec`).
        ValueError: a column does not fit (see :func:`adapters.rows.column_spec`); a tag
            uses one of TQ's reserved names :data:`RESERVED_TAGS`.
    """
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


def tag_updates(
    plan: PutPlan, current: Sequence[Mapping[str, Any]], reserved: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """What the put sets in each key's tags (TQ merges them shallowly into the current ones, new values win).

    The put's user tags, ``reserved[i]`` (checked by :func:`adapters.store_port.validate_put`), the merged
    spec tag and, if the put gave lengths, the length.
    """
    user = plan.receipt.tags
    lengths = plan.receipt.sequence_lengths
    by_name = reserved if isinstance(reserved, TagColumns) else None
    merged: dict[SpecTag | None, SpecTag] = {}  # keys mostly share one old tag: merge once per distinct tag
    out = []
    for i, old in enumerate(current):
        prev = _spec_tag_of(old)
        tag = merged.get(prev)
        if tag is None:
            tag = merged[prev] = merge_spec_tags(prev, plan.tag)
        update = thaw(user[i]) if user is not None else {}
        if reserved is not None and by_name is None:
            update.update(reserved[i])
        update[SPEC_TAG] = tag
        if lengths is not None:
            update[LENGTH_TAG] = lengths[i]
        out.append(update)
    if by_name is not None:  # a column per name, no mapping per key (reserved names never meet the keys above)
        for name in by_name.names:
            lacking = by_name.lacking(name)
            for i, (update, value) in enumerate(zip(out, by_name.column(name))):
                if not lacking or i not in lacking:
                    update[name] = value
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
    parts = jagged_parts(value)
    if parts is not None:
        # Each attribute of a jagged tensor costs a __torch_function__ call: read its buffers instead.
        if parts.offsets.shape[0] - 1 != n:
            raise RuntimeError(f"TransferQueue returned {parts.offsets.shape[0] - 1} rows of field {name!r}: expected {n}")
        values, dtype = parts.values, parts.values.dtype
        if parts.lengths is None and parts.ragged_dim == 1:
            inner = tuple(values.shape[1:])
            if spec.kind == "jagged" and dtype == spec.torch_dtype and inner == spec.shape:
                return value
            width = spec.shape[0] if spec.shape else 1  # Mooncake returns an (N,) field as rows of one element
            if spec.kind == "dense" and dtype == spec.torch_dtype and inner == spec.shape[1:]:
                if values.shape[0] == n * width and bool((parts.offsets.diff() == width).all()):
                    return values.reshape(n, *spec.shape)
            if spec.kind not in TENSOR_KINDS and dtype == torch.uint8 and not inner:
                flat = values.numpy().tobytes()
                bounds = parts.offsets.tolist()
                return stack_column(name, spec, [pickle.loads(flat[a:b]) for a, b in zip(bounds, bounds[1:])])
    elif isinstance(value, torch.Tensor):
        shape, layout, dtype = value.shape, value.layout, value.dtype
        if not shape or shape[0] != n:
            got = shape[0] if shape else "a 0-d tensor, no"
            raise RuntimeError(f"TransferQueue returned {got} rows of field {name!r}: expected {n}")
        if layout == torch.strided and not value.is_nested and spec.kind == "dense" and dtype == spec.torch_dtype:
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
    return stored_meta(
        keys,
        partition_id,
        [stored_specs(t) for t in tags],
        [{k: v for k, v in t.items() if k not in RESERVED_TAGS} for t in tags],
        [t.get(LENGTH_TAG) for t in tags],
    )
