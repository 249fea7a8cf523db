"""The tiled engine: on-chip accumulation per document tile, exact by a certified margin.

Layout (built from an :class:`~gpusparse.index.Index`, kept in ``index.cache``): documents
are cut into tiles of ``2**tile_bits``; postings are stored tile-major, then term-major,
then by document: ``offs`` (int16 holding the unsigned 16-bit offset inside the tile) and
``wts`` (float32, 30-bit fixed-point integers, or 8-bit levels), with ``seg[tile * V +
term]`` the start of each (tile, term) segment — 6 bytes a posting instead of the paper's
8, and no padding. Segments covering a large share of a tile are stored densely, one weight
per document of the tile.

Search (per query batch): every (query, tile) pair accumulates its scores in fixed point
(32-bit sums by default, see :data:`DEFAULT_ACC`; on a GPU in shared memory,
:mod:`gpusparse.kernels.tiled`; on a CPU the same steps in PyTorch), keeps a running
per-query lower bound ``theta`` of the k-th best score, and emits only documents within an
error margin of it. The margin covers the fixed-point rounding, the canonical float64
sum's own error and one float32 ulp, so the candidates always contain the exact top-k of
the search contract (see :mod:`gpusparse.search`); candidates whose float32 score is not
certain from the integer sum are rescored canonically. No ``[B, N]`` buffer is ever
allocated. On a GPU the steps run without host synchronisation (:func:`device_search`);
rows it cannot finish go the general way (:func:`candidates`, which syncs per wave).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from .topk import decode_keys, top_keys, topk_by_key

if TYPE_CHECKING:
    from .index import Index
    from .search import BatchResult, QueryBatch

# Tile size and dense-segment threshold by weight type, measured best at 8.8M x 256 on an
# H200 (bench/results/2026-11-26-H200-profile-tiled-8.8M-v9-layout.json, -v11-fixed.json):
# fixed-point float32 weights (integer products) 8,192-document tiles with segments covering
# 12% of a tile stored densely; float32 weights with float64 products (the fallback) half a
# tile, as float64 dense sums cost more; 8-bit levels 8,192-document tiles and 12% since the
# kernel's launch shape follows the tile size (...-v13-q8.json: 10.3 / 8.0 ms at k = 1000 /
# 10 against 11.0 / 9.4 ms with 16,384-document tiles; 16K had won with 512 threads at 8K).
DEFAULT_LAYOUT = {"fixed": (13, 0.12), "float32": (13, 0.5), "uint8": (13, 0.12)}
DEFAULT_TILE_BITS, DEFAULT_DENSE_MIN = DEFAULT_LAYOUT["fixed"]
# Dense segments pay where there are many blocks (throughput); with few tiles a block's own
# latency shows and the dense phase (a pass over the whole tile per dense term) costs more
# than the atomics it saves: below SMALL_TILES tiles, fixed-point weights use this threshold
# (bench/results/2026-11-26-H200-fixed-ab.log: 50K documents, batch 1, 12% dense 2.3-2.8 ms
# against 1.7-1.9 ms at 50%; at 1M batch 1 equal, batch 1024 72.4K QPS at 12% (final6)
# against 62.9K at 50% (final7); at 8.8M x 256 12% is 10-20% faster).
SMALL_TILES, SMALL_DENSE_MIN = 32, 0.5
# Fixed-point float32 weights by default (integer products in the kernel: -15% at k = 1000,
# -19% at k = 10, v11), unless a query's margin would exceed FIXED_MAX_DELTA units (of
# ~2**31): then float64 products.
DEFAULT_FIXED = True
FIXED_MAX_DELTA = 1 << 16
AUTO = "auto"
# A batch this small whose tiles may emit at most this many candidates a query (k per
# tile) runs in a single wave: the waves' host syncs cost more than the extra candidates.
SINGLE_WAVE_MAX_BATCH = 8
SINGLE_WAVE_MAX_CANDIDATES = 1 << 16
# Below this batch size the last wave's candidates go to the final selection without a
# compaction pass (its ~15 small operations cost more host time than the few extra rescorings).
FINAL_COMPACTION_MIN_BATCH = 9
MAX_TILE_BITS = 16  # offsets are 16-bit
# Accumulator mode of the CUDA kernel (see gpusparse.kernels.tiled.ACC_MODES): "u32" measured
# fastest (bench/NOTES.md); "carry" keeps 2**61 units of precision (fewer rescored candidates).
DEFAULT_ACC = "u32"
# Layouts built on a GPU keep the index's forward copy, which rescoring reads instead of
# binary-searching the inverted lists (bench/NOTES.md, issue 8).
FORWARD_RESCORING = True


@dataclass(frozen=True)
class TiledIndex:
    """Postings regrouped by (tile, term); see the module docstring."""

    tile_bits: int
    n_docs: int
    n_terms: int
    seg: torch.Tensor  # int64 [n_tiles * n_terms + 1]
    offs: torch.Tensor  # int16 [P] (unsigned offset inside the tile)
    wts: torch.Tensor  # float32 [P], or uint8 levels (weight = level · step) of a quantized index
    dense_id: torch.Tensor  # int32 [n_tiles * n_terms]: row of `dense`, or -1 for a sparse segment
    dense: torch.Tensor  # wts's dtype [n_dense, 2**tile_bits]: weights by offset, 0 where absent
    step: float = 1.0  # what a stored weight is worth (1 for float32 weights)
    # Fixed-point float32 weights (int32 storage): stored = round(weight · 2**weight_bits).
    weight_bits: int | None = None
    # int32 [n_tiles * n_terms]: real postings of each term in earlier tiles, i.e. where a
    # tile's share of the term's list starts in the index's own list; it narrows the binary
    # searches of canonical rescoring from the whole list (~22 steps) to one tile's share.
    list_pos: torch.Tensor | None = None
    # The index's document-major copy (gpusparse.kernels.forward_index: indptr, terms,
    # weights), kept with a layout built on a GPU: rescoring reads a candidate's ~120
    # postings in order instead of binary-searching each query term's list (bench/NOTES.md).
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def n_tiles(self) -> int:
        """Number of document tiles."""
        return (self.n_docs + (1 << self.tile_bits) - 1) >> self.tile_bits

    @property
    def nbytes(self) -> int:
        """Device bytes of the arrays."""
        arrays = (self.seg, self.offs, self.wts, self.dense_id, self.dense, self.list_pos, *(self.forward or ()))
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)


def build_tiled(
    index: Index,
    tile_bits: int = DEFAULT_TILE_BITS,
    *,
    dense_min: float | None = DEFAULT_DENSE_MIN,
    fixed: bool = False,
    chunk: int = 1 << 23,
) -> TiledIndex:
    """Regroup an index's postings by (tile, term), on the index's device.

    No sort is needed: inside a term's list documents are ascending, so each tile's share
    of the list is contiguous and keeps its order; a posting's new position is its
    (tile, term) segment start plus its rank inside that share. Temporaries are bounded by
    ``chunk`` postings (~100 bytes each: 2**23 keep the build within ~1 GB beside the index)
    plus a few ``[n_tiles, V]`` count matrices.

    Segments holding at least ``dense_min`` of a tile's documents are stored densely instead
    (one weight per document of the tile): the kernel adds them with coalesced reads into
    registers, without shared-memory atomics. ``None`` keeps every segment sparse.

    A quantized index (:mod:`gpusparse.quantize`) stores its weights as uint8 levels: 3
    bytes a sparse posting, 1 a dense slot. ``fixed`` (float32 weights only) stores them in
    fixed point, ``round(w · 2**b)`` with the largest weight below ``2**30``, so the kernel
    multiplies integers; the rounding is covered by :func:`fixed_point`'s margin.
    """
    from .index import real_postings

    if not 1 <= tile_bits <= MAX_TILE_BITS:
        raise ValueError(f"tile_bits must be in 1..{MAX_TILE_BITS}")
    dev = index.device
    n_terms, n_docs = len(index.vocab), index.n_docs
    n_tiles = max(1, (n_docs + (1 << tile_bits) - 1) >> tile_bits)
    lengths = index.lengths.to(torch.int64)
    list_start = torch.cumsum(lengths, 0) - lengths  # start of each list among real postings
    counts = torch.zeros(n_tiles * n_terms, dtype=torch.int64, device=dev)
    for _, _, term, pos in real_postings(index, chunk):
        tile = index.doc_ids[pos].to(torch.int64) >> tile_bits
        counts += torch.bincount(tile * n_terms + term, minlength=n_tiles * n_terms)
    is_dense = counts >= max(1, int(dense_min * (1 << tile_bits))) if dense_min is not None else counts < 0
    n_dense = int(is_dense.sum())
    quant = index.quantization
    fixed = fixed and quant is None
    wdtype, step = (torch.uint8, quant.step) if quant is not None else (torch.float32, 1.0)
    weight_bits = None
    if fixed:
        wdtype, weight_bits = torch.int32, fixed_weight_bits(float(index.max_scores.max()) if n_terms else 0.0)

    def stored(scores: torch.Tensor) -> torch.Tensor:
        if weight_bits is not None:
            return torch.round(scores.to(torch.float64) * 2.0**weight_bits).to(torch.int32)  # < 2**30
        if quant is None:
            return scores
        from .quantize import levels

        return levels(scores, step, quant.bits).to(torch.uint8)  # exact: scores are level · step

    dense_id = torch.full((n_tiles * n_terms,), -1, dtype=torch.int32, device=dev)
    dense_id[is_dense] = torch.arange(n_dense, dtype=torch.int32, device=dev)
    dense = torch.zeros((n_dense, 1 << tile_bits), dtype=wdtype, device=dev)
    sparse_counts = torch.where(is_dense, torch.zeros_like(counts), counts)
    seg = torch.zeros(n_tiles * n_terms + 1, dtype=torch.int64, device=dev)
    torch.cumsum(sparse_counts, 0, out=seg[1:])
    # Postings of term t in tiles before tile b: the rank offset of the (b, t) share.
    before = torch.cumsum(counts.view(n_tiles, n_terms), 0) - counts.view(n_tiles, n_terms)
    n_sparse = int(seg[-1])
    offs = torch.empty(n_sparse, dtype=torch.int16, device=dev)
    wts = torch.empty(n_sparse, dtype=wdtype, device=dev)
    mask = (1 << tile_bits) - 1
    for a, b, term, pos in real_postings(index, chunk):
        doc = index.doc_ids[pos].to(torch.int64)
        tile = doc >> tile_bits
        key = tile * n_terms + term
        off = doc & mask
        did = dense_id[key].to(torch.int64)
        d = did >= 0
        dense[did[d], off[d]] = stored(index.scores[pos[d]])
        s = ~d
        rank = torch.arange(a, b, device=dev)[s] - list_start[term[s]]  # rank inside the term's list
        new = seg[key[s]] + rank - before[tile[s], term[s]]
        offs[new] = torch.where(off[s] >= 1 << 15, off[s] - (1 << 16), off[s]).to(torch.int16)
        wts[new] = stored(index.scores[pos[s]])
    list_pos = before.reshape(-1).to(torch.int32)  # < n_docs
    return TiledIndex(tile_bits, n_docs, n_terms, seg, offs, wts, dense_id, dense, step, weight_bits, list_pos)


def fixed_weight_bits(max_weight: float) -> int:
    """``b`` with ``max_weight · 2**b < 2**30``, the largest such (fixed-point weights)."""
    import math

    if not max_weight > 0:
        return 0
    return 30 - math.frexp(max_weight)[1]


def default_layout(index: Index, fixed: bool = False) -> tuple[int, float]:
    """``(tile_bits, dense_min)`` for this index's weights (see :data:`DEFAULT_LAYOUT`)."""
    if index.quantization is not None:
        return DEFAULT_LAYOUT["uint8"]
    bits, dense_min = DEFAULT_LAYOUT["fixed" if fixed else "float32"]
    if fixed and (index.n_docs >> bits) < SMALL_TILES:
        dense_min = SMALL_DENSE_MIN
    return bits, dense_min


def tiled(
    index: Index,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    fixed: bool = False,
    *,
    forward: bool = True,
) -> TiledIndex:
    """The index's tiled layout, built once per index object and kept in ``index.cache``.

    ``tile_bits=None`` and ``dense_min="auto"`` take :func:`default_layout`'s values;
    ``dense_min=None`` keeps every segment sparse; ``fixed``: fixed-point float32 weights
    (see :func:`build_tiled`). On a GPU with the CUDA kernels (:data:`FORWARD_RESCORING`) a
    new layout also holds the index's forward copy for rescoring (8 bytes a posting, shared
    with the doc-parallel kernel's), unless ``forward=False`` (a layout to be streamed).
    """
    fixed = fixed and index.quantization is None
    auto_bits, auto_dense = default_layout(index, fixed)
    tile_bits = auto_bits if tile_bits is None else tile_bits
    dense_min = auto_dense if dense_min == AUTO else dense_min
    key = f"tiled-{tile_bits}-{dense_min}" + ("-fixed" if fixed else "")
    if key not in index.cache:
        layout = build_tiled(index, tile_bits, dense_min=dense_min, fixed=fixed)
        if forward and FORWARD_RESCORING and index.device.type == "cuda":
            from .kernels import rescore
            from .search import forward_copy

            if rescore.available():
                layout = replace(layout, forward=forward_copy(index))
        index.cache[key] = layout
    return index.cache[key]  # type: ignore[return-value]


def search_layout(
    index: Index,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    acc: str | None = None,
    fixed: bool | None = None,
    *,
    forward: bool = True,
) -> TiledIndex:
    """The layout :func:`tiled_search` searches with these arguments (built once per index;
    ``forward``: see :func:`tiled`)."""
    acc = choose_acc(acc)
    fixed = (DEFAULT_FIXED if fixed is None else fixed) and acc == "u32" and index.quantization is None
    return tiled(index, tile_bits, dense_min, fixed, forward=forward)


@dataclass(frozen=True)
class FixedPoint:
    """Per-query fixed-point parameters: ``scale`` (a power of two) and the margin ``delta``;
    with fixed-point weights also each query weight's multiplier and each product's shift."""

    scale: torch.Tensor  # float64 [B]
    delta: torch.Tensor  # int64 [B], in units
    mult: torch.Tensor | None = None  # float64 [B]: q = round(w_q · mult), mult = scale · 2**c
    shift: torch.Tensor | None = None  # int32 [B]: b + c, product = (q · d) >> shift
    scale_host: np.ndarray | None = None  # float64 [B]: ``scale`` on the host (no copy back)
    floor: torch.Tensor | None = None  # float64 [B]: :func:`match_floor`, moved in the same copy


def choose_acc(acc: str | None) -> str:
    """The accumulator mode: ``acc``, checked, or :data:`DEFAULT_ACC`."""
    from .kernels.tiled import ACC_MODES

    acc = acc or DEFAULT_ACC
    if acc not in ACC_MODES:
        raise ValueError(f"acc must be one of {sorted(ACC_MODES)}, got {acc!r}")
    return acc


def integer_weights(tl: TiledIndex, batch: QueryBatch, fp: FixedPoint, acc: str) -> bool:
    """Whether the kernel may multiply integers: 8-bit levels, "u32", and every scaled query
    weight an integer (true for quantized queries: their step times the scale is a power of
    two of at least 1). Checked on the host copies: no device work."""
    if tl.wts.dtype != torch.uint8 or acc != "u32":
        return False
    _, weights, _ = batch.host_arrays()
    scale = fp.scale_host if fp.scale_host is not None else fp.scale.cpu().numpy()
    w = weights.astype(np.float64) * (scale * tl.step)[:, None]
    return bool((w == np.round(w)).all())


def fixed_point(index: Index, batch: QueryBatch, acc: str = "carry", weight_bits: int | None = None) -> FixedPoint:
    """Choose each query's scale so its largest possible score fits, and its error margin.

    ``ub = Σ w_q[t] · max_scores[t]`` bounds every score; ``scale`` is the largest power of
    two with ``ub · scale ≤ top``, the accumulator mode's limit (``2**61`` for "carry",
    ``2**31`` for "u32"; exact, from the binary exponent of ``ub``).
    The integer sum ``F`` is within ``n/2`` units of ``scale · S`` (S the exact score): each
    product is rounded once to the unit (or, in the "u32" kernel's dense phase, m exact
    products are summed in float64 below 2**32, error at most (m−1)·2**-21, then rounded
    once: at most m/2 again). The canonical float64 sum is within
    ``2·(n+1)·2**-53 · scale · S``; twice their sum, plus slack, is the margin between any
    two of them. Computed on the host (a batch is small) and moved in one copy.

    ``weight_bits`` (fixed-point document weights ``d = round(w_d · 2**b)``, "u32"): each
    query weight becomes ``q = round(w_q · scale · 2**c)`` (``c`` the largest with every
    ``q < 2**31``) and a product ``(q · d) >> (b + c)``. Against ``P = w_q · scale · w_d``
    that product errs by less than ``1`` (the shift truncates) ``+ |q − w_q·scale·2**c| ·
    w_d · 2**-c + |d − w_d·2**b| · w_q·scale · 2**-b`` (+ their product), so ``n/2`` above
    becomes ``E = n + n·max_w·2**-(c+1) + Σ w_q·scale·2**-(b+1) + n·2**-(b+c+2)``.
    """
    import math

    from .kernels.tiled import ACC_TOP
    from .search import to_device

    terms, weights, n_terms = batch.host_arrays()
    max_scores = index.cache.get("max_scores_host")
    if max_scores is None:
        max_scores = index.cache["max_scores_host"] = index.max_scores.cpu().numpy().astype(np.float64)
        index.cache["max_score_host"] = float(max_scores.max()) if max_scores.size else 0.0
    # Padding (term -1, weight 0) adds 0 below: a batch is small, but each numpy pass over
    # [B, T] costs tens of microseconds, and this runs before the first launch.
    w64 = weights.astype(np.float64)
    ub = np.einsum("ij,ij->i", w64, max_scores[terms]) if terms.size else np.zeros(len(terms))
    mant, expo = np.frexp(ub)  # ub = mant · 2**expo, mant in [0.5, 1)
    e = int(math.log2(ACC_TOP[acc])) - expo + (mant == 0.5)
    scale = np.where(ub > 0, np.ldexp(1.0, np.clip(e, -1000, 1000)), 1.0)
    n = n_terms.astype(np.float64)
    canon = (ub * scale) * 2 * (n + 1) * 2.0**-53
    dev = batch.padded_terms.device
    floor = _match_floor_host(index, terms, weights)
    if weight_bits is None:
        delta = np.ceil(2 * (n / 2 + 1) + 2 * canon + 2)
        scale_d, delta_d, floor_d = to_device([scale, delta.astype(np.int64), floor], dev)
        return FixedPoint(scale_d, delta_d, scale_host=scale, floor=floor_d)
    # max and sum of w_q · scale: scale is a power of two, so scaling after is exact
    qmax = (weights.max(1) if terms.shape[1] else np.zeros(len(scale))) * scale
    qsum = w64.sum(1) * scale
    _, qexpo = np.frexp(qmax)
    c = np.where(qmax > 0, 31 - qexpo, 0)  # qmax · 2**c < 2**31
    max_w = index.cache["max_score_host"]
    err = n + n * max_w * np.ldexp(0.5, -c) + qsum * 2.0 ** -(weight_bits + 1)
    err += n * np.ldexp(0.25, -(weight_bits + c))
    delta = np.ceil(2 * (err + 1) + 2 * canon + 2)
    shift = weight_bits + c
    # Out of range when one document weight dwarfs the query's own terms' (b then leaves
    # ordinary weights few bits): the margin would admit most documents. The caller falls
    # back to float64 products.
    if (shift < 0).any() or (shift > 62).any() or (delta > FIXED_MAX_DELTA).any():
        raise ValueError("weights outside the fixed-point range")
    moved = to_device([scale, delta.astype(np.int64), np.ldexp(scale, c), shift.astype(np.int32), floor], dev)
    return FixedPoint(*moved[:4], scale_host=scale, floor=moved[4])


