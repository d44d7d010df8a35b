"""The TransferQueue system's life cycle in one process: start it, attach to it, reach its client, shut it down.

A TransferQueue (TQ) system runs on a Ray cluster: a controller actor (named
:data:`CONTROLLER_NAME` in namespace :data:`CONTROLLER_NAMESPACE`) that maps
``(partition, key)`` to rows and per-key tags, plus storage (SimpleStorage
units by default, or Mooncake, see :mod:`adapters.tq_mooncake`). TQ keeps
process globals: one TQ client per process (``tq.init`` / ``tq.get_client`` /
``tq.close``), shared by every store of the process. :func:`start` starts TQ
(and a local Ray cluster when none is initialised) and returns a
:class:`SystemHold` that owns them; :func:`attach` joins a running TQ from any
process of the cluster and owns nothing.

TQ quirks handled here: its backend processes (the ``mooncake_master``) are
started but never stopped by TQ, so the owner stops them; its client logs a
warning on every call (:func:`quiet_logs`); its ``init`` takes no placement
for the controller, which this module adds (:data:`CONTROLLER_RESOURCE`).

Invariant: :func:`release` shuts down exactly what the hold owns (TQ and its
backend processes, then Ray), and a failed :func:`start` leaves nothing
running that it started.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

import attrs
import ray
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf

from adapters import tq_object_store
from adapters.node_resource import resource_options
from adapters.ray_actors import named_actor_exists
from adapters.store_health import ActorParts, StorePart, actor_pids
from adapters.tq_mooncake import MOONCAKE, attach_lending_no_memory, prepare_mooncake

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_PREFIX = "TransferQueueStorageUnit#"
"""SimpleStorage names its storage-unit actors ``TransferQueueStorageUnit#<rank>`` in the namespace of the process
that started TQ."""
CONTROLLER_RESOURCE = "required_node_resource"
"""The key of TQ's config section ``controller`` (ours: TQ 0.1.11 has no such setting) that names a custom node
resource the controller needs (null: where Ray puts it, which is the starting process's node when it has a free CPU).
Every put, get and clear of every process sends its metadata to the controller, so on a cluster its node carries
that traffic: with a resource that only worker nodes have, the driver's node carries only the driver's calls."""
STORE_NAME = "TransferQueue"
RAY_NAMESPACE = "rl-dataplane"
"""The Ray namespace of a cluster that :func:`start` starts itself."""

Config = Mapping[str, Any]


@attrs.frozen
class SystemHold:
    """One process's hold on the running TQ system: what it owns, and which backend stores the rows.

    Attributes:
        owns_transfer_queue: :func:`release` shuts TQ down (``tq.close()``) and
            stops the backend processes it started.
        owns_ray: :func:`release` also shuts Ray down.
        kv_backend: the storage backend is Mooncake (rows travel padded, clears go per field set).
        storage_backend: TQ's ``backend.storage_backend`` (``SimpleStorage``, ``RayObjectStore``, ...).
        backend_processes: the local processes TQ started for its backend.
    """

    owns_transfer_queue: bool = False
    owns_ray: bool = False
    kv_backend: bool = False
    storage_backend: str = "SimpleStorage"
    backend_processes: tuple[subprocess.Popen, ...] = ()


# ---------------------------------------------------------------- configuration


def _default_config() -> DictConfig:
    """TQ's own defaults, plus this project's settings, null: the controller's :data:`CONTROLLER_RESOURCE`, and a
    section for the backend :data:`adapters.tq_object_store.BACKEND` (its one setting,
    :data:`adapters.tq_object_store.INDEX_RESOURCE`)."""
    conf = OmegaConf.load(resources.files("transfer_queue") / "config.yaml")
    ours = {
        "controller": {CONTROLLER_RESOURCE: None},
        "backend": {tq_object_store.BACKEND: {tq_object_store.INDEX_RESOURCE: None}},
    }
    return OmegaConf.merge(conf, ours)  # type: ignore[return-value]


def known_backends() -> tuple[str, ...]:
    """The storage backends TQ 0.1.11 knows (the sections of ``backend`` in its default config) and ours."""
    return tuple(name for name in _default_config().backend if name != "storage_backend")


def resolve_config(config: Config | None = None) -> DictConfig:
    """TQ's default config with ``config`` merged over it, checked before anything starts.

    Args:
        config: a mapping or ``OmegaConf`` config of TQ settings, e.g.
            ``{"backend": {"storage_backend": "MooncakeStore"}}``; None for the
            defaults (SimpleStorage).

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: ``backend.storage_backend`` names a backend TQ does not know.

    Example:
        >>> resolve_config({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}).backend.storage_backend
        'SimpleStorage'
    """
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"'config' must be a mapping of TransferQueue settings or None: got {type(config).__name__}; "
            f"e.g. config={{'backend': {{'storage_backend': 'SimpleStorage'}}}}"
        )
    merged = OmegaConf.create({}, flags={"allow_objects": True})
    merged = OmegaConf.merge(merged, _default_config())
    if config:
        merged = OmegaConf.merge(merged, config)
    backend = merged.backend.storage_backend
    backends = known_backends()
    if backend not in backends:
        raise ValueError(f"'backend.storage_backend' must be one of {backends}: got {backend!r}")
    return merged  # type: ignore[return-value]


def is_running() -> bool:
    """Whether a TransferQueue controller is registered on this process's Ray cluster (False without Ray).

    Never starts Ray: without an initialised Ray there is no cluster to look in.
    """
    return named_actor_exists(CONTROLLER_NAME, CONTROLLER_NAMESPACE)



def quiet_logs() -> None:
    """Keep errors only from TQ's loggers: its client warns on every call that it caps its threads at the core count."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("transfer_queue"):
            logging.getLogger(name).setLevel(logging.ERROR)


# ---------------------------------------------------------------- life cycle


START_TIMEOUT_S = 300.0
"""How long :func:`start` waits for TQ's ``init`` (its controller, storage units or index to start) by default: as
long as a worker group waits for its actors (``WorkerGroup``'s ``setup_timeout_s``)."""


def start(config: Config | None = None, *, start_timeout_s: float = START_TIMEOUT_S) -> SystemHold:
    """Start TransferQueue on the current Ray cluster (or a local one); the hold owns it.

    If Ray is not initialised, a local cluster is started with logical CPUs
    (``max(8, os.cpu_count())``, since TQ's controller and storage units
    each take one), no dashboard, namespace :data:`RAY_NAMESPACE`; the hold
    then owns Ray too.

    Args:
        config: TQ settings merged over its defaults (see :func:`resolve_config`);
            SimpleStorage unless ``backend.storage_backend`` says otherwise.
        start_timeout_s: how long TQ's ``init`` may take. Ray leaves an actor that no node can take (no node with
            its resource has a free CPU) pending for ever, and ``init`` waits on it; past this, the parts not
            started yet are named in the error, and everything started is stopped.

    Raises:
        TypeError: ``config`` is not a mapping.
        ValueError: an unknown storage backend (checked before anything starts), or a placement resource that no
            alive node has (``controller.required_node_resource``, ``backend.RayObjectStore.required_node_resource``;
            TQ checks SimpleStorage's itself).
        RuntimeError: a TransferQueue already runs on this Ray cluster (attach to it instead), or TQ did not start
            within ``start_timeout_s`` (naming the parts that had not started).
    """
    if isinstance(start_timeout_s, bool) or not (
        isinstance(start_timeout_s, (int, float)) and math.isfinite(start_timeout_s) and start_timeout_s > 0
    ):
        raise ValueError(f"'start_timeout_s' must be a finite number of seconds > 0: got {start_timeout_s!r}")
    conf = resolve_config(config)
    mooncake = conf.backend.storage_backend == MOONCAKE
    if mooncake:
        prepare_mooncake(conf)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        # address="local": a cluster of our own, even where a `ray start` cluster runs (as the docstring says)
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, namespace=RAY_NAMESPACE)
    try:
        if is_running():
            raise RuntimeError(
                f"a TransferQueue already runs on this Ray cluster (actor {CONTROLLER_NAME!r} in namespace "
                f"{CONTROLLER_NAMESPACE!r}): join it with TransferQueueStore.attach()"
            )
        placed = resource_options(conf.controller.get(CONTROLLER_RESOURCE), f"controller.{CONTROLLER_RESOURCE}")
        early_index = None
        if conf.backend.storage_backend == tq_object_store.BACKEND:
            # The index's process boots while TQ's controller does (each takes seconds); TQ's bootstrap of the
            # backend then waits for this one instead of starting its own.
            section = conf.backend[tq_object_store.BACKEND]
            early_index = tq_object_store.start_index(section.get(tq_object_store.INDEX_RESOURCE))
            conf.backend[tq_object_store.BACKEND][tq_object_store.STARTED_INDEX] = early_index
        try:
            with _controller_options(placed):
                _init_within(conf, start_timeout_s, _placements(conf))
        except BaseException:
            processes = _backend_processes()
            index = _take_object_store_index() or early_index
            with contextlib.suppress(Exception):
                tq.close()
            _stop(processes)
            if index is not None:
                with contextlib.suppress(Exception):
                    ray.kill(index)
            raise
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    return SystemHold(
        owns_transfer_queue=True,
        owns_ray=owns_ray,
        kv_backend=mooncake,
        storage_backend=conf.backend.storage_backend,
        backend_processes=_backend_processes(),
    )


