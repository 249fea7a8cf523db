"""The tiled engine: on-chip accumulation per document tile, exact by a certified margin.

Search (per query batch) over the tiled layout (:mod:`gpusparse.layout.tiled`): every
(query, tile) pair accumulates its scores in fixed point (32-bit sums by default; on a GPU
in shared memory, :mod:`gpusparse.kernels.tile_candidates`; on a CPU the same steps in PyTorch,
:mod:`.emulation`), keeps a running per-query lower bound ``theta`` of the k-th best score,
and emits only documents within an error margin of it (:mod:`.fixed_point`). The margin
covers the fixed-point rounding, the canonical float64 sum's own error and one float32 ulp,
so the candidates always contain the exact top-k of the search contract
(:mod:`gpusparse.exact`); candidates whose float32 score is not certain from the integer sum
are rescored canonically (:mod:`.ranking`). No ``[B, N]`` buffer is ever allocated. On a GPU
the steps run without host synchronisation (:mod:`.device`); rows it cannot finish go the
general way (:mod:`.waves`, which syncs per wave).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ...config import EngineConfig, engine_config
from ...kernels import cupy_launch, rescore, tile_candidates
from ...layout.layout_only import LayoutOnly
from ...layout.order import order_clusters
from ...layout.postings import PostingLists
from ...layout.tiled import AUTO, TiledIndex, default_layout, tiled_layout
from ...quantize import quantize_queries
from ...queries import QueryBatch, batch_rows, query_batch
from ..base import DEFAULT_MEMORY_BUDGET, POSTING_BYTES, BatchResult, SearchPlan, plan_chunks
from ..reference import reference_search
from .device import device_search, graphed_steps
from .emulation import torch_tiled_candidates
from .fixed_point import choose_acc, exact_margin, fixed_point, integer_weights, out_of_range
from .graphs import Repeat, csr_batch, query_width
from .layout_fallback import layout_reference_search
from .ranking import rank_candidates
from .waves import candidate_lows, candidates, compact_cuda, compact_torch

if TYPE_CHECKING:
    from ...collection import SparseCollection


class TiledEngine:
    """:func:`tiled_search` behind the :class:`~gpusparse.engines.base.Engine` interface."""

    name: ClassVar[str] = "tiled"
    auto_rank: ClassVar[int] = 30

    def unavailable(self, device: torch.device, *, auto: bool = False) -> str | None:
        """Runs anywhere (PyTorch off a GPU with CuPy); chosen automatically only on a CUDA
        device with CuPy, the CUDA kernel's runtime compiler."""
        if auto and not (device.type == "cuda" and cupy_launch.available()):
            return "the tiled engine's CUDA kernel needs a CUDA device and CuPy (elsewhere it is an emulation)"
        return None

    # Queries of a plan with ``query_bits`` arrive unquantized: a batch that replays a CUDA graph
    # is quantized there, any other on the host first.
    quantizes_queries: ClassVar[bool] = True

    def search_batch(self, index: PostingLists, queries: SparseCollection, k: int, plan: SearchPlan) -> BatchResult:
        """Exact top-``k`` of the batch, before the GPU path's host sync (see :func:`tiled_search`;
        a batch that replays a CUDA graph: :func:`graphed_batch_search`)."""
        bits = plan.query_bits or 0
        graphed = graphed_batch_search(index, queries, k, cutoff=plan.cutoff, to_host=plan.to_host, bits=bits)
        if graphed is not None:
            return graphed
        if bits:
            queries = quantize_queries(queries, bits)
        return tiled_search(index, query_batch(queries, index.device), k, cutoff=plan.cutoff)


