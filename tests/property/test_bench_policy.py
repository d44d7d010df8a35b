"""Laws of the policy bench's workload: pure in its config, rows within their bounds, the mask inside each row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shell.bench.policy import PolicyBenchConfig, describe_workload, workload


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40).map(lambda n: 2 * n),
    seed=st.integers(0, 2**31 - 1),
    lengths=st.sampled_from(["lognormal", "short"]),
    max_len=st.integers(16, 2048),
)
def test_workload_is_pure_and_its_rows_fit(rows: int, seed: int, lengths: str, max_len: int) -> None:
    cfg = PolicyBenchConfig(rows=rows, seed=seed, lengths=lengths, max_len=max_len)
    batch, again = workload(cfg), workload(cfg)
    for name in ("input_ids", "token_mask", "advantages", "lengths"):
        assert torch.equal(batch[name], again[name])
    n = batch["lengths"]
    low, high = (16, max_len) if lengths == "lognormal" else (8, 64)
    assert batch.batch_size == torch.Size([rows])
    assert int(n.min()) >= min(low, high) and int(n.max()) <= high
    assert batch["input_ids"].shape[1] >= int(n.max())
    positions = torch.arange(batch["token_mask"].shape[1])[None, :]
    assert torch.equal(batch["token_mask"], (positions >= 4) & (positions < n[:, None]))  # response tokens only


def test_lognormal_rows_have_the_issues_median() -> None:
    """Issue 13's realistic rows: lognormal lengths of median 700 (clipped only above max_len)."""
    n = workload(PolicyBenchConfig(rows=4096, max_len=8192))["lengths"].float()
    assert 650 <= float(n.median()) <= 750
    assert "median 700, <= 1024" in describe_workload(PolicyBenchConfig())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": 3}, r"'rows' must be even \(one half per DP rank\): got 3"),
        ({"rows": 0}, r"'rows' must be >= 2: got 0"),
        ({"repeats": 0}, r"'repeats' must be >= 1: got 0"),
        ({"max_len": 8}, r"'max_len' must be >= 16: got 8"),
        ({"lengths": "uniform"}, r"'lengths' must be in"),
    ],
)
def test_config_rejects_what_cannot_run(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyBenchConfig(**kwargs)
