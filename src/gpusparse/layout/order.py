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

import math
import warnings

import torch

CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Tiles at the start of the order that sample every cluster: the engine's largest first wave
# (gpusparse.engines.tiled.waves.wave_plan). Every tile of a first wave must be a sample: the
# next wave's candidate capacity assumes its threshold is the k-th of all the first wave's
# documents, as in a random order. With 4 (the smallest first wave) a batch of 32 at
# k = 1000, whose first wave is 9 tiles, overflowed and was searched again (7.6 against 1.5
# ms at 8.8M, bench/NOTES.md). At 8.8M documents 32 tiles are 3 % of the collection.
SAMPLE_TILES = 32
# A layout of at least this many tiles is ordered by cluster under doc_order "auto": at 8.8M
# documents (1,080 tiles) the kernel took 20 % less time (bench/NOTES.md, issue 23, tenth
# session); a small collection's layout is cheap to search in any order.
ORDER_MIN_TILES = 64
# Documents the seeds are drawn from, postings a step of the rounds reads at once, and the
# temporaries (counted from the code: the centroid update's int64 rows, keys, terms and
# labels and float64 products of a chunk; a few float and int64 vectors a document, the seeds'
# [sample, tries] similarities): gpusparse.footprint predicts with these.
SEED_SAMPLE = 1 << 16
CHUNK_POSTINGS = 1 << 23
CHUNK_BYTES = 64
DOC_BYTES = 48


def order_clusters(setting: str, clusters: int, n_docs: int, tile_bits: int, *, forward: bool) -> int:
    """Clusters to order a layout of ``n_docs`` documents by (0: collection order), from
    :attr:`~gpusparse.config.EngineConfig.doc_order` ``setting`` and ``clusters``. ``forward``:
    the layout keeps the forward copy, which the clustering reads; ``"auto"`` orders only such
    a layout (else the clustering would need a temporary copy of the collection)."""
    if setting == "none" or clusters <= 1:
        return 0
    if setting == "auto" and (not forward or (n_docs >> tile_bits) < ORDER_MIN_TILES):
        return 0
    return clusters


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


def _similarities(csr: CSR, inv_norm: torch.Tensor, centroids: torch.Tensor, chunks, reduce) -> torch.Tensor:
    """``reduce`` of each chunk's cosines to the centroids (rows scaled by ``inv_norm``; ``[rows,
    columns]`` float32), concatenated over the rows."""
    indptr, terms, weights = csr
    out = []
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
        out.append(reduce(m @ centroids))
    return torch.cat(out)


def _seed(csr: CSR, inv_norm: torch.Tensor, n_terms: int, clusters: int, chunks, gen) -> torch.Tensor:
    """Greedy k-means++ seeding on the unit sphere: for each next centroid, ``2 + ln(clusters)``
    documents drawn with probability ∝ their squared distance to the nearest chosen one
    (``2 - 2 cos``) and the farthest document, of which the one that lowers the sum of those
    distances most is kept. On four topics of disjoint terms plain random seeds merged two
    topics in about half the draws, k-means++ in about a third, these draws without the
    farthest document in a quarter (measured, 30 collections): documents of a topic are far
    apart too (a cosine near 0.5), so a topic not yet seeded holds little more of the draws'
    weight than one seeded. ``[n_terms, clusters]`` float32."""
    indptr, terms, weights = csr
    n, dev = len(indptr) - 1, indptr.device
    tries = 2 + int(math.log(clusters))

    def vectors(docs: list[int]) -> torch.Tensor:
        out = torch.zeros((n_terms, len(docs)), dtype=torch.float32, device=dev)
        for c, d in enumerate(docs):
            lo, hi = int(indptr[d]), int(indptr[d + 1])
            out[terms[lo:hi].to(torch.int64), c] = weights[lo:hi].to(torch.float32) * inv_norm[d]
        return out

    chosen = [int(torch.randint(n, (1,), generator=gen))]
    best = _similarities(csr, inv_norm, vectors(chosen), chunks, lambda s: s[:, 0])
    while len(chosen) < clusters:
        dist = (2.0 - 2.0 * best.to(torch.float64)).clamp_min(0).cpu()
        if float(dist.sum()) > 0:
            cand = torch.multinomial(dist, tries, replacement=True, generator=gen).tolist()
        else:
            cand = torch.randint(n, (tries,), generator=gen).tolist()
        cand.append(int(dist.argmax()))  # the farthest document too: a group no draw hit
        sims = _similarities(csr, inv_norm, vectors(cand), chunks, lambda s: s)  # [n, tries]
        after = torch.maximum(best[:, None], sims)
        pick = int((2.0 - 2.0 * after.to(torch.float64)).clamp_min(0).sum(0).argmin())
        chosen.append(cand[pick])
        best = after[:, pick].contiguous()
    return vectors(chosen)


