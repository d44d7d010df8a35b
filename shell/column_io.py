"""Column I/O: the three ways trainers move columns through a data-plane client.

* :func:`first_write`: the rollout's one bulk put. Per-token fields go on the
  wire jagged (``core.codec.pack_fields``), so padding never travels.
  :func:`first_write_behind` is the same put with its store I/O on an
  executor: the caller gets the receipt at once and a future of the write.
* :func:`read_columns`: read columns by a meta's keys; per-token fields come
  back padded to the step's ``global_forward_pad_seqlen`` when the meta
  carries one (so every DP rank forwards at the same length).
* :func:`write_columns`: write results back under the same keys; per-token
  results are trimmed to each row's length first, so they line up with the
  jagged rows of the first write. It only adds fields to stored keys: a key
  no first write stored raises, so no orphan key is ever created.

Invariant: ``read_columns(c, first_write(c, f, ...), names, layout="jagged")``
returns the token fields of ``f`` trimmed to their lengths and the other
fields unchanged.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from adapters.rows import build_tensordict, read_columns_of
from adapters.store_port import DataPlaneClient, validate_put
from core.codec import Layout, is_jagged, materialize, pack_fields, to_jagged
from core.fields import GLOBAL_FORWARD_PAD_SEQLEN
from core.meta import KVBatchMeta

Columns = Mapping[str, Any]


def _columns(fields: TensorDict | Columns) -> dict[str, Any]:
    if isinstance(fields, TensorDict):
        return read_columns_of(fields)
    if isinstance(fields, Mapping):
        return dict(fields)
    raise TypeError(f"'fields' must be a TensorDict or a mapping of name -> column: got {type(fields).__name__}")


def first_write(
    client: DataPlaneClient,
    fields: TensorDict | Columns,
    *,
    keys: Sequence[str],
    partition_id: str,
    lengths: Sequence[int],
    token_fields: Collection[str],
    tags: Sequence[Mapping[str, Any]] | None = None,
    extra_info: Mapping[str, Any] | None = None,
) -> KVBatchMeta:
    """Put a rollout batch once: token fields jagged, the rest as they are.

    Args:
        client: the store.
        fields: ``(N, S, ...)`` token fields and any other ``(N, ...)`` columns.
        keys: one key per row.
        partition_id: the partition to write.
        lengths: valid tokens per row (stored as the meta's sequence lengths).
        token_fields: names of the per-token fields.
        tags: optional per-row tags.
        extra_info: batch-wide metadata to put on the returned meta.

    Returns:
        The receipt, with ``sequence_lengths``, ``tags`` and ``extra_info``.

    Raises:
        ValueError: a token field is missing or narrower than its rows, or
            sizes do not match (see ``core.codec.pack_fields`` and the port).
    """
    wire = _wire(fields, keys, lengths, token_fields)
    receipt = client.put(keys, partition_id, wire, tags=tags, sequence_lengths=lengths)
    return receipt.with_extra_info(**dict(extra_info or {}))


def first_write_behind(
    client: DataPlaneClient,
    fields: TensorDict | Columns,
    *,
    executor: concurrent.futures.Executor,
    keys: Sequence[str],
    partition_id: str,
    lengths: Sequence[int],
    token_fields: Collection[str],
    tags: Sequence[Mapping[str, Any]] | None = None,
    extra_info: Mapping[str, Any] | None = None,
) -> tuple[KVBatchMeta, concurrent.futures.Future[KVBatchMeta]]:
    """:func:`first_write` with its store I/O on ``executor``: the receipt now, the write behind it.

    What needs no store runs here, in the caller, before anything is
    submitted: the codec (``core.codec.pack_fields``) and the port's checks
    (:func:`adapters.store_port.validate_put`, which builds the receipt every
    adapter returns), so bad input raises here and nothing is written. The
    put runs on ``executor``; its future resolves to the same receipt once the
    rows are stored, or raises the put's error (the adapter has then written
    nothing, as for a synchronous put: adapter-level checks, such as an
    unsupported dtype, raise there).

    No reader or clear of these keys may start before the future resolves:
    whoever hands the keys on waits for it first (the driver's transport does:
    :meth:`shell.transport.DataPlaneTransport.admit`'s ``landed``).

    Returns:
        ``(receipt, future)``: ``receipt`` as :func:`first_write` returns it,
        and the write's future (resolving to the store's receipt, equal to it).

    Raises:
        ValueError, TypeError: as :func:`first_write`, before any I/O.
    """
    wire = _wire(fields, keys, lengths, token_fields)
    receipt = validate_put(keys, partition_id, wire, tags=tags, sequence_lengths=lengths)
    receipt = receipt.with_extra_info(**dict(extra_info or {}))

    def write() -> KVBatchMeta:
        stored = client.put(keys, partition_id, wire, tags=tags, sequence_lengths=lengths)
        return stored.with_extra_info(**dict(extra_info or {}))

    return receipt, executor.submit(write)


def _wire(fields: TensorDict | Columns, keys: Sequence[str], lengths: Sequence[int], token_fields: Collection[str]) -> TensorDict:
    """A first write's wire batch: the token fields jagged (``core.codec.pack_fields``), the rest as they are."""
    columns = _columns(fields)
    tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
    packed = pack_fields(tensors, lengths=lengths, token_fields=token_fields)
    return build_tensordict({**columns, **packed}, len(keys))