def tiled_search(
    index: Index,
    batch: QueryBatch,
    k: int,
    *,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    acc: str | None = None,
    fixed: bool | None = None,
    emulated: bool = False,
    general: bool = False,
    deferred: bool = False,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | BatchResult:
    """Exact top-k of a query batch with the tiled engine: ``(scores, ids)`` ``[B, k]`` on the device.

    Uses the CUDA kernel on a GPU with CuPy, and the same algorithm in PyTorch elsewhere
    (or when ``emulated``). On a GPU the search runs without host synchronisation
    (:func:`device_search`) and rows it flags go the general way, which syncs after each
    wave to size its buffers (``general``: every row that way).
    ``tile_bits`` / ``dense_min``: the layout (see :func:`tiled`).
    ``acc``: the kernel's accumulator mode (default
    :data:`DEFAULT_ACC`); it sets the fixed-point scale, so the PyTorch path follows it too.
    ``fixed``: fixed-point float32 weights (default :data:`DEFAULT_FIXED`; "u32" only).
    ``deferred``: a :class:`~gpusparse.search.BatchResult` instead, before the GPU path's host
    sync: its flagged rows are searched again only when the caller asks (after its own sync).
    ``cutoff``: for a search whose results are merged with other searches' (shards), a function
    that takes this search's candidate lower bounds (:func:`candidate_lows`) and returns, per
    row, a bound that the merged k-th score reaches (the k-th largest of all searches' lower
    bounds); candidates surely below it are not rescored, and the rows' results are only
    right for that merge. Every search of the merge must call it (it is collective): it is
    used unless the batch replays a CUDA graph (at most :data:`GRAPH_MAX_BATCH` rows), and
    not on the general path.
    """
    from .kernels import tiled as cuda
    from .search import BatchResult, batch_rows

    acc = choose_acc(acc)
    tl = search_layout(index, tile_bits, dense_min, acc, fixed)
    try:
        fp = fixed_point(index, batch, acc, tl.weight_bits)
    except ValueError:  # weights too far from 1 for 64-bit products: float64 arithmetic instead
        tl = tiled(index, tile_bits, dense_min, False)
        fp = fixed_point(index, batch, acc)
    dev = index.device
    int_w = integer_weights(tl, batch, fp, acc)
    on_gpu = dev.type == "cuda" and cuda.available() and not emulated
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 1
    if on_gpu and not general:
        scores, ids, redo_rows = device_search(index, tl, batch, fp, k, acc=acc, int_weights=int_w, n_sm=n_sm,
                                               cutoff=cutoff)  # fmt: skip

        def again(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            # capacities overflowed, or scores below one unit may be missed: the general path
            return tiled_search(index, batch_rows(batch, rows, dev), k, tile_bits=tile_bits, dense_min=dense_min,
                                acc=acc, fixed=fixed, general=True)  # type: ignore[return-value]  # fmt: skip

        if deferred:
            return BatchResult(scores, ids, redo_rows, again)
        redo = redo_rows.nonzero().flatten().cpu().numpy()  # the search's one host sync
        if redo.size:
            s2, i2 = again(redo)
            at = torch.from_numpy(redo).to(dev)
            scores[at], ids[at] = s2, i2
        return scores, ids
    launch, compact = (cuda.tiled_candidates, _cuda_compact) if on_gpu else (torch_tiled_candidates, _compact)
    docs, vals = candidates(tl, batch, fp, k, launch=launch, n_sm=n_sm, acc=acc, int_weights=int_w, compact=compact)
    floor = None
    if cutoff is not None and not general and batch.padded_terms.shape[0] > GRAPH_MAX_BATCH:  # as device_search
        floor = cutoff(candidate_lows(vals, (docs >= 0).sum(1).to(torch.int32), fp.delta, fp.scale, vals.shape[1]))
    scores, ids = finalize_candidates(index, batch, fp, docs, vals, k, tl, floor=floor)
    redo = out_of_range(index, batch, fp, scores, k, floor)
    if redo.size:  # queries whose matches may include scores below one fixed-point unit
        from .search import _POSTING_BYTES, DEFAULT_MEMORY_BUDGET, plan_chunks, reference_search

        sub = batch_rows(batch, redo, dev)
        # 2**61 units instead of 2**31, on the same layout; fixed-point weights need "u32",
        # and another layout for a few rows would cost a whole build: the float64 path then.
        if acc != "carry" and tl.weight_bits is None:
            s2, i2 = tiled_search(index, sub, k, tile_bits=tile_bits, dense_min=dense_min, acc="carry",
                                  fixed=False, emulated=emulated, general=True)  # fmt: skip
        else:  # float64 scatter-add: any range
            _, chunk = plan_chunks(len(redo), index.n_docs, DEFAULT_MEMORY_BUDGET, len(redo))
            most = DEFAULT_MEMORY_BUDGET // _POSTING_BYTES
            s2, i2 = reference_search(index, sub, k, doc_chunk=chunk, max_postings=most)
        at = torch.from_numpy(redo).to(dev)
        scores[at], ids[at] = s2, i2
    return BatchResult(scores, ids) if deferred else (scores, ids)


# Candidate slots per query kept for the final selection on the synchronisation-free path:
# after the last compaction a row holds its k best plus the few within the margin of the k-th.
DEVICE_WIDTH_SLACK = 1024


def device_search(
    index: Index,
    tl: TiledIndex,
    batch: QueryBatch,
    fp: FixedPoint,
    k: int,
    *,
    acc: str,
    int_weights: bool,
    n_sm: int,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA search without host synchronisation: ``(scores, ids, redo)`` on the device.

    The waves, capacities and final width are fixed in advance (:func:`wave_plan`,
    :func:`initial_capacity`, ``2k +`` :data:`DEVICE_WIDTH_SLACK`); each wave's candidates are
    compacted by one kernel, turned into keys by another, and the top-k taken. A row whose
    candidates outgrew a capacity, or whose top-k may miss documents below one fixed-point
    unit (:func:`uncertain_rows`), is flagged in ``redo`` (bool ``[B]``): its results are not
    to be used, and :func:`tiled_search` searches it again the general way.

    Batches of at most :data:`GRAPH_MAX_BATCH` queries replay a captured CUDA graph of these
    steps (their time is mostly the host's launching them); the graph is captured on the
    first batch of its shape and kept with the index. ``cutoff``: see :func:`tiled_search`
    (not for those batches: a capture may fail on one process only).
    """
    dev = tl.seg.device
    lb = fp.floor if fp.floor is not None else match_floor(index, batch, dev)
    terms, weights = batch.padded_terms, batch.padded_weights
    if terms.shape[0] <= GRAPH_MAX_BATCH:
        out = _graphed_search(index, tl, terms, weights, fp, lb, k, acc=acc, int_weights=int_weights, n_sm=n_sm)
        if out is not None:
            return out
        cutoff = None
    return _device_steps(index, tl, terms.contiguous(), weights.contiguous(), fp, lb, k, acc, int_weights, n_sm,
                         cutoff)  # fmt: skip


def _device_steps(
    index: Index,
    tl: TiledIndex,
    terms: torch.Tensor,
    weights: torch.Tensor,
    fp: FixedPoint,
    lb: torch.Tensor,
    k: int,
    acc: str,
    int_weights: bool,
    n_sm: int,
    cutoff: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`device_search`'s device work, from tensors only (so that it can be captured)."""
    from .kernels import rescore
    from .kernels import tiled as cuda
    from .search import finalize

    dev = tl.seg.device
    b = terms.shape[0]
    terms32 = terms.to(torch.int32)
    q_scale = kernel_scale(tl, fp)
    plan = wave_plan(tl.n_tiles, b, k, n_sm)
    cap = initial_capacity(k, plan[0][1] if plan else 1)
    theta = torch.zeros(b, dtype=torch.int64, device=dev)
    count = torch.zeros(b, dtype=torch.int32, device=dev)
    cand_doc = torch.empty((b, cap), dtype=torch.int32, device=dev)
    cand_val = torch.empty((b, cap), dtype=torch.int64, device=dev)
    redo = torch.zeros(b, dtype=torch.bool, device=dev)
    for first, n in plan:
        cuda.tiled_candidates(
            tl.seg, tl.offs, tl.wts, tl.dense_id, tl.dense, terms32, weights, q_scale, fp.delta,
            n_docs=tl.n_docs, n_terms=tl.n_terms, tile_bits=tl.tile_bits, k=k, tiles=(first, n), select=first == 0,
            acc=acc, int_weights=int_weights, q_shift=fp.shift,
            theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val,
        )  # fmt: skip
        redo |= count > cap  # candidates past the capacity were counted, not stored
        cuda.compact_candidates(theta, count, cand_doc, cand_val, fp.delta, k, cap)
    width = min(cap, 2 * k + DEVICE_WIDTH_SLACK)
    redo |= count > width
    floor = cutoff(candidate_lows(cand_val, count, fp.delta, fp.scale, width)) if cutoff is not None else None
    keys = rescore.candidate_keys_cuda(
        index.doc_ids, index.scores, index.offsets, index.lengths, terms, weights, cand_doc, cand_val,
        fp.delta, fp.scale, width=width, count=count, list_pos=tl.list_pos, tile_bits=tl.tile_bits, floor=floor,
        forward=tl.forward,
    )  # fmt: skip
    top = top_keys(keys, k, count)
    scores, ids = finalize(decode_keys(top) if width else None, k, b, dev)
    redo |= uncertain_rows(index, None, fp, scores, k, lb, floor)
    return scores, ids, redo


# Batches of at most this many queries replay a captured CUDA graph (device_search); at most
# GRAPH_CACHE graphs are kept per index, the least recently used dropped first.
GRAPH_MAX_BATCH = 8
GRAPH_CACHE = 8


def _graphed_search(
    index: Index,
    tl: TiledIndex,
    terms: torch.Tensor,
    weights: torch.Tensor,
    fp: FixedPoint,
    lb: torch.Tensor,
    k: int,
    *,
    acc: str,
    int_weights: bool,
    n_sm: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_device_steps` by a CUDA graph for this shape, captured once (``None``: it
    could not be captured here; the caller runs the steps themselves).

    The query width is padded to a power of two (at least 8) so that few shapes occur; the
    padding is what a batch's shorter rows already have (term -1, weight 0).
    """
    from collections import OrderedDict

    b, t = terms.shape
    width = max(8, 1 << max(t - 1, 0).bit_length())
    graphs = index.cache.setdefault("graphs", OrderedDict())
    key = (id(tl), b, width, k, acc, int_weights, fp.mult is not None, fp.shift is not None)
    entry = graphs.get(key)
    if entry is False:
        return None
    if entry is None:
        entry = _capture(index, tl, b, width, fp, k, acc, int_weights, n_sm)
        graphs[key] = entry if entry is not None else False
        while len(graphs) > GRAPH_CACHE:
            graphs.popitem(last=False)
        if entry is None:
            return None
    graphs.move_to_end(key)
    graph, inputs, outputs = entry
    inputs["terms"].fill_(-1)
    inputs["terms"][:, :t].copy_(terms)
    inputs["weights"].zero_()
    inputs["weights"][:, :t].copy_(weights)
    for name in ("scale", "delta", "mult", "shift"):
        if getattr(fp, name) is not None:
            inputs[name].copy_(getattr(fp, name))
    inputs["lb"].copy_(lb)
    graph.replay()
    return tuple(x.clone() for x in outputs)  # type: ignore[return-value]


def _capture(
    index: Index, tl: TiledIndex, b: int, width: int, fp: FixedPoint, k: int, acc: str, int_weights: bool, n_sm: int
):  # -> (graph, inputs, outputs) | None
    dev = tl.seg.device
    inputs = {
        "terms": torch.full((b, width), -1, dtype=torch.int64, device=dev),
        "weights": torch.zeros((b, width), dtype=torch.float32, device=dev),
        "lb": torch.zeros(b, dtype=torch.float64, device=dev),
    }
    for name in ("scale", "delta", "mult", "shift"):
        if getattr(fp, name) is not None:
            inputs[name] = getattr(fp, name).clone()
    static = FixedPoint(inputs["scale"], inputs["delta"], inputs.get("mult"), inputs.get("shift"))

    def steps():
        return _device_steps(index, tl, inputs["terms"], inputs["weights"], static, inputs["lb"], k, acc,
                             int_weights, n_sm)  # fmt: skip

    try:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up: kernels compiled, allocations made
            steps()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = steps()
    except RuntimeError:  # capture unsupported here: the caller runs the steps directly
        torch.cuda.synchronize(dev)
        return None
    return graph, inputs, outputs


def min_weight(index: Index) -> float:
    """The index's smallest document weight (cached; +inf for an empty index)."""
    key = "min_weight"
    if key not in index.cache:
        best = float("inf")
        for a in range(0, index.doc_ids.numel(), 1 << 26):  # padding (doc -1) left out
            real = index.doc_ids[a : a + (1 << 26)] >= 0
            if bool(real.any()):
                best = min(best, float(index.scores[a : a + (1 << 26)][real].min()))
        index.cache[key] = best
    return index.cache[key]  # type: ignore[return-value]


def out_of_range(
    index: Index, batch: QueryBatch, fp: FixedPoint, scores: torch.Tensor, k: int, floor: torch.Tensor | None = None
) -> np.ndarray:
    """Rows whose top-k may miss documents that scored below one fixed-point unit.

    Candidates are emitted from integer sums of at least 1, so a matching document whose
    sum rounded to 0 (its score more than ~2**31 times, "u32", or 2**61 times, "carry",
    below the query's bound) is never seen. That matters only where the k-th result is
    within the margin of 0 (fewer than k results above it): a row is certain when its k-th
    score exceeds the margin, or when every matching document provably sums to at least 1
    (the smallest query weight times the index's smallest weight, less half the margin).
    ``floor``: a bound the k-th score reaches (a ``cutoff``'s, see :func:`tiled_search`), used
    where it exceeds the row's own k-th. One host sync.
    """
    return uncertain_rows(index, batch, fp, scores, k, None, floor).nonzero().flatten().cpu().numpy()


def uncertain_rows(
    index: Index,
    batch: QueryBatch | None,
    fp: FixedPoint,
    scores: torch.Tensor,
    k: int,
    lb: torch.Tensor | None = None,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`out_of_range` as a bool ``[B]`` tensor on the device, without a host sync;
    ``lb``: :func:`match_floor`'s tensor, if already on the device (then ``batch`` is not read)."""
    b = scores.shape[0]
    if b == 0 or k == 0:
        return torch.zeros(b, dtype=torch.bool, device=scores.device)
    if lb is None:
        if batch is None:
            raise ValueError("uncertain_rows needs the batch or its match floor")
        lb = match_floor(index, batch, scores.device)
    delta = fp.delta.to(torch.float64)
    kth = scores[:, k - 1] if floor is None else torch.maximum(scores[:, k - 1], floor)
    kth = kth.to(torch.float64) * fp.scale * (1 - 2.0**-22)  # float32 rounding
    return ~((kth > delta) | (lb * fp.scale >= delta / 2 + 1))


def match_floor(index: Index, batch: QueryBatch, dev: torch.device) -> torch.Tensor:
    """float64 ``[B]``: no document matching a query scores below this (its smallest weight
    times the index's smallest weight; inf for a query without terms: nothing to miss)."""
    terms, weights, _ = batch.host_arrays()
    return torch.from_numpy(_match_floor_host(index, terms, weights)).to(dev)


def _match_floor_host(index: Index, terms: np.ndarray, weights: np.ndarray) -> np.ndarray:
    b = terms.shape[0]
    qmin = np.where(terms >= 0, weights, np.inf).min(1) if terms.shape[1] else np.full(b, np.inf)
    return qmin.astype(np.float64) * min_weight(index)


def candidates(
    tl: TiledIndex,
    batch: QueryBatch,
    fp: FixedPoint,
    k: int,
    *,
    launch: Callable[..., None],
    n_sm: int,
    acc: str = "carry",
    int_weights: bool = False,
    compact: Callable[..., None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates from ``launch`` (the CUDA kernel or :func:`torch_tiled_candidates`), in waves
    of tiles: ``(docs, values)`` ``[B, C]`` (``-1``/0 padded). ``n_sm``: the GPU's multiprocessors.
    ``compact``: :func:`_compact` (the default) or its one-launch CUDA version.

    A block only knows its own tile's k-th score; the k-th of everything seen so far is a far
    better threshold. So tiles go in waves of growing size (at least enough blocks to fill the
    GPU): after each wave the candidates are reduced to the query's top k (with the margin)
    and ``theta`` is raised to their k-th value, which the next wave's blocks start from.
    Candidates then stay near k per wave instead of near k per tile.
    """
    dev = tl.seg.device
    compact = compact or _compact
    b = batch.padded_terms.shape[0]
    terms32 = batch.padded_terms.to(torch.int32).contiguous()
    weights = batch.padded_weights.contiguous()
    q_scale, q_shift = kernel_scale(tl, fp), fp.shift
    plan = wave_plan(tl.n_tiles, b, k, n_sm)
    cap = initial_capacity(k, plan[0][1] if plan else 1)
    most, compacted = 0, False
    while True:
        theta = torch.zeros(b, dtype=torch.int64, device=dev)
        count = torch.zeros(b, dtype=torch.int32, device=dev)
        cand_doc = torch.empty((b, cap), dtype=torch.int32, device=dev)
        cand_val = torch.empty((b, cap), dtype=torch.int64, device=dev)
        overflow = False
        for first, n in plan:
            launch(
                tl.seg, tl.offs, tl.wts, tl.dense_id, tl.dense, terms32, weights, q_scale, fp.delta,
                n_docs=tl.n_docs, n_terms=tl.n_terms, tile_bits=tl.tile_bits, k=k, tiles=(first, n), select=first == 0,
                acc=acc, int_weights=int_weights, q_shift=q_shift,
                theta=theta, cand_count=count, cand_doc=cand_doc, cand_val=cand_val,
            )  # fmt: skip
            most = int(count.max()) if b else 0
            if most > cap:
                overflow = True
                break
            compacted = first + n < tl.n_tiles or b >= FINAL_COMPACTION_MIN_BATCH
            if compacted:
                compact(theta, count, cand_doc, cand_val, most, fp, k)
        if not overflow:
            break
        cap = 2 * most  # rare: start again with room for every candidate
    # After a final compaction the counts shrank (one more sync keeps the width tight for a
    # large batch's final selection); else the last wave's maximum is the width.
    width = max(int(count.max()) if compacted and b else most, 1)
    cols = torch.arange(width, device=dev)
    present = cols[None, :] < count[:, None].to(torch.int64)
    docs = torch.where(present, cand_doc[:, :width].to(torch.int64), torch.full_like(cols[None, :], -1))
    vals = torch.where(present, cand_val[:, :width], torch.zeros_like(docs))
    return docs, vals


def wave_plan(n_tiles: int, b: int, k: int, n_sm: int) -> list[tuple[int, int]]:
    """``(first tile, tiles)`` of each wave of a search (see :func:`candidates`).

    Small batches whose tiles emit few candidates run in one wave (no host sync between
    waves); otherwise the first wave fills the GPU about twice and each later one is 16
    times larger (few waves: each costs a compaction and, on the host path, a sync).
    """
    if b <= SINGLE_WAVE_MAX_BATCH and k * n_tiles <= SINGLE_WAVE_MAX_CANDIDATES:
        wave = n_tiles
    else:
        wave = max(4, min(32, -(-2 * n_sm // max(b, 1))))
    plan, done = [], 0
    while done < n_tiles:
        n = min(wave, n_tiles - done)
        plan.append((done, n))
        done += n
        wave = max(16 * wave, -(-4 * n_sm // max(b, 1)))
    return plan


def kernel_scale(tl: TiledIndex, fp: FixedPoint) -> torch.Tensor:
    """The kernel's ``q_scale``: the fixed-point scale per stored weight unit (exact: both
    are powers of two), or with fixed-point weights the multiplier of each query weight."""
    return fp.mult if tl.weight_bits is not None else fp.scale * tl.step


def _compact(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    most: int,
    fp: FixedPoint,
    k: int,
) -> None:
    """Raise ``theta`` to the k-th candidate value and drop candidates below its margin, in place."""
    if most == 0:
        return
    cols = torch.arange(most, device=theta.device)
    present = cols[None, :] < count[:, None].to(torch.int64)
    vals = torch.where(present, cand_val[:, :most], torch.zeros_like(cand_val[:, :most]))
    if most >= k:
        kth = torch.topk(vals, k, dim=1, sorted=False).values.min(dim=1).values
        theta.copy_(torch.maximum(theta, kth))
    keep = present & (vals >= emission_threshold(theta, fp.delta)[:, None])
    new_count = keep.sum(1)
    dest = torch.cumsum(keep, 1) - 1  # slot of each kept candidate
    r, c = keep.nonzero(as_tuple=True)
    docs = cand_doc[r, c]
    kept_vals = cand_val[r, c]
    cand_doc[r, dest[r, c]] = docs
    cand_val[r, dest[r, c]] = kept_vals
    count.copy_(new_count.to(torch.int32))


def _cuda_compact(
    theta: torch.Tensor,
    count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    most: int,
    fp: FixedPoint,
    k: int,
) -> None:
    """:func:`_compact` by the CUDA kernel (one launch instead of ~20 small operations)."""
    from .kernels.tiled import compact_candidates

    compact_candidates(theta, count, cand_doc, cand_val, fp.delta, k, most)


def initial_capacity(k: int, first_wave: int) -> int:
    """Candidate slots per query for the first try (a query needing more reruns with enough).

    The first wave's blocks know no threshold but their tile's: each may emit about k.
    """
    return max(4 * k + 4096, first_wave * (k + 256), 1 << 15)


def emission_threshold(theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Smallest value a candidate needs: ``theta`` less the margin and one float32 ulp, at least 1.

    The CUDA kernel applies the same rule (see :mod:`gpusparse.kernels.tiled`).
    """
    d = delta + (theta >> 22)
    return torch.where(theta > d, theta - d, torch.ones_like(theta)).clamp_min(1)


def candidate_lows(
    cand_val: torch.Tensor, count: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, width: int
) -> torch.Tensor:
    """float32 ``[B, width]``: for the first ``width`` candidate slots of each row (the first
    ``count`` hold candidates, the rest 0), a value the candidate's float32 score reaches:
    the ``low`` of :func:`finalize_candidates`, by the same float64 operations. The k-th
    largest of all these over the searches of a merge is a bound the merged k-th score
    reaches (k distinct documents reach it)."""
    v = cand_val[:, :width].to(torch.float64)
    margin = delta[:, None].to(torch.float64) + v * 2.0**-50
    low = ((v - margin).clamp_min(0) / scale[:, None]).to(torch.float32)
    present = torch.arange(width, device=v.device)[None, :] < count[:, None]
    return torch.where(present, low, torch.zeros_like(low))


def torch_tiled_candidates(
    seg: torch.Tensor,
    offs: torch.Tensor,
    wts: torch.Tensor,
    dense_id: torch.Tensor,
    dense: torch.Tensor,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    q_scale: torch.Tensor,
    q_delta: torch.Tensor,
    *,
    n_docs: int,
    n_terms: int,
    tile_bits: int,
    k: int,
    tiles: tuple[int, int],
    select: bool,
    acc: str = "carry",
    int_weights: bool = False,
    q_shift: torch.Tensor | None = None,
    theta: torch.Tensor,
    cand_count: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
) -> None:
    """The CUDA kernel's contract (:func:`gpusparse.kernels.tiled.tiled_candidates`) in PyTorch.

    Tile after tile, all queries at once: the same fixed-point sums, ``tau`` the tile's exact
    k-th value (the kernel's radix passes give a value at or below it; any value that k
    documents of the tile reach is a valid bound), the same emission rule. Candidates past a
    query's capacity are counted but not stored, as on the GPU. The sums are exact int64
    here, which every ``acc`` mode also gives within its range (checked); ``int_weights``
    changes nothing here (the products are then integers anyway). int32 ``wts`` are
    fixed-point weights: products ``(round(w_q · q_scale) · d) >> q_shift``, as on the GPU.
    """
    from .kernels.tiled import ACC_TOP
    from .search import expand_ranges

    dev = seg.device
    b, cap, tile = q_terms.shape[0], cand_doc.shape[1], 1 << tile_bits
    rows, cols = (q_terms >= 0).nonzero(as_tuple=True)
    terms = q_terms[rows, cols].to(torch.int64)
    wq = q_weights[rows, cols].to(torch.float64) * q_scale[rows]
    fixed = wts.dtype == torch.int32
    if fixed:
        wq_int = torch.round(wq).to(torch.int64)
        sh = q_shift.to(torch.int64)[rows]

    def products(p: torch.Tensor | int, pair_weights: torch.Tensor) -> torch.Tensor:
        if fixed:  # < 2**31 · 2**30: exact in int64
            return (wq_int[p] * pair_weights.to(torch.int64)) >> sh[p]
        return torch.round(wq[p] * pair_weights.to(torch.float64)).to(torch.int64)

    for t in range(tiles[0], tiles[0] + tiles[1]):
        base = t * tile
        width = min(tile, n_docs - base)
        sums = torch.zeros(b * width, dtype=torch.int64, device=dev)
        did = dense_id[t * n_terms + terms].to(torch.int64)
        for p in (did >= 0).nonzero().flatten().tolist():
            col = products(p, dense[did[p], :width])
            sums[rows[p] * width : (rows[p] + 1) * width] += col
        lo, hi = seg[t * n_terms + terms], seg[t * n_terms + terms + 1]
        for pair, pos in expand_ranges(lo, hi, 1 << 22):
            off = offs[pos].to(torch.int64) & 0xFFFF
            contrib = products(pair, wts[pos])
            sums.index_add_(0, rows[pair] * width + off, contrib)
        top = sums.max() if sums.numel() else 0
        if top >= 2 * ACC_TOP[acc]:
            raise OverflowError(f"fixed-point sum {int(top)} exceeds the {acc!r} accumulator")
        sums = sums.view(b, width)
        tau = torch.zeros(b, dtype=torch.int64, device=dev)
        if select and k <= width:
            tau = torch.topk(sums, k, dim=1).values[:, -1].clamp_min(0)
        theta.copy_(torch.maximum(theta, tau))
        r, c = (sums >= emission_threshold(theta, q_delta)[:, None]).nonzero(as_tuple=True)  # row-major
        per_row = torch.bincount(r, minlength=b)
        slot = cand_count[r].to(torch.int64) + torch.arange(r.numel(), device=dev) - (per_row.cumsum(0) - per_row)[r]
        ok = slot < cap
        cand_doc[r[ok], slot[ok]] = (c[ok] + base).to(torch.int32)
        cand_val[r[ok], slot[ok]] = sums[r[ok], c[ok]]
        cand_count += per_row.to(torch.int32)


def finalize_candidates(
    index: Index,
    batch: QueryBatch,
    fp: FixedPoint,
    docs: torch.Tensor,
    vals: torch.Tensor,
    k: int,
    tl: TiledIndex | None = None,
    *,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical float32 scores of the candidates, then the tie-broken top-k (padded to ``k``).
    ``floor`` (float32 ``[B]``): candidates whose score is surely below it are left out.

    On a GPU one kernel turns the candidates into ranking keys (rescoring the uncertain ones
    from ``tl.forward``, or by binary searches narrowed by ``tl.list_pos``); the PyTorch
    steps below are its reference.
    """
    from .kernels import rescore
    from .search import exact_scores, finalize

    b = docs.shape[0]
    dev = docs.device
    if docs.is_cuda and rescore.available():  # one launch over all slots, no host sync
        keys = rescore.candidate_keys_cuda(
            index.doc_ids, index.scores, index.offsets, index.lengths,
            batch.padded_terms.contiguous(), batch.padded_weights.contiguous(),
            docs.to(torch.int32), vals.contiguous(), fp.delta, fp.scale,
            list_pos=tl.list_pos if tl is not None else None, tile_bits=tl.tile_bits if tl is not None else 0,
            floor=floor, forward=tl.forward if tl is not None else None,
        )  # fmt: skip
        return finalize(decode_keys(top_keys(keys, k)) if docs.shape[1] else None, k, b, dev)
    present = docs >= 0
    v = vals.to(torch.float64)
    margin = fp.delta[:, None].to(torch.float64) + v * 2.0**-50
    scale = fp.scale[:, None]
    low = ((v - margin).clamp_min(0) / scale).to(torch.float32)
    high = ((v + margin) / scale).to(torch.float32)
    if floor is not None:  # surely below the merged k-th: not a result here
        present = present & (high >= floor[:, None])
    scores = torch.where(present, low, torch.zeros_like(low))
    unsure = present & (low != high)
    if bool(unsure.any()):
        r, c = unsure.nonzero(as_tuple=True)
        scores[r, c] = exact_scores(index, batch, r, docs[r, c])
    ids = torch.where(present, docs, torch.full_like(docs, (1 << 31) - 1))
    scores = torch.where(present, scores, torch.zeros_like(scores))
    best = topk_by_key(scores, ids, k) if docs.shape[1] else None
    return finalize(best, k, b, dev)
