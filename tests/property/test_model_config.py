"""TinyGPTConfig: a pure value (core), checked when built, importable without any model library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.model_config import TinyGPTConfig

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_gpt_config_defaults_ffn_to_four_times_hidden() -> None:
    """The MLP width defaults to 4 x hidden_size, and every size given is kept."""
    config = TinyGPTConfig(vocab_size=32, hidden_size=64, num_layers=2, num_attention_heads=4)
    assert config.ffn_hidden_size == 256 and (config.vocab_size, config.max_sequence_length) == (32, 64)


def test_tiny_gpt_config_rejects_heads_not_dividing_hidden() -> None:
    """hidden_size must split evenly over the attention heads."""
    with pytest.raises(ValueError, match=r"'hidden_size' must be a multiple of 'num_attention_heads' \(5\): got 64"):
        TinyGPTConfig(num_attention_heads=5)


def test_tiny_gpt_config_rejects_non_int_sizes() -> None:
    """Sizes are positive ints."""
    with pytest.raises(TypeError, match=r"'vocab_size' must be int: got float"):
        TinyGPTConfig(vocab_size=32.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'num_layers' must be a positive int: got 0"):
        TinyGPTConfig(num_layers=0)


def test_tiny_gpt_config_import_loads_no_megatron() -> None:
    """Building a model config in a fresh interpreter loads neither megatron nor the model adapter."""
    code = (
        "import sys, json\n"
        "from core.model_config import TinyGPTConfig\n"
        "TinyGPTConfig()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' or m == 'adapters.megatron')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []
