"""Laws of the dataplane bench's schedule: how many calls its CPU table times (:func:`shell.bench.dataplane.cpu_calls`:
whole blocks, bounded, fewer for larger payloads) and the order of a round's calls
(:func:`shell.bench.dataplane.round_order`: every transport twice, each compared pair as A B B A, every block in every
position)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shell.bench.dataplane import CPU_BLOCK, CPU_BYTES, KEYED, PAIRED_BLOCKS, RAY, cpu_calls, round_order


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


@given(st.integers(0, 10_000))
def test_a_round_calls_every_transport_twice_each_block_as_a_b_b_a(rep: int) -> None:
    order = round_order(rep)
    names = [name for block in PAIRED_BLOCKS for name in block]
    assert sorted(order) == sorted(names * 2)
    at = 0
    while at < len(order):  # consecutive blocks, each its names then the same names reversed
        block = next(b for b in PAIRED_BLOCKS if order[at] in b)
        run = order[at : at + 2 * len(block)]
        assert run[: len(block)] == run[len(block) :][::-1] and set(run) == set(block)
        at += 2 * len(block)


def test_over_a_cycle_every_block_leads_once_with_each_side_first() -> None:
    cycle = 2 * len(PAIRED_BLOCKS)
    leads = [round_order(rep)[0] for rep in range(cycle)]
    assert sorted(leads) == sorted([block[0] for block in PAIRED_BLOCKS] + [block[-1] for block in PAIRED_BLOCKS])
    assert (RAY,) in PAIRED_BLOCKS and (KEYED,) in PAIRED_BLOCKS  # the key table never sits between ray.put's calls
