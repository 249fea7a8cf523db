"""How the CUDA kernels are compiled and launched: one path for every CuPy launcher.

The kernels' sources are package data (``kernels/cuda/*.cu``, :func:`source`). :func:`get_kernel`
compiles one through CuPy (NVRTC) with its options (``-D`` defines), and caches the kernel per
(source text hash, kernel name, options, device); :func:`launch` runs it on PyTorch's current
stream of the tensors' device, so it orders with PyTorch's own work; :func:`load_kernel` is
:func:`get_kernel` for a ``.cu`` file of the package. A launcher is then: check
its tensors (:func:`check_tensors`), build the argument tuple (:func:`pointer` for tensors,
``np.int32`` / ``np.int64`` for scalars, as the kernel declares them), launch.

Whole-search benchmarks, which reach the launchers only through the engine, compile variants
inside :func:`variant` (extra defines, or another source text, for one ``.cu`` file).

Nothing here imports CuPy until a kernel is compiled or launched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

__all__ = [
    "GraphLaunch",
    "StreamEvent",
    "available",
    "check_tensors",
    "copy_async",
    "cupy_stream",
    "device_index",
    "get_kernel",
    "kernel_key",
    "launch",
    "load_kernel",
    "mapped_pointer",
    "pointer",
    "raw_stream",
    "source",
    "variant",
    "variant_of",
]


@functools.cache
def available() -> bool:
    """Whether the CUDA kernels can run here (CuPy importable and a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def check_tensors(expected: dict[str, tuple[torch.Tensor, torch.dtype]], dev: torch.device) -> None:
    """Refuse a kernel argument that is not a contiguous tensor of its dtype on ``dev``."""
    for name, (tensor, dtype) in expected.items():
        if tensor.dtype != dtype or tensor.device != dev or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor on {dev}")


def pointer(tensor: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument (8 bytes, like the pointer parameter).

    Cheaper than wrapping each tensor with ``cupy.from_dlpack`` (~60 µs each, measured: a
    millisecond per launch); the caller has checked dtype, device and contiguity.
    """
    return np.uint64(tensor.data_ptr())


def cupy_stream(dev: torch.device):  # -> a CuPy stream context
    """PyTorch's current stream on ``dev``, as a CuPy stream (launches then order with PyTorch's)."""
    import cupy as cp

    stream = torch.cuda.current_stream(dev)
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cp.cuda.Stream.from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream)  # older CuPy or PyTorch


def device_index(dev: torch.device) -> int:
    """``dev``'s index, PyTorch's current device for a bare ``cuda``."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.cache
def source(name: str) -> str:
    """The text of ``kernels/cuda/<name>`` (package data)."""
    return resources.files(__package__).joinpath("cuda", name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=64)
def _digest(code: str) -> str:
    # Keyed by the text itself: a launcher passes the same str object each call, whose
    # lookup is then a hash already computed and an identity check, not a new sha256.
    return hashlib.sha256(code.encode()).hexdigest()


def kernel_key(
    code: str, name: str, options: Sequence[str], device: int, max_dynamic_shared: int = 0
) -> tuple[str, str, tuple[str, ...], int, int]:
    """The compile cache's key of a kernel: (source hash, kernel name, options, device index,
    dynamic shared memory limit)."""
    return _digest(code), name, tuple(options), device, max_dynamic_shared


_MODULES: dict[tuple[str, tuple[str, ...], int], Any] = {}  # (hash, options, device) -> cupy.RawModule
_KERNELS: dict[tuple[str, str, tuple[str, ...], int, int], Any] = {}  # kernel_key -> cupy.RawKernel


def get_kernel(
    code: str, name: str, *, options: Sequence[str] = (), device: int, max_dynamic_shared: int = 0
):  # -> cupy.RawKernel
    """Kernel ``name`` of CUDA source text ``code`` compiled with ``options`` for device index
    ``device``, cached per :func:`kernel_key` (kernels of one source and options share one
    compilation). ``max_dynamic_shared`` > 0 raises the kernel's dynamic shared memory limit
    to that many bytes (needed above 48 KiB)."""
    key = kernel_key(code, name, options, device, max_dynamic_shared)
    kernel = _KERNELS.get(key)
    if kernel is None:
        import cupy as cp

        digest, _, opts, _, _ = key
        with cp.cuda.Device(device):
            module = _MODULES.get((digest, opts, device))
            if module is None:
                module = _MODULES[(digest, opts, device)] = cp.RawModule(code=code, options=opts)
            kernel = module.get_function(name)
            if max_dynamic_shared:
                kernel.max_dynamic_shared_size_bytes = max_dynamic_shared
        _KERNELS[key] = kernel
    return kernel


def launch(
    kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, *, device: torch.device, shared_mem: int = 0
) -> None:
    """Run ``kernel`` on ``device`` (made CuPy's current device) and PyTorch's current stream there."""
    import cupy as cp

    with cp.cuda.Device(device.index), cupy_stream(device):
        kernel(grid, block, args, shared_mem=shared_mem)


# Per .cu file name: the source text and extra defines compiled in place of the package's (variant).
_VARIANTS: contextvars.ContextVar[Mapping[str, tuple[str | None, tuple[str, ...]]]] = contextvars.ContextVar(
    "gpusparse_kernel_variants", default=MappingProxyType({})
)


@contextlib.contextmanager
def variant(file: str, *, code: str | None = None, defines: Sequence[str] = ()) -> Iterator[None]:
    """Inside the block, kernels of ``kernels/cuda/<file>`` compile from ``code`` (default: the
    package's text) with ``-D`` options ``defines`` added (e.g. ``"PROFILE_SKIP_DENSE"``).

    For benchmarks that time a whole search, whose launchers they cannot call themselves;
    the variants are compiled and cached apart (their key holds the text and the options).
    Scoped to the block and to the current thread or task (a context variable), not a global.
    """
    current = dict(_VARIANTS.get())
    current[file] = (code, tuple(defines))
    token = _VARIANTS.set(MappingProxyType(current))
    try:
        yield
    finally:
        _VARIANTS.reset(token)


def variant_of(file: str) -> tuple[str, tuple[str, ...]]:
    """The source text of ``kernels/cuda/<file>`` and the extra defines to compile it with
    here: the package's text and none, unless inside :func:`variant`."""
    code, defines = _VARIANTS.get().get(file, (None, ()))
    return (source(file) if code is None else code), defines


def load_kernel(
    file: str, name: str, *, options: Sequence[str] = (), device: int, max_dynamic_shared: int = 0
):  # -> cupy.RawKernel
    """Kernel ``name`` of ``kernels/cuda/<file>`` (:func:`get_kernel`), as :func:`variant` says here:
    the package's source and ``options``, or the variant's source and ``options`` plus its defines."""
    code, defines = variant_of(file)
    options = (*options, *(f"-D{d}" for d in defines))
    return get_kernel(code, name, options=options, device=device, max_dynamic_shared=max_dynamic_shared)


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
    """``src``'s bytes into ``dst`` (same size, contiguous; device or page-locked host memory)
    by one ``cudaMemcpyAsync`` on the raw CUDA ``stream``. Inside a CUDA graph's capture this is a
    copy node at fixed addresses, with no PyTorch bookkeeping around it (a pinned tensor's
    ``copy_`` records an event for its host allocator)."""
    import cupy as cp

    nbytes = dst.numel() * dst.element_size()
    if nbytes != src.numel() * src.element_size() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_async needs two contiguous tensors of the same size in bytes")
    if nbytes:
        cp.cuda.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, cp.cuda.runtime.memcpyDefault, stream)