def cluster_order(
    csr: CSR,
    n_terms: int,
    *,
    clusters: int = 16,
    rounds: int = 3,
    seed: int = 0,
    tile_bits: int = 13,
    chunk_postings: int = CHUNK_POSTINGS,
) -> torch.Tensor:
    """``perm`` (int64, on the CSR's device): ``perm[i]`` is the document placed at position ``i``.

    Documents are grouped by spherical k-means with ``clusters`` centroids (greedy k-means++
    seeds drawn with ``seed``) and ``rounds`` Lloyd rounds, then ordered by
    cluster; inside a cluster they keep their order, and tiles of ``2**tile_bits`` documents
    are then interleaved across clusters (see :func:`_tile_order`). The seeds are drawn from
    :data:`SEED_SAMPLE` documents. Temporaries: at most :data:`CHUNK_BYTES` bytes a posting of a
    chunk of ``chunk_postings`` (2**23: ~0.5 GB), :data:`DOC_BYTES` a document, and the
    ``[n_terms, clusters]`` centroids.
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
    # seeds from a sample (k-means++ practice): its steps then cost little beside the rounds
    sample = torch.sort(torch.randperm(n, generator=gen)[:SEED_SAMPLE]).values.to(dev)
    sub = permute_csr(csr, sample)
    centroids = _seed(sub, inv_norm[sample], n_terms, clusters, _row_chunks(sub[0], chunk_postings), gen)
    del sub
    labels = _similarities(csr, inv_norm, centroids, chunks, lambda s: s.argmax(1))
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
        labels = _similarities(csr, inv_norm, centroids, chunks, lambda s: s.argmax(1))
    perm = torch.sort(labels, stable=True).indices
    return _tile_order(perm, labels[perm], tile_bits)


def _tile_order(perm: torch.Tensor, labels: torch.Tensor, tile_bits: int) -> torch.Tensor:
    """The documents of ``perm`` (sorted by cluster ``labels``) placed into tiles for the engine.

    The engine searches tiles in waves, first up to :data:`SAMPLE_TILES` tiles whose
    candidates set the threshold the later waves emit against: tiles of a few clusters there
    would set it too low for the other clusters' queries, and the next wave would overflow
    its candidates. So each of the first tiles holds an even sample of the whole order
    (every cluster in proportion), and the remaining full tiles are interleaved so that each
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
        # sample tile j takes every sample-th of the picked documents from the j-th on: each
        # tile of the first wave is an even sample by itself
        head = perm[picked].view(size, sample).T.reshape(-1)
        perm, labels = perm[~picked], labels[~picked]
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
    """The rows ``perm`` of ``csr``, in that order (row ``i`` of the result is row ``perm[i]``;
    a permutation reorders the collection, a subset selects from it)."""
    indptr, terms, weights = csr
    lengths = (indptr[1:] - indptr[:-1])[perm]
    new_ptr = torch.zeros(len(perm) + 1, dtype=indptr.dtype, device=indptr.device)
    torch.cumsum(lengths, 0, out=new_ptr[1:])
    total = int(new_ptr[-1])
    src = torch.repeat_interleave(indptr[:-1][perm] - new_ptr[:-1], lengths, output_size=total)
    src += torch.arange(total, device=terms.device)
    return new_ptr, terms[src], weights[src]
