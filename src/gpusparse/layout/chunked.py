"""The tiled layout built from document chunks, never from the whole collection:
:func:`build_tiled_chunks`.

A chunk is a run of whole tiles (``2**tile_bits`` documents; the last chunk may end with a
partial tile) given as canonical CSR on any device. Every (tile, term) segment lies in one
chunk, so a chunk's piece of the layout — built by :func:`~.tiled.build_tiled` on a small
index of the chunk alone — is the final layout's rows for its tiles (segment starts and
dense ids are relative to their tile), with its tiles' first posting and first dense row
shifted by the sparse postings and dense rows before it (:func:`append_piece`), and its
postings packed with the whole collection's exponent base. Two passes over the chunks:
the first counts (the final arrays' sizes, the exponent range, and the statistics the
engine reads: :class:`ChunkStatistics`), the second builds and appends; the chunks must
come back the same the second time (checked by the sizes).

Memory: the final layout, plus one chunk's CSR, its padded lists and its piece (about 30
bytes a posting of a chunk). Positions are int64 (``tile_start`` holds them; a layout of
100M documents has ~1.2e10 postings).

A quantized layout needs its step before the first posting is stored: ``quantization``
is given up front (e.g. :func:`~gpusparse.quantize.power_of_two_step` of the generator's
largest weight) and each chunk is quantized with it as it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..quantize import Quantization, quantize_csr
from ..vocab import Vocabulary
from . import packing
from .packing import exponent_base, exponent_range, merge_range
from .postings import PostingLists, build_inverted_index
from .tiled import TiledIndex, build_tiled, fixed_weight_bits, sparse_array

CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class ChunkStatistics:
    """What the tiled engine reads about an index besides its layout, accumulated chunk by
    chunk: per-term list lengths and largest weights, the smallest weight, empty documents."""

    lengths: torch.Tensor  # int64 [V]
    max_scores: torch.Tensor  # float32 [V], 0 for an empty list
    min_weight: float = math.inf
    n_docs: int = 0
    n_empty_docs: int = 0

    @classmethod
    def empty(cls, n_terms: int, device: torch.device) -> ChunkStatistics:
        """Statistics of no documents."""
        zeros = torch.zeros(n_terms, device=device)
        return cls(torch.zeros(n_terms, dtype=torch.int64, device=device), zeros)

    @property
    def max_weight(self) -> float:
        """The largest weight (0 for no postings)."""
        return float(self.max_scores.max()) if self.max_scores.numel() else 0.0

    @property
    def n_postings(self) -> int:
        """Postings so far."""
        return int(self.lengths.sum())

    def add(self, csr: CSR) -> None:
        """Count one chunk's documents."""
        indptr, terms, weights = csr
        dev = self.lengths.device
        t = terms.to(dev, torch.int64)
        w = weights.to(dev, torch.float32)
        self.lengths += torch.bincount(t, minlength=self.lengths.numel())
        self.max_scores.scatter_reduce_(0, t, w, reduce="amax")
        if w.numel():
            self.min_weight = min(self.min_weight, float(w.min()))
        self.n_docs += indptr.numel() - 1
        self.n_empty_docs += int((torch.diff(indptr) == 0).sum())


def chunk_lists(csr: CSR, n_terms: int, quantization: Quantization | None, device: torch.device) -> PostingLists:
    """The padded lists of one chunk's documents (numbered from 0), on ``device``."""
    indptr, terms, weights = csr
    arrays = build_inverted_index((indptr, terms, weights, n_terms), device=device)
    return PostingLists(arrays, ids=None, n_docs=indptr.numel() - 1, vocab=Vocabulary.integer(n_terms),
                        quantization=quantization)  # fmt: skip