def mapped_pointer(host: torch.Tensor) -> int | None:
    """The device address of page-locked host memory ``host`` (a kernel then reads it across the
    bus itself, with no copy before it), or ``None`` where it has none (not page-locked, or not
    mapped into the device's address space)."""
    import cupy as cp

    try:
        attributes = cp.cuda.runtime.pointerGetAttributes(host.data_ptr())
    except Exception:  # CuPy's CUDARuntimeError, or a call CuPy lacks: no mapping
        return None
    address = int(getattr(attributes, "devicePointer", 0) or 0)
    return address or None


def raw_stream(device_index: int) -> int:
    """PyTorch's current CUDA stream on that device, as the raw handle (a C call: on a slow host
    ``torch.cuda.current_stream`` costs ~7 µs of Python)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return int(get(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


class GraphLaunch:
    """Replays a captured :class:`torch.cuda.CUDAGraph` on a raw stream handle: by its executable
    graph through the runtime's own ``cudaGraphLaunch`` (CuPy's), where PyTorch gives that handle
    and the stream's device is the current one; else by :meth:`~torch.cuda.CUDAGraph.replay` (on
    PyTorch's current stream of the graph's device, which the handle must be). A replay of
    PyTorch's also sets the device and advances random generators' offsets, neither of which a
    search's graphs use; its Python took ~10-14 µs of an H200 host's time a batch (measured)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, device_index: int) -> None:
        import cupy as cp

        self._graph, self._device = graph, device_index
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        self._launch = getattr(cp.cuda.runtime, "graphLaunch", None)
        self._exec = int(raw()) if raw is not None and self._launch is not None else 0
        self._get_device = cp.cuda.runtime.getDevice

    def __call__(self, stream: int) -> None:
        if self._exec and self._get_device() == self._device:
            self._launch(self._exec, stream)
        else:
            self._graph.replay()


class StreamEvent:
    """A CUDA event recorded on a raw stream handle, queried and waited for by the runtime's own
    calls (CuPy's): ~1 µs each, against ~10 µs for ``torch.cuda.Event.record``'s Python."""

    def __init__(self, device_index: int) -> None:
        import cupy as cp

        with cp.cuda.Device(device_index):
            self._event = cp.cuda.Event(disable_timing=True)
        self._recorded = False
        self._ptr, self._record = self._event.ptr, cp.cuda.runtime.eventRecord

    def record(self, stream: int) -> None:
        self._record(self._ptr, stream)
        self._recorded = True

    def query(self) -> bool:
        """Whether the work before its last record has completed (``True`` if never recorded)."""
        return not self._recorded or self._event.done

    def synchronize(self) -> None:
        if self._recorded:
            self._event.synchronize()
            self._recorded = False  # its work is done: later queries need not ask the runtime
