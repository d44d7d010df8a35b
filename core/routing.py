"""Router replay (R3): the experts an MoE router chose at rollout, as a per-token field, and how far training drifts.

R3 ("Rollout Routing Replay") records, for every generated token, every layer
and every top-k slot, the expert the rollout's router chose, and makes the
trainer route each token through those very experts. The record is the token
field ``routed_experts`` (:data:`core.fields.ROUTED_EXPERTS`): ``[T, layers,
topk]`` per row, jagged on the wire, ``[B, S, layers, topk]`` padded in a rank
batch, holding expert ids in ``[0, num_experts)`` and :data:`NO_ROUTE` (-1)
where there is no route.

Invariants:
  * a routing is stored in :func:`routing_dtype` (the narrowest signed integer
    dtype holding ``-1`` and every id), and ``decode_routing(encode_routing(x,
    E))`` is ``x`` for every ``x`` in ``[-1, E)``;
  * a *valid* routing (:func:`check_routing`) gives every real token
    (position ``t < lengths[i]``) ``topk`` distinct experts in ``[0,
    num_experts)`` in every layer; padding positions may hold anything (the
    codec pads with 0 by default, -1 when asked) and are never read;
  * :func:`pad_routing_for_replay` leaves every real position bit for bit and
    gives every padding position ``0, 1, ..., topk - 1``, so a padded batch
    replays with no -1 and no repeated expert;
  * the metrics (:func:`routing_disagreement`, :func:`logprob_mismatch`) read
    real tokens only, compare each token's top-k as a set (slot order never
    matters) and are 0 for identical inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from core.checks import check_int, check_int_entries
from core.grpo import TokenMask, _check_floating, _check_mask, _check_shape, _masked_mean, kl_k3

NO_ROUTE = -1
"""The id of "no route": a position (padding, or a token not yet routed) that names no expert."""

RoutedExperts = Tensor  # IntTensor[B, S, layers, topk] (or [T, layers, topk], one row of real tokens)
RowLengths = Sequence[int] | Tensor  # [B]: real tokens of each row

_ROUTING_DTYPES = (torch.int8, torch.int16, torch.int32)


# ---------------------------------------------------------------- dtype and codec


def routing_dtype(num_experts: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds :data:`NO_ROUTE` and every id ``0 .. num_experts - 1``.

    int8 up to 128 experts (ids up to 127), int16 up to 32768, int32 up to 2**31.

    Raises:
        TypeError: ``num_experts`` is not an int.
        ValueError: ``num_experts < 1``, or its largest id does not fit int32.

    Example:
        >>> routing_dtype(8), routing_dtype(128), routing_dtype(129), routing_dtype(40_000)
        (torch.int8, torch.int8, torch.int16, torch.int32)
    """
    experts = check_int("num_experts", num_experts, minimum=1)
    for dtype in _ROUTING_DTYPES:
        if experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    top = torch.iinfo(_ROUTING_DTYPES[-1]).max + 1
    raise ValueError(f"'num_experts' must be <= {top} (its ids must fit int32): got {experts}")


def encode_routing(indices: Tensor, num_experts: int) -> RoutedExperts:
    """``indices`` (expert ids, or -1 for no route) cast to :func:`routing_dtype` ``(num_experts)``, after a range check.

    Args:
        indices: an integer tensor of any shape (megatron's router gives int64).
        num_experts: the experts of each MoE layer, >= 1.

    Returns:
        A new tensor of the same shape and values, in ``routing_dtype(num_experts)``.

    Raises:
        TypeError: ``indices`` is not an integer tensor; ``num_experts`` is not an int.
        ValueError: an entry is outside ``[-1, num_experts)``; ``num_experts`` is out of range.

    Example:
        >>> encode_routing(torch.tensor([[3, -1]]), num_experts=8)
        tensor([[ 3, -1]], dtype=torch.int8)
    """
    dtype = routing_dtype(num_experts)
    tensor = _check_integer("indices", indices)
    bad = (tensor < NO_ROUTE) | _at_least(tensor, num_experts)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"'indices' must hold expert ids in [-1, {num_experts}) (-1: no route): "
            f"got {int(tensor[index])} at index {index}"
        )
    return tensor.to(dtype, copy=True)


