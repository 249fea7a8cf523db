"""How much device memory a search will need, predicted before anything is built or uploaded.

:func:`predict` gives, for one way of searching on a GPU (a *mode*), the bytes of each
resident component, the temporaries of building and of one query batch, an allowance for
the allocators, and the peak. Every formula mirrors what the code builds:

* ``lists`` (:attr:`~gpusparse.config.EngineConfig.resident` ``"lists"``, the tiled engine's
  default): the padded lists (:mod:`gpusparse.layout.postings`: 8 bytes a posting slot,
  padding included, and 20 a term), the forward copy (:mod:`gpusparse.layout.forward`: int64
  ``indptr``, then int32 term and float32 weight a posting) and the tiled layout (in cluster
  order, :attr:`~gpusparse.config.EngineConfig.doc_order`, with 8 bytes a document more and
  the clustering's temporaries, :mod:`gpusparse.layout.order`);
* ``tiled`` (``resident="tiled"``): the tiled layout alone (without ``list_pos``), which
  rescoring reads;
* ``streamed`` (:mod:`gpusparse.streaming`): two pieces of the index at once, each its lists
  and its tiled layout;
* ``scatter`` (the scatter-add engines): the padded lists and the temporaries the memory
  budget allows.

The tiled layout (:mod:`gpusparse.layout.tiled`) costs ``seg`` (int32 per (tile, term), plus
one a tile, and an int64 ``tile_start`` a tile), ``dense_id`` (int16 per (tile, term), and an
int32 ``dense_start`` a tile), ``list_pos`` (int32 per (tile, term)), 5 bytes a sparse posting
with float32 weights that pack (:mod:`gpusparse.layout.packing`) or else an int16 offset and
a weight, and :func:`dense_row_bytes` a dense segment. Which segments are dense depends on how
many postings each (tile, term) pair holds: :class:`IndexShape` counts them once on the host
(a bincount over the postings); whether the weights pack, on the span of their exponents
(:meth:`IndexShape.exponents`). The search temporaries are
:func:`~gpusparse.engines.tiled.waves.search_bytes`. The reserve covers the allocators'
rounding and caching (:data:`RESERVE_BYTES` plus :data:`RESERVE_SHARE`); the CUDA context
(a few hundred MB, outside every allocator) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .config import EngineConfig, engine_config
from .engines.base import CELL_BYTES, DEFAULT_MEMORY_BUDGET
from .engines.tiled.waves import search_bytes
from .layout.order import CHUNK_BYTES as ORDER_CHUNK_BYTES
from .layout.order import CHUNK_POSTINGS as ORDER_CHUNK
from .layout.order import DOC_BYTES as ORDER_DOC_BYTES
from .layout.order import order_clusters
from .layout.packing import exponent_base, exponent_range, merge_range
from .layout.postings import PostingLists
from .layout.statistics import max_score
from .layout.tiled import BUILD_CHUNK as TILED_CHUNK
from .layout.tiled import dense_segments, fixed_weight_bits, layout_defaults

MODES = ("lists", "tiled", "streamed", "scatter")
H100_SMS = 132  # multiprocessors assumed when no GPU is at hand
# Temporaries of the builders, per position of a slab: build_tiled ~128 bytes (counted from
# its code: the slab's arrays and the share ranks carried between slabs) over TILED_CHUNK
# positions, forward_index ~60 over 2**23.
BUILD_CHUNK = 1 << 23
TILED_BUILD_BYTES = 128
FORWARD_BUILD_BYTES = 60
# Beside the layout's own arrays build_tiled keeps only, where list_pos is kept, `before`
# (int32 a (tile, term) pair, which becomes list_pos): its count matrices are freed before
# those arrays are allocated.
TILED_COUNT_BYTES = 4
# The allocators' rounding, fragmentation and caching: a fixed part and a share of the rest.
RESERVE_BYTES = 64 << 20
RESERVE_SHARE = 0.01
LIST_BYTES_PER_TERM = 8 + 4 + 4 + 4  # offsets int64, lengths, padded_lengths int32, max_scores float32


def dense_row_bytes(tile_bits: int, n_postings: np.ndarray | int, weight_bytes: int) -> np.ndarray:
    """Bytes of dense rows of the tiled layout, elementwise over ``n_postings`` (each row's real
    postings): one weight a document of the tile, present or not (``n_postings`` does not
    count in this form)."""
    return np.zeros(np.shape(n_postings), dtype=np.int64) + (1 << tile_bits) * weight_bytes


class IndexShape:
    """What the prediction reads of an index: counts, the weight type, and the postings of each
    (tile, term) pair (counted on the arrays' device in slabs, once per ``tile_bits``)."""

    def __init__(self, index: PostingLists) -> None:
        self.index = index
        self.n_docs = index.n_docs
        self.n_terms = len(index.vocab)
        self.n_padded = int(index.doc_ids.numel())
        self.n_postings = int(index.lengths.to(torch.int64).sum())
        self.quantized = index.quantization is not None
        self._counts: dict[int, np.ndarray] = {}
        self._exponents: tuple[int, int] | None = None

    def exponents(self, chunk: int = 1 << 22) -> tuple[int, int]:
        """``(smallest, largest)`` float32 exponent field of the real postings' weights
        (:func:`~gpusparse.layout.packing.exponent_range`), read in slabs of ``chunk``."""
        if self._exponents is None:
            index = self.index
            span = exponent_range(torch.zeros(0))
            for a in range(0, self.n_padded, chunk):
                real = index.doc_ids[a : a + chunk] >= 0
                span = merge_range(span, tuple(x.cpu() for x in exponent_range(index.scores[a : a + chunk][real])))
            self._exponents = (int(span[0]), int(span[1]))
        return self._exponents

    def packed(self, tile_bits: int, fixed: bool) -> bool:
        """Whether build_tiled packs this index's float32 sparse postings in 5 bytes."""
        if self.quantized:
            return False
        weight_bits = fixed_weight_bits(max_score(self.index)) if fixed else None
        return exponent_base(*self.exponents(), tile_bits, weight_bits) is not None

    def tile_counts(self, tile_bits: int, chunk: int = 1 << 22, *, bounded: bool | None = None) -> np.ndarray:
        """int64 ``[n_tiles * n_terms]``: real postings of each (tile, term) pair, tile-major.
        ``bounded`` (default: for an index on a GPU) counts each slab's distinct pairs instead
        of a bincount, so that the device's temporaries stay bounded by ``chunk``."""
        if tile_bits not in self._counts:
            index, n_terms = self.index, self.n_terms
            n_tiles = max(1, -(-self.n_docs >> tile_bits))
            dev = index.doc_ids.device
            bounded = dev.type != "cpu" if bounded is None else bounded
            offsets = index.offsets.to(dev, torch.int64)
            counts = np.zeros(n_tiles * n_terms, dtype=np.int64)  # on the host: no device memory
            for a in range(0, self.n_padded, chunk):
                b = min(self.n_padded, a + chunk)
                doc = index.doc_ids[a:b].to(torch.int64)
                term = torch.searchsorted(offsets, torch.arange(a, b, device=dev), right=True) - 1
                real = doc >= 0
                key = (doc[real] >> tile_bits) * n_terms + term[real]
                if not bounded:
                    counts += torch.bincount(key, minlength=counts.size).numpy()
                else:
                    present, n = torch.unique(key, return_counts=True)
                    np.add.at(counts, present.cpu().numpy(), n.cpu().numpy())
            self._counts[tile_bits] = counts
        return self._counts[tile_bits]


@dataclass(frozen=True)
class Footprint:
    """A mode's predicted device bytes (see the module docstring).

    Attributes:
        mode: ``"lists"``, ``"tiled"``, ``"streamed"`` or ``"scatter"``.
        components: ``(name, bytes)`` resident while searching.
        temporaries: ``(name, bytes)`` alive for a while (building, one batch).
        peak: resident bytes plus the largest moment of temporaries, plus the reserve.
        reserve: the allocators' allowance included in ``peak``.
        pieces: document ranges streamed (``"streamed"``; 1 otherwise).
    """

    mode: str
    components: tuple[tuple[str, int], ...]
    temporaries: tuple[tuple[str, int], ...]
    peak: int
    reserve: int
    pieces: int = 1
    notes: dict = field(default_factory=dict)

    @property
    def resident(self) -> int:
        """Bytes of the resident components."""
        return sum(n for _, n in self.components)

    def as_dict(self) -> dict:
        """For ``--json`` and benchmark results."""
        return {"mode": self.mode, "components": dict(self.components), "temporaries": dict(self.temporaries),
                "resident": self.resident, "reserve": self.reserve, "peak": self.peak, "pieces": self.pieces,
                **self.notes}  # fmt: skip


def layout_choice(shape: IndexShape, config: EngineConfig) -> tuple[int, float, bool]:
    """``(tile_bits, dense_min, fixed)`` the tiled engine builds for this index and settings
    (:func:`~gpusparse.layout.tiled.layout_defaults`, fixed point as in
    :func:`~gpusparse.engines.tiled.engine.layout_for_search`)."""
    fixed = config.fixed_point and config.accumulator == "u32" and not shape.quantized
    bits, dense_min = layout_defaults(shape.n_docs, shape.quantized, fixed)
    if config.dense_min != "auto":  # the engine's setting replaces the default share
        dense_min = config.dense_min  # type: ignore[assignment]
    return bits, dense_min, fixed


def list_parts(n_padded: int, n_terms: int) -> list[tuple[str, int]]:
    """The padded lists: doc id and score a slot, four arrays a term."""
    return [("padded lists", 8 * n_padded + LIST_BYTES_PER_TERM * n_terms)]


def forward_parts(n_docs: int, n_postings: int) -> list[tuple[str, int]]:
    """The forward copy: int64 ``indptr``, int32 term and float32 weight a posting."""
    return [("forward copy", 8 * (n_docs + 1) + 8 * n_postings)]


def layout_parts(shape: IndexShape, config: EngineConfig, *, list_positions: bool) -> list[tuple[str, int]]:
    """The tiled layout's arrays (``list_positions``: the layout beside the lists, with
    ``list_pos``, its fixed-point weights stored as integers, as
    :func:`~gpusparse.engines.tiled.engine.layout_for_search` builds it)."""
    bits, dense_min, fixed = layout_choice(shape, config)
    counts = shape.tile_counts(bits)
    pairs = counts.size
    n_tiles = pairs // max(1, shape.n_terms)
    dense = dense_segments(torch.from_numpy(counts), shape.n_terms, bits, dense_min).numpy()
    n_sparse = int(counts[~dense].sum())
    wbytes = 1 if shape.quantized else 4
    stored_fixed = list_positions and fixed  # int32 integers: not packed
    posting = 5 if not stored_fixed and shape.packed(bits, fixed) else 2 + wbytes
    parts = [
        ("tiled layout: seg", 4 * n_tiles * (shape.n_terms + 1) + 8 * (n_tiles + 1)),
        (
            "tiled layout: dense_id + list_pos" if list_positions else "tiled layout: dense_id",
            (6 if list_positions else 2) * pairs + 4 * (n_tiles + 1),
        ),
        (f"tiled layout: {posting}-byte sparse postings", n_sparse * posting),
        ("tiled layout: dense rows", int(dense_row_bytes(bits, counts[dense], wbytes).sum())),
    ]
    return parts


def _reserve(n: int) -> int:
    return RESERVE_BYTES + int(RESERVE_SHARE * n)


def predict(
    shape: IndexShape,
    mode: str,
    *,
    batch_size: int = 256,
    k: int = 1000,
    n_sm: int = H100_SMS,
    memory_budget: int | None = None,
    pieces: int = 2,
    config: EngineConfig | None = None,
) -> Footprint:
    """The device bytes of searching ``shape`` in ``mode`` (see the module docstring) with
    batches of ``batch_size`` queries at ``k``; ``n_sm``: the GPU's multiprocessors;
    ``memory_budget``: the scatter engines' temporaries (default 1 GiB); ``pieces``: for
    ``"streamed"``; ``config``: the engine settings (default: those in force)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    config = config or engine_config()
    bits, _, _ = layout_choice(shape, config)
    kk = max(1, min(k, shape.n_docs))
    n_tiles = max(1, -(-shape.n_docs >> bits))
    batch = search_bytes(n_tiles, batch_size, kk, n_sm, levels=shape.quantized)
    lists = list_parts(shape.n_padded, shape.n_terms)
    slab = min(TILED_CHUNK, shape.n_padded)
    before = n_tiles * shape.n_terms * TILED_COUNT_BYTES  # where list_pos is kept
    layout_build = slab * TILED_BUILD_BYTES
    if mode == "scatter":
        scatter = min(memory_budget or DEFAULT_MEMORY_BUDGET, batch_size * max(1, shape.n_docs) * CELL_BYTES)
        temps = [("search: score buffer (memory budget)", scatter), ("search: results", batch_size * kk * 12)]
        comps = lists
        top = sum(n for _, n in temps)
    elif mode == "tiled":
        comps = layout_parts(shape, config, list_positions=False)
        temps = [("build: tiled layout", layout_build), ("search: one batch", batch)]
        top = max(layout_build, batch)
    elif mode == "lists":
        fwd = forward_parts(shape.n_docs, shape.n_postings)
        fwd_build = min(BUILD_CHUNK, shape.n_postings) * FORWARD_BUILD_BYTES + 16 * shape.n_docs
        ordered = order_clusters(config.doc_order, config.order_clusters, shape.n_docs, bits,
                                 forward=config.forward_rescoring) > 0  # fmt: skip
        # In cluster order the layout has no list_pos, and the order's two int32 arrays; its
        # dense rows and sparse postings are counted in collection order (the order made them
        # fewer at 8.8M: bench/NOTES.md, issue 23, tenth session).
        layout = layout_parts(shape, config, list_positions=not ordered)
        if ordered:
            layout.append(("tiled layout: document order", 8 * shape.n_docs))
        comps = lists + fwd + layout
        temps = [("build: tiled layout", layout_build), ("build: forward copy", fwd_build)]
        if ordered:
            order_build = min(ORDER_CHUNK, shape.n_postings) * ORDER_CHUNK_BYTES + ORDER_DOC_BYTES * shape.n_docs
            temps.append(("build: document order", order_build))
        temps.append(("search: one batch", batch))
        # the layout is built before the forward copy (its temporaries come without it), or, in
        # cluster order, after it and the clustering (which reads it), with a count a (tile, term)
        layout_build += before
        if ordered:
            top = max(layout_build, fwd_build, order_build, batch)
        else:
            top = max(layout_build - fwd[0][1], fwd_build, batch)
    else:  # streamed: two pieces at once, each a share of the lists and the layout
        whole = sum(n for _, n in lists + layout_parts(shape, config, list_positions=True))
        per_piece = -(-whole // pieces) + (shape.n_terms * 16 if pieces > 1 else 0)  # a piece's own partial tiles
        n_on = min(2, pieces)
        comps = [(f"two of {pieces} pieces (lists and tiled layout)" if n_on == 2 else "the index", n_on * per_piece)]
        piece_build = min(TILED_CHUNK, -(-shape.n_padded // pieces)) * TILED_BUILD_BYTES
        piece_build += -(-n_tiles // pieces) * shape.n_terms * TILED_COUNT_BYTES  # list_pos kept
        merge = batch_size * kk * 12 * 4
        temps = [("build: a piece's tiled layout", piece_build), ("search: one batch and the merge", batch + merge)]
        top = max(piece_build, batch + merge)
    resident = sum(n for _, n in comps)
    reserve = _reserve(resident + top)
    return Footprint(mode, tuple(comps), tuple(temps), resident + top + reserve, reserve,
                     pieces if mode == "streamed" else 1,
                     {"batch_size": batch_size, "k": k, "tile_bits": bits})  # fmt: skip


def streamed_pieces(shape: IndexShape, limit: int, **kwargs) -> int | None:
    """The fewest pieces whose streamed search fits ``limit`` bytes, or ``None`` if none does
    (more pieces never need more: doubling, then a binary search)."""
    most = max(2, shape.n_docs)

    def fits(n: int) -> bool:
        return predict(shape, "streamed", pieces=n, **kwargs).peak <= limit

    hi = 2
    while not fits(hi):
        if hi >= most:
            return None
        hi = min(most, 2 * hi)
    lo = max(2, hi // 2)  # lo - 1 pieces do not fit (or lo == 2)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi
