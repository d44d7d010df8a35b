"""``shell.ray_cluster`` without a cluster: how ``ray.address`` resolves, and how failures read (Ray is never started;
``ray.init`` is replaced where a test reaches it). The real joins are in ``tests/e2e/test_ray_cluster.py``."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from shell import ray_cluster
from shell.config_error import ConfigError
from shell.config_schema import NodePlacement, RaySection


def _ray(address: str | None, num_cpus: int) -> RaySection:
    """A ``ray`` section with the default placement."""
    return RaySection(address=address, num_cpus=num_cpus, placement=NodePlacement.pack, worker_resource=None)


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No RAY_ADDRESS, and a RAY_TMPDIR where `ray start` recorded nothing; returns that folder."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return tmp_path


def _listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_resolve_address_auto_reads_ray_address_then_the_recorded_file(no_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' is RAY_ADDRESS when set, else the address `ray start` recorded; host:port is itself."""
    (no_cluster / "ray").mkdir()
    (no_cluster / "ray" / "ray_current_cluster").write_text("10.1.2.3:6379\n")
    assert ray_cluster.resolve_address("auto") == "10.1.2.3:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:7000")
    assert ray_cluster.resolve_address("auto") == "10.9.9.9:7000"
    assert ray_cluster.resolve_address("h:1") == "h:1"


def test_resolve_address_auto_without_a_cluster_names_ray_address(no_cluster: Path) -> None:
    """'auto' with nothing recorded is a ConfigError naming ray.address and where it looked."""
    with pytest.raises(ConfigError, match=r"config key 'ray.address': is 'auto', but no running Ray cluster was found .*ray start --head"):
        ray_cluster.resolve_address("auto")


def test_check_address_accepts_a_ray_gcs_and_rejects_a_closed_port(no_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port where the GCS probe succeeds passes; a refused connection is a ConfigError with the address and a fix."""
    monkeypatch.setattr(ray_cluster, "_dialed_address", lambda target: target)
    monkeypatch.setattr(ray_cluster, "_probe_gcs", lambda address: "")
    with _listening() as server:
        port = server.getsockname()[1]
        ray_cluster.check_address(_ray(f"127.0.0.1:{port}", 1))
    with pytest.raises(ConfigError, match=rf"config key 'ray.address': no Ray cluster answers at 127.0.0.1:{port}: .*ray start --head --port={port}"):
        ray_cluster.check_address(_ray(f"127.0.0.1:{port}", 1))
    ray_cluster.check_address(_ray(None, 1))  # embedded: nothing to check


def test_check_address_rejects_a_silent_port_within_its_timeout(no_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port that accepts connections but answers no gRPC (not a Ray GCS) is a ConfigError naming ray.address,
    raised within the probe timeouts instead of Ray's minutes of retries."""
    monkeypatch.setattr(ray_cluster, "_dialed_address", lambda target: target)
    monkeypatch.setattr(ray_cluster, "CONNECT_TIMEOUT_S", 0.5)
    with _listening() as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"config key 'ray.address': no Ray cluster answers at {address}: "
                                              r"the port accepts connections, but no Ray GCS answered within 0.5 s"):
            ray_cluster.check_address(_ray(address, 1))
    assert time.monotonic() - started < 5.0


def test_connect_turns_a_failed_join_into_a_config_error(no_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A join that Ray refuses (here: ConnectionError, as on a token mismatch) is one ConfigError naming ray.address."""
    calls: list[dict[str, Any]] = []

    def refuse(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1\nmore detail")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # the failed join's clean-up must not stop this process's Ray
    monkeypatch.setattr(ray_cluster, "_present_token", lambda: None)
    monkeypatch.setattr(ray_cluster, "_dialed_address", lambda target: target)
    monkeypatch.setattr(ray_cluster, "_probe_gcs", lambda address: "")
    with _listening() as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ConfigError, match=rf"^config key 'ray.address': cannot join the Ray cluster at {address}: "
                                              r"Failed to connect to Ray cluster at 127.0.0.1:1; if the cluster uses token"):
            ray_cluster.connect(_ray(address, 1), lambda message: None)
    assert calls[0]["address"] == address


def test_connect_embedded_never_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.address null starts a local cluster (address='local': RAY_ADDRESS and the address file are not read)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    assert ray_cluster.connect(_ray(None, 3), lambda message: None) is True
    assert (calls[0]["address"], calls[0]["num_cpus"]) == ("local", 3)


def test_connect_keeps_the_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init replaces SIGTERM's handler (it exits at once); connect puts the caller's SIGINT and SIGTERM handlers back."""

    def mine(signum: int, frame: Any) -> None:
        pass

    def init(**kwargs: Any) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as ray.init does
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    saved = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray_cluster.connect(_ray(None, 1), lambda message: None)
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_connect_hands_a_sigterm_during_ray_init_to_the_callers_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init's own SIGTERM handler ends it with SystemExit(15): connect shuts down what it started and raises what
    the caller's SIGTERM handler raises instead."""

    class Stop(BaseException):
        pass

    def mine(signum: int, frame: Any) -> None:
        raise Stop(signum)

    def init(**kwargs: Any) -> None:
        raise SystemExit(signal.SIGTERM)  # what ray.init's handler does on SIGTERM

    shutdowns: list[bool] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    saved = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(Stop):
            ray_cluster.connect(_ray(None, 1), lambda message: None)
        assert signal.getsignal(signal.SIGTERM) is mine and shutdowns == [True]
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_connect_uses_the_ray_this_process_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Ray already initialised (a library caller, the test session), connect starts nothing and owns nothing."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("ray.init must not be called"))
    assert ray_cluster.connect(_ray("auto", 1), lambda message: None) is False
