"""Seeded sequence-length workloads shared by the benchmarks.

Invariant: a workload is a pure function of ``(n, seed)``; the same arguments
always give the same lengths.
"""

from __future__ import annotations

import numpy as np

MIN_LEN = 16
MAX_LEN = 8192


def lognormal_lengths(n: int, seed: int, *, median: float = 700.0, sigma: float = 1.0) -> np.ndarray:
    """Lengths ~ LogNormal(log(median), sigma), rounded and clipped to [16, 8192] (int64)."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), MIN_LEN, MAX_LEN).astype(np.int64)


def bimodal_lengths(n: int, seed: int) -> np.ndarray:
    """80% of lengths near 200 (N(200, 50)), 20% near 4000 (N(4000, 500)); clipped to [16, 8192] (int64)."""
    rng = np.random.default_rng(seed)
    small = rng.random(n) < 0.8
    raw = np.where(small, rng.normal(200.0, 50.0, n), rng.normal(4000.0, 500.0, n))
    return np.clip(np.rint(raw), MIN_LEN, MAX_LEN).astype(np.int64)


WORKLOADS = {"lognormal": lognormal_lengths, "bimodal": bimodal_lengths}
