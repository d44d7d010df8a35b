"""``adapters.megatron_setup.bind_absent_te_gemm``: megatron's MoE router gating runs without Transformer Engine.

megatron-core 0.16.1 binds ``moe_utils.te_general_gemm`` only when Transformer
Engine imports, and its router gating reads the name; on the H100 an MoE run on
CUDA failed with ``NameError`` there (the CPU shim used to bind it on CPU only).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from adapters.megatron_setup import bind_absent_te_gemm


@pytest.fixture
def unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    """``moe_utils`` as megatron leaves it without Transformer Engine: the name unbound (restored after)."""
    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: megatron binds te_general_gemm itself")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)


def test_router_gating_without_transformer_engine_raises_until_bound_then_is_a_matmul(unbound: None) -> None:
    """megatron's router gating raises ``NameError`` with the name unbound; once bound (twice: idempotent) it is
    ``inp @ weight.T``, the plain ``torch.mm`` path."""
    g = torch.Generator().manual_seed(0)
    inp, weight = torch.randn(2, 3, 8, generator=g), torch.randn(4, 8, generator=g)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    bind_absent_te_gemm()
    bind_absent_te_gemm()  # idempotent
    assert moe_utils.te_general_gemm is None
    torch.testing.assert_close(moe_utils.router_gating_linear(inp, weight, None, torch.float32), inp @ weight.t(), rtol=0, atol=1e-6)


def test_bind_leaves_a_bound_name_alone(unbound: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that is bound (Transformer Engine's gemm, say) is never replaced."""
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    bind_absent_te_gemm()
    assert moe_utils.te_general_gemm is sentinel
