"""``ConfigError``: the one error every check of a run's configuration raises.

Invariant: ``str(error)`` is one line that starts with the key, as
``config key '<key>': <what was expected>: got <what was given>``; ``error.key``
is that key (a dotted config key such as ``policy.layout.tensor_parallel``, or
a command-line option such as ``--resume``) and ``error.message`` the rest.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config key or value; ``key`` is its dotted name (e.g. ``policy.layout.tensor_parallel``).

    Example:
        >>> str(ConfigError("grpo.num_steps", "must be >= 1: got 0"))
        "config key 'grpo.num_steps': must be >= 1: got 0"
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = " ".join(line.strip() for line in message.splitlines() if line.strip())  # always one line
        super().__init__(f"config key '{key}': {self.message}")
