"""``apply_cpu_shim``: lets megatron-core 0.16.1 train a model on CPU, in one process.

megatron-core assumes a CUDA device on the training path: it allocates with
``device=torch.cuda.current_device()`` or ``device="cuda"`` (grad buffers, p2p
shape buffers, the optimizer's loss scale, the schedules' token counter), calls
``torch.cuda.synchronize()``, and seeds CUDA generators for its RNG tracker. A
CPU-only torch raises on each of those. The shim makes them run on CPU:

1. ``torch.cuda.current_device`` returns ``0`` (the int megatron expects) instead
   of raising "Torch not compiled with CUDA enabled"; patch 2 maps that 0 to CPU.
2. A device remap (:class:`CudaToCpu`, a ``TorchFunctionMode``) rewrites every
   CUDA device a torch call names (the ``device=`` argument of a factory such
   as ``torch.zeros`` / ``torch.empty`` / ``torch.tensor``, including
   megatron's int ``0``; ``Tensor.to("cuda")``; ``Tensor.cuda()``) to ``cpu``. It covers megatron's DDP grad buffers,
   optimizer, schedules, p2p communication and grad-norm code without patching
   each call site. torch keeps modes per thread, so the shim pushes it for the
   rest of the calling thread, and :func:`cpu_device_remap` enters it on any
   other thread (the backend wraps each of its calls in it: a Ray actor may run
   methods on another thread than the one that built it).
3. ``torch.cuda.synchronize`` is a no-op: there is no device queue to drain on CPU.
4. megatron's RNG tracker is the *inference* tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``): its ``add`` and
   ``fork`` are no-ops, so megatron never seeds or swaps CUDA generator states
   (``model_parallel_cuda_manual_seed`` would). Dropout is off in the backend and
   weights are drawn on CPU, so nothing draws from the tracker; the CPU generator,
   seeded the same on every rank by the backend, is the only randomness.
5. CUDA streams are one CPU stand-in (:class:`CpuStream`): ``torch.cuda.Stream()``
   and ``torch.cuda.current_stream()`` both return it, ``torch.cuda.stream(s)``
   enters nothing, and its ``wait_stream`` / ``record_event`` / event
   ``synchronize`` are no-ops. CPU work runs in program order, so there is
   nothing to order. This lets megatron's ``alltoall`` MoE token dispatcher run
   (it builds a device-to-host stream when built and switches to it in each
   forward); since the current stream *is* that stream, the dispatcher never
   takes its side-stream branch (``Tensor.record_stream``).
6. The backward of every custom autograd ``Function`` runs under a fresh
   remap (patch 2): ``BackwardCFunction.apply`` and ``apply_boxed`` enter a
   :class:`CudaToCpu` around the user's backward. ``torch.autograd.backward``
   is itself a torch function, and torch runs a mode's handler with that mode
   popped off the stack, so the whole backward pass runs without the remap
   (the thread's remap count still says it is active). megatron's
   tensor-parallel ``Function`` objects allocate in backward with
   ``device=torch.cuda.current_device()`` (the sequence-parallel linear
   layers' gather and reduce-scatter buffers, the MoE dispatcher's
   collectives); without this they would ask for CUDA device 0.

Gradient clipping stays off (``clip_grad=0.0``): the backend computes the grad
norm itself with megatron's ``get_grad_norm``, which runs under the remap.

Invariants: the shim is idempotent (a second call changes nothing, and at most
one remap is active per thread), is applied only when called (never at import),
and only in the process that calls it. Call it only in a CPU worker process: it
makes CUDA unusable there by design. The GPU path never calls it and runs
megatron without it (:func:`adapters.megatron_setup.bind_absent_te_gemm`, which
``build_gpt`` applies on every device, is not part of the shim).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch
from megatron.core import tensor_parallel
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

__all__ = ["CpuStream", "CudaToCpu", "apply_cpu_shim", "cpu_device_remap", "cpu_shim_applied"]

_CPU = torch.device("cpu")


def _cpu_current_device() -> int:
    """Patch 1: the device index megatron passes as ``device=``; :class:`CudaToCpu` maps it to CPU."""
    return 0


def _cpu_synchronize(device: Any = None) -> None:
    """Patch 3: nothing to wait for on CPU."""
    return None


class _CpuEvent:
    """Patch 5: an event recorded on :class:`CpuStream`; it has always happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """Patch 5: the one stream of a CPU process; ordering calls are no-ops (CPU work runs in program order)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_STREAM = CpuStream()


def _cpu_stream(*args: Any, **kwargs: Any) -> CpuStream:
    """Patch 5: ``torch.cuda.Stream()`` and ``torch.cuda.current_stream()``: the one CPU stream."""
    return _STREAM


def _cpu_stream_context(stream: Any = None) -> AbstractContextManager[None]:
    """Patch 5: ``torch.cuda.stream(s)``: nothing to switch to."""
    return contextlib.nullcontext()


def _remap(device: Any, *, int_is_cuda: bool) -> Any:
    """``device`` with any CUDA device replaced by ``cpu``; other values unchanged."""
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if int_is_cuda and isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class CudaToCpu(TorchFunctionMode):
    """Patch 2: rewrites each CUDA device named in a torch call to ``cpu``.

    Handles the ``device=`` keyword of every torch function (an int there is a
    CUDA index, as ``torch.cuda.current_device()`` returns), ``Tensor.cuda()``
    (returns the tensor itself) and a device given positionally to ``Tensor.to``.
    Counts the remaps active on each thread (:meth:`active_here`).
    """

    _threads = threading.local()

    @classmethod
    def active_here(cls) -> bool:
        """Whether a remap is active on the calling thread."""
        return getattr(cls._threads, "depth", 0) > 0

    def __enter__(self) -> CudaToCpu:
        type(self)._threads.depth = getattr(type(self)._threads, "depth", 0) + 1
        return super().__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        type(self)._threads.depth -= 1
        super().__exit__(exc_type, exc, traceback)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _remap(kwargs["device"], int_is_cuda=True)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _remap(args[1], int_is_cuda=True), *args[2:])
        return func(*args, **kwargs)


def _remapped_backward(apply: Callable[..., Any]) -> Callable[..., Any]:
    """Patch 6: ``apply`` (a ``BackwardCFunction`` method, which runs a custom ``Function``'s backward) under a
    fresh :class:`CudaToCpu`, whatever the thread's remap count says (the backward pass runs with it popped)."""

    def remapped(self: Any, *args: Any) -> Any:
        with CudaToCpu():
            return apply(self, *args)

    remapped.__wrapped__ = apply  # type: ignore[attr-defined]
    return remapped


def cpu_device_remap() -> AbstractContextManager[Any]:
    """Patch 2 on the calling thread: a new :class:`CudaToCpu` where none is active here, else a no-op."""
    return contextlib.nullcontext() if CudaToCpu.active_here() else CudaToCpu()


def cpu_shim_applied() -> bool:
    """Whether :func:`apply_cpu_shim` has run in this process."""
    return torch.cuda.current_device is _cpu_current_device


def apply_cpu_shim() -> None:
    """Patch torch and megatron-core so megatron's training path runs on CPU (patches 1 to 7 above).

    Idempotent: a second call returns without changing anything. Call it in a CPU
    worker process before building a megatron model; never on a GPU worker.

    Example, in a CPU worker process::

        apply_cpu_shim()
        torch.zeros(1, device=torch.cuda.current_device()).device  # device(type='cpu')
    """
    if cpu_shim_applied():
        return
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    torch.cuda.Stream = _cpu_stream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = _cpu_stream  # type: ignore[assignment]
    torch.cuda.stream = _cpu_stream_context  # type: ignore[assignment]
    BackwardCFunction.apply = _remapped_backward(BackwardCFunction.apply)  # type: ignore[method-assign]
    if hasattr(BackwardCFunction, "apply_boxed"):  # torch 2.13's second backward entry; torch 2.11 has only apply
        BackwardCFunction.apply_boxed = _remapped_backward(BackwardCFunction.apply_boxed)  # type: ignore[method-assign]
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Pushed for the rest of this thread on purpose: megatron allocates on CUDA from
    # many call sites, and a CPU worker has no CUDA work that the remap could hide.
    CudaToCpu().__enter__()
