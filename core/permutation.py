"""Permutations of row positions.

Invariant: for a permutation ``p`` of ``range(n)``,
``inverse_permutation(p)[p[i]] == i`` for every ``i``, and
``inverse_permutation(inverse_permutation(p)) == p``.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.checks import check_int_entries

Permutation = tuple[int, ...]


def inverse_permutation(perm: Sequence[int]) -> Permutation:
    """Invert a permutation of ``range(len(perm))``.

    Args:
        perm: ``perm[i]`` is the source position of output position ``i``.

    Returns:
        ``inv`` with ``inv[perm[i]] == i``.

    Raises:
        TypeError: an entry is not an int.
        ValueError: ``perm`` is not a permutation of ``range(len(perm))``.

    Example:
        >>> inverse_permutation([2, 0, 1])
        (1, 2, 0)
    """
    n = len(perm)
    inverse = [-1] * n
    for index, source in enumerate(check_int_entries("perm", perm)):
        if not 0 <= source < n:
            raise ValueError(
                f"'perm' must be a permutation of range({n}): entry {source} at index {index} is out of range"
            )
        if inverse[source] != -1:
            raise ValueError(
                f"'perm' must be a permutation of range({n}): entry {source} repeats "
                f"(indices {inverse[source]} and {index})"
            )
        inverse[source] = index
    return tuple(inverse)