def decode_routing(routed: RoutedExperts) -> Tensor:
    """``routed`` as int64 ids, the dtype megatron's router replay takes (the inverse of :func:`encode_routing`).

    Raises:
        TypeError: ``routed`` is not an integer tensor.
        ValueError: an entry is below -1.

    Example:
        >>> decode_routing(encode_routing(torch.tensor([5, -1]), num_experts=6)).tolist()
        [5, -1]
    """
    tensor = _check_integer("routed", routed)
    bad = tensor < NO_ROUTE
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"'routed' must hold expert ids >= -1 (-1: no route): got {int(tensor[index])} at index {index}")
    return tensor.to(torch.int64, copy=True)


def routing_bytes(num_tokens: int, num_layers: int, topk: int, num_experts: int) -> int:
    """Bytes of ``routed_experts`` for ``num_tokens`` tokens: one id per token, layer and slot, in :func:`routing_dtype`.

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``num_tokens < 0``; ``num_layers``, ``topk`` or ``num_experts`` below 1;
            ``num_experts`` too large (see :func:`routing_dtype`).

    Example:
        >>> routing_bytes(1000, num_layers=24, topk=8, num_experts=128)
        192000
    """
    tokens = check_int("num_tokens", num_tokens, minimum=0)
    layers = check_int("num_layers", num_layers, minimum=1)
    slots = check_int("topk", topk, minimum=1)
    return tokens * layers * slots * routing_dtype(num_experts).itemsize


# ---------------------------------------------------------------- validation


