"""A small batch's search as a CUDA graph, captured once per shape; its inputs and results
cross between host and device inside the graph.

A small batch's search is mostly the host's work (the kernel over all tiles takes ~0.1-0.2 ms
at 8.8M documents; each PyTorch call around it costs 5-15 µs of host time on an H200's host).
A graph replays every device operation in one launch, and copies in it spare the host its own
calls. The host writes the batch's rows as they are (CSR: row pointers, terms, weights) into a
page-locked staging buffer; the graph's first kernel (:func:`~gpusparse.kernels.query_rows.query_rows`)
reads them from there (mapped host memory; where the memory is not mapped, a copy node brings
the buffer over first), pads the rows and, for a quantized index, quantizes their weights; its
last node copies the results (up to :data:`HOST_COPY_MAX_BYTES`; one copy where they lie in one
buffer, as the search's do, else one each) into page-locked host buffers. Per batch the host
copies the rows into the staging buffer, replays and records an event; the caller takes the
results once the event has completed (:class:`HostResults`).

Each shape keeps up to two captures ("slots") in one memory pool, used in turn: a batch is
launched while the one before is still running, or its results not yet taken (Index.search
pipelines two batches). A slot is written again only once its replay has completed and its
results are taken (or, with both slots busy, copied out of the way first). The two captures
share their intermediates: their replays must be ordered, i.e. on one stream
(as every search of an index is; a search is not to run from two threads at once).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...config import engine_config
from ...kernels.cupy_launch import GraphLaunch, StreamEvent, copy_async, mapped_pointer, raw_stream
from ...kernels.query_rows import csr_fields, query_rows
from ...queries import unpadded
from ...queries_native import longest_row, stage_rows
from ...streams import capture_stream, collection_held

Steps = Callable[[Mapping[str, torch.Tensor]], tuple[torch.Tensor, ...]]
SLOTS = 2  # captures per shape: a batch in flight while the next is launched
# Results up to this size are copied to the host inside the graph. Larger ones (batch 256 at
# top-1000: 3 MB) go the general way, on a side stream after the replay: in the graph their copy
# would hold up the next batch's kernels (pipelined batch 256 was ~4 % slower, measured on an H200).
# A repeat (one batch, none after it) copies them right after the replay, on its stream.
HOST_COPY_MAX_BYTES = 1 << 20


def query_width(t: int) -> int:
    """The graph's query width for a batch padded to ``t`` terms: a power of two, at least 8,
    so that few shapes occur."""
    return max(8, 1 << max(t - 1, 0).bit_length())


def _numpy_view(buf: np.ndarray, spec: tuple) -> np.ndarray:
    start, nbytes, dtype, shape = spec
    return buf[start : start + nbytes].view(dtype).reshape(shape)


class HostResults:
    """One replay's results, copied by the graph into its slot's page-locked buffers (or, with
    ``delivered``, by copies after the replay on its stream into page-locked tensors of their
    own): host tensors once the replay has completed (:meth:`take`). ``flag``: the output that
    is a bool array of flags (rows to search again), ``None`` in the results where none is set."""

    def __init__(
        self, slot: _Slot, flag: int | None = None, *, own: bool = False, delivered: list[torch.Tensor] | None = None
    ) -> None:
        self._slot: _Slot | None = slot
        self._flag = flag
        self._taken: list[torch.Tensor | None] = []
        self.repeat: Repeat | None = None  # later batches of this shape (set by graphed)
        self._delivered = delivered
        if delivered is not None and flag is not None:
            self._delivered_flags = delivered[flag].numpy()
        # own: the results' memory taken now, while the device works, not after the wait (the
        # flags' filled only where one is set)
        self._own: list[np.ndarray] | None = None
        if own:
            self._own = [np.empty_like(h) for h in slot.host_np]
            self._own_t = [torch.from_numpy(a) for a in self._own]

    def take(self, into: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor | None, ...]:
        """The results (the steps' outputs, in order) as host tensors of their own, after one
        wait for the replay; the first ones written into ``into`` (host tensors of the same
        shapes) where given; the flags' output ``None`` where no flag is set. Frees the slot."""
        slot = self._slot
        if slot is not None:
            slot.done.synchronize()
            if self._delivered is not None:  # already the caller's: nothing to copy
                self._taken = list(self._delivered)
                if self._flag is not None and not _any_set(self._delivered_flags):
                    self._taken[self._flag] = None
                slot.pending, self._slot = None, None
                return self.take(into)
            # a copy each: one copy of the packed buffer and views of it took ~35 µs more of an
            # H200 host's time at batch 1 (the views' Python; measured)
            skip = -1 if self._flag is None or _any_set(slot.host_np[self._flag]) else self._flag
            own = self._own
            if own is not None and not into:
                for i, (target, h) in enumerate(zip(own, slot.host_np, strict=True)):
                    if i != skip:
                        target[...] = h
                self._taken = [None if i == skip else t for i, t in enumerate(self._own_t)]
            else:
                self._taken = [
                    None if i == skip else into[i].copy_(h) if i < len(into) and into[i] is not None else h.clone()
                    for i, h in enumerate(slot.host_out)
                ]
            slot.pending, self._slot = None, None
            return tuple(self._taken)
        out = list(self._taken)  # taken before (copied out of the slot's way)
        for i, target in enumerate(into):
            if target is not None and out[i] is not None:
                out[i] = target.copy_(out[i])
        return tuple(out)


def _any_set(flags: np.ndarray) -> bool:
    """Whether any of a bool array's flags is set (its bytes: a tenth of ``any()``'s host time)."""
    return bool(flags.tobytes().strip(b"\x00"))


@dataclass
class _Slot:
    """One capture of a shape: its graph, its page-locked staging buffer (and the buffer's
    fields as numpy views), the graph's outputs on the device and their page-locked copies."""

    graph: torch.cuda.CUDAGraph
    staging: torch.Tensor  # uint8, page-locked
    views: dict[str, np.ndarray]
    out_views: list[torch.Tensor]  # rewritten by each replay
    host_out: list[torch.Tensor]  # page-locked (one buffer's views where packed), graph-written (none: too large)
    host_np: list[np.ndarray]  # host_out as numpy views (the flags read there without a torch call)
    done: StreamEvent  # recorded after each replay
    launch: GraphLaunch  # replays the graph on a raw stream
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
    """A shape's captures (up to :data:`SLOTS`, one memory pool): ``rows`` queries of at most
    ``width`` terms, staged as :func:`~gpusparse.kernels.query_rows.csr_fields` ``(rows, cap)``
    lays them out (``inputs``: each field's spec), quantized on the device to ``bits`` (0: not).
    ``dev_in``: the device buffer the slots' graphs copy their staging buffers into, made only
    where a staging buffer is not mapped into the device's address space."""

    rows: int
    width: int
    bits: int
    inputs: dict  # name -> field spec in each staging buffer
    size: int  # a staging buffer's bytes
    device: torch.device
    device_index: int
    pool: tuple
    dev_in: torch.Tensor | None = None  # uint8
    slots: list[_Slot] = field(default_factory=list)
    room: int = SLOTS  # the captures it may hold (lowered to those it has when one fails)
    nbytes: int = 0  # device bytes it holds (estimated): the cache's bound
    count: int = 0
    repeat: Repeat | None = None  # later batches of this shape (made at the first replay to the host)

    @property
    def cap(self) -> int:
        """Terms a staging buffer holds: every row may be ``width`` long."""
        return self.rows * self.width

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

    def run(
        self, slot: _Slot, to_host: bool, flag: int | None = None, *, own: bool = False
    ) -> tuple[torch.Tensor, ...] | HostResults:
        """Replay ``slot`` (its staging buffer written); its results on the host (``flag``,
        ``own``: see :class:`HostResults`), or a copy of each output on the device (the graph's
        own are rewritten by its next replay). With ``own``, results too large for the graph's
        own copy (:data:`HOST_COPY_MAX_BYTES`) are copied to the host right after the replay, on
        its stream, into page-locked tensors of their own: a repeat's single batch has no next
        batch for the copies to hold up."""
        stream = raw_stream(self.device_index)
        slot.launch(stream)
        delivered = None
        if to_host and own and not slot.host_out:
            delivered = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in slot.out_views]
            for h, o in zip(delivered, slot.out_views, strict=True):
                copy_async(h, o, stream)
        slot.done.record(stream)
        self.count += 1
        slot.last = self.count
        if to_host and (slot.host_out or delivered is not None):
            slot.pending = HostResults(slot, flag, own=own, delivered=delivered)
            return slot.pending
        return DeviceResults(x.clone() for x in slot.out_views)