_INIT_JOIN_S = 45.0
"""How long a failed start waits for TQ's ``init`` to end once its parts are killed: longer than TQ's own retry of
a storage manager's handshake with the controller (``TQ_STORAGE_HANDSHAKE_TIMEOUT``, 30 s)."""


_INTERRUPTED_JOIN_S = 10.0
"""How long an interrupted start waits for TQ's ``init`` to end once its parts are killed: an interrupt must end the
run promptly, so less than :data:`_INIT_JOIN_S`."""


def _placements(conf: DictConfig) -> dict[str, Any]:
    """The placement settings of ``conf`` that name a resource: ``{setting: resource}``."""
    settings = {f"controller.{CONTROLLER_RESOURCE}": conf.controller.get(CONTROLLER_RESOURCE)}
    backend = conf.backend.storage_backend
    section = conf.backend.get(backend)
    if section is not None and "required_node_resource" in section:
        settings[f"backend.{backend}.required_node_resource"] = section.get("required_node_resource")
    return {setting: resource for setting, resource in settings.items() if resource is not None}


def _stop_started_parts() -> None:
    """Kill TQ's parts that this process's start made (in its namespace, where TQ names its storage units): this
    fails the ``ray.get`` that TQ's ``init`` waits in, so its thread ends."""
    for handle in _named_parts(ray.get_runtime_context().namespace).values():
        with contextlib.suppress(Exception):
            ray.kill(handle)


def _init_within(conf: DictConfig, timeout_s: float, placements: Mapping[str, Any]) -> None:
    """``tq.init(conf)``, on a thread of its own, for at most ``timeout_s``.

    Past the deadline, the TQ actors that have not answered yet are named, the parts this start made are killed
    (:func:`_stop_started_parts`), and ``RuntimeError`` is raised once ``init`` has ended (or after
    :data:`_INIT_JOIN_S`, which the error then says); the caller stops the rest. ``placements`` (the settings that
    placed parts on nodes with a resource) go into the error.
    """
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            tq.init(conf)
        except BaseException as error:  # handed to the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=run, name="transfer-queue-init", daemon=True)
    thread.start()
    try:
        thread.join(timeout_s)
    except BaseException:  # an interrupt: end init's wait before the caller stops what was started, without delay
        _stop_started_parts()
        thread.join(_INTERRUPTED_JOIN_S)
        raise
    if not thread.is_alive():
        if outcome:
            raise outcome[0]
        return
    actors = _named_parts(ray.get_runtime_context().namespace)
    probes = {role: handle.__ray_ready__.remote() for role, handle in actors.items()}
    answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=2.0) if probes else ([], [])
    waiting = [role for role, probe in probes.items() if probe not in set(answered)]
    _stop_started_parts()
    thread.join(_INIT_JOIN_S)
    late = ", ".join(waiting) if waiting else "none of its parts (its init itself was slow)"
    where = (
        "; placed by " + ", ".join(f"{setting}={resource!r}" for setting, resource in placements.items())
        if placements else ""
    )
    still = f" (its init had not ended {_INIT_JOIN_S:g} s after its parts were killed)" if thread.is_alive() else ""
    raise RuntimeError(
        f"TransferQueue did not start within {timeout_s:g} s; not answering: {late}{where}. Ray leaves an actor "
        f"pending while no node can take it (none of the nodes with its resource has a free CPU), or it was "
        f"still booting{still}"
    )


class _WithOptions:
    """A Ray actor class whose ``options`` add ``extra`` to the caller's; an option both set is refused (a TQ
    that places its controller itself must not be overridden silently, nor override the placement silently)."""

    def __init__(self, actor_class: Any, extra: Mapping[str, Any]) -> None:
        self._actor_class, self._extra = actor_class, dict(extra)

    def options(self, **options: Any) -> Any:
        both = sorted(set(options) & set(self._extra))
        if both:
            raise RuntimeError(
                f"cannot place TransferQueue's controller: TransferQueue sets the Ray options {both} itself; set "
                f"controller.{CONTROLLER_RESOURCE} to null"
            )
        return self._actor_class.options(**{**self._extra, **options})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor_class, name)


@contextlib.contextmanager
def _controller_options(extra: Mapping[str, Any]) -> Iterator[None]:
    """While ``tq.init`` runs, TQ's controller is created with ``extra`` Ray options too.

    TQ 0.1.11's ``init`` creates the controller as ``interface.TransferQueueController.options(name=...,
    namespace=...)`` and takes no placement for it, so the class it looks up is swapped for one whose ``options``
    add ``extra``, and restored afterwards, whatever happens.

    Raises:
        RuntimeError: ``extra`` is not empty and TQ's ``interface`` has no ``TransferQueueController`` (another
            TQ version; nothing is swapped).
    """
    if not extra:
        yield
        return
    interface = importlib.import_module("transfer_queue.interface")
    actor_class = getattr(interface, "TransferQueueController", None)
    if actor_class is None or not callable(getattr(actor_class, "options", None)):
        raise RuntimeError(
            "cannot place TransferQueue's controller: transfer_queue.interface.TransferQueueController is not a Ray "
            f"actor class in this TransferQueue version; set controller.{CONTROLLER_RESOURCE} to null"
        )
    interface.TransferQueueController = _WithOptions(actor_class, extra)
    try:
        yield
    finally:
        interface.TransferQueueController = actor_class


def attach() -> SystemHold:
    """Join the TransferQueue running on this process's Ray cluster; the hold owns nothing.

    Works from the driver that started TQ, another driver on the cluster, or
    any Ray actor or task. The process's TQ client is created on first use
    and shared (TQ keeps one per process).

    Raises:
        RuntimeError: Ray is not initialised in this process, or no
            TransferQueue runs on the cluster.
    """
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised in this process: connect to the cluster that runs TransferQueue first, "
            "e.g. ray.init(address='auto'), then call TransferQueueStore.attach()"
        )
    if not is_running():
        raise RuntimeError(
            f"no TransferQueue is running on this Ray cluster (no actor {CONTROLLER_NAME!r} in namespace "
            f"{CONTROLLER_NAMESPACE!r}): start one with TransferQueueStore.start()"
        )
    controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    conf = ray.get(controller.get_config.remote())
    mooncake = conf.backend.storage_backend == MOONCAKE
    if mooncake:
        attach_lending_no_memory(conf)
    tq.init()
    return SystemHold(kv_backend=mooncake, storage_backend=conf.backend.storage_backend)


def parts(timeout_s: float) -> ActorParts:
    """The running TQ's processes as health-checked parts: the controller, then each SimpleStorage unit by rank,
    or the ``RayObjectStore`` backend's index actor.

    Storage units are found by name in every namespace (TQ names them in the namespace of the process that
    started it). Each part's process id is asked once, within ``timeout_s``. On Mooncake there are no unit
    actors: the controller is the one part (the ``mooncake_master`` is a process of the owner, not a Ray actor).

    Raises:
        RuntimeError: no TransferQueue controller runs on this Ray cluster.
    """
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"no TransferQueue is running on this Ray cluster (no actor {CONTROLLER_NAME!r} in namespace "
            f"{CONTROLLER_NAMESPACE!r}): start one with TransferQueueStore.start()"
        ) from None
    named = {"TransferQueue controller": controller, **_named_parts()}  # the controller first
    pids = actor_pids(list(named.values()), timeout_s)
    return ActorParts(STORE_NAME, [(StorePart(role, pid), h) for (role, h), pid in zip(named.items(), pids)])


