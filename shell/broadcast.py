"""Leader broadcast of a dict of tensors over a process group, with no tensor payload ever pickled.

A replica group's leader reads a batch once and hands it to the other ranks of
its group in two phases:

1. a small *descriptor* (names, layouts, dtypes, shapes; for a jagged nested
   tensor its values' shape and its offsets' length) goes out with
   ``torch.distributed.broadcast_object_list``;
2. each tensor's bytes go out with ONE ``torch.distributed.broadcast`` (a
   jagged tensor sends its values and its offsets and is rebuilt on arrival).

Invariant: every rank returns a dict with the source's names, in its order,
each tensor with the source's layout, dtype, shape and bytes. The wire carries
raw bytes (a ``uint8`` view of each contiguous tensor), so every dtype crosses
every backend: gloo rejects ``int16``, ``uint16``, ``uint32`` and float8 in
broadcast, and ``bool`` / ``bfloat16`` support varies across versions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple, cast

import torch
import torch.distributed as dist

TensorDictLike = dict[str, torch.Tensor]
WireLayout = Literal["dense", "jagged"]


class TensorDescriptor(NamedTuple):
    """What a receiver needs to allocate one tensor: never its data.

    ``shape`` is the tensor's shape for a dense tensor, and its values' shape
    for a jagged one; ``offsets_length`` and ``offsets_dtype`` describe a
    jagged tensor's offsets (``None`` for dense); ``jagged_dim`` is its ragged dim.
    """

    name: str
    layout: WireLayout
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets_length: int | None = None
    offsets_dtype: torch.dtype | None = None
    jagged_dim: int | None = None


class _Rejected(NamedTuple):
    """Sent instead of a descriptor when the source rejects its data, so receivers fail instead of hanging."""

    message: str


def describe(data: Mapping[str, torch.Tensor]) -> tuple[TensorDescriptor, ...]:
    """The descriptor of ``data``: one entry per tensor, in ``data``'s order.

    Raises:
        TypeError: ``data`` is not a mapping of str -> tensor, or holds a
            nested tensor that is not ``torch.jagged``.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"'data' must be a dict of str -> torch.Tensor on the source rank: got {type(data).__name__}")
    entries = []
    for name, tensor in data.items():
        if not isinstance(name, str):
            raise TypeError(f"'data' keys must be str: got {type(name).__name__} ({name!r})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"'data[{name!r}]' must be a torch.Tensor: got {type(tensor).__name__}")
        if tensor.is_nested:
            if tensor.layout != torch.jagged:
                raise TypeError(
                    f"'data[{name!r}]' must be dense or a torch.jagged nested tensor: got layout {tensor.layout}; "
                    f"rebuild it with torch.nested.nested_tensor(rows, layout=torch.jagged)"
                )
            compact = tensor.contiguous()
            ragged = [i for i, size in enumerate(compact.shape) if isinstance(size, torch.SymInt)]
            entries.append(
                TensorDescriptor(
                    name,
                    "jagged",
                    compact.dtype,
                    tuple(compact.values().shape),
                    offsets_length=int(compact.offsets().numel()),
                    offsets_dtype=compact.offsets().dtype,
                    jagged_dim=ragged[0],
                )
            )
        else:
            entries.append(TensorDescriptor(name, "dense", tensor.dtype, tuple(tensor.shape)))
    return tuple(entries)


def _send(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None) -> None:
    wire = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if wire.numel():
        dist.broadcast(wire, src=src, group=group)


def _receive(
    shape: tuple[int, ...], dtype: torch.dtype, *, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    wire = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=device)
    if wire.numel():
        dist.broadcast(wire, src=src, group=group)
    return wire.view(dtype).reshape(shape)


def broadcast_tensors(
    data: Mapping[str, torch.Tensor] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str,
) -> TensorDictLike:
    """Broadcast ``data`` from global rank ``src`` to every rank of ``group``.

    Every rank of ``group`` must call this with the same ``src`` and ``group``.
    Dense tensors keep their shape and dtype; jagged tensors keep their rows and
    ragged dim (one with holes arrives compacted, as ``tensor.contiguous()``).

    Args:
        data: on ``src``, the tensors to send (name -> tensor); on every other rank, None.
        src: the sender's GLOBAL rank (as in ``torch.distributed.broadcast``).
        group: the process group; None is the default (world) group.
        device: where received tensors are allocated, and where the source's
            tensors are moved before sending (a CUDA device with NCCL).

    Returns:
        name -> tensor on ``device``, in the source's order. The source gets its
        own tensors back (moved to ``device``; the same objects if already there).

    Raises:
        TypeError: on ``src``, ``data`` is not a dict of str -> tensor; on every
            rank, when the source rejected its data (the receivers are told, so
            none hangs).
        ValueError: a rank other than ``src`` passed data (on that rank only:
            pass None there).

    Example:
        >>> out = broadcast_tensors(batch if rank == leader else None,  # doctest: +SKIP
        ...                         src=leader, group=replica_group, device="cpu")
    """
    device = torch.device(device)
    is_src = dist.get_rank() == src
    if not is_src and data is not None:
        raise ValueError(
            f"'data' must be None on every rank but the source ({src}): got "
            f"{type(data).__name__} on rank {dist.get_rank()}; pass data only on the source"
        )
    if is_src:
        try:
            descriptor: tuple[TensorDescriptor, ...] | _Rejected = describe(data)  # type: ignore[arg-type]
            rejection = None
        except TypeError as error:
            descriptor, rejection = _Rejected(str(error)), error
        box: list[object] = [descriptor]
        dist.broadcast_object_list(box, src=src, group=group, device=device)
        if rejection is not None:
            raise rejection
        sent = cast(Mapping[str, torch.Tensor], data)
        out: TensorDictLike = {}
        for entry in cast(tuple[TensorDescriptor, ...], descriptor):
            tensor = sent[entry.name].to(device)
            if entry.layout == "jagged":
                compact = tensor.contiguous()
                _send(compact.values(), src=src, group=group)
                _send(compact.offsets(), src=src, group=group)
            else:
                _send(tensor, src=src, group=group)
            out[entry.name] = tensor
        return out

    box = [None]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    received = box[0]
    if isinstance(received, _Rejected):
        raise TypeError(f"broadcast_tensors: the source rank {src} rejected its data: {received.message}")
    out = {}
    for entry in received:  # type: ignore[union-attr]
        values = _receive(entry.shape, entry.dtype, src=src, group=group, device=device)
        if entry.layout == "jagged":
            offsets = _receive(
                (entry.offsets_length,), entry.offsets_dtype, src=src, group=group, device=device  # type: ignore[arg-type]
            )
            out[entry.name] = torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=entry.jagged_dim)
        else:
            out[entry.name] = values
    return out
