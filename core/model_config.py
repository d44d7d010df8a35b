"""``TinyGPTConfig``: the shape of the tiny GPT policy, a pure value any process can build.

The driver builds it from the run's config (vocabulary from the task), and the
workers hand it to their model backend (:mod:`adapters.model_port`); building
one needs no model library.

Invariant: every size is a positive int, ``hidden_size`` is a multiple of
``num_attention_heads``, and an MoE model (``num_experts >= 2``) routes
``1 <= moe_topk <= num_experts`` experts per token, checked when the value is built.
"""

from __future__ import annotations

from typing import Any

import attrs


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"'{attribute.name}' must be int: got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"'{attribute.name}' must be a positive int: got {value}")


def _int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"'{attribute.name}' must be int: got {type(value).__name__} ({value!r})")


@attrs.frozen
class TinyGPTConfig:
    """Shape of the tiny GPT: learned absolute positions, LayerNorm, GELU MLP, untied output layer.

    ``num_experts`` 0 is a dense MLP in every layer; ``num_experts >= 2`` makes every layer's MLP a
    mixture of that many experts with ``moe_topk`` of them routed per token (``moe_topk`` is unused by a
    dense model).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is not positive, ``hidden_size`` is not a multiple of ``num_attention_heads``,
            ``num_experts`` is 1 or negative, or an MoE model's ``moe_topk`` is not in ``[1, num_experts]``.

    Example:
        >>> TinyGPTConfig(vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=4).ffn_hidden_size
        256
        >>> TinyGPTConfig(num_experts=8, moe_topk=2).is_moe, TinyGPTConfig().is_moe
        (True, False)
    """

    vocab_size: int = attrs.field(default=32, validator=_positive_int)
    hidden_size: int = attrs.field(default=64, validator=_positive_int)
    num_layers: int = attrs.field(default=2, validator=_positive_int)
    num_attention_heads: int = attrs.field(default=4, validator=_positive_int)
    max_sequence_length: int = attrs.field(default=64, validator=_positive_int)
    ffn_hidden_size: int = attrs.field(
        default=attrs.Factory(lambda self: 4 * self.hidden_size, takes_self=True), validator=_positive_int
    )
    num_experts: int = attrs.field(default=0, validator=_int)
    moe_topk: int = attrs.field(default=2, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"'hidden_size' must be a multiple of 'num_attention_heads' ({self.num_attention_heads}): "
                f"got {self.hidden_size}"
            )
        if self.num_experts < 0 or self.num_experts == 1:
            raise ValueError(f"'num_experts' must be 0 (dense) or >= 2 (MoE): got {self.num_experts}")
        if self.is_moe and self.moe_topk > self.num_experts:
            raise ValueError(f"'moe_topk' must be in [1, num_experts ({self.num_experts})]: got {self.moe_topk}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts (``num_experts > 0``)."""
        return self.num_experts > 0

