"""The tiled CUDA kernel's contract in PyTorch (:func:`torch_tiled_candidates`): the tiled
engine on a CPU, and the reference its GPU kernel is tested against."""

from __future__ import annotations

import torch

from ...exact import expand_ranges
from ...kernels.tile_candidates import ACC_TOP
from ...layout.tiled import TiledIndex
from .fixed_point import emission_threshold


def torch_tiled_candidates(
    layout: TiledIndex,
    q_terms: torch.Tensor,
    q_weights: torch.Tensor,
    q_scale: torch.Tensor,
    q_delta: torch.Tensor,
    *,
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
    """The CUDA kernel's contract (:func:`gpusparse.kernels.tile_candidates.tiled_candidates`) in PyTorch.

    Tile after tile, all queries at once: the same fixed-point sums, ``tau`` the tile's exact
    k-th value (the kernel's radix passes give a value at or below it; any value that k
    documents of the tile reach is a valid bound), the same emission rule. Candidates past a
    query's capacity are counted but not stored, as on the GPU. The sums are exact int64
    here, which every ``acc`` mode also gives within its range (checked); ``int_weights``
    changes nothing here (the products are then integers anyway). The layout's
    ``weight_bits``: fixed-point products ``(round(w_q · q_scale) · round(w_d · 2**weight_bits))
    >> q_shift``, as on the GPU. The sparse postings are read through the layout's accessors
    (packed or not: the same weights).
    """
    dev = layout.seg.device
    n_docs, n_terms, tile_bits, weight_bits = layout.n_docs, layout.n_terms, layout.tile_bits, layout.weight_bits
    b, cap, tile = q_terms.shape[0], cand_doc.shape[1], 1 << tile_bits
    rows, cols = (q_terms >= 0).nonzero(as_tuple=True)
    terms = q_terms[rows, cols].to(torch.int64)
    wq = q_weights[rows, cols].to(torch.float64) * q_scale[rows]
    fixed = weight_bits is not None
    if fixed:
        wq_int = torch.round(wq).to(torch.int64)
        sh = q_shift.to(torch.int64)[rows]

    def products(p: torch.Tensor | int, pair_weights: torch.Tensor) -> torch.Tensor:
        if fixed:  # < 2**31 · 2**30: exact in int64
            d = pair_weights.to(torch.int64)  # int32: stored as fixed point
            if pair_weights.dtype != torch.int32:
                d = torch.round(pair_weights.to(torch.float64) * 2.0**weight_bits).to(torch.int64)
            return (wq_int[p] * d) >> sh[p]
        return torch.round(wq[p] * pair_weights.to(torch.float64)).to(torch.int64)

    for t in range(tiles[0], tiles[0] + tiles[1]):
        base = t * tile
        width = min(tile, n_docs - base)
        sums = torch.zeros(b * width, dtype=torch.int64, device=dev)
        did = layout.dense_rows(t * n_terms + terms)
        for p in (did >= 0).nonzero().flatten().tolist():
            col = products(p, layout.dense[did[p], :width])
            sums[rows[p] * width : (rows[p] + 1) * width] += col
        lo, hi = layout.segments(t * n_terms + terms)
        for pair, pos in expand_ranges(lo, hi, 1 << 22):
            off = layout.offsets_at(pos)
            contrib = products(pair, layout.weights_at(pos))
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
        pos = c[ok] + base
        # a layout in an order of its own: candidates leave as documents, as the kernel's do
        cand_doc[r[ok], slot[ok]] = (pos if layout.doc_of is None else layout.doc_of[pos]).to(torch.int32)
        cand_val[r[ok], slot[ok]] = sums[r[ok], c[ok]]
        cand_count += per_row.to(torch.int32)
