"""A user's limit on GPU memory (:attr:`~gpusparse.config.EngineConfig.device_memory_limit`):
decided within before the first search, enforced on every allocator, explained when exceeded.

Before the first search on a device (:func:`search_plan`) the need of each way of searching
is predicted (:func:`gpusparse.footprint.predict`) and the first that fits is taken, in this
order: the configured one (``resident="lists"``, the fastest), the tiled layout alone
(``resident="tiled"``), streaming from host memory (where the caller can stream:
:func:`gpusparse.streaming.open_for_search`), the scatter-add kernel. Taking another than the
configured one warns once (:class:`DeviceMemoryWarning`) with the figures; when none fits the
search is refused before anything is allocated (:class:`~gpusparse.errors.DeviceMemoryError`).

The limit is then enforced over both allocators (:func:`enforce`): CuPy's pool gets
:data:`CUPY_SHARE` of it (at most 256 MiB: GPUSparse's CUDA kernels allocate through PyTorch
and CuPy only launches them) and PyTorch the rest
(``torch.cuda.set_per_process_memory_fraction``); the prediction must fit PyTorch's share.
An out-of-memory error of either during a search becomes a one-line
:class:`~gpusparse.errors.DeviceMemoryError` with the figures and what to change
(:func:`out_of_memory_error`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from . import engines
from .config import engine_config
from .errors import DeviceMemoryError
from .footprint import H100_SMS, MODES, Footprint, IndexShape, predict, streamed_pieces
from .layout.postings import PostingLists

# Searching time against resident "lists", measured at 8.8M documents x 256 queries, k = 1000
# (bench/NOTES.md): tiled layout alone +13-15 % float32, +4-23 % 8-bit (H100,
# bench/results/2026-11-26-H100-memory-v3.json, -v4.json), streamed from pinned memory in
# 4 pieces 360 ms against 10.8 (H200), the exact scatter path 287 against 11 ms (H200).
SLOWDOWN = {"lists": 1.0, "tiled": 1.15, "streamed": 33.0, "scatter": 26.0}
CUPY_SHARE = 1 / 16
CUPY_SHARE_MAX = 256 << 20


class DeviceMemoryWarning(UserWarning):
    """A search takes a slower mode than configured, to fit the device memory limit."""


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes: ``total``, and ``free`` when the plan was made."""

    total: int
    free: int


def device_memory(device: torch.device) -> DeviceMemory:
    """The memory of CUDA ``device`` (``torch.cuda.mem_get_info``)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(total), int(free))


def gb(n: int) -> str:
    """``n`` bytes for messages: GB, or MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def torch_share(limit: int) -> int:
    """PyTorch's part of ``limit`` (CuPy's pool gets the rest; see the module docstring)."""
    return limit - min(CUPY_SHARE_MAX, int(limit * CUPY_SHARE))


@dataclass(frozen=True)
class Decision:
    """How a search will run under a limit: ``wanted`` (the configured mode's footprint),
    ``chosen`` (the first that fits), ``limit`` (the user's), ``usable`` (what the prediction
    must fit: PyTorch's share of the limit, at most the device's memory) and ``kernel``
    (the engine the search must ask for)."""

    wanted: Footprint
    chosen: Footprint
    limit: int
    usable: int
    kernel: str
    implicit: bool = False  # no user limit: ``limit`` is what the device had available

    @property
    def fallback(self) -> bool:
        """Whether the chosen mode is not the configured one."""
        return self.chosen.mode != self.wanted.mode

    def message(self) -> str:
        """The one-line warning of a fallback."""
        chosen = self.chosen
        how = {
            "tiled": "the tiled layout alone on the GPU (resident='tiled')",
            "streamed": f"the index streamed from host memory in {chosen.pieces} pieces",
            "scatter": f"the {self.kernel} kernel over the padded lists",
        }.get(chosen.mode, chosen.mode)
        slower = SLOWDOWN[chosen.mode] / SLOWDOWN[self.wanted.mode]
        limit = f"{gb(self.limit)} available on the GPU" if self.implicit else f"limit {gb(self.limit)}"
        return (
            f"the fast layout needs {gb(self.wanted.peak)} of GPU memory, {limit}: searching with "
            f"{how}, {gb(chosen.peak)} (about {slower:.1f}x slower)"
        )


def decide(
    shape: IndexShape,
    limit: int,
    *,
    wanted: str = "lists",
    kernel: str = "tiled",
    fallback_kernel: str = "scatter",
    allow_streaming: bool = False,
    memory: DeviceMemory | None = None,
    batch_size: int = 256,
    k: int = 1000,
    n_sm: int = H100_SMS,
    memory_budget: int | None = None,
) -> Decision:
    """The first mode from ``wanted`` on (``lists``, ``tiled``, ``streamed`` where
    ``allow_streaming``, ``scatter``) whose predicted peak fits PyTorch's share of ``limit``
    (and the device's ``memory``, when given); :class:`DeviceMemoryError` when none does.
    ``kernel``: the engine asked for (``"auto"``, ``"tiled"``: every mode; another: only
    ``scatter``); ``fallback_kernel``: the engine a ``scatter`` fallback runs."""
    usable = torch_share(limit if memory is None else min(limit, memory.total))
    chain = [m for m in MODES[MODES.index(wanted) :] if allow_streaming or m != "streamed"]
    if kernel not in ("auto", "tiled"):
        chain = ["scatter"]
    opts = {"batch_size": batch_size, "k": k, "n_sm": n_sm, "memory_budget": memory_budget}
    first: Footprint | None = None
    tried: list[Footprint] = []
    for mode in chain:
        if mode == "streamed":
            pieces = streamed_pieces(shape, usable, **opts)
            fp = predict(shape, mode, pieces=pieces or max(2, shape.n_docs), **opts)
        else:
            fp = predict(shape, mode, **opts)
        first = first or fp
        if fp.peak <= usable:
            run = fallback_kernel if mode == "scatter" and kernel in ("auto", "tiled") else kernel
            return Decision(first, fp, limit, usable, run)
        tried.append(fp)
    needs = ", ".join(f"{fp.mode} {gb(fp.peak)}" for fp in tried)
    raise DeviceMemoryError(
        f"a search of batches of {batch_size} at k = {k} does not fit {gb(usable)} of GPU memory "
        f"(limit {gb(limit)}{'' if memory is None else f', device {gb(memory.total)}'}; needs {needs}): "
        "lower the batch size, quantize the index (gpusparse index --quantize 8), stream it from host memory "
        "(gpusparse search --pieces N) or raise the limit (--device-memory-limit)"
    )


def fallback_kernel(device: torch.device) -> str:
    """The scatter-add engine that runs on ``device``: ``scatter`` (Triton) or ``reference``."""
    return "scatter" if engines.get("scatter").unavailable(device) is None else "reference"


def search_plan(
    index: PostingLists,
    device: torch.device,
    limit: int,
    *,
    kernel: str = "auto",
    batch_size: int | None = None,
    k: int = 1000,
    memory_budget: int | None = None,
    allow_streaming: bool = False,
    memory: DeviceMemory | None = None,
    warn: bool = True,
    implicit: bool = False,
) -> Decision:
    """:func:`decide` for searching ``index`` on CUDA ``device`` under ``limit`` bytes, made once
    per index object and arguments (the shape is counted once); a new plan also enforces the
    limit (:func:`enforce`) and warns if it falls back (``warn``). ``memory``: the device's
    memory as a test gives it (then nothing is enforced); default: asked of the device.
    ``implicit``: ``limit`` is not the user's but what the device had available
    (:func:`available_memory`): planned within, not enforced."""
    config = engine_config()
    batch = batch_size or 256
    key = (str(device), limit, kernel, batch, k, memory_budget, allow_streaming, config.resident,
           config.fixed_point, config.accumulator)  # fmt: skip
    plans = index.__dict__.setdefault("_memory_plans", {})
    if key in plans:
        return plans[key]
    shape = index.__dict__.get("_memory_shape")
    if shape is None:
        shape = index.__dict__["_memory_shape"] = IndexShape(index)
    real = memory is None
    memory = device_memory(device) if real else memory
    name = engines.choose(kernel, device).name if real else ("tiled" if kernel == "auto" else kernel)
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if real else H100_SMS
    decision = decide(
        shape, limit, wanted=config.resident if name == "tiled" else "scatter", kernel=name,
        fallback_kernel=fallback_kernel(device) if real else "scatter", allow_streaming=allow_streaming,
        memory=memory, batch_size=batch, k=k, n_sm=n_sm, memory_budget=memory_budget,
    )  # fmt: skip
    if implicit:
        decision = dataclasses.replace(decision, implicit=True)
    elif real:
        enforce(device, limit, memory)
    if warn and decision.fallback:
        warnings.warn(decision.message(), DeviceMemoryWarning, stacklevel=3)
    plans[key] = decision
    return decision


def available_memory(device: torch.device) -> int:
    """What this process may take on CUDA ``device`` without a user limit: its free memory plus
    what PyTorch already holds there (the index's own arrays, if on the device, are part of
    the prediction)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device))


def surely_fits(lists_bytes: int, available: int) -> bool:
    """Whether the default mode fits ``available`` bytes without a prediction: padded lists,
    forward copy and tiled layout stay within about 3.5 times the lists' bytes (22 bytes a
    posting at their peak against 8), plus temporaries; a margin covers the rest."""
    return 4 * lists_bytes + (1 << 30) <= available


def enforce(device: torch.device, limit: int, memory: DeviceMemory) -> dict[str, int]:
    """Cap PyTorch's caching allocator at :func:`torch_share` of ``limit`` and CuPy's default
    pool at the rest, on CUDA ``device``; the two shares in bytes."""
    torch_bytes = min(torch_share(limit), memory.total)
    cupy_bytes = limit - torch_share(limit)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, torch_bytes / memory.total), index)
    try:
        import cupy
    except ImportError:
        return {"torch": torch_bytes, "cupy": 0}
    with cupy.cuda.Device(index):
        cupy.get_default_memory_pool().set_limit(size=cupy_bytes)
    return {"torch": torch_bytes, "cupy": cupy_bytes}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch's or CuPy's out-of-memory error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    kind = type(exc)
    return kind.__name__ == "OutOfMemoryError" and kind.__module__.startswith("cupy")


def out_of_memory_error(
    device: torch.device, *, batch_size: int | None, k: int, decision: Decision | None = None
) -> DeviceMemoryError:
    """The one-line error for an out-of-memory error during a search on ``device``: what
    PyTorch held, the prediction and limit when there was one, and what to change."""
    figures = []
    if device.type == "cuda" and torch.cuda.is_available():
        held = torch.cuda.memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        figures.append(f"PyTorch held {gb(held)} of {gb(total)}")
    if decision is not None:
        chosen = decision.chosen
        figures.append(f"predicted peak {gb(chosen.peak)} ({chosen.mode}), limit {gb(decision.limit)}")
    batch = f"batches of {batch_size}" if batch_size else "the default batches"
    return DeviceMemoryError(
        f"out of GPU memory on {device} searching {batch} at k = {k}"
        + (f" ({'; '.join(figures)})" if figures else "")
        + ": lower the batch size (--batch-size), set a limit the search can plan for (--device-memory-limit), "
        "keep only the tiled layout on the GPU (resident='tiled') or quantize the index (--quantize 8)"
    )
