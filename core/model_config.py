"""TEMPORARY: replaced by the ports helper's core/model_config.py at merge."""
from adapters.megatron import TinyGPTConfig  # noqa: F401
