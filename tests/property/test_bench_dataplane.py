"""Laws of how many calls the dataplane bench's CPU table times (:func:`shell.bench.dataplane.cpu_calls`): whole
blocks, bounded, fewer for larger payloads."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shell.bench.dataplane import CPU_BLOCK, CPU_BYTES, cpu_calls


@given(st.integers(1, 1 << 40), st.integers(1, 1 << 40))
def test_the_cpu_table_times_whole_blocks_and_fewer_calls_for_larger_payloads(small: int, large: int) -> None:
    """Whole blocks, 2 blocks to 200 calls, never more calls for a larger payload, and at most about
    :data:`CPU_BYTES` moved once the 2-block floor is passed."""
    small, large = min(small, large), max(small, large)
    for size in (small, large):
        calls = cpu_calls(size)
        assert calls % CPU_BLOCK == 0 and 2 * CPU_BLOCK <= calls <= 200
        assert calls == 2 * CPU_BLOCK or calls * size <= CPU_BYTES
    assert cpu_calls(large) <= cpu_calls(small)


def test_the_issues_payloads_get_200_and_20_calls() -> None:
    """The bench's 3 MB payload gets 200 calls of each operation, its 64 MB one 20."""
    assert (cpu_calls(3_000_000), cpu_calls(64_000_000)) == (200, 20)
