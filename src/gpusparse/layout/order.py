"""A document order that groups documents with similar terms, for the tiled layout.

The tiled engine pays per (query, tile) for each query term's postings in the tile: a dense
row when the term covers much of the tile, else one shared-memory atomic a posting. Documents
that share their terms, placed in the same tiles, make a term's postings fewer tiles' worth
of rows, denser: fewer rows and fewer sparse postings per query, for the same scores.

:func:`cluster_order` groups documents by spherical k-means over their weight vectors (cosine
similarity to the centroids, a few Lloyd rounds), then orders them by cluster, keeping the
collection's order inside a cluster. It uses only the vectors and a seed, so the same
collection gets the same order on the same device.
"""

from __future__ import annotations

import warnings

import torch

CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Tiles at the start of the order that sample every cluster: the engine's largest first wave
# (gpusparse.engines.tiled.waves.wave_plan) is 32 tiles.
SAMPLE_TILES = 32


def _row_chunks(indptr: torch.Tensor, postings: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of at most ``postings`` postings each (at least one row)."""
    ptr = indptr.cpu()
    n = len(ptr) - 1
    out, a = [], 0
    while a < n:
        b = int(torch.searchsorted(ptr, ptr[a] + postings, right=True)) - 1
        b = min(n, max(b, a + 1))
        out.append((a, b))
        a = b
    return out


def _rows_of(indptr: torch.Tensor, a: int, b: int, postings: int) -> torch.Tensor:
    """The row of each posting of rows ``[a, b)``."""
    lengths = indptr[a + 1 : b + 1] - indptr[a:b]
    return torch.repeat_interleave(torch.arange(a, b, device=indptr.device), lengths, output_size=postings)


def _assign(csr: CSR, inv_norm: torch.Tensor, centroids: torch.Tensor, chunks) -> torch.Tensor:
    """Each row's nearest centroid by cosine (rows scaled by ``inv_norm``): int64 ``[n]``."""
    indptr, terms, weights = csr
    labels = torch.empty(len(indptr) - 1, dtype=torch.int64, device=indptr.device)
    for a, b in chunks:
        lo, hi = int(indptr[a]), int(indptr[b])
        x = weights[lo:hi].to(torch.float32) * inv_norm[_rows_of(indptr, a, b, hi - lo)]
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            m = torch.sparse_csr_tensor(
                indptr[a : b + 1] - lo,
                terms[lo:hi].to(torch.int64),
                x,
                (b - a, centroids.shape[0]),
                check_invariants=False,
            )
        labels[a:b] = (m @ centroids).argmax(1)
    return labels


def cluster_order(
    csr: CSR,
    n_terms: int,
    *,
    clusters: int = 16,
    rounds: int = 3,
    seed: int = 0,
    tile_bits: int = 13,
    chunk_postings: int = 1 << 22,
) -> torch.Tensor:
    """``perm`` (int64, on the CSR's device): ``perm[i]`` is the document placed at position ``i``.

    Documents are grouped by spherical k-means with ``clusters`` centroids (seeded from
    ``clusters`` documents drawn with ``seed``) and ``rounds`` Lloyd rounds, then ordered by
    cluster; inside a cluster they keep their order, and tiles of ``2**tile_bits`` documents
    are then interleaved across clusters (see :func:`_tile_order`). Temporaries are bounded by
    ``chunk_postings`` postings (a ``[rows, clusters]`` float32 block per chunk, plus the
    ``[n_terms, clusters]`` centroids).
    """
    indptr, terms, weights = csr
    n = len(indptr) - 1
    dev = indptr.device
    if n <= 1 or clusters <= 1:
        return torch.arange(n, dtype=torch.int64, device=dev)
    clusters = min(clusters, n)
    chunks = _row_chunks(indptr, chunk_postings)
    sq = torch.zeros(n, dtype=torch.float64, device=dev)
    for a, b in chunks:
        lo, hi = int(indptr[a]), int(indptr[b])
        sq.index_add_(0, _rows_of(indptr, a, b, hi - lo), weights[lo:hi].to(torch.float64) ** 2)
    inv_norm = torch.where(sq > 0, sq.rsqrt(), torch.zeros_like(sq)).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(n, generator=gen)[:clusters].to(dev)
    centroids = torch.zeros((n_terms, clusters), dtype=torch.float32, device=dev)
    for c, d in enumerate(seeds.tolist()):
        lo, hi = int(indptr[d]), int(indptr[d + 1])
        centroids[terms[lo:hi].to(torch.int64), c] = weights[lo:hi].to(torch.float32) * inv_norm[d]
    labels = _assign(csr, inv_norm, centroids, chunks)
    for _ in range(rounds):
        sums = torch.zeros(n_terms * clusters, dtype=torch.float64, device=dev)
        for a, b in chunks:
            lo, hi = int(indptr[a]), int(indptr[b])
            rows = _rows_of(indptr, a, b, hi - lo)
            key = terms[lo:hi].to(torch.int64) * clusters + labels[rows]
            sums.index_add_(0, key, weights[lo:hi].to(torch.float64) * inv_norm[rows].to(torch.float64))
        sums = sums.view(n_terms, clusters)
        norm = sums.norm(dim=0)
        # A cluster left empty keeps its centroid.
        centroids = torch.where(norm > 0, sums / norm.clamp_min(1e-300), centroids.to(torch.float64)).to(torch.float32)
        labels = _assign(csr, inv_norm, centroids, chunks)
    perm = torch.sort(labels, stable=True).indices
    return _tile_order(perm, labels[perm], tile_bits)


def _tile_order(perm: torch.Tensor, labels: torch.Tensor, tile_bits: int) -> torch.Tensor:
    """The documents of ``perm`` (sorted by cluster ``labels``) placed into tiles for the engine.

    The engine searches tiles in waves, first up to :data:`SAMPLE_TILES` tiles whose
    candidates set the threshold the later waves emit against: tiles of one cluster there
    would set it too low for the other clusters' queries, and the next wave would overflow
    its candidates. So the first tiles hold an even sample of the whole order (every
    cluster in proportion), and the remaining full tiles are interleaved so that each
    cluster's tiles spread evenly over the order (a tile belongs to its first document's
    cluster; the j-th of a cluster's ``m`` tiles sorts at ``(j + 0.5) / m``). A last,
    partial tile stays last (positions stay tile-aligned).
    """
    size = 1 << tile_bits
    n = len(perm)
    full = n // size
    sample = min(SAMPLE_TILES, full // 4)
    if full <= 1:
        return perm
    dev = perm.device
    if sample:
        picked = torch.zeros(n, dtype=torch.bool, device=dev)
        picked[torch.div(torch.arange(sample * size, device=dev) * n, sample * size, rounding_mode="floor")] = True
        head, perm, labels = perm[picked], perm[~picked], labels[~picked]
    else:
        head = perm[:0]
    full -= sample
    first = labels[: full * size : size]  # each full tile's cluster
    counts = torch.bincount(first)
    start = torch.cumsum(counts, 0) - counts  # a cluster's tiles are consecutive: labels are sorted
    rank = torch.arange(full, device=dev) - start[first]
    key = (rank.to(torch.float64) + 0.5) / counts[first].to(torch.float64)
    tiles = torch.sort(key, stable=True).indices
    return torch.cat([head, perm[: full * size].view(full, size)[tiles].reshape(-1), perm[full * size :]])


def permute_csr(csr: CSR, perm: torch.Tensor) -> CSR:
    """The rows of ``csr`` in the order ``perm`` (row ``i`` of the result is row ``perm[i]``)."""
    indptr, terms, weights = csr
    lengths = (indptr[1:] - indptr[:-1])[perm]
    new_ptr = torch.zeros_like(indptr)
    torch.cumsum(lengths, 0, out=new_ptr[1:])
    src = torch.repeat_interleave(indptr[:-1][perm] - new_ptr[:-1], lengths, output_size=len(terms))
    src += torch.arange(len(terms), device=terms.device)
    return new_ptr, terms[src], weights[src]
