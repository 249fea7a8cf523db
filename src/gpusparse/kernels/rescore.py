"""Canonical rescoring on the GPU: two launchers of ``cuda/rescore.cu``.

* :func:`exact_scores_cuda`: canonical scores of (query, document) pairs, one warp per pair.
  The warp's lanes find the document in the posting lists of the query's terms by binary
  search (one term each), and lane 0 adds ``w_q · w_d`` in float64 — exactly the summation
  order of :func:`gpusparse.exact.exact_scores`'s PyTorch path, so both give the same bits —
  then rounds once to float32. One launch replaces the PyTorch path's few hundred small ones.
* :func:`candidate_keys_cuda`: the tiled engine's candidates turned into ranking keys in one
  launch, rescoring the uncertain ones from the index's forward copy, by binary searches
  narrowed to a tile's share of each list, or from the tiled layout alone (an index whose
  lists are not on the device); its PyTorch reference is
  :func:`gpusparse.engines.tiled.ranking.rank_candidates`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..layout.packing import kernel_bias
from .cupy_launch import available, check_tensors, device_index, launch, load_kernel, pointer

if TYPE_CHECKING:
    from ..layout.tiled import TiledIndex

__all__ = ["SOURCE", "available", "candidate_keys_cuda", "exact_scores_cuda"]

SOURCE = "rescore.cu"  # in kernels/cuda/

THREADS = 256
# Rescoring by the forward copy finds a document's terms in a per-row table in shared memory
# (one byte per vocabulary term: the term's column in the query + 1) while it fits the
# default 48 KiB and a row has fewer than 256 terms; else by binary search over the row.
TABLE_MAX_TERMS = 48 * 1024


def _index_arrays(
    doc_ids: torch.Tensor,
    scores: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """The index and query arrays both kernels read first, with their dtypes (for
    ``check_tensors``; their pointers lead the launch arguments in this order)."""
    return {
        "doc_ids": (doc_ids, torch.int32),
        "scores": (scores, torch.float32),
        "offsets": (offsets, torch.int64),
        "lengths": (lengths, torch.int32),
        "q_terms": (q_terms, torch.int64),
        "q_weights": (q_weights, torch.float32),
    }


def exact_scores_cuda(
    doc_ids: torch.Tensor,
    scores: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    rows: torch.Tensor,
    docs: torch.Tensor,
) -> torch.Tensor:
    """float32 ``[M]`` canonical scores of pairs (``rows[i]``, ``docs[i]``); see the module docstring.

    Index arrays as in :class:`gpusparse.Index`; ``q_terms`` int64 and ``q_weights`` float32
    ``[B, T]``; ``rows``/``docs`` int64 ``[M]``; all contiguous on one CUDA device. A pair
    whose document is ``-1`` is skipped (score 0), so callers can pass fixed-shape slots.
    """
    dev = doc_ids.device
    index = _index_arrays(doc_ids, scores, offsets, lengths, q_terms, q_weights)
    check_tensors({**index, "rows": (rows, torch.int64), "docs": (docs, torch.int64)}, dev)
    m = docs.numel()
    out = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0 or doc_ids.numel() == 0:
        return out.zero_()
    kernel = load_kernel(SOURCE, "exact_scores_kernel", device=device_index(dev))
    args = [pointer(x) for x, _ in index.values()]
    tail = [pointer(rows), pointer(docs), np.int64(m), pointer(out)]
    blocks = (m * 32 + THREADS - 1) // THREADS  # a warp per pair
    launch(kernel, (blocks,), (THREADS,), (*args, np.int32(q_terms.shape[1]), *tail), device=dev)
    return out


def candidate_keys_cuda(
    doc_ids: torch.Tensor | None,
    scores: torch.Tensor | None,
    offsets: torch.Tensor | None,
    lengths: torch.Tensor | None,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    cand_doc: torch.Tensor,
    cand_val: torch.Tensor,
    q_delta: torch.Tensor,
    q_scale: torch.Tensor,
    *,
    width: int | None = None,
    count: torch.Tensor | None = None,
    list_pos: torch.Tensor | None = None,
    tile_bits: int = 0,
    floor: torch.Tensor | None = None,
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tiled: TiledIndex | None = None,
    lanes: bool = False,
) -> torch.Tensor:
    """int64 ranking keys ``[B, width]`` of the tiled engine's candidates (see ``cuda/rescore.cu``).

    Index arrays as in :class:`gpusparse.Index`; ``q_terms`` int64 and ``q_weights`` float32
    ``[B, T]``; ``cand_doc`` int32 (-1: absent) and ``cand_val`` int64 ``[B, C]``, of which the
    first ``width`` (default ``C``) slots are read, and only the first ``count[b]`` of row
    ``b`` if ``count`` (int32 ``[B]``) is given; ``q_delta`` int64 and ``q_scale`` float64
    ``[B]``; ``list_pos`` (optional) int32 ``[n_tiles · V]`` real postings of each term before
    each tile of ``2**tile_bits`` documents; ``floor`` (optional) float32 ``[B]``: candidates
    whose score is surely below it get key 0 unrescored; ``forward`` (optional): the index's
    :func:`~gpusparse.kernels.forward_index`, which rescoring then reads instead of searching
    the inverted lists (same bits, far fewer memory sectors); ``tiled`` (optional, without
    ``forward`` or ``list_pos``): the tiled layout, which rescoring then reads
    (``canonical_tiled``: its float32 weights, packed or not, or 8-bit levels), and the four index arrays may
    be ``None``; ``lanes``: a lane a slot, for margins of 0 (exact integer products, where nearly no
    key needs rescoring; with a margin most do, and a warp a slot spreads them over more warps).
    All contiguous on one CUDA device.
    """
    dev = cand_doc.device
    b, ld = cand_doc.shape
    w = ld if width is None else width
    t = q_terms.shape[1]
    lists = (doc_ids, scores, offsets, lengths)
    if tiled is not None:
        if forward is not None or list_pos is not None:
            raise ValueError("rescoring reads one source: give tiled without forward and list_pos")
        v, tile_bits = tiled.n_terms, tiled.tile_bits
    elif any(x is None for x in lists):
        raise ValueError("the index arrays are needed unless rescoring reads the tiled layout")
    else:
        v = offsets.numel()  # type: ignore[union-attr]
    n_tiles = 0 if list_pos is None else list_pos.numel() // max(v, 1)
    index = {
        name: entry
        for name, entry in _index_arrays(doc_ids, scores, offsets, lengths, q_terms, q_weights).items()  # type: ignore[arg-type]
        if entry[0] is not None
    }
    expected = {
        **index,
        "cand_doc": (cand_doc, torch.int32),
        "cand_val": (cand_val, torch.int64),
        "q_delta": (q_delta, torch.int64),
        "q_scale": (q_scale, torch.float64),
    }
    if count is not None:
        expected["count"] = (count, torch.int32)
    if list_pos is not None:
        expected["list_pos"] = (list_pos, torch.int32)
    if floor is not None:
        expected["floor"] = (floor, torch.float32)
    if forward is not None:
        dtypes = {"indptr": torch.int64, "terms": torch.int32, "weights": torch.float32}
        if len(forward) != len(dtypes):
            raise ValueError("forward must be the index's (indptr, terms, weights)")
        expected |= {f"forward {name}": (x, dtypes[name]) for name, x in zip(dtypes, forward, strict=True)}
        if forward[1].shape != forward[2].shape or forward[0].numel() < 1:
            raise ValueError("forward must be the index's (indptr, terms, weights)")
    t_args: list = [np.uint64(0)] * 9 + [np.float32(1.0), np.uint64(0), np.uint32(0), np.uint64(0)]
    if tiled is not None:
        wdtype = tiled.dense.dtype
        if wdtype not in (torch.float32, torch.uint8):
            raise ValueError("the layout's rescoring weights must be float32 or uint8 levels")
        packed = tiled.packed
        expected |= {
            "tiled seg": (tiled.seg, torch.int32),
            "tiled tile_start": (tiled.tile_start, torch.int64),
            "tiled offs": (tiled.offs, torch.int32 if packed else torch.int16),
            "tiled dense_id": (tiled.dense_id, torch.int16),
            "tiled dense_start": (tiled.dense_start, torch.int32),
            "tiled weights": (tiled.wts, torch.uint8 if packed else wdtype),
            "tiled dense": (tiled.dense, wdtype),
        }
        if tiled.dense_id.numel() != tiled.n_tiles * v or tiled.seg.numel() != tiled.n_tiles * (v + 1):
            raise ValueError("the tiled layout's seg and dense_id must hold one entry per (tile, term)")
        sparse = None if packed else tiled.wts
        fl, lv = (
            ((sparse, tiled.dense), (None, None)) if wdtype == torch.float32 else ((None, None), (sparse, tiled.dense))
        )
        t_args = [pointer(x) for x in (tiled.seg, tiled.tile_start, tiled.offs, tiled.dense_id, tiled.dense_start)]
        t_args += [pointer(x) if x is not None else np.uint64(0) for x in (*fl, *lv)]
        t_args.append(np.float32(tiled.step))
        t_args += (
            [pointer(tiled.wts), np.uint32(kernel_bias(tiled.exp_base, None))]
            if packed
            else [np.uint64(0), np.uint32(0)]
        )
        if tiled.pos_of is not None:  # candidates are documents: rescoring finds their positions
            expected["tiled pos_of"] = (tiled.pos_of, torch.int32)
        t_args.append(pointer(tiled.pos_of) if tiled.pos_of is not None else np.uint64(0))
    check_tensors(expected, dev)
    if cand_val.shape != cand_doc.shape or not 0 <= w <= ld:
        raise ValueError("cand_doc and cand_val must have one shape, of at least width columns")
    if list_pos is not None and list_pos.numel() != n_tiles * v:
        raise ValueError("list_pos must hold one entry per (tile, term)")
    if floor is not None and floor.numel() != b:
        raise ValueError("floor must hold one value per row")
    keys = torch.empty((b, w), dtype=torch.int64, device=dev)
    if b * w == 0:
        return keys
    kernel = load_kernel(SOURCE, "candidate_keys", device=device_index(dev))
    null = np.uint64(0)
    index_args = [pointer(x) if x is not None else null for x in (*lists, q_terms, q_weights)]
    tiles = [pointer(list_pos) if list_pos is not None else null, np.int32(tile_bits), np.int32(v), np.int32(n_tiles)]
    cands = [pointer(cand_doc), pointer(cand_val), np.int64(ld), pointer(count) if count is not None else null]
    rest = [np.int64(w), pointer(q_delta), pointer(q_scale), np.int64(b), pointer(floor) if floor is not None else null]
    fwd = [pointer(x) for x in forward] if forward is not None else [null] * 3
    table = forward is not None and v <= TABLE_MAX_TERMS and t < 256
    shared = -(-v // 16) * 16 if table else 0
    # Blocks per row: about one warp per 16 slots of the width (a row holds ~k candidates
    # of its 2k + 1024 slots; with ``lanes``, per 32: one pass of its lanes), at most 16; rows
    # beyond the grid's 65,535 loop.
    per_warp = 32 if lanes else 16
    grid = (max(1, min(16, -(-w // (per_warp * (THREADS // 32))))), min(b, 65535))
    args = (*index_args, np.int32(t), *tiles, *cands, *rest, *fwd, np.int32(table), np.int32(lanes), *t_args,
            pointer(keys))  # fmt: skip
    launch(kernel, grid, (THREADS,), args, device=dev, shared_mem=shared)
    return keys