def check_routing(
    routed: RoutedExperts,
    lengths: RowLengths | None,
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    field: str = "routed_experts",
) -> None:
    """Check that ``routed`` routes every real token through ``topk`` distinct experts in every layer.

    A real token is position ``t < lengths[i]`` of row ``i``; every other
    position is padding and may hold anything (it is never read). Errors name
    the first bad (row, token, layer), in that order, checking ids before
    missing routes before repeats.

    Args:
        routed: ``[B, S, num_layers, topk]`` integer tensor, or ``[T,
            num_layers, topk]`` (the tokens of one row, all real).
        lengths: the real tokens of each row, ``B`` ints in ``[0, S]`` (a
            sequence or a 1-D integer tensor); None: every position is real.
            Must be None for a 3-D ``routed``.
        num_layers: MoE layers recorded, >= 1.
        topk: experts per token and layer, in ``[1, num_experts]``.
        num_experts: experts per layer, >= 1.
        field: the name errors give ``routed``.

    Raises:
        TypeError: ``routed`` is not an integer tensor; a size or length is not an int.
        ValueError: ``routed`` has another shape; a length is out of range or
            ``lengths`` has another count; a real token has an id outside
            ``[0, num_experts)``, a missing route (-1) or an expert repeated
            in its top-k slots.

    Example:
        >>> routed = torch.tensor([[[[0, 2]], [[1, 9]]]])  # 1 row, 2 tokens, 1 layer, top-2
        >>> check_routing(routed, [1], num_layers=1, topk=2, num_experts=4)  # token 1 is padding
        >>> check_routing(routed, [2], num_layers=1, topk=2, num_experts=4)
        Traceback (most recent call last):
        ...
        ValueError: routed_experts row 0 token 1 layer 0: expected expert ids in [0, 4), got 9
    """
    experts = check_int("num_experts", num_experts, minimum=1)
    layers = check_int("num_layers", num_layers, minimum=1)
    slots = check_int("topk", topk, minimum=1)
    if slots > experts:
        raise ValueError(f"'topk' must be in [1, num_experts ({experts})]: got {slots}")
    padded, real = _padded_and_real(field, routed, lengths)
    if tuple(padded.shape[2:]) != (layers, slots):
        raise ValueError(
            f"'{field}' must have shape [B, S, {layers}, {slots}] ([B, S, num_layers, topk]): "
            f"got {tuple(padded.shape)}"
        )
    selected = real[:, :, None, None]
    out_of_range = selected & (((padded < 0) & (padded != NO_ROUTE)) | _at_least(padded, experts))
    if bool(out_of_range.any()):
        row, token, layer, slot = _first(out_of_range)
        raise ValueError(
            f"{field} row {row} token {token} layer {layer}: expected expert ids in [0, {experts}), "
            f"got {int(padded[row, token, layer, slot])}"
        )
    missing = selected & (padded == NO_ROUTE)
    if bool(missing.any()):
        row, token, layer, slot = _first(missing)
        raise ValueError(
            f"{field} row {row} token {token} layer {layer}: expected a route in each of the {slots} top-k slots "
            f"(ids in [0, {experts})), got {NO_ROUTE} (no route) in slot {slot}"
        )
    ordered = padded.sort(dim=-1).values
    repeated = real[:, :, None] & (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if bool(repeated.any()):
        row, token, layer = _first(repeated)
        raise ValueError(
            f"{field} row {row} token {token} layer {layer}: expected {slots} distinct experts, "
            f"got {padded[row, token, layer].tolist()}"
        )


def pad_routing_for_replay(routed: RoutedExperts, lengths: RowLengths | None) -> RoutedExperts:
    """``routed`` with every padding position routed to experts ``0, 1, ..., topk - 1``, real tokens untouched.

    Megatron replays a routing for every position of a padded batch, padding
    included, and rejects -1; padding's loss is masked, so any valid route
    does. Call it on a routing :func:`check_routing` accepts (``topk <=
    num_experts``, so ``0 .. topk - 1`` are valid, distinct ids).

    Args:
        routed: ``[B, S, layers, topk]`` integer tensor (or ``[T, layers,
            topk]``, all real: returned as a copy).
        lengths: the real tokens of each row, as in :func:`check_routing`.

    Returns:
        A new tensor of ``routed``'s shape and dtype: equal to it (bitwise) at
        real positions, ``arange(topk)`` in every layer of every padding position.

    Raises:
        TypeError: ``routed`` is not an integer tensor, a length is not an int.
        ValueError: ``routed`` is not 3-D or 4-D; ``lengths`` does not fit it.

    Example:
        >>> routed = torch.tensor([[[[3, 1]], [[-1, -1]]]])  # 1 row, 2 tokens, 1 layer, top-2
        >>> pad_routing_for_replay(routed, [1]).tolist()
        [[[[3, 1]], [[0, 1]]]]
    """
    padded, real = _padded_and_real("routed", routed, lengths)
    if padded.dim() != 4:
        raise ValueError(f"'routed' must be [B, S, layers, topk] or [T, layers, topk]: got shape {tuple(routed.shape)}")
    fill = torch.arange(padded.shape[-1], dtype=padded.dtype, device=padded.device).expand_as(padded)
    out = torch.where(real[:, :, None, None], padded, fill)
    return out.reshape(routed.shape)


# ---------------------------------------------------------------- metrics


@attrs.frozen
class RoutingDisagreement:
    """How two routings of the same real tokens differ, as counts; the shares are derived.

    A *decision* is one router call: one real token in one layer, whose
    outcome is the *set* of its top-k experts. A decision differs when the
    two sets differ; a token differs when any of its decisions does. Hence
    ``differing_tokens <= differing_decisions <= differing_tokens * layers``
    and ``decision_share <= token_share <= layers * decision_share``.

    Attributes:
        tokens: real tokens compared.
        decisions: decisions compared, ``tokens * layers``.
        differing_tokens: tokens routed differently in at least one layer.
        differing_decisions: (token, layer) decisions whose expert sets differ.

    Raises:
        TypeError: a count is not an int.
        ValueError: a count is negative, or a differing count exceeds its total
            or the relation between the differing counts is broken.
    """

    tokens: int = attrs.field(converter=lambda v: check_int("tokens", v, minimum=0))
    decisions: int = attrs.field(converter=lambda v: check_int("decisions", v, minimum=0))
    differing_tokens: int = attrs.field(converter=lambda v: check_int("differing_tokens", v, minimum=0))
    differing_decisions: int = attrs.field(converter=lambda v: check_int("differing_decisions", v, minimum=0))

    def __attrs_post_init__(self) -> None:
        if self.differing_tokens > self.tokens:
            raise ValueError(f"'differing_tokens' must be <= tokens ({self.tokens}): got {self.differing_tokens}")
        if self.differing_decisions > self.decisions:
            raise ValueError(
                f"'differing_decisions' must be <= decisions ({self.decisions}): got {self.differing_decisions}"
            )
        if self.differing_tokens > self.differing_decisions:
            raise ValueError(
                f"'differing_decisions' must be >= differing_tokens ({self.differing_tokens}; a differing token "
                f"has a differing decision): got {self.differing_decisions}"
            )

    @property
    def token_share(self) -> float:
        """Share of real tokens routed differently in at least one layer (0.0 when there are none)."""
        return self.differing_tokens / self.tokens if self.tokens else 0.0

    @property
    def decision_share(self) -> float:
        """Share of router decisions (token, layer) whose expert sets differ (0.0 when there are none)."""
        return self.differing_decisions / self.decisions if self.decisions else 0.0


def routing_disagreement(
    recorded: RoutedExperts, replayed: RoutedExperts, lengths: RowLengths | None
) -> RoutingDisagreement:
    """How the routing recomputed in training (``replayed``) differs from the rollout's (``recorded``), on real tokens.

    Each (token, layer) decision is compared as the set of its top-k experts
    (sorted, so slot order never matters; a repeated id counts as a multiset,
    which :func:`check_routing` rules out). Padding is never read.

    Args:
        recorded: ``[B, S, layers, topk]`` integer tensor (or ``[T, layers, topk]``).
        replayed: an integer tensor of the same shape (any integer dtype).
        lengths: the real tokens of each row, as in :func:`check_routing`.

    Returns:
        The counts of :class:`RoutingDisagreement`; its shares are 0 for identical routings.

    Raises:
        TypeError: a routing is not an integer tensor; a length is not an int.
        ValueError: the shapes differ or are not 3-D / 4-D; ``lengths`` does not fit.

    Example:
        >>> a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])  # 1 row, 2 tokens, 2 layers, top-2
        >>> b = torch.tensor([[[[1, 0], [2, 3]], [[4, 5], [6, 0]]]])  # token 0 reordered, token 1 layer 1 differs
        >>> d = routing_disagreement(a, b, [2])
        >>> d.token_share, d.decision_share
        (0.5, 0.25)
    """
    first, real = _padded_and_real("recorded", recorded, lengths)
    second = _check_integer("replayed", replayed)
    _check_shape("replayed", second, tuple(recorded.shape), "same as 'recorded'")
    if first.dim() != 4:
        raise ValueError(
            f"'recorded' must be [B, S, layers, topk] or [T, layers, topk]: got shape {tuple(recorded.shape)}"
        )
    second = second.reshape(first.shape)
    differs = (first.sort(dim=-1).values.to(torch.int64) != second.sort(dim=-1).values.to(torch.int64)).any(dim=-1)
    differs = differs & real[:, :, None]  # [B, S, layers]
    tokens = int(real.sum())
    return RoutingDisagreement(
        tokens=tokens,
        decisions=tokens * first.shape[2],
        differing_tokens=int(differs.any(dim=-1).sum()),
        differing_decisions=int(differs.sum()),
    )


@attrs.frozen
class LogprobMismatch:
    """How the trainer's log-probs of the sampled tokens differ from the rollout's, over real tokens.

    Attributes:
        mean_abs_diff: mean of ``|train - rollout|`` (symmetric in its inputs).
        k3_kl: mean of the k3 estimator of KL(rollout || train), >= 0.
        tokens: the tokens averaged over (0: both means are 0.0).
    """

    mean_abs_diff: float
    k3_kl: float
    tokens: int


def logprob_mismatch(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: TokenMask) -> LogprobMismatch:
    """The training-inference mismatch of the sampled tokens: mean absolute log-prob gap and the k3 KL.

        d_t   = train_t - rollout_t
        k3_t  = exp(d_t) - 1 - d_t    (>= 0; its mean over tokens the rollout
                                       sampled estimates KL(rollout || train))

    both averaged over the tokens where ``mask`` is non-zero (a floating mask
    weights them). Masked-out positions may hold anything (``-inf``, NaN).
    With router replay the gap should shrink: this is the metric R3 moves.

    Args:
        train_logprobs: [B, S] floating log-probs the trainer computes for the sampled tokens.
        rollout_logprobs: [B, S] floating log-probs the rollout recorded (``generation_logprobs``).
        mask: [B, S] bool, or floating weights; 0 marks tokens that do not count.

    Returns:
        A :class:`LogprobMismatch` (floats; 0.0 for equal log-probs, or when no token counts).

    Raises:
        TypeError: a log-prob tensor is not floating; ``mask`` is neither bool nor floating.
        ValueError: the shapes differ.

    Example:
        >>> train = torch.tensor([[-1.0, -2.0, -9.0]])
        >>> m = logprob_mismatch(train, torch.tensor([[-1.0, -1.0, 0.0]]), torch.tensor([[True, True, False]]))
        >>> m.mean_abs_diff, round(m.k3_kl, 4), m.tokens
        (0.5, 0.1839, 2)
    """
    train = _check_floating("train_logprobs", train_logprobs)
    rollout = _check_floating("rollout_logprobs", rollout_logprobs)
    _check_shape("rollout_logprobs", rollout, tuple(train.shape), "same as 'train_logprobs'")
    weights = _check_mask(mask, tuple(train.shape), torch.float64)
    selected = weights != 0
    t = torch.where(selected, train.detach().to(torch.float64), 0)
    r = torch.where(selected, rollout.detach().to(torch.float64), 0)
    mean_abs = _masked_mean((t - r).abs(), weights, None, None)
    k3 = _masked_mean(kl_k3(r, t), weights, None, None)
    return LogprobMismatch(mean_abs_diff=float(mean_abs), k3_kl=float(k3), tokens=int(selected.sum()))


# ---------------------------------------------------------------- helpers


def _at_least(tensor: Tensor, bound: int) -> Tensor:
    """``tensor >= bound`` for an integer tensor, exact for a bound its dtype cannot hold (torch would wrap
    ``bound`` into the dtype: an int8 tensor ``>= 128`` compares with -128, true for every entry)."""
    if bound > torch.iinfo(tensor.dtype).max:
        return torch.zeros_like(tensor, dtype=torch.bool)
    return tensor >= bound


def _check_integer(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor) or value.is_nested:
        kind = "a nested tensor" if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"'{name}' must be a dense integer tensor: got {kind}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"'{name}' must have an integer dtype (expert ids): got {value.dtype}; pass {name}.long()")
    return value


def _padded_and_real(name: str, routed: Any, lengths: RowLengths | None) -> tuple[Tensor, Tensor]:
    """``routed`` as [B, S, ...] (a 3-D one as one row) and its [B, S] bool mask of real positions."""
    tensor = _check_integer(name, routed)
    if tensor.dim() == 3:
        if lengths is not None:
            raise ValueError(
                f"'lengths' must be None for a 3-D '{name}' ([T, layers, topk]: one row, every token real): "
                f"got {lengths!r}; pass a [B, S, layers, topk] batch to give row lengths"
            )
        tensor = tensor.unsqueeze(0)
    elif tensor.dim() != 4:
        raise ValueError(f"'{name}' must be [B, S, layers, topk] or [T, layers, topk]: got shape {tuple(tensor.shape)}")
    rows, width = tensor.shape[0], tensor.shape[1]
    if lengths is None:
        return tensor, torch.ones(rows, width, dtype=torch.bool, device=tensor.device)
    lens = _lengths(lengths, rows, width, name)
    real = torch.arange(width, device=tensor.device) < torch.tensor(lens, dtype=torch.int64, device=tensor.device)[:, None]
    return tensor, real


def _lengths(lengths: RowLengths, rows: int, width: int, name: str) -> tuple[int, ...]:
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"'lengths' must be a 1-D integer tensor (one entry per row): got {lengths.dtype} of shape {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    lens = check_int_entries("lengths", lengths, minimum=0)
    if len(lens) != rows:
        raise ValueError(f"'lengths' must have {rows} entries (one per row of '{name}'): got {len(lens)}")
    for row, length in enumerate(lens):
        if length > width:
            raise ValueError(f"'lengths' entries must be <= {width} (the width S of '{name}'): got {length} at index {row}")
    return lens


def _first(mask: Tensor) -> tuple[int, ...]:
    """The index of the first True of ``mask`` in row-major order."""
    return tuple(int(i) for i in mask.nonzero()[0])