class DeviceResults(tuple):
    """A replay's outputs copied on the device (:meth:`GraphEntry.run`), and the shape's
    :class:`Repeat` where :func:`graphed` made one."""

    repeat: Repeat | None = None


class Repeat:
    """Later batches of one captured shape (a :class:`GraphEntry` in its cache under ``key``), with
    the least host work: the batch's rows staged and the graph replayed, its results on their way
    to the host, without the general path's look-ups (:func:`graphed`). A search that sends the
    same shape batch after batch spends its host time between the device's searches: on an H200's
    host each µs of Python there costs 3-5 µs after the device's 3 ms wait (measured)."""

    def __init__(self, cache: OrderedDict, key: tuple, entry: GraphEntry, flag: int | None) -> None:
        # the entry held weakly: one dropped from the cache frees its graphs and buffers at once,
        # though a search still holds this repeat (and the entry holds it: no cycle)
        self.cache, self.key, self._entry, self.flag = cache, key, weakref.ref(entry), flag
        self.config = engine_config()  # the settings it was made under: another object voids it
        # results the graph does not copy out are copied after the replay: by one copy each, which
        # needs them contiguous (finish_rows' are)
        outs = entry.slots[0].out_views if entry.slots else []
        self.serves = bool(entry.slots) and (bool(entry.slots[0].host_out) or all(o.is_contiguous() for o in outs))

    def launch(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> HostResults | None:
        """:func:`graphed` of a batch of canonical rows (as :func:`csr_batch` takes them) to the
        host, by this shape's graph; ``None`` where this shape does not serve it: another number
        of rows or query width, other settings in force, the entry no longer in its cache (dropped,
        or the index's derived state reset), a slot still to be captured, outputs it cannot copy
        out (not contiguous), or no C module (the caller then searches the general way)."""
        entry = self._entry()
        if not self.serves or entry is None or self.cache.get(self.key) is not entry:
            return None
        if engine_config() is not self.config:
            return None
        if len(indptr) - 1 != entry.rows or len(indices) > entry.cap:
            return None
        slot = entry.slot()
        if slot is None:
            return None
        # staged first (the pass finds the longest row): a batch of another width leaves the idle
        # slot's buffer written but not replayed, and the next batch writes it again
        views = slot.views
        longest = stage_rows(indptr, indices, values, views["indptr"], views["indices"], views["values"])
        if longest is None or query_width(longest) != entry.width:
            return None
        self.cache.move_to_end(self.key)
        return entry.run(slot, True, self.flag, own=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class HostBatch:
    """A batch for :func:`graphed`: ``rows`` queries of ``nnz`` terms in all, the longest of
    ``longest``, whose weights the graph quantizes to ``bits`` (0: used as they are; see
    :func:`~gpusparse.kernels.query_rows.query_rows`), and ``fill(indptr, indices, values)``,
    which writes its rows into a staging buffer's views: int32 row pointers ``[rows + 1]``
    from 0, int32 terms and float32 weights (``nnz`` of them, at the views' start)."""

    rows: int
    longest: int
    nnz: int
    bits: int
    fill: Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def csr_batch(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, bits: int = 0) -> HostBatch:
    """A :class:`HostBatch` of canonical rows (``indptr`` int64, from any start; ``indices``
    int32; ``values`` float32, > 0), copied as they are into the staging buffer."""
    rows, nnz = len(indptr) - 1, int(indptr[-1] - indptr[0])
    longest = longest_row(indptr)  # one C pass each (here and in fill): this is a batch's latency
    if longest is None:
        longest = int((indptr[1:] - indptr[:-1]).max()) if rows > 0 else 0

    def fill(ptr: np.ndarray, ind: np.ndarray, val: np.ndarray) -> None:
        if stage_rows(indptr, indices, values, ptr, ind, val) is None:
            np.subtract(indptr, indptr[0], out=ptr, casting="unsafe")
            ind[:nnz] = indices
            val[:nnz] = values

    return HostBatch(rows, longest, nnz, bits, fill)


def padded_batch(terms: np.ndarray, weights: np.ndarray, lengths: np.ndarray) -> HostBatch:
    """A :class:`HostBatch` of a batch padded on the host (int64 ``terms``, ``-1`` after each
    row's ``lengths`` terms, and float32 ``weights`` ``[B, t]``: a
    :class:`~gpusparse.queries.QueryBatch`'s host arrays), its rows taken back out of the padding."""
    indptr, indices, values = unpadded(terms, weights, lengths)
    return csr_batch(indptr, indices.astype(np.int32), values.astype(np.float32, copy=False))


def graphed(
    cache: OrderedDict,
    key: tuple,
    steps: Steps,
    batch: HostBatch,
    device: torch.device,
    nbytes: Callable[[int], int] = lambda rows: 0,
    *,
    to_host: bool = False,
    flag: int | None = None,
) -> tuple[torch.Tensor, ...] | HostResults | None:
    """``steps(inputs)``'s outputs for this batch by the CUDA graph of its shape, captured on
    first use and kept in ``cache`` under ``key`` + the shape (least recently used dropped
    past :attr:`~gpusparse.config.EngineConfig.graph_cache`); ``None`` where it could not be
    captured (remembered: the caller runs the steps themselves). ``to_host``: the outputs as
    :class:`HostResults` (copied to the host by the graph) where they are at most
    :data:`HOST_COPY_MAX_BYTES` and results use page-locked memory
    (:attr:`~gpusparse.config.EngineConfig.pinned_results`); otherwise, a copy of each on the device.
    ``flag``: the output that is a bool array of flags (:class:`HostResults`).

    ``batch`` writes its rows into the graph's staging buffer (:class:`HostBatch`; room for
    ``B · width`` terms); ``steps`` reads the batch padded (and quantized to ``batch.bits``) from
    the tensors it is given, ``terms`` (int64), ``weights`` (float32) and ``terms32`` (the terms
    as int32) ``[B, width]``, the query
    width padded (:func:`query_width` of the longest row), which the graph's first kernel writes
    (:func:`~gpusparse.kernels.query_rows.query_rows`).
    ``nbytes(rows)``: the device bytes the steps allocate for a batch of ``rows`` queries (their
    buffers stay with the graph; asked only before a capture); the cache holds at most
    :attr:`~gpusparse.config.EngineConfig.graph_cache_bytes` of them, and a graph larger than
    that is not captured.
    """
    b, width = batch.rows, query_width(batch.longest)
    full_key = (*key, b, width, batch.bits)
    entry = cache.get(full_key)
    if entry is False:
        return None
    config = engine_config()
    if entry is None:
        held = nbytes(b)
        if held > config.graph_cache_bytes:
            return None
        inputs, size = csr_fields(b, b * width)
        dev = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        pool = torch.cuda.graph_pool_handle()
        entry = GraphEntry(b, width, batch.bits, inputs, size, dev, dev.index, pool)
        entry.nbytes = held + size  # with the device copy of the staging buffer, where one is needed
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
        batch.fill(slot.views["indptr"], slot.views["indices"], slot.views["values"])  # type: ignore[union-attr]
    to_host = to_host and config.pinned_results
    out = entry.run(slot, to_host, flag)  # type: ignore[arg-type]
    if to_host:  # later batches of the shape, to the host (results too large for the graph's copy too)
        if entry.repeat is None or entry.repeat.config is not config:
            entry.repeat = Repeat(cache, full_key, entry, flag)
        out.repeat = entry.repeat  # type: ignore[union-attr]
    return out


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
    dev = entry.device
    staging = torch.empty(entry.size, dtype=torch.uint8, pin_memory=True)
    views = {n: _numpy_view(staging.numpy(), spec) for n, spec in entry.inputs.items()}
    batch.fill(views["indptr"], views["indices"], views["values"])
    # the first kernel reads the rows where the host wrote them, else from a copy made first
    mapped = mapped_pointer(staging)
    if mapped is None and entry.dev_in is None:
        entry.dev_in = torch.empty(entry.size, dtype=torch.uint8, device=dev)
    source = mapped if mapped is not None else entry.dev_in

    def padded() -> dict[str, torch.Tensor]:
        if mapped is None:
            copy_async(entry.dev_in, staging, side.cuda_stream)  # type: ignore[arg-type]
        terms, weights, terms32 = query_rows(source, entry.rows, entry.cap, entry.width, entry.bits, device=dev)  # type: ignore[arg-type]
        return {"terms": terms, "weights": weights, "terms32": terms32}

    current = torch.cuda.current_stream(dev)
    side = capture_stream(dev)
    try:
        # a collection mid-capture may void it (collection_held), and the shape would then never
        # be captured again
        with collection_held():
            side.wait_stream(current)
            with torch.cuda.stream(side):  # warm up: kernels compiled, allocations made, output shapes known
                outs = steps(padded())
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
                out_views = list(steps(padded()))
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
    launch = GraphLaunch(graph, entry.device_index)
    host_np = [h.numpy() for h in host_out]
    return _Slot(graph, staging, views, out_views, host_out, host_np, StreamEvent(entry.device_index), launch)
