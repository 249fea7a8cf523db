"""A small batch's search as a CUDA graph, captured once per shape; its inputs and results
cross between host and device inside the graph.

A small batch's search is mostly the host's work (the kernel over all tiles takes ~0.1-0.2 ms
at 8.8M documents; each PyTorch call around it costs 5-15 µs of host time on an H200's host).
A graph replays every device operation in one launch, and copies in it spare the host its own
calls: the graph's first node copies a page-locked staging buffer (the padded terms and weights) to
the device, and its last node copies the results (up to :data:`HOST_COPY_MAX_BYTES`; one copy where
they lie in one buffer, as the search's do, else one each)
into page-locked host buffers. Per batch the host writes the staging buffer, replays and records
an event; the caller takes the results once the event has completed (:class:`HostResults`).

Each shape keeps up to two captures ("slots") in one memory pool, used in turn: a batch is
launched while the one before is still running, or its results not yet taken (Index.search
pipelines two batches). A slot is written again only once its replay has completed and its
results are taken (or, with both slots busy, copied out of the way first). The two captures
share their input buffer and intermediates: their replays must be ordered, i.e. on one stream
(as every search of an index is; a search is not to run from two threads at once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...config import engine_config
from ...kernels.cupy_launch import StreamEvent, copy_async, raw_stream
from ...streams import capture_stream, collection_held

Steps = Callable[[Mapping[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# (name, numpy dtype, what a row's unused slots hold) of each input, [B, width]
INPUTS: tuple[tuple[str, type, int], ...] = (("terms", np.int64, -1), ("weights", np.float32, 0))
SLOTS = 2  # captures per shape: a batch in flight while the next is launched
# Results up to this size are copied to the host inside the graph. Larger ones (batch 256 at
# top-1000: 3 MB) go the general way, on a side stream after the replay: in the graph their copy
# would hold up the next batch's kernels (pipelined batch 256 was ~4 % slower, measured on an H200).
HOST_COPY_MAX_BYTES = 1 << 20


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


class HostResults:
    """One replay's results, copied by the graph into its slot's page-locked buffers: host
    tensors once the replay has completed (:meth:`take`)."""

    def __init__(self, slot: _Slot) -> None:
        self._slot: _Slot | None = slot
        self._taken: list[torch.Tensor] = []

    def take(self, into: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, ...]:
        """The results (the steps' outputs, in order) as host tensors of their own, after one
        wait for the replay; the first ones written into ``into`` (host tensors of the same
        shapes) where given. Frees the slot."""
        slot = self._slot
        if slot is not None:
            slot.done.synchronize()
            self._taken = [
                into[i].copy_(h) if i < len(into) and into[i] is not None else h.clone()
                for i, h in enumerate(slot.host_out)
            ]
            slot.pending, self._slot = None, None
            return tuple(self._taken)
        out = list(self._taken)  # taken before (copied out of the slot's way)
        for i, target in enumerate(into):
            if target is not None:
                out[i] = target.copy_(out[i])
        return tuple(out)


@dataclass
class _Slot:
    """One capture of a shape: its graph, its page-locked staging buffer (and the buffer's
    fields as numpy views), the graph's outputs on the device and their page-locked copies."""

    graph: torch.cuda.CUDAGraph
    staging: torch.Tensor  # uint8, page-locked
    views: dict[str, np.ndarray]
    out_views: list[torch.Tensor]  # rewritten by each replay
    host_out: list[torch.Tensor]  # page-locked (one buffer's views where packed), graph-written (none: too large)
    done: StreamEvent  # recorded after each replay
    pending: HostResults | None = None  # results in host_out not yet taken
    last: int = 0  # when it was last replayed (the entry's count)

    def __del__(self) -> None:
        # The graph's copies read `staging` and write `host_out` behind PyTorch's back (raw
        # cudaMemcpyAsync): page-locked memory returned to its cache while a replay still runs
        # could be handed to another buffer and written by both. Wait for the last replay first.
        # not contextlib.suppress: at interpreter shutdown module globals may be gone already
        try:  # noqa: SIM105
            self.done.synchronize()
        except Exception:  # at shutdown: nothing left to protect
            pass

    def idle(self) -> bool:
        """Free to be written: its results taken and its last replay completed."""
        return self.pending is None and self.done.query()

    def make_free(self) -> None:
        """Wait for it: its results copied out of the way (kept by their :class:`HostResults`)."""
        if self.pending is not None:
            self.pending.take()
        else:
            self.done.synchronize()


@dataclass
class GraphEntry:
    """A shape's captures (up to :data:`SLOTS`, one memory pool) and the device input buffer
    that each slot's graph fills from its staging buffer."""

    inputs: dict  # name -> field spec of dev_in (and of each staging buffer)
    dev_in: torch.Tensor  # uint8
    device_index: int
    pool: tuple
    slots: list[_Slot] = field(default_factory=list)
    room: int = SLOTS  # the captures it may hold (lowered to those it has when one fails)
    nbytes: int = 0  # device bytes it holds (estimated): the cache's bound
    count: int = 0

    def slot(self) -> _Slot | None:
        """A slot to write: an idle one (least recently used first), else ``None`` while another
        may be captured, else the least recently used made free."""
        by_age = sorted(self.slots, key=lambda s: s.last)
        for s in by_age:
            if s.idle():
                return s
        if len(self.slots) < self.room:
            return None
        by_age[0].make_free()
        return by_age[0]

    def run(self, slot: _Slot, to_host: bool) -> tuple[torch.Tensor, ...] | HostResults:
        """Replay ``slot`` (its staging buffer written); its results on the host, or a copy of
        each output on the device (the graph's own are rewritten by its next replay)."""
        slot.graph.replay()
        slot.done.record(raw_stream(self.device_index))
        self.count += 1
        slot.last = self.count
        if to_host and slot.host_out:
            slot.pending = HostResults(slot)
            return slot.pending
        return tuple(x.clone() for x in slot.out_views)


def _fill(views: Mapping[str, np.ndarray], terms: np.ndarray, weights: np.ndarray) -> None:
    """The padded batch into the views, its rows padded further to the views' width."""
    for (name, _, pad), src in zip(INPUTS, (terms, weights), strict=True):
        view = views[name]
        if src.shape[1] == view.shape[1]:
            view[...] = src
        else:
            view.fill(pad)
            view[:, : src.shape[1]] = src


@dataclass(frozen=True)
class HostBatch:
    """A batch for :func:`graphed`: ``rows`` queries, the longest of ``longest`` terms, and
    ``fill(terms, weights)``, which writes it padded into a staging buffer's int64 terms and
    float32 weights ``[rows, width]`` (``width`` at least ``longest``; ``-1`` and ``0`` after each
    row's end)."""

    rows: int
    longest: int
    fill: Callable[[np.ndarray, np.ndarray], None]


def padded_batch(terms: np.ndarray, weights: np.ndarray) -> HostBatch:
    """A :class:`HostBatch` of a batch already padded on the host (int64 ``terms`` and float32
    ``weights`` ``[B, t]``), copied into the staging buffer."""
    return HostBatch(terms.shape[0], terms.shape[1], lambda t, w: _fill({"terms": t, "weights": w}, terms, weights))


def graphed(
    cache: OrderedDict,
    key: tuple,
    steps: Steps,
    batch: HostBatch,
    device: torch.device,
    nbytes: Callable[[], int] = lambda: 0,
    *,
    to_host: bool = False,
) -> tuple[torch.Tensor, ...] | HostResults | None:
    """``steps(inputs)``'s outputs for this batch by the CUDA graph of its shape, captured on
    first use and kept in ``cache`` under ``key`` + the shape (least recently used dropped
    past :attr:`~gpusparse.config.EngineConfig.graph_cache`); ``None`` where it could not be
    captured (remembered: the caller runs the steps themselves). ``to_host``: the outputs as
    :class:`HostResults` (copied to the host by the graph) where they are at most
    :data:`HOST_COPY_MAX_BYTES` and results use page-locked memory
    (:attr:`~gpusparse.config.EngineConfig.pinned_results`); otherwise, a copy of each on the device.

    ``batch`` writes the padded batch into the graph's staging buffer (:class:`HostBatch`):
    ``steps`` reads it from the tensors it is given, ``terms`` (int64) and ``weights`` (float32)
    ``[B, width]``, the query width padded (:func:`query_width` of the longest row).
    ``nbytes()``: the device bytes the steps allocate (their buffers stay with the graph;
    asked only before a capture); the cache holds at most
    :attr:`~gpusparse.config.EngineConfig.graph_cache_bytes` of them, and a graph larger than
    that is not captured.
    """
    b, width = batch.rows, query_width(batch.longest)
    full_key = (*key, b, width)
    entry = cache.get(full_key)
    if entry is False:
        return None
    config = engine_config()
    if entry is None:
        held = nbytes()
        if held > config.graph_cache_bytes:
            return None
        inputs, size = _fields([(n, d, (b, width)) for n, d, _ in INPUTS])
        dev_in = torch.empty(size, dtype=torch.uint8, device=device)
        entry = GraphEntry(inputs, dev_in, dev_in.device.index, torch.cuda.graph_pool_handle())
        entry.nbytes = held + size
        cache[full_key] = entry
        while len(cache) > config.graph_cache or _bytes(cache) > config.graph_cache_bytes:
            cache.popitem(last=False)
    else:
        cache.move_to_end(full_key)
    slot = entry.slot()
    captured = _capture(entry, steps, batch) if slot is None else None  # filled with this batch
    if captured is not None:
        entry.slots.append(captured)
        if len(entry.slots) > 1:  # the second slot's own outputs (the pool and the inputs are shared)
            entry.nbytes += sum(o.numel() * o.element_size() for o in captured.out_views)
            while len(cache) > 1 and _bytes(cache) > config.graph_cache_bytes:
                cache.popitem(last=False)
        slot = captured
    elif slot is None:  # the capture failed
        if not entry.slots:
            cache[full_key] = False  # remembered: capture unsupported for this shape
            return None
        entry.room = len(entry.slots)  # a second one (memory, say): the first slot serves alone
        slot = entry.slot()
    if captured is None:
        batch.fill(slot.views["terms"], slot.views["weights"])  # type: ignore[union-attr]
    return entry.run(slot, to_host and config.pinned_results)  # type: ignore[arg-type]


def _packed(outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """Where the outputs are contiguous views packed in one buffer (as
    :func:`gpusparse.kernels.finish.finish_rows`'s): that buffer's bytes that hold them (a uint8
    view) and each output's byte offset in it; else ``None``."""
    if not outs or not all(o.is_contiguous() for o in outs):
        return None
    storage = outs[0].untyped_storage()
    if any(o.untyped_storage().data_ptr() != storage.data_ptr() for o in outs):
        return None
    sizes = [o.numel() * o.element_size() for o in outs]
    start = min(o.data_ptr() for o in outs)
    end = max(o.data_ptr() + n for o, n in zip(outs, sizes, strict=True))
    if end - start > sum(sizes) + 8 * len(outs):  # views scattered over a larger buffer: not packed
        return None
    whole = torch.empty(0, dtype=torch.uint8, device=outs[0].device).set_(storage)
    first = start - storage.data_ptr()
    return whole[first : first + end - start], [o.data_ptr() - start for o in outs]


def _view_at(host: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The view of ``host`` (uint8) at byte ``offset`` with ``like``'s dtype and shape."""
    return host[offset : offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def _bytes(cache: Mapping) -> int:
    return sum(e.nbytes for e in cache.values() if e)


def _capture(entry: GraphEntry, steps: Steps, batch: HostBatch) -> _Slot | None:
    """A new slot of ``entry``, its staging buffer holding this batch (the caller replays it:
    a capture runs nothing); ``None`` where capture is unsupported here."""
    dev = entry.dev_in.device
    size = entry.dev_in.numel()
    staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    views = {n: _numpy_view(staging.numpy(), spec) for n, spec in entry.inputs.items()}
    batch.fill(views["terms"], views["weights"])
    inputs = {n: _torch_view(entry.dev_in, spec) for n, spec in entry.inputs.items()}
    current = torch.cuda.current_stream(dev)
    side = capture_stream(dev)
    try:
        # a collection mid-capture may void it (collection_held), and the shape would then never
        # be captured again
        with collection_held():
            side.wait_stream(current)
            with torch.cuda.stream(side):  # warm up: kernels compiled, allocations made, output shapes known
                copy_async(entry.dev_in, staging, side.cuda_stream)
                outs = steps(inputs)
            small = sum(o.numel() * o.element_size() for o in outs) <= HOST_COPY_MAX_BYTES
            packed = _packed(outs)
            if not small:
                host_base, host_out = None, []
            elif packed is not None:  # one buffer, one copy (each copy is a node of its own)
                host_base = torch.empty(packed[0].numel(), dtype=torch.uint8, pin_memory=True)
                host_out = [_view_at(host_base, at, o) for at, o in zip(packed[1], outs, strict=True)]
            else:
                host_base, host_out = None, [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outs]
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls meanwhile (an encoder's tokenising thread
            # allocating pinned memory) are no part of this capture and must not void it
            with torch.cuda.graph(graph, pool=entry.pool, stream=side, capture_error_mode="thread_local"):
                copy_async(entry.dev_in, staging, side.cuda_stream)
                out_views = list(steps(inputs))
                if host_base is not None:
                    again = _packed(out_views)
                    if again is None or again[1] != packed[1]:  # type: ignore[index]
                        raise RuntimeError("the captured outputs are laid out unlike the warm-up's")
                    copy_async(host_base, again[0], side.cuda_stream)
                else:
                    for h, o in zip(host_out, out_views if host_out else [], strict=True):
                        copy_async(h, o.contiguous(), side.cuda_stream)
    except RuntimeError:  # capture unsupported here: the caller runs the steps directly
        torch.cuda.set_stream(current)  # a failed capture leaves its stream current
        torch.cuda.synchronize(dev)
        return None
    return _Slot(graph, staging, views, out_views, host_out, StreamEvent(entry.device_index))
