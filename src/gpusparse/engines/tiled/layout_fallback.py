"""The exact search of a few rows from the tiled layout alone, for an index without lists
(:class:`~gpusparse.layout.layout_only.LayoutOnly`): the rows the tiled engine cannot certify
(:func:`~.fixed_point.out_of_range`) are searched here instead of on the padded lists.

Per row, a float64 accumulator over all documents receives the query's terms one after the
other in ascending term order (a term adds to each of its documents once, so the order of
the additions inside a term does not matter): the canonical sum of the search contract
(:mod:`gpusparse.exact`), then rounded once to float32 and ranked with the tie-break. A
term's postings are its dense rows and its sparse (tile, term) segments in every tile.
Memory: 8 bytes a document plus ``max_postings`` positions; time: one pass over the row's
terms' postings. Meant for the rare rows that need it, not for whole batches.
"""

from __future__ import annotations

import torch

from ...exact import expand_ranges, pad_results
from ...layout.tiled import TiledIndex
from ...queries import QueryBatch
from ...topk import topk_by_key


def layout_reference_search(
    layout: TiledIndex, batch: QueryBatch, k: int, *, max_postings: int = 1 << 24, tiles_per_step: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` ``(scores float32, ids int64)`` ``[B, k]`` of every row of ``batch``,
    read from ``layout`` (see the module docstring), on the layout's device."""
    dev = layout.seg.device
    terms, weights, lengths = batch.host_arrays()
    b, n = len(lengths), layout.n_docs
    scores = torch.zeros((b, k), dtype=torch.float32, device=dev)
    ids = torch.full((b, k), -1, dtype=torch.int64, device=dev)
    if n == 0 or k == 0:
        return scores, ids
    bits, v, width = layout.tile_bits, layout.n_terms, 1 << layout.tile_bits
    tiles = torch.arange(layout.n_tiles, dtype=torch.int64, device=dev)
    in_tile = torch.arange(width, dtype=torch.int64, device=dev)
    doc_ids = torch.arange(n, dtype=torch.int64, device=dev)[None]

    def weight(w: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.uint8:  # level · step: exact in float32
            return (w.to(torch.float32) * layout.step).to(torch.float64)
        return w.to(torch.float64)

    for r in range(b):
        acc = torch.zeros(n, dtype=torch.float64, device=dev)
        for j in range(int(lengths[r])):  # ascending term order: the canonical sum
            wq = float(weights[r, j])  # float32 → float64, exact; products are exact in float64
            key = tiles * v + int(terms[r, j])
            rows = layout.dense_rows(key)
            dense_tiles = (rows >= 0).nonzero().squeeze(1)
            for a in range(0, dense_tiles.numel(), tiles_per_step):
                dt = dense_tiles[a : a + tiles_per_step]
                docs = ((dt << bits)[:, None] + in_tile).flatten()
                real = docs < n  # the last tile may be partial (its row is 0 past the end)
                add = (weight(layout.dense[rows[dt]]).flatten() * wq)[real]
                acc.index_add_(0, docs[real], add)
            for pair, pos in expand_ranges(*layout.segments(key), max_postings):
                acc.index_add_(0, (tiles[pair] << bits) + layout.offsets_at(pos), weight(layout.weights_at(pos)) * wq)
        if layout.pos_of is not None:  # sums by position: by document, for the tie-break
            acc = acc[layout.pos_of.to(torch.int64)]
        best = topk_by_key(acc.to(torch.float32)[None], doc_ids, k)
        scores[r], ids[r] = (x[0] for x in pad_results(best, k, 1, dev))
    return scores, ids