def _named_parts(units_namespace: str | None = None) -> dict[str, Any]:
    """TQ's named actors on this Ray cluster, by role: the controller, each SimpleStorage unit by rank (found by
    name in ``units_namespace``, or in every namespace when None: TQ names them in the namespace of the process
    that started it), the ``RayObjectStore`` index; those that exist."""
    found: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        found["TransferQueue controller"] = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    units: list[tuple[int, Any]] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        rank = name[len(STORAGE_UNIT_PREFIX):]
        if units_namespace is not None and entry["namespace"] != units_namespace:
            continue
        if name.startswith(STORAGE_UNIT_PREFIX) and rank.isdigit():
            with contextlib.suppress(ValueError):  # gone since the listing
                units.append((int(rank), ray.get_actor(name, namespace=entry["namespace"])))
    for rank, handle in sorted(units, key=lambda unit: unit[0]):
        found[f"TransferQueue storage unit {rank}"] = handle
    with contextlib.suppress(ValueError):  # the RayObjectStore backend's index (no such actor on other backends)
        found["TransferQueue object-store index"] = ray.get_actor(
            tq_object_store.INDEX_NAME, namespace=tq_object_store.INDEX_NAMESPACE
        )
    return found


def client() -> tq.TransferQueueClient:
    """This process's TQ client.

    Raises:
        RuntimeError: TQ is not running in this process (its owner closed it).
    """
    try:
        found = tq.get_client()
    except AssertionError:
        found = None
    if found is None:
        raise RuntimeError(
            "TransferQueue is not running in this process (its owner closed it): "
            "start it again with TransferQueueStore.start()"
        )
    return found


def storage_units() -> dict[str, Any]:
    """The Ray actor handles of the SimpleStorage units this process started, by name (``{}`` elsewhere).

    Only the process that started TransferQueue (:func:`start`) holds them; an
    attached process, or another backend, gets an empty mapping.
    """
    started = getattr(getattr(tq, "interface", None), "_TQ_STORAGE", None) or {}
    units = started.get("SimpleStorage") or {}
    return dict(units) if isinstance(units, Mapping) else {}


def release(hold: SystemHold, *, graceful: bool = True) -> None:
    """Shut down what ``hold`` owns: TQ and its backend processes, then Ray (even if TQ's shutdown fails).

    Args:
        hold: what to shut down.
        graceful: ask each SimpleStorage unit to shut down and wait for it (TQ's own close, up to 15 s) before
            killing it. False (a part of the store failed) kills the units at once: a dead or silent unit would
            only make the close wait.
    """
    try:
        if hold.owns_transfer_queue:
            index = None
            try:
                index = _take_object_store_index()
                if not graceful:
                    _kill_storage_units()
                tq.close()
            finally:
                _stop(hold.backend_processes)  # TQ leaves the Mooncake master running
                if index is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(index)
    finally:
        if hold.owns_ray:
            ray.shutdown()


def _kill_storage_units() -> None:
    """Kill the SimpleStorage units this process started, without waiting, and take them out of TQ's globals (so
    TQ's ``close()`` does not wait for their graceful shutdown)."""
    started = getattr(getattr(tq, "interface", None), "_TQ_STORAGE", None) or {}
    units = started.pop("SimpleStorage", None) if isinstance(started, dict) else None
    for unit in (units.values() if isinstance(units, Mapping) else ()):
        with contextlib.suppress(Exception):  # already dead, or its node is gone
            ray.kill(unit)


def _take_object_store_index() -> Any:
    """The :data:`adapters.tq_object_store.BACKEND` index this process started, taken out of TQ's globals (TQ's
    ``close()`` knows no way to stop it), or None."""
    started = getattr(getattr(tq, "interface", None), "_TQ_STORAGE", None) or {}
    resources_ = started.pop(tq_object_store.BACKEND, None) if isinstance(started, dict) else None
    return resources_.get("index") if isinstance(resources_, Mapping) else None


def _backend_processes() -> tuple[subprocess.Popen, ...]:
    """The local processes TQ started for its storage backend in this process (the Mooncake master)."""
    started = getattr(getattr(tq, "interface", None), "_TQ_STORAGE", None) or {}
    found: list[Any] = []
    for resource in started.values():
        found.extend(resource.values() if isinstance(resource, Mapping) else [resource])
    return tuple(p for p in found if isinstance(p, subprocess.Popen))


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """Terminate ``processes`` (SIGTERM, then SIGKILL after 10 s) and reap them."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

