"""The tiled layout: postings regrouped by (document tile, term), as the tiled engine reads them.

Documents are cut into tiles of ``2**tile_bits``; postings are stored tile-major, then
term-major, then by document. A sparse posting is its offset inside the tile and its weight:
5 bytes for float32 weights (:mod:`.packing`: a 32-bit word holding the 13-bit offset and the
weight's top bits, and a byte), else ``offs`` (int16 holding the unsigned 16-bit offset) and
``wts`` (float32; int32 fixed-point integers in a layout beside the lists; or 8-bit levels).
Each tile's (tile, term) segments start at ``tile_start[tile] + seg[tile * (V + 1) + term]``
(an int64 per tile, an int32 per pair: a tile holds fewer than 2**31 postings). Segments
covering a large share of a tile are stored densely, one weight per document of the tile
(0 where absent), which the kernel adds in registers instead of with atomics: row
``dense_start[tile] + dense_id[tile * V + term]`` of ``dense`` (int16 ids, -1 for a sparse
segment). The engine that searches it is :mod:`gpusparse.engines.tiled`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..quantize import levels
from . import packing
from .forward import forward_copy, forward_index
from .order import cluster_order
from .packing import exponent_base, exponent_range, merge_range, unpack_offsets, unpack_weights
from .postings import PostingLists, posting_slabs
from .statistics import max_score

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
AUTO = "auto"
MAX_TILE_BITS = 16  # offsets are 16-bit
BUILD_CHUNK = 1 << 20  # postings per slab of build_tiled (~100 bytes of temporaries each)
MAX_DENSE_PER_TILE = (1 << 15) - 1  # dense rows a tile may have (int16 ids, -1 for sparse)
OCT = 8  # sparse arrays end on a whole group of this many elements (the kernel's OCTS reads)


@dataclass(frozen=True)
class TiledIndex:
    """Postings regrouped by (tile, term); see the module docstring. Read the sparse postings
    through :meth:`segments`, :meth:`offsets_at` and :meth:`weights_at` (their form depends on
    :attr:`exp_base`), the dense rows through :meth:`dense_rows`."""

    tile_bits: int
    n_docs: int
    n_terms: int
    seg: torch.Tensor  # int32 [n_tiles * (n_terms + 1)]: segment starts inside each tile's postings
    # int16 [P] (unsigned offset inside the tile); packed (exp_base set): int32 words (.packing)
    offs: torch.Tensor
    # float32 [P], uint8 levels (weight = level · step) of a quantized index, or int32
    # round(weight · 2**weight_bits) (a fixed-point layout built with stored_fixed); packed:
    # uint8, the low byte of each weight's 27-bit field (.packing)
    wts: torch.Tensor
    dense_id: torch.Tensor  # int16 [n_tiles * n_terms]: row of `dense` after dense_start[tile], or -1 (sparse)
    dense: torch.Tensor  # [n_dense, 2**tile_bits] (float32, uint8 or int32): weights by offset, 0 where absent
    tile_start: torch.Tensor  # int64 [n_tiles + 1]: first sparse posting of each tile, then P
    dense_start: torch.Tensor  # int32 [n_tiles + 1]: first dense row of each tile, then n_dense
    step: float = 1.0  # what a stored weight is worth (1 for float32 weights)
    # Fixed-point arithmetic for float32 weights: the kernel multiplies the integers
    # round(weight · 2**weight_bits), stored as such (int32 `wts`), or converted from the
    # stored float32 bits as it reads them (exact: a power-of-two scaling, then round half to
    # even), so that rescoring can read the layout's weights.
    weight_bits: int | None = None
    # int32 [n_tiles * n_terms]: real postings of each term in earlier tiles, i.e. where a
    # tile's share of the term's list starts in the index's own list; it narrows the binary
    # searches of canonical rescoring from the whole list (~22 steps) to one tile's share.
    # Built only where rescoring reads the lists (``list_positions``).
    list_pos: torch.Tensor | None = None
    # The index's document-major copy (gpusparse.kernels.forward_index: indptr, terms,
    # weights), kept with a layout built on a GPU: rescoring reads a candidate's ~120
    # postings in order instead of binary-searching each query term's list (bench/NOTES.md).
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Packed sparse postings (5 bytes, float32 weights): the exponent base (.packing); None: 6 bytes.
    exp_base: int | None = None
    # A layout built in a document order of its own (:mod:`.order`): int32 [n_docs], the
    # document at each position (``doc_of``) and the position of each document (``pos_of``).
    # Tiles, offsets and dense rows are in positions; candidates leave the kernel as documents.
    # None: positions are documents.
    doc_of: torch.Tensor | None = None
    pos_of: torch.Tensor | None = None

    @property
    def n_tiles(self) -> int:
        """Number of document tiles."""
        return (self.n_docs + (1 << self.tile_bits) - 1) >> self.tile_bits

    @property
    def n_dense(self) -> int:
        """Number of dense rows."""
        return self.dense.shape[0]

    @property
    def n_sparse(self) -> int:
        """Number of sparse postings."""
        return self.offs.numel()

    @property
    def packed(self) -> bool:
        """Sparse postings in 5 bytes (:mod:`.packing`)."""
        return self.exp_base is not None

    @property
    def quantized(self) -> bool:
        """Weights stored as 8-bit levels (worth ``step`` each)."""
        return self.dense.dtype == torch.uint8

    @property
    def nbytes(self) -> int:
        """Device bytes of the arrays."""
        return sum(t.numel() * t.element_size() for t in self.arrays())

    def arrays(self, forward: bool = True) -> list[torch.Tensor]:
        """Every array the layout holds (``forward``: the forward copy's too)."""
        own = (self.seg, self.offs, self.wts, self.dense_id, self.dense, self.tile_start, self.dense_start)
        extra = (self.list_pos, self.doc_of, self.pos_of)
        return [t for t in (*own, *extra, *((self.forward or ()) if forward else ())) if t is not None]

    def segments(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(start, end)`` among the sparse postings of the segments ``keys = tile ·
        n_terms + term`` (empty for a dense segment)."""
        keys = keys.to(torch.int64)
        tile, term = keys // self.n_terms, keys % self.n_terms
        at = tile * (self.n_terms + 1) + term
        base = self.tile_start[tile]
        return base + self.seg[at].to(torch.int64), base + self.seg[at + 1].to(torch.int64)

    def segment_starts(self) -> torch.Tensor:
        """int64 ``[n_tiles · n_terms + 1]``: the start of every segment, then ``P`` (tests, benchmarks)."""
        keys = torch.arange(self.n_tiles * self.n_terms, device=self.seg.device)
        return torch.cat([self.segments(keys)[0], self.tile_start[-1:]])

    def dense_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 row of ``dense`` of the segments ``keys``, or -1 for a sparse one."""
        keys = keys.to(torch.int64)
        local = self.dense_id[keys].to(torch.int64)
        return torch.where(local >= 0, self.dense_start[keys // self.n_terms].to(torch.int64) + local, local)

    def offsets_at(self, pos: torch.Tensor | slice) -> torch.Tensor:
        """int64 offsets inside their tile of the sparse postings ``pos`` (positions or a slice)."""
        if self.packed:
            return unpack_offsets(self.offs[pos], self.tile_bits)
        return self.offs[pos].to(torch.int64) & 0xFFFF  # stored as int16: the unsigned offset

    def weights_at(self, pos: torch.Tensor | slice) -> torch.Tensor:
        """Stored weights of the sparse postings ``pos`` (positions or a slice; float32, uint8
        levels or int32 integers)."""
        if self.packed:
            return unpack_weights(self.offs[pos], self.wts[pos], self.exp_base, self.tile_bits)  # type: ignore[arg-type]
        return self.wts[pos]


def dense_segments(counts: torch.Tensor, n_terms: int, tile_bits: int, dense_min: float | None) -> torch.Tensor:
    """bool ``[n_tiles · n_terms]``: the segments stored densely, from each (tile, term)
    pair's postings ``counts``: those holding at least ``dense_min`` of a tile's documents, at
    most :data:`MAX_DENSE_PER_TILE` a tile (the first in term order: ids are int16)."""
    if dense_min is None:
        return torch.zeros(counts.shape, dtype=torch.bool, device=counts.device)
    dense = counts >= max(1, int(dense_min * (1 << tile_bits)))
    rank = torch.cumsum(dense.view(-1, n_terms), 1, dtype=torch.int32).view(-1)
    return dense & (rank <= MAX_DENSE_PER_TILE)


def sparse_array(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``[n]`` array of sparse postings (offsets or weights) whose storage
    reaches the end of the last group of :data:`OCT` elements: the kernel reads them eight at a
    time (:func:`~gpusparse.kernels.tile_candidates.octs_readable`)."""
    return torch.empty(-(-n // OCT) * OCT, dtype=dtype, device=device)[:n]


def build_tiled(
    index: PostingLists,
    tile_bits: int = DEFAULT_TILE_BITS,
    *,
    dense_min: float | None = DEFAULT_DENSE_MIN,
    fixed: bool = False,
    list_positions: bool = True,
    stored_fixed: bool = False,
    device: torch.device | str | None = None,
    chunk: int = BUILD_CHUNK,
    pack: bool = True,
    order: torch.Tensor | None = None,
) -> TiledIndex:
    """Regroup an index's postings by (tile, term), on ``device`` (default: the index's).

    No sort is needed: inside a term's list documents are ascending, so each tile's share
    of the list is contiguous and keeps its order; a posting's new position is its
    (tile, term) segment start plus its rank inside that share (the slab's postings since
    the share's first one, carried from slab to slab). The padded lists are read in
    slabs of ``chunk`` positions (:func:`~gpusparse.layout.postings.posting_slabs`), copied
    to ``device`` one at a time when they live elsewhere (an index kept on the host); the
    temporaries are bounded by ``chunk`` postings (~100 bytes each: 2**20 keep the build
    within ~0.1 GB beside the layout), plus, where ``list_positions``, an int32 a (tile,
    term) pair. The count matrices are released before the layout's own arrays are allocated.

    Segments holding at least ``dense_min`` of a tile's documents are stored densely instead
    (one weight per document of the tile): the kernel adds them with coalesced reads into
    registers, without shared-memory atomics. ``None`` keeps every segment sparse.

    A quantized index (:mod:`gpusparse.quantize`) stores its weights as uint8 levels: 3
    bytes a sparse posting, 1 a dense slot. ``fixed`` (float32 weights only) records the
    fixed-point exponent ``b`` (the largest weight times ``2**b`` below ``2**30``) for the
    kernel's integer products; the weights stay float32, converted as the kernel reads them,
    unless ``stored_fixed``: then they are stored as the int32 integers themselves (the
    kernel's fastest form, but rescoring can no longer read them: for a layout beside the
    lists). ``list_positions``: also build :attr:`TiledIndex.list_pos` (only rescoring from
    the lists reads it). ``pack``: float32 sparse postings in 5 bytes where the weights
    allow it (:mod:`.packing`; else, or with ``pack=False``, 6).

    ``order`` (optional, a permutation of the documents: ``order[i]`` is the document placed
    at position ``i``, e.g. :func:`~gpusparse.layout.order.cluster_order`): tiles are cut from
    positions instead of document numbers; inside a tile positions follow document numbers
    (so a segment's offsets stay ascending). The layout then records
    :attr:`TiledIndex.doc_of` and :attr:`TiledIndex.pos_of`, and has no list positions (a
    tile's share of a list is no longer contiguous).
    """
    if not 1 <= tile_bits <= MAX_TILE_BITS:
        raise ValueError(f"tile_bits must be in 1..{MAX_TILE_BITS}")
    dev = index.device if device is None else torch.device(device)
    n_terms, n_docs = len(index.vocab), index.n_docs
    doc_of = pos_of = None
    if order is not None:
        doc_of, pos_of = _positions(order, n_docs, tile_bits, dev)
        list_positions = False
    n_tiles = max(1, (n_docs + (1 << tile_bits) - 1) >> tile_bits)
    quant = index.quantization
    fixed = fixed and quant is None
    wdtype, step = (torch.uint8, quant.step) if quant is not None else (torch.float32, 1.0)
    weight_bits = fixed_weight_bits(max_score(index)) if fixed else None
    if weight_bits is not None and stored_fixed:
        wdtype = torch.int32
    want_pack = pack and wdtype == torch.float32
    counts = torch.zeros(n_tiles * n_terms, dtype=torch.int64, device=dev)
    span = exponent_range(torch.zeros(0, device=dev))
    for term, doc, score, _ in posting_slabs(index, dev, chunk):
        if pos_of is not None:
            doc = pos_of[doc].to(torch.int64)
        key = (doc >> tile_bits) * n_terms + term
        counts.index_add_(0, key, torch.ones_like(key))  # no [n_tiles · V] temporary per slab
        if want_pack:
            span = merge_range(span, exponent_range(score))
    exp_base = exponent_base(int(span[0]), int(span[1]), tile_bits, weight_bits) if want_pack else None
    is_dense = dense_segments(counts, n_terms, tile_bits, dense_min)
    per_tile = is_dense.view(n_tiles, n_terms)
    local = torch.cumsum(per_tile, 1, dtype=torch.int32) - 1  # < MAX_DENSE_PER_TILE
    dense_id = torch.where(per_tile, local, -1).to(torch.int16).view(-1)
    del local
    dense_start = torch.zeros(n_tiles + 1, dtype=torch.int32, device=dev)
    torch.cumsum(per_tile.sum(1, dtype=torch.int32), 0, out=dense_start[1:])
    n_dense = int(dense_start[-1])
    sparse_counts = torch.where(is_dense, torch.zeros_like(counts), counts).view(n_tiles, n_terms)
    tile_start = torch.zeros(n_tiles + 1, dtype=torch.int64, device=dev)
    torch.cumsum(sparse_counts.sum(1), 0, out=tile_start[1:])
    if n_tiles and int((tile_start[1:] - tile_start[:-1]).max()) >= 1 << 31:
        raise ValueError("a tile holds 2**31 sparse postings or more: use smaller tiles")
    seg = torch.zeros((n_tiles, n_terms + 1), dtype=torch.int32, device=dev)
    seg[:, 1:] = torch.cumsum(sparse_counts, 1, dtype=torch.int32)  # before the layout's big arrays
    seg = seg.view(-1)
    del sparse_counts, is_dense, per_tile
    # Postings of term t in tiles before tile b: where the (b, t) share starts in t's list.
    before = None
    if list_positions:
        before = (torch.cumsum(counts.view(n_tiles, n_terms), 0) - counts.view(n_tiles, n_terms)).to(torch.int32)
    del counts
    _release_cached(dev)
    # the layout's own arrays only now, without the count matrices beside them
    dense = torch.zeros((n_dense, 1 << tile_bits), dtype=wdtype, device=dev)
    n_sparse = int(tile_start[-1])
    packed = exp_base is not None
    offs = sparse_array(n_sparse, torch.int32 if packed else torch.int16, dev)
    wts = sparse_array(n_sparse, torch.uint8 if packed else wdtype, dev)
    layout = TiledIndex(tile_bits, n_docs, n_terms, seg, offs, wts, dense_id, dense, tile_start, dense_start, step,
                        weight_bits, exp_base=exp_base)  # fmt: skip

    def stored(scores: torch.Tensor) -> torch.Tensor:
        if wdtype == torch.int32:  # < 2**30
            return torch.round(scores.to(torch.float64) * 2.0**weight_bits).to(torch.int32)
        if quant is None:
            return scores
        return levels(scores, step, quant.bits).to(torch.uint8)  # exact: scores are level · step

    mask = (1 << tile_bits) - 1
    carry = (torch.full((), -1, dtype=torch.int64, device=dev), torch.zeros((), dtype=torch.int64, device=dev))
    # In an order of its own a (tile, term) share is not contiguous in its list: its postings
    # so far are counted instead.
    seen = torch.zeros(n_tiles * n_terms, dtype=torch.int32, device=dev) if pos_of is not None else None
    for term, doc, score, rank in posting_slabs(index, dev, chunk):
        if term.numel() == 0:
            continue
        if pos_of is not None:
            doc = pos_of[doc].to(torch.int64)
        tile = doc >> tile_bits
        key = tile * n_terms + term
        off = doc & mask
        if seen is not None:
            in_share = _ranks_counted(key, seen)
        else:
            first, carry = _share_starts(key, rank, carry) if before is None else (before[tile, term], carry)
            in_share = rank.sub_(first)  # rank inside the (tile, term) share
            del first
        del tile, doc  # the slab's temporaries stay few (BUILD_CHUNK)
        row = layout.dense_rows(key)
        d = row >= 0
        dense[row[d], off[d]] = stored(score[d])
        s = ~d
        del row, d
        new = layout.segments(key[s])[0].add_(in_share[s])
        del key, in_share
        if packed:
            offs[new], wts[new] = packing.pack(off[s], score[s], exp_base, tile_bits)  # type: ignore[arg-type]
        else:
            offs[new] = torch.where(off[s] >= 1 << 15, off[s] - (1 << 16), off[s]).to(torch.int16)
            wts[new] = stored(score[s])
    list_pos = before.reshape(-1) if before is not None else None  # < n_docs
    del before, seen
    _release_cached(dev)
    return replace(layout, list_pos=list_pos, doc_of=doc_of, pos_of=pos_of)


def _positions(
    order: torch.Tensor, n_docs: int, tile_bits: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_of, pos_of)`` int32 for a document order, each tile's documents ascending."""
    order = torch.as_tensor(order).to(dev, torch.int64)
    if order.shape != (n_docs,) or (
        n_docs and (int(order.min()) < 0 or int(order.max()) >= n_docs or bool((torch.bincount(order) != 1).any()))
    ):
        raise ValueError(f"order must be a permutation of the {n_docs} documents")
    tile = torch.arange(n_docs, device=dev) >> tile_bits
    doc_of = torch.sort(tile * n_docs + order).values % max(n_docs, 1)  # ascending inside each tile
    pos_of = torch.empty_like(doc_of)
    pos_of[doc_of] = torch.arange(n_docs, device=dev)
    return doc_of.to(torch.int32), pos_of.to(torch.int32)


def _ranks_counted(key: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Each posting's rank among the postings of its key so far (this slab in order, after the
    ``seen[key]`` of earlier slabs); ``seen`` is updated in place."""
    sk, idx = torch.sort(key, stable=True)  # each key's postings consecutive, in slab order
    at = torch.arange(sk.numel(), device=key.device)
    # no share carried in: keys are ≥ 0, so the first posting starts a share
    no_carry = (
        torch.full((), -1, dtype=torch.int64, device=key.device),
        torch.zeros((), dtype=torch.int64, device=key.device),
    )
    run_start, _ = _share_starts(sk, at, no_carry)
    ranks = torch.empty_like(key)
    ranks[idx] = seen[sk].to(torch.int64) + at - run_start
    seen.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return ranks


def _share_starts(
    key: torch.Tensor, rank: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The rank of the first posting of each posting's (tile, term) share, for a slab in list
    order (a share's postings are consecutive); ``carry``: the previous slab's last key and
    its share's first rank (0-dim tensors: no host sync), returned updated for the next slab."""
    n = key.numel()
    prev = torch.cat([carry[0].view(1), key[:-1]])
    idx = torch.arange(n, device=key.device)
    start_at = torch.cummax(torch.where(key != prev, idx, -1), 0).values  # -1: the previous slab's share
    first = torch.where(start_at >= 0, rank[start_at.clamp_min(0)], carry[1])
    return first, (key[-1], first[-1])


def _release_cached(dev: torch.device) -> None:
    """Give PyTorch's cached free blocks back to the device: the build's freed temporaries
    would otherwise stay reserved beside the layout (measured: 0.75 GB at 8.8M documents)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def fixed_weight_bits(max_weight: float) -> int:
    """``b`` with ``max_weight · 2**b < 2**30``, the largest such (fixed-point weights)."""
    if not max_weight > 0:
        return 0
    return 30 - math.frexp(max_weight)[1]


def default_layout(index: PostingLists, fixed: bool = False) -> tuple[int, float]:
    """``(tile_bits, dense_min)`` for this index's weights (see :data:`DEFAULT_LAYOUT`)."""
    return layout_defaults(index.n_docs, index.quantization is not None, fixed)


def layout_defaults(n_docs: int, quantized: bool, fixed: bool) -> tuple[int, float]:
    """:func:`default_layout` from the figures it depends on (for predictions made without
    the index's arrays)."""
    if quantized:
        return DEFAULT_LAYOUT["uint8"]
    bits, dense_min = DEFAULT_LAYOUT["fixed" if fixed else "float32"]
    if fixed and (n_docs >> bits) < SMALL_TILES:
        dense_min = SMALL_DENSE_MIN
    return bits, dense_min


def tiled_layout(
    index: PostingLists,
    tile_bits: int | None = None,
    dense_min: float | str | None = AUTO,
    fixed: bool = False,
    *,
    forward: bool = False,
    list_positions: bool = True,
    stored_fixed: bool = False,
    clusters: int = 0,
) -> TiledIndex:
    """The index's tiled layout, built once per index object and kept in its derived state.

    ``tile_bits=None`` and ``dense_min="auto"`` take :func:`default_layout`'s values;
    ``dense_min=None`` keeps every segment sparse; ``fixed``: fixed-point float32 weights
    (see :func:`build_tiled`). ``forward``: a layout built now also holds the index's forward
    copy (:func:`~gpusparse.layout.forward.forward_copy`, 8 bytes a posting, shared with the
    doc-parallel kernel's) for rescoring; the engine asks for it on a GPU with the CUDA
    kernels, not for a layout to be streamed. ``list_positions=False``: a layout built now
    leaves out :attr:`TiledIndex.list_pos` (rescoring will read the layout, not the lists).
    ``stored_fixed``: a fixed-point layout built now stores int32 weights (:func:`build_tiled`).
    ``clusters``: documents in the order of :func:`~gpusparse.layout.order.cluster_order` with
    this many clusters (0: collection order), computed from the forward copy.
    Built on ``index.device``, which for a :class:`~gpusparse.layout.resident.TiledResident`
    view is the device searched, its lists staying on the host.
    """
    fixed = fixed and index.quantization is None
    auto_bits, auto_dense = default_layout(index, fixed)
    tile_bits = auto_bits if tile_bits is None else tile_bits
    dense_min = auto_dense if dense_min == AUTO else dense_min
    key = (tile_bits, dense_min, fixed) + ((clusters,) if clusters else ())
    layouts = index.derived.layouts
    if key not in layouts:
        perm = None
        if clusters:
            csr = forward_copy(index) if forward else forward_index(index)
            perm = cluster_order(csr, n_terms=len(index.vocab), clusters=clusters, tile_bits=tile_bits)
            del csr
        layout = build_tiled(index, tile_bits, dense_min=dense_min, fixed=fixed, list_positions=list_positions,
                             stored_fixed=stored_fixed, order=perm)  # fmt: skip
        del perm
        if forward:
            layout = replace(layout, forward=forward_copy(index))
        layouts[key] = layout
    return layouts[key]
