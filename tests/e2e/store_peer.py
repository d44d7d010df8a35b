"""A second process for the Ray-backed store adapters' e2e tests, and a process without Ray.

Importable by Ray workers (the session puts the repo on their path).

* :func:`trainer_batch`: fields of every kind a trainer sends.
* :class:`StorePeer`: a Ray actor (another process) that builds its client from
  a picklable factory, as a worker does.
* :func:`check_round_trip_through_peer`: the law every Ray-backed adapter keeps
  across processes: a peer reads bit for bit what the driver put, sees the
  store's own errors, writes a field the driver reads back, and its close
  leaves the store serving.
* :func:`run_without_ray`: a script's JSON report from a fresh interpreter that
  never starts Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
from tensordict import NonTensorStack, TensorDict

from adapters.rows import columns_equal
from adapters.store_port import DataPlaneClient
from core.codec import jagged_lengths, to_jagged
from tests.e2e.conftest import ROOT


def trainer_batch(n: int, lengths: list[int]) -> TensorDict:
    """Fields of every kind a trainer sends: jagged ids and bf16 logprobs, (N,), (N,1), (N,S), objects, texts."""
    g = torch.Generator().manual_seed(n)
    td = TensorDict(
        {
            "input_ids": to_jagged(torch.randint(0, 1000, (n, max(lengths)), generator=g), lengths),
            "logprobs": to_jagged(torch.randn(n, max(lengths), generator=g).to(torch.bfloat16), lengths),
            "reward": torch.randn(n, generator=g, dtype=torch.float64),
            "mask": torch.rand(n, 1, generator=g) > 0.5,
            "hidden": torch.randn(n, 4, generator=g).to(torch.float16),
        },
        batch_size=[n],
    )
    td["meta"] = np.array([{"uid": i, "turns": (i, i + 1), "seen": {i}} for i in range(n)], dtype=object)
    td["texts"] = NonTensorStack(*(f"prompt {i}" for i in range(n)))
    return td


@ray.remote
class StorePeer:
    """A Ray actor (another process) that builds its client from a pickled factory, as a worker does."""

    def __init__(self, make_client: Callable[[], DataPlaneClient]) -> None:
        self._store = make_client()

    def read(self, keys: list[str], partition: str, names: list[str]) -> dict[str, Any]:
        got = self._store.get(keys, partition, names)
        return {name: got.get(name) for name in names}

    def write_scaled_logprobs(self, keys: list[str], partition: str) -> tuple[str, ...]:
        logprobs = self._store.get(keys, partition, ["logprobs"])["logprobs"]
        scaled = torch.nested.nested_tensor([row * 2 for row in logprobs.unbind()], layout=torch.jagged)
        fields = TensorDict({"scaled": scaled}, batch_size=[len(keys)])
        return self._store.put(keys, partition, fields, tags=[{"by": "actor"}] * len(keys)).fields

    def missing_key_error(self, partition: str) -> tuple[str, str]:
        try:
            self._store.get(["never-put"], partition, ["x"])
        except Exception as e:  # the test checks which exception arrived
            return type(e).__name__, str(e)
        return "", ""

    def close(self) -> None:
        self._store.close()
        self._store.close()


def check_round_trip_through_peer(
    store: DataPlaneClient, make_client: Callable[[], DataPlaneClient], partition: str, serving: Callable[[], bool]
) -> None:
    """A :class:`StorePeer` built from ``make_client`` reads bit for bit what ``store`` put (objects included),
    sees the store's own errors, and ``store`` reads the field it writes back; after the peer closes its client
    twice, ``serving()`` still holds and the keys are still stored. Clears its keys and kills the peer."""
    keys = ["k0", "k1", "k2", "k3"]
    fields = trainer_batch(4, [3, 0, 5, 2])
    peer = StorePeer.remote(make_client)  # type: ignore[attr-defined]
    try:
        store.put(keys, partition, fields, tags=[{"uid": i} for i in range(4)])
        order = [2, 0, 3]
        got = ray.get(peer.read.remote([keys[i] for i in order], partition, list(fields.keys())))
        expected = store.get([keys[i] for i in order], partition, list(fields.keys()))
        for name in fields.keys():
            assert columns_equal(got[name], expected.get(name)), name
        assert got["meta"].data.tolist() == [fields["meta"][i] for i in order]
        assert isinstance(got["texts"], NonTensorStack)
        assert got["texts"].tolist() == ["prompt 2", "prompt 0", "prompt 3"]
        assert ray.get(peer.missing_key_error.remote(partition)) == (
            "KeyError",
            str(KeyError(f"1 keys are not stored in partition {partition!r}: ['never-put']")),
        )
        assert ray.get(peer.write_scaled_logprobs.remote(keys, partition)) == ("scaled",)
        scaled = store.get(keys, partition, ["scaled"])["scaled"]
        assert jagged_lengths(scaled) == (3, 0, 5, 2)
        for row, original in zip(scaled.unbind(), fields["logprobs"].unbind()):
            assert torch.equal(row, original * 2) and row.dtype == torch.bfloat16
        meta = store.describe(["k1"], partition)
        assert meta.fields == (*fields.keys(), "scaled")
        assert meta.tags == ({"uid": 1, "by": "actor"},)
        ray.get(peer.close.remote())
        assert serving(), "an attached client's close in another process must leave the store serving"
        assert store.list_keys(partition) == tuple(keys)
    finally:
        ray.kill(peer)
        store.clear([key for key in keys if key in store.list_keys(partition)], partition)


def run_without_ray(script: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter with the repo on its path (it must not start Ray) and return the
    JSON object it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
