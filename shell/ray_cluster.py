"""Ray for a run: start an embedded cluster of its own, or join the one ``ray.address`` names.

Invariants:
  * ``ray.address: null`` always starts a new cluster, whatever runs on the
    machine: a ``ray start`` cluster, ``RAY_ADDRESS``, or the
    ``ray_current_cluster`` file a stopped cluster leaves are never joined
    (``ray.init(address="local")``);
  * a cluster is joined only through ``ray.address``: ``auto`` is
    ``RAY_ADDRESS`` or the address ``ray start`` recorded on this machine,
    ``host:port`` is that address. Before joining, :func:`check_address`
    checks, within :data:`CONNECT_TIMEOUT_S` per probe, that a Ray GCS answers
    there (at the address Ray itself will dial: ``127.0.0.1`` becomes this
    node's IP), so an unreachable address fails in seconds instead of Ray's
    minutes of retries; any failure to join is a :class:`ConfigError`
    naming ``ray.address``;
  * joining or starting Ray leaves the process's SIGINT and SIGTERM handlers
    as they were (``ray.init`` installs its own SIGTERM handler, which exits
    without the run's clean-up), and a SIGTERM during ``ray.init`` reaches
    the caller's handler;
  * joining presents this machine's Ray token when it has one (``ray start``
    turns token authentication on when ``~/.ray/auth_token`` exists), as
    ``ray.init(address="auto")`` does by itself; ``RAY_AUTH_MODE``, when set, decides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from shell.config_error import ConfigError
from shell.config_schema import RaySection

CONNECT_TIMEOUT_S = 5.0
"""How long each probe of :func:`check_address` waits: the port accepting a connection, then the GCS answering."""
_AUTH_MODE = "RAY_AUTH_MODE"
_ADDRESS_ENV = "RAY_ADDRESS"


def _address_file() -> Path:
    """Where ``ray start`` records its cluster's address (``$RAY_TMPDIR/ray/ray_current_cluster`` or ``/tmp/ray/...``)."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # Ray before 2.47 kept it in ray._private.utils
        from ray._private.utils import get_ray_address_file  # type: ignore[attr-defined,no-redef]
    return Path(get_ray_address_file(None))


def resolve_address(address: str) -> str:
    """``host:port`` of the cluster ``address`` names (``auto``: ``RAY_ADDRESS``, else the one ``ray start`` recorded).

    Raises:
        ConfigError: ``auto`` finds no cluster (naming ``ray.address``).
    """
    if address != "auto":
        return address
    env = os.environ.get(_ADDRESS_ENV, "")
    if env and env != "auto":
        return env
    file = _address_file()
    recorded = file.read_text().strip() if file.is_file() else ""
    if not recorded:
        raise ConfigError(
            "ray.address",
            f"is 'auto', but no running Ray cluster was found ({_ADDRESS_ENV} is unset and `ray start` recorded "
            f"no address in {file}): start one with `ray start --head`, or give host:port: got 'auto'",
        )
    return recorded


def check_address(config: RaySection) -> None:
    """Check that a Ray cluster answers at the address ``config.address`` names (nothing to check for an embedded one).

    Two probes, each bounded by :data:`CONNECT_TIMEOUT_S`: the port accepts a
    TCP connection, then Ray's GCS answers a gRPC request there (a port held
    by something else, or an address this node cannot reach, would make
    ``ray.init`` retry for minutes).

    Raises:
        ConfigError: ``auto`` finds no cluster, or no Ray cluster answers at the address (naming ``ray.address``).
    """
    if config.address is None:
        return
    target = resolve_address(config.address)
    via = f" (from {config.address!r})" if target != config.address else ""
    dialed = _dialed_address(target)
    if dialed != target:
        via += f" (Ray dials it as {dialed})"
    host, _, port = dialed.rpartition(":")
    hint = (
        f"start one there with `ray start --head --port={port}`, or use ray.address=null for an embedded cluster: "
        f"got {config.address!r}"
    )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise ConfigError("ray.address", f"no Ray cluster answers at {target}{via}: {reason}; {hint}") from None
    problem = _probe_gcs(dialed)
    if problem:
        raise ConfigError("ray.address", f"no Ray cluster answers at {target}{via}: {problem}; {hint}")


def _dialed_address(target: str) -> str:
    """The address ``ray.init`` will dial for ``target`` (it replaces a loopback host by this node's IP)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(target) or target
    except Exception:  # a malformed address: the TCP probe reports it
        return target


def _probe_gcs(address: str) -> str:
    """Ask the GCS at ``address`` for its cluster id within :data:`CONNECT_TIMEOUT_S`; "" if a Ray GCS answered,
    else why not (a GCS that refuses our token still answered: joining reports that)."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    _present_token()
    channel = init_grpc_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT_S)
    except grpc.RpcError as error:
        code = error.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"the port accepts connections, but no Ray GCS answered within {CONNECT_TIMEOUT_S:g} s"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return "a gRPC server answers there, but it is not Ray's GCS"
        details = (error.details() or "").strip().splitlines()
        return f"the Ray GCS probe failed: {code.name}{': ' + details[0] if details else ''}"
    finally:
        channel.close()
    return ""


def connect(config: RaySection, say: Callable[[str], None]) -> bool:
    """Start or join Ray for the run, unless this process already has it; return whether it started a connection.

    Args:
        config: the run's ``ray`` section.
        say: reports what is being started.

    Raises:
        ConfigError: the cluster at ``ray.address`` cannot be joined (naming ``ray.address``).
    """
    if ray.is_initialized():
        return False
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if config.address is None:
        say("starting Ray (embedded)")
        _init_ray(
            address="local",
            num_cpus=config.num_cpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=False,
        )
        return True
    check_address(config)
    target = resolve_address(config.address)
    say(f"joining Ray at {target}")
    _present_token()
    try:
        _init_ray(address=target, runtime_env=runtime_env, log_to_driver=False)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError, AuthenticationError, ...
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            "ray.address",
            f"cannot join the Ray cluster at {target}: {text}; if the cluster uses token authentication, "
            f"this machine needs its token (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)",
        ) from None
    return True


def _init_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)``, leaving the SIGINT and SIGTERM handlers as they were (main thread only, where handlers
    live).

    ``ray.init`` installs SIGTERM handlers of its own that end the process with
    ``SystemExit`` (15; 1 after stopping an embedded node) and no clean-up of
    the caller's. A SIGTERM during ``ray.init`` therefore goes to the caller's
    handler once the handlers are back (it raises what that handler raises);
    an interrupted or failed ``ray.init`` is shut down first, so none of what it
    started is left.
    """
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        ray.init(**kwargs)
    except BaseException as error:
        with contextlib.suppress(Exception):
            ray.shutdown()
        _restore_handlers(saved)
        handler = saved.get(signal.SIGTERM)
        if isinstance(error, SystemExit) and callable(handler):
            handler(signal.SIGTERM, None)
        raise
    finally:
        _restore_handlers(saved)


def _restore_handlers(saved: dict[signal.Signals, Any]) -> None:
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


def _present_token() -> None:
    """Turn token authentication on for this process when a token is available and ``RAY_AUTH_MODE`` is unset."""
    if _AUTH_MODE in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # a Ray without token authentication
        return
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it warns that the token is used: that is what we ask of it
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        logger.setLevel(level)