def piece_sizes(csr: CSR, n_terms: int, tile_bits: int, dense_min: float | None) -> tuple[int, int]:
    """``(sparse postings, dense rows)`` of one chunk's piece, as :func:`~.tiled.build_tiled`
    lays it out: without building it."""
    indptr, terms, _ = csr
    n = indptr.numel() - 1
    if n == 0:
        return 0, 0
    dev = terms.device
    doc = torch.repeat_interleave(torch.arange(n, device=dev), torch.diff(indptr).to(dev))
    n_tiles = (n + (1 << tile_bits) - 1) >> tile_bits
    counts = torch.bincount((doc >> tile_bits) * n_terms + terms.to(torch.int64), minlength=n_tiles * n_terms)
    del doc
    if dense_min is None:
        return int(counts.sum()), 0
    dense = counts >= max(1, int(dense_min * (1 << tile_bits)))  # build_tiled's rule
    return int(counts[~dense].sum()), int(dense.sum())


def empty_tiled(
    n_docs: int, n_terms: int, tile_bits: int, n_sparse: int, n_dense: int, wdtype: torch.dtype,
    device: torch.device, step: float = 1.0, weight_bits: int | None = None, exp_base: int | None = None,
) -> TiledIndex:  # fmt: skip
    """A layout's arrays, allocated for :func:`append_piece` to fill: ``seg``, ``tile_start``,
    ``dense_start`` and ``dense`` zeros (absent documents weigh 0), ``dense_id`` -1 (sparse),
    the postings uninitialised. ``exp_base``: sparse postings packed in 5 bytes (float32
    weights whose exponents :func:`~.packing.exponent_base` accepted)."""
    n_tiles = max(1, (n_docs + (1 << tile_bits) - 1) >> tile_bits)  # build_tiled's count
    packed = exp_base is not None
    return TiledIndex(
        tile_bits, n_docs, n_terms,
        seg=torch.zeros(n_tiles * (n_terms + 1), dtype=torch.int32, device=device),
        offs=sparse_array(n_sparse, torch.int32 if packed else torch.int16, device),
        wts=sparse_array(n_sparse, torch.uint8 if packed else wdtype, device),
        dense_id=torch.full((n_tiles * n_terms,), -1, dtype=torch.int16, device=device),
        dense=torch.zeros((n_dense, 1 << tile_bits), dtype=wdtype, device=device),
        tile_start=torch.zeros(n_tiles + 1, dtype=torch.int64, device=device),
        dense_start=torch.zeros(n_tiles + 1, dtype=torch.int32, device=device),
        step=step, weight_bits=weight_bits, exp_base=exp_base,
    )  # fmt: skip


def append_piece(layout: TiledIndex, piece: TiledIndex, tile0: int, at: tuple[int, int]) -> tuple[int, int]:
    """Write ``piece`` (the layout of the documents of tiles ``tile0 ..``, numbered from the
    tile's first, built unpacked) into ``layout``: its tiles' postings after the ``at = (sparse
    postings, dense rows)`` already there; returns the new ``at``. ``seg`` and ``dense_id`` are
    relative to their tile and copy as they are; ``tile_start`` and ``dense_start`` are shifted
    by ``at``; the sparse postings are packed with the layout's ``exp_base`` where it has one
    (every piece then shares one base, decided before the first)."""
    pos0, row0 = at
    v = layout.n_terms
    if piece.n_terms != v or piece.tile_bits != layout.tile_bits or piece.dense.dtype != layout.dense.dtype:
        raise ValueError("a piece must have the layout's vocabulary, tile size and weight type")
    if piece.packed:
        raise ValueError("a piece is appended unpacked (the layout packs it with its own exp_base)")
    nt = piece.n_tiles
    if tile0 + nt > layout.n_tiles:
        raise ValueError(f"a piece of {nt} tiles from tile {tile0} runs past the layout's")
    n_sparse, n_dense = piece.n_sparse, piece.n_dense
    if pos0 + n_sparse > layout.n_sparse or row0 + n_dense > layout.n_dense:
        raise ValueError(f"no room for the piece from tile {tile0}: more postings or dense rows than allocated")
    layout.seg[tile0 * (v + 1) : (tile0 + nt) * (v + 1)] = piece.seg
    layout.dense_id[tile0 * v : (tile0 + nt) * v] = piece.dense_id
    layout.tile_start[tile0 : tile0 + nt + 1] = piece.tile_start + pos0  # int64: past 2**31 exact
    layout.dense_start[tile0 : tile0 + nt + 1] = piece.dense_start + row0
    end = pos0 + n_sparse
    if layout.packed:
        every = slice(None)  # the whole piece: views, not a gather through an index array
        offs, low = packing.pack(piece.offsets_at(every), piece.weights_at(every), layout.exp_base, layout.tile_bits)
        layout.offs[pos0:end], layout.wts[pos0:end] = offs, low
    else:
        layout.offs[pos0:end], layout.wts[pos0:end] = piece.offs, piece.wts
    layout.dense[row0 : row0 + n_dense] = piece.dense
    return end, row0 + n_dense


