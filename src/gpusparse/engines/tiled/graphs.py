"""A small batch's search as a CUDA graph, captured once per shape and fed through one copy.

A small batch's search is mostly the host launching its device operations (the kernel over
all tiles takes ~0.2 ms at 8.8M documents; launching the ~30 operations around it took
longer). A graph replays them in one launch. Its inputs (padded terms and weights, the
fixed-point parameters, the match floor) are laid out on the host in a page-locked buffer
and moved in one copy into the graph's input buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ...config import engine_config
from ...streams import capture_stream

Steps = Callable[[Mapping[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# (name, numpy dtype, shape) of each input: "bw" is [B, width], "b" is [B]
INPUTS: tuple[tuple[str, type, str], ...] = (
    ("terms", np.int64, "bw"),
    ("weights", np.float32, "bw"),
    ("scale", np.float64, "b"),
    ("delta", np.int64, "b"),
    ("mult", np.float64, "b"),
    ("shift", np.int32, "b"),
    ("lb", np.float64, "b"),
)
_PADDING = {"terms": -1, "weights": 0}  # what a row's unused slots hold (term -1, weight 0)


def query_width(t: int) -> int:
    """The graph's query width for a batch padded to ``t`` terms: a power of two, at least 8,
    so that few shapes occur."""
    return max(8, 1 << max(t - 1, 0).bit_length())


def _fields(specs: list[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[dict, int]:
    """Byte offsets of ``(name, dtype, shape)`` fields laid out one after the other, each
    8-byte aligned (so every view is legal); and the total size."""
    out, total = {}, 0
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out[name] = (total, nbytes, np.dtype(dtype), shape)
        total += -(-nbytes // 8) * 8
    return out, max(total, 8)


def _torch_view(buf: torch.Tensor, spec: tuple) -> torch.Tensor:
    start, nbytes, dtype, shape = spec
    return buf[start : start + nbytes].view(torch.from_numpy(np.zeros(0, dtype)).dtype).view(shape)


def _numpy_view(buf: np.ndarray, spec: tuple) -> np.ndarray:
    start, nbytes, dtype, shape = spec
    return buf[start : start + nbytes].view(dtype).reshape(shape)


@dataclass
class GraphEntry:
    """A captured search of one shape: the graph, its input buffer and outputs on the
    device, and two page-locked staging buffers used in turn (a staging buffer is written
    again only once its previous copy to the device has completed)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict  # name -> field spec of dev_in
    dev_in: torch.Tensor  # uint8
    out_views: list  # the graph's outputs, in the order of the steps' outputs
    staging: list[torch.Tensor]
    views: list  # each staging buffer's fields as numpy views
    nbytes: int = 0  # device bytes it holds (estimated): the cache's bound
    copied: list = field(default_factory=lambda: [None, None])  # the event after each staging's copy
    turn: int = 0

    def load(self, terms: np.ndarray, weights: np.ndarray, params: Mapping[str, np.ndarray]) -> None:
        """Write this batch's inputs into the next staging buffer and queue its copy to the device."""
        i = self.turn
        self.turn ^= 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # its previous copy has read it (normally long done)
        _fill(self.views[i], terms, weights, params)
        self.dev_in.copy_(self.staging[i], non_blocking=True)
        event = self.copied[i] or torch.cuda.Event()
        event.record()
        self.copied[i] = event

    def run(self) -> tuple[torch.Tensor, ...]:
        """Replay, then a copy of each output (the graph's own are rewritten by the next replay)."""
        self.graph.replay()
        return tuple(x.clone() for x in self.out_views)


def _fill(views: Mapping[str, np.ndarray], terms: np.ndarray, weights: np.ndarray, params: Mapping) -> None:
    """Each input into its view; the padded batch's rows padded further to the view's width."""
    for name, view in views.items():
        if name in _PADDING:
            src = terms if name == "terms" else weights
            if src.shape[1] == view.shape[1]:
                view[...] = src
            else:
                view.fill(_PADDING[name])
                view[:, : src.shape[1]] = src
        else:
            view[...] = params[name]


def graphed(
    cache: OrderedDict,
    key: tuple,
    steps: Steps,
    terms: np.ndarray,
    weights: np.ndarray,
    params: Mapping[str, np.ndarray],
    device: torch.device,
    nbytes: Callable[[], int] = lambda: 0,
) -> tuple[torch.Tensor, ...] | None:
    """``steps(inputs)``'s outputs for this batch by the CUDA graph of its shape, captured on
    first use and kept in ``cache`` under ``key`` + the shape (least recently used dropped
    past :attr:`~gpusparse.config.EngineConfig.graph_cache`); ``None`` where it could not be
    captured (remembered: the caller runs the steps themselves).

    ``terms`` (int64) and ``weights`` (float32) ``[B, t]`` are the padded batch on the host,
    ``params`` the per-query arrays ``[B]`` named as in :data:`INPUTS` (those given). ``steps``
    reads its inputs from the tensors it is given, under the same names, with the query
    width padded (:func:`query_width`). ``nbytes()``: the device bytes the steps allocate (their
    buffers stay with the graph; asked only before a capture); the cache holds at most
    :attr:`~gpusparse.config.EngineConfig.graph_cache_bytes` of them, and a graph larger than
    that is not captured.
    """
    b, t = terms.shape
    width = query_width(t)
    names = tuple(n for n, _, _ in INPUTS if n in params or n in _PADDING)
    full_key = (*key, b, width, names)
    entry = cache.get(full_key)
    if entry is False:
        return None
    if entry is None:
        config = engine_config()
        held = nbytes()
        if held > config.graph_cache_bytes:
            return None
        entry = _capture(steps, terms, weights, params, names, b, width, device)
        if entry is not None:
            entry.nbytes = held + int(entry.dev_in.numel())
        cache[full_key] = entry if entry is not None else False
        while len(cache) > config.graph_cache or _bytes(cache) > config.graph_cache_bytes:
            cache.popitem(last=False)
        if entry is None:
            return None
        return entry.run()  # the capture loaded this batch's inputs
    cache.move_to_end(full_key)
    entry.load(terms, weights, params)
    return entry.run()


def _bytes(cache: Mapping) -> int:
    return sum(e.nbytes for e in cache.values() if e)


def _capture(steps: Steps, terms, weights, params, names, b: int, width: int, dev: torch.device) -> GraphEntry | None:
    shapes = {"bw": (b, width), "b": (b,)}
    inputs, size = _fields([(n, d, shapes[s]) for n, d, s in INPUTS if n in names])
    dev_in = torch.empty(size, dtype=torch.uint8, device=dev)
    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = {n: _torch_view(dev_in, spec) for n, spec in inputs.items()}
    current = torch.cuda.current_stream(dev)
    try:
        staged = [{n: _numpy_view(buf.numpy(), spec) for n, spec in inputs.items()} for buf in staging]
        entry = GraphEntry(torch.cuda.CUDAGraph(), inputs, dev_in, [], staging, staged)
        entry.load(terms, weights, params)  # the warm-up and the capture search real inputs
        side = capture_stream(dev)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm up: kernels compiled, allocations made
            steps(views)
        current.wait_stream(side)
        # thread_local: another thread's CUDA calls meanwhile (an encoder's tokenising thread
        # allocating pinned memory) are no part of this capture and must not void it
        with torch.cuda.graph(entry.graph, stream=side, capture_error_mode="thread_local"):
            entry.out_views = list(steps(views))
    except RuntimeError:  # capture unsupported here: the caller runs the steps directly
        torch.cuda.set_stream(current)  # a failed capture leaves its stream current
        torch.cuda.synchronize(dev)
        return None
    return entry