def graphed_batch_search(
    index: PostingLists,
    queries: SparseCollection,
    k: int,
    *,
    cutoff: Callable | None = None,
    to_host: bool = False,
    bits: int = 0,
) -> BatchResult | None:
    """:func:`tiled_search` of a batch on a GPU by the CUDA graph of its shape
    (:func:`~.device.graphed_steps`), from the host arrays: the batch's rows are copied as they
    are into the graph's staging buffer, and its first kernel pads them on the device (and
    quantizes them, with ``bits``); its fixed-point parameters are computed in the graph,
    whose one launch replays every device operation of the search. For batches of at most
    :attr:`~gpusparse.config.EngineConfig.graph_max_batch` queries (``cutoff`` then unused, as
    in :func:`~.device.device_search`), and for larger ones up to
    :attr:`~gpusparse.config.EngineConfig.graph_repeat_batch` without a ``cutoff`` or a
    :attr:`~gpusparse.config.EngineConfig.device_memory_limit` from the second batch of the
    same shape on. ``None`` where this path does not apply (another
    device, a batch too large or seen once, no graph; rows outside the fixed-point range are
    flagged in the graph):
    the caller searches the general way. Flagged rows are searched again as
    :func:`tiled_search` does. ``to_host``: the results delivered to the host by the graph
    (:attr:`~gpusparse.engines.base.BatchResult.host`) where they are small enough
    (:func:`~.graphs.graphed`), not as device tensors. ``bits``: the queries are not yet
    quantized; the graph quantizes them to that many bits
    (:func:`gpusparse.quantize.quantize_queries`'s rule, on the device)."""
    dev = index.device
    b = len(queries)
    config = engine_config()
    if not (b > 0 and dev.type == "cuda" and cupy_launch.available()):
        return None
    # a larger batch's graph keeps its buffers between searches: not under a device memory limit
    repeat = b <= config.graph_repeat_batch and cutoff is None and config.device_memory_limit is None
    if b > config.graph_max_batch and not repeat:
        return None
    # the rows as they are: the graph's first kernel pads (and quantizes) them
    host = csr_batch(queries.indptr, queries.indices, queries.values, bits)
    if b > config.graph_max_batch and not _seen_before(index, (b, query_width(host.longest), k, bits)):
        return None
    acc = choose_acc(None)
    layout = layout_for_search(index, acc=acc)
    # The parameters are computed in the graph. Integer products on the 8-bit layout: prepared
    # queries' weights are levels times a power of two, as are the documents', and the scale
    # (2**31 over the score bound) leaves their product an integer for any query of up to 2**14
    # terms; a row where it does not (a query not prepared) is flagged in the graph.
    int_w = layout.quantized and acc == "u32"
    n_sm = _sm_count(cupy_launch.device_index(dev))
    out = graphed_steps(index, layout, host, k, acc=acc, int_weights=int_w, n_sm=n_sm, to_host=to_host)
    if out is None:
        return None

    again = functools.partial(_search_again, index, queries, k, bits)
    # later batches of this shape: by the graph's Repeat (a batch above graph_max_batch only
    # without a cutoff, which a repeat does not check)
    rep = out.repeat if cutoff is None else None  # type: ignore[union-attr]  # (graphed's tuples: DeviceResults)
    repeat = None if rep is None else functools.partial(_repeat, index, k, bits, rep)
    if isinstance(out, tuple):
        return BatchResult(*out, again, repeat=repeat)
    return BatchResult(None, None, None, again, host=out, repeat=repeat)


def _search_again(
    index: PostingLists, queries: SparseCollection, k: int, bits: int, rows: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a graph flagged, searched the general way (:func:`tiled_search`)."""
    prepared = quantize_queries(queries, bits) if bits else queries
    batch = batch_rows(query_batch(prepared, index.device), rows, index.device)
    return tiled_search(index, batch, k, general=True).resolved()


def _repeat(
    index: PostingLists, k: int, bits: int, rep: Repeat, queries: SparseCollection, query_bits: int | None
) -> BatchResult | None:
    """:func:`graphed_batch_search` of a later batch by the graph an earlier one of its shape
    replayed (:class:`~.graphs.Repeat`; :attr:`BatchResult.repeat`), or ``None`` where that graph
    does not serve it."""
    if (query_bits or 0) != bits:
        return None
    out = rep.launch(queries.indptr, queries.indices, queries.values)
    if out is None:
        return None
    return BatchResult(None, None, None, functools.partial(_search_again, index, queries, k, bits), host=out)


@functools.cache
def _sm_count(device_index: int) -> int:
    """The device's multiprocessors (asked once: ~7 µs a call on a slow host)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _seen_before(index: PostingLists, shape: tuple) -> bool:
    """Whether a batch of this shape came before (and remember it: the last 64 shapes)."""
    seen = index.derived.graph_shapes
    if shape in seen:
        seen.move_to_end(shape)
        return True
    seen[shape] = True
    while len(seen) > 64:
        seen.popitem(last=False)
    return False


def layout_for_search(
    index: PostingLists,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    acc: str | None = None,
    fixed: bool | None = None,
    *,
    forward: bool = True,
) -> TiledIndex:
    """The layout :func:`tiled_search` searches with these arguments (built once per index).
    ``fixed=None`` takes :attr:`~gpusparse.config.EngineConfig.fixed_point`. ``forward``:
    a layout built on a GPU with the CUDA kernels holds the index's forward copy for
    rescoring (:attr:`~gpusparse.config.EngineConfig.forward_rescoring`); ``False`` for a
    layout to be streamed. An index whose lists are not on the device
    (:class:`~gpusparse.layout.resident.TiledResident`) rescores from the layout: no forward
    copy and no list positions."""
    config = engine_config()
    # every search asks: the answer is kept per arguments and settings (a few µs of a small batch's latency)
    chosen = index.derived.chosen
    key = (tile_bits, dense_min, acc, fixed, forward)
    hit = chosen.get(key)
    if hit is not None and hit[0] is config:
        return hit[1]
    layout = _layout_for_search(index, config, tile_bits, dense_min, acc, fixed, forward)
    chosen[key] = (config, layout)  # the settings held: another object cannot take their id
    return layout


def _layout_for_search(
    index: PostingLists,
    config: EngineConfig,
    tile_bits: int | None,
    dense_min: float | str | None,
    acc: str | None,
    fixed: bool | None,
    forward: bool,
) -> TiledIndex:
    acc = choose_acc(acc)
    dense_min = config.dense_min if dense_min == AUTO else dense_min
    fixed = (config.fixed_point if fixed is None else fixed) and acc == "u32" and index.quantization is None
    if not index.lists_resident:
        return tiled_layout(index, tile_bits, dense_min, fixed, list_positions=False)
    forward = forward and config.forward_rescoring and index.device.type == "cuda" and rescore.available()
    bits = default_layout(index, fixed)[0] if tile_bits is None else tile_bits
    # a layout-only index holds the one layout it was built with
    clusters = (
        0
        if isinstance(index, LayoutOnly)
        else order_clusters(config.doc_order, config.order_clusters, index.n_docs, bits, forward=forward)
    )
    # beside the lists rescoring reads them (or the forward copy): the weights may be stored
    # in fixed point, which spares the kernel a conversion a posting and a dense slot
    return tiled_layout(index, tile_bits, dense_min, fixed, forward=forward, stored_fixed=True, clusters=clusters)


def tiled_search(
    index: PostingLists,
    batch: QueryBatch,
    k: int,
    *,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    acc: str | None = None,
    fixed: bool | None = None,
    emulated: bool = False,
    general: bool = False,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> BatchResult:
    """Exact top-k of a query batch with the tiled engine: a
    :class:`~gpusparse.engines.base.BatchResult` ``[B, k]`` on the device.

    Uses the CUDA kernel on a GPU with CuPy, and the same algorithm in PyTorch elsewhere
    (or when ``emulated``). On a GPU the search runs without host synchronisation
    (:func:`~.device.device_search`): the result's flagged rows are searched again the
    general way, which syncs after each wave to size its buffers, only when the caller asks
    (:meth:`~gpusparse.engines.base.BatchResult.resolved`, after its own sync); ``general``:
    every row that way.
    ``tile_bits`` / ``dense_min``: the layout (see :func:`~gpusparse.layout.tiled.tiled_layout`).
    ``acc``: the kernel's accumulator mode (default: the configured one); it sets the
    fixed-point scale, so the PyTorch path follows it too.
    ``fixed``: fixed-point float32 weights (default: configured; "u32" only).
    ``cutoff``: for a search whose results are merged with other searches' (shards), a function
    that takes this search's candidate lower bounds (:func:`~.waves.candidate_lows`) and returns,
    per row, a bound that the merged k-th score reaches (the k-th largest of all searches' lower
    bounds); candidates surely below it are not rescored, and the rows' results are only
    right for that merge. Every search of the merge must call it (it is collective): it is
    used unless the batch replays a CUDA graph (at most
    :attr:`~gpusparse.config.EngineConfig.graph_max_batch` rows), and not on the general path.
    """
    acc = choose_acc(acc)
    layout = layout_for_search(index, tile_bits, dense_min, acc, fixed)
    try:
        fp = fixed_point(index, batch, acc, layout.weight_bits)
    except ValueError:  # weights too far from 1 for 64-bit products: float64 arithmetic instead
        layout = layout_for_search(index, tile_bits, dense_min, acc, False)
        fp = fixed_point(index, batch, acc)
    dev = index.device
    int_w = integer_weights(layout, batch, fp, acc)
    if int_w:  # exact integer products: no margin
        fp = exact_margin(fp)
    on_gpu = dev.type == "cuda" and cupy_launch.available() and not emulated
    n_sm = _sm_count(cupy_launch.device_index(dev)) if on_gpu else 1
    if on_gpu and not general:
        scores, ids, redo_rows = device_search(index, layout, batch, fp, k, acc=acc, int_weights=int_w, n_sm=n_sm,
                                               cutoff=cutoff)  # fmt: skip

        def again(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            # capacities overflowed, or scores below one unit may be missed: the general path
            return tiled_search(index, batch_rows(batch, rows, dev), k, tile_bits=tile_bits, dense_min=dense_min,
                                acc=acc, fixed=fixed, general=True).resolved()  # fmt: skip

        return BatchResult(scores, ids, redo_rows, again)
    launch, compact = (
        (tile_candidates.tiled_candidates, compact_cuda) if on_gpu else (torch_tiled_candidates, compact_torch)
    )
    docs, vals = candidates(layout, batch, fp, k, launch=launch, n_sm=n_sm, acc=acc, int_weights=int_w, compact=compact)
    floor = None
    if cutoff is not None and not general and batch.padded_terms.shape[0] > engine_config().graph_max_batch:
        # as device_search: batches that replay a graph take no cutoff
        floor = cutoff(candidate_lows(vals, (docs >= 0).sum(1).to(torch.int32), fp.delta, fp.scale, vals.shape[1]))
    scores, ids = rank_candidates(index, batch, fp, docs, vals, k, layout, floor=floor)
    redo = out_of_range(index, batch, fp, scores, k, floor)
    if redo.size:  # queries whose matches may include scores below one fixed-point unit
        sub = batch_rows(batch, redo, dev)
        # 2**61 units instead of 2**31, on the same layout; fixed-point weights need "u32",
        # and another layout for a few rows would cost a whole build: the float64 path then.
        if acc != "carry" and layout.weight_bits is None:
            s2, i2 = tiled_search(index, sub, k, tile_bits=tile_bits, dense_min=dense_min, acc="carry",
                                  fixed=False, emulated=emulated, general=True).resolved()  # fmt: skip
        else:  # float64 scatter-add: any range
            _, chunk = plan_chunks(len(redo), index.n_docs, DEFAULT_MEMORY_BUDGET, len(redo))
            most = DEFAULT_MEMORY_BUDGET // POSTING_BYTES
            if index.lists_resident:
                s2, i2 = reference_search(index, sub, k, doc_chunk=chunk, max_postings=most)
            elif isinstance(index, LayoutOnly):  # no lists anywhere: these few rows are searched on the layout
                s2, i2 = layout_reference_search(layout, sub, k, max_postings=most)
            else:  # the lists are on the host: these few rows are searched there
                host = index.host  # type: ignore[attr-defined]
                s2, i2 = reference_search(host, batch_rows(batch, redo, host.device), k, doc_chunk=chunk,
                                          max_postings=most)  # fmt: skip
                s2, i2 = s2.to(dev), i2.to(dev)
        at = torch.from_numpy(redo).to(dev)
        scores[at], ids[at] = s2, i2
    return BatchResult(scores, ids)