def read_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    fields: Sequence[str],
    *,
    layout: Layout = "padded",
    pad_values: Mapping[str, float | int | bool] | None = None,
) -> TensorDict:
    """Read ``fields`` of ``meta``'s rows, in ``meta.keys`` order.

    With ``layout="padded"`` jagged (per-token) fields are padded to
    ``meta.extra_info["global_forward_pad_seqlen"]`` when it is set, else to
    the longest row; ``pad_values`` gives per-field pad values (default 0).
    With ``layout="jagged"`` they stay jagged.

    Raises:
        KeyError: a key or a field is not stored (see the port).
        ValueError: a row is longer than the global pad length.
    """
    out = client.get(meta.keys, meta.partition_id, list(fields))
    columns = read_columns_of(out)
    pad_to = meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN)
    tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
    shaped = materialize(tensors, layout=layout, pad_values=pad_values, pad_to_length=pad_to if layout == "padded" else None)
    return build_tensordict({**columns, **shaped}, len(meta))


def write_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    fields: TensorDict | Columns,
    *,
    token_fields: Collection[str] | None = None,
) -> KVBatchMeta:
    """Write result columns back under ``meta``'s keys; return ``meta`` listing the new fields.

    Per-token results are trimmed to each row's length (``meta.sequence_lengths``)
    and written jagged. ``token_fields`` names them; when None, a dense tensor
    of 2 or more dims whose dim 1 is at least the longest row (and wider than
    1) is taken as per-token, and a jagged tensor is written as it is.

    Raises:
        ValueError: per-token fields need ``meta.sequence_lengths``; a field's
            rows do not match the key count.
        KeyError: some of ``meta``'s keys are not stored (never written, or
            cleared); names the partition and keys. Nothing is written.
    """
    columns = _columns(fields)
    lengths = meta.sequence_lengths
    if token_fields is None:
        longest = max(lengths, default=0) if lengths is not None else None
        token_fields = [
            name
            for name, v in columns.items()
            if isinstance(v, torch.Tensor) and not is_jagged(v) and v.dim() >= 2 and longest is not None
            and v.shape[1] >= longest and v.shape[1] > 1
        ]
    missing = sorted(set(token_fields) - set(columns))
    if missing:
        raise ValueError(f"'token_fields' must name fields being written: {missing} are not in {sorted(columns)}")
    token_fields = [name for name in token_fields if not is_jagged(columns[name])]
    if token_fields and lengths is None:
        raise ValueError(
            f"'meta.sequence_lengths' is needed to trim per-token fields {sorted(token_fields)}: got None; "
            f"write them jagged or pass token_fields=()"
        )
    for name in token_fields:
        columns[name] = to_jagged(columns[name], lengths)  # type: ignore[arg-type]
    wire = build_tensordict(columns, len(meta))
    try:
        client.put(meta.keys, meta.partition_id, wire, require_stored=True)
    except KeyError as error:
        raise KeyError(
            f"write_columns adds fields to stored keys only (first_write stores them), so it would leave orphan "
            f"keys: {error.args[0]}"
        ) from None
    return meta.with_fields(columns)


def clear_stored(client: DataPlaneClient, keys: Sequence[str], partition_id: str) -> int:
    """Clear those of ``keys`` that ``partition_id`` still holds (keys already gone are skipped); how many.

    The port's ``clear`` wants stored keys; a row may have been cleared by
    another owner (the step, the buffer, a shutdown sweep) in the meantime.
    The usual case, every key still stored, is one ``clear``; only when it
    raises ``KeyError`` (which, by the port's contract, removes nothing) are
    the partition's keys listed and the stored ones cleared.
    """
    if not keys:
        return 0
    try:
        client.clear(keys, partition_id)
        return len(keys)
    except KeyError:
        pass
    stored = set(client.list_keys(partition_id))
    present = [k for k in keys if k in stored]
    if present:
        client.clear(present, partition_id)
    return len(present)