def build_tiled_chunks(
    chunks: Callable[[], Iterable[CSR]],
    n_docs: int,
    n_terms: int,
    *,
    tile_bits: int,
    dense_min: float | None,
    quantization: Quantization | None = None,
    fixed: bool = False,
    pack: bool = True,
    device: torch.device | str,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[TiledIndex, ChunkStatistics]:
    """The tiled layout of the documents that ``chunks()`` yields (a fresh iterator each call;
    called twice), equal field by field to :func:`~.tiled.build_tiled` of the whole
    collection with the same arguments and ``list_positions=False``; and the statistics.

    Each chunk but the last holds a multiple of ``2**tile_bits`` documents. ``quantization``:
    store 8-bit levels with this step (each chunk is quantized with it; weights rounding to
    level 0 are dropped, as in a quantized build). ``fixed``: record the fixed-point exponent
    of the largest weight (float32 weights only). ``pack``: float32 sparse postings in 5 bytes
    where the whole collection's weights allow it (as :func:`~.tiled.build_tiled`).
    ``progress(pass, chunk, documents done)`` is called after each chunk of each pass
    (``"count"``, then ``"build"``).
    """
    dev = torch.device(device)
    stats = ChunkStatistics.empty(n_terms, dev)
    n_sparse = n_dense = 0

    def prepared() -> Iterable[tuple[int, CSR]]:
        doc0 = 0
        for i, csr in enumerate(chunks()):
            n = csr[0].numel() - 1
            if doc0 & ((1 << tile_bits) - 1):
                raise ValueError(f"chunk {i} starts at document {doc0}, inside a tile of {1 << tile_bits}")
            if quantization is not None:
                csr, _ = quantize_csr(*csr, quantization.bits, quantization.step)
            yield doc0, csr
            doc0 += n
        if doc0 != n_docs:
            raise ValueError(f"the chunks hold {doc0} documents, not {n_docs}")

    span = exponent_range(torch.zeros(0, device=dev))
    for i, (doc0, csr) in enumerate(prepared()):
        stats.add(csr)
        s, d = piece_sizes(csr, n_terms, tile_bits, dense_min)
        n_sparse, n_dense = n_sparse + s, n_dense + d
        if pack and quantization is None:
            span = merge_range(span, exponent_range(csr[2].to(dev)))
        if progress is not None:
            progress("count", i, doc0 + csr[0].numel() - 1)
    wdtype, step = (torch.uint8, quantization.step) if quantization is not None else (torch.float32, 1.0)
    weight_bits = fixed_weight_bits(stats.max_weight) if fixed and quantization is None else None
    exp_base = None
    if pack and quantization is None:  # build_tiled's choice, over the whole collection
        exp_base = exponent_base(int(span[0]), int(span[1]), tile_bits, weight_bits)
    layout = empty_tiled(n_docs, n_terms, tile_bits, n_sparse, n_dense, wdtype, dev, step, weight_bits, exp_base)
    at = (0, 0)
    for i, (doc0, csr) in enumerate(prepared()):
        n = csr[0].numel() - 1
        if n:
            lists = chunk_lists(csr, n_terms, quantization, dev)
            del csr
            piece = build_tiled(lists, tile_bits, dense_min=dense_min, list_positions=False, device=dev, pack=False)
            del lists
            at = append_piece(layout, piece, doc0 >> tile_bits, at)
            del piece
        if progress is not None:
            progress("build", i, doc0 + n)
    if at != (n_sparse, n_dense):
        raise ValueError(
            f"the chunks changed between the passes: {at} (sparse postings, dense rows) built, "
            f"{(n_sparse, n_dense)} counted"
        )
    return layout, stats
