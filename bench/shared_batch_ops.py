"""One block per document chunk for the whole batch (issue 23, fifth session): the data structures.

8-bit levels only: every score is the exact integer ``Σ q_level · d_level`` (at most 107 terms ×
255 × 255 < 2**32, so uint32 accumulators are exact). The engine's 8-bit ranking is that
integer times the query's and the index's power-of-two steps, so it ranks the same.

* :func:`doc_levels` / :func:`query_levels`: the levels of the repo's own 8-bit quantisation
  (``gpusparse.quantize.quantize_csr`` as ``Index.from_csr(..., quantize=8)`` runs it, and
  ``quantize_queries`` as every search of a quantized index runs it);
* :func:`chunk_layout`: documents in chunks of ``C`` (≤ 256); a chunk's postings sorted by
  (term, doc), each packed in a uint32 ``term << 16 | doc offset << 8 | level`` (held in an
  int32 tensor, same bits), ``chunk_start`` int64 ``[n_chunks + 1]``;
* :func:`batch_terms`: the batch as term → query lists: ``tmap`` int16 ``[V]`` (batch-term
  index or -1), ``qptr`` int32 ``[n_bt + 1]``, ``qlist`` uint16 ``[n_pairs]`` = ``query << 8 |
  query level`` (held in int16, same bits; B ≤ 256), and what the kernels read per posting:
  ``tinfo`` int32 ``[V]`` = ``qptr[bt] << 9 | m`` (``m`` the term's number of queries, ≤ 256;
  0 for a term outside the batch) — one load per posting instead of tmap then qptr;
* :func:`emulate`: the kernels' work in PyTorch (any device): windows of a chunk's postings,
  the batch's postings compacted, the flattened pairs (variant "flat": ``[0, P)`` split over
  threads by a merge-path search of the pair prefix) or a warp per run (variant "warp": lane
  ``l`` takes query ``l % m`` of posting ``l // m``), the accumulators ``[C][stride]`` (query
  fastest, odd row stride), then per-query maxima and the candidates ``acc ≥ theta[q]``;
* :func:`chunk_statistics`: what predicts the kernels' cost (pairs, runs, mean ``m``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpusparse.layout.tiled import dense_segments
from gpusparse.quantize import levels, power_of_two_steps, quantize_csr, quantize_queries

MAX_TERMS = 1 << 16  # a packed posting holds the term in 16 bits
MAX_CHUNK = 256  # and the document's offset in its chunk in 8
MAX_BATCH = 256  # a qlist entry holds the query in 8 bits
BITS = 8


def _as_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` as int32 tensors holding the same 32 bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def doc_levels(
    indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], float]:
    """The documents quantized as ``Index.from_csr(..., quantize=8)`` does (``quantize_csr``):
    ``(indptr, terms, level)`` with zero levels removed (level uint8 in 1..255), and the step.
    The returned CSR's float weights are ``level · step``, what that index stores."""
    (qi, qt, qv), report = quantize_csr(indptr, indices, values, BITS)
    step = report.quantization.step
    lev = torch.empty(qv.numel(), dtype=torch.uint8, device=qv.device)
    for lo in range(0, qv.numel(), 1 << 24):  # levels() works in float64 and int64: bounded pieces
        lev[lo : lo + (1 << 24)] = levels(qv[lo : lo + (1 << 24)], step, BITS).to(torch.uint8)
    return (qi, qt, lev), step


def query_levels(queries) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A :class:`~gpusparse.collection.SparseCollection` of queries as the engine quantizes them
    for an 8-bit index (``quantize_queries``: each query its own power-of-two step): CSR
    ``(indptr, terms, level)`` numpy int64, levels in 1..255 (zero levels dropped)."""
    indptr = queries.indptr.astype(np.int64)
    values = queries.values.astype(np.float64)
    lens = np.diff(indptr)
    row_max = np.zeros(len(queries))
    if values.size:
        nonempty = lens > 0
        row_max[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty])
    steps = power_of_two_steps(row_max, BITS)  # the steps quantize_queries chooses
    quantized = quantize_queries(queries, BITS)
    q_indptr = quantized.indptr.astype(np.int64)
    lev = quantized.values.astype(np.float64) / np.repeat(steps, np.diff(q_indptr))
    if not (np.all(lev == np.round(lev)) and np.all((lev >= 1) & (lev <= 255))):
        raise ValueError("quantize_queries' weights are not level · step with the expected steps")
    return q_indptr, quantized.indices.astype(np.int64), lev.astype(np.int64)


@dataclass(frozen=True)
class ChunkLayout:
    """Postings grouped by chunks of ``chunk`` documents, sorted by (term, doc) in a chunk."""

    post: torch.Tensor  # int32 [nnz]: uint32 bits term << 16 | offset << 8 | level
    chunk_start: torch.Tensor  # int64 [n_chunks + 1]
    n_docs: int
    chunk: int
    n_terms: int

    @property
    def n_chunks(self) -> int:
        return self.chunk_start.numel() - 1

    @property
    def nbytes(self) -> int:
        return self.post.numel() * 4 + self.chunk_start.numel() * 8

    def head(self, n_chunks: int) -> ChunkLayout:
        """The first ``n_chunks`` chunks (views; for statistics on a sample of a large layout)."""
        k = min(n_chunks, self.n_chunks)
        end = int(self.chunk_start[k])
        return ChunkLayout(self.post[:end], self.chunk_start[: k + 1], min(self.n_docs, k * self.chunk), self.chunk,
                           self.n_terms)  # fmt: skip

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Term, offset in the chunk, level of every posting (int64)."""
        p = self.post.to(torch.int64) & 0xFFFFFFFF
        return p >> 16, (p >> 8) & 0xFF, p & 0xFF


def chunk_layout(
    indptr: torch.Tensor,
    terms: torch.Tensor,
    level: torch.Tensor,
    n_terms: int,
    chunk: int = 128,
    group_postings: int = 1 << 24,
) -> ChunkLayout:
    """The chunk layout of CSR document levels (on their device), built a group of whole chunks
    (about ``group_postings`` postings) at a time so the sort's temporaries stay bounded."""
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in 1..{MAX_CHUNK}, not {chunk}")
    if n_terms > MAX_TERMS:
        raise ValueError(f"a packed posting holds terms below {MAX_TERMS}, the vocabulary has {n_terms}")
    if level.numel() and (int(level.min()) < 1 or int(level.max()) > 255):
        raise ValueError("levels must be in 1..255")
    dev = terms.device
    indptr = indptr.to(torch.int64)
    n = indptr.numel() - 1
    n_chunks = -(-n // chunk)
    bounds = indptr[torch.clamp(torch.arange(n_chunks + 1, device=dev) * chunk, max=n)]
    post = torch.empty(terms.numel(), dtype=torch.int32, device=dev)
    bounds_h = bounds.cpu().numpy()
    c0 = 0
    while c0 < n_chunks:
        # the most chunks from c0 whose postings fit the group (at least one)
        c1 = max(c0 + 1, int(np.searchsorted(bounds_h, bounds_h[c0] + group_postings, side="right")) - 1)
        c1 = min(c1, n_chunks)
        lo, hi = int(bounds_h[c0]), int(bounds_h[c1])
        if hi > lo:
            docs = torch.repeat_interleave(
                torch.arange(c0 * chunk, min(c1 * chunk, n), device=dev),
                torch.diff(indptr[c0 * chunk : c1 * chunk + 1]),
            )
            packed = (terms[lo:hi].to(torch.int64) << 16) | ((docs % chunk) << 8) | level[lo:hi].to(torch.int64)
            key = ((docs // chunk - c0) << 32) | packed
            post[lo:hi] = _as_int32_bits(torch.sort(key).values & 0xFFFFFFFF)
        c0 = c1
    return ChunkLayout(post, bounds, n, chunk, n_terms)


def sparse_only(
    indptr: torch.Tensor,
    terms: torch.Tensor,
    level: torch.Tensor,
    n_terms: int,
    tile_bits: int = 13,
    dense_min: float = 0.12,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict]:
    """The CSR without the postings the tiled layout keeps in dense rows: those of a (tile, term)
    with at least ``max(1, int(dense_min · 2**tile_bits))`` postings in the tile's ``2**tile_bits``
    documents (the layout's own rule, :func:`gpusparse.layout.tiled.dense_segments`), i.e. what a
    kernel whose dense part runs on tensor cores would still add one posting at a time.
    ``(indptr, terms, level)`` (same dtypes) and counts."""
    dev = terms.device
    indptr = indptr.to(torch.int64)
    n = indptr.numel() - 1
    tile = 1 << tile_bits
    bounds = indptr[torch.clamp(torch.arange(0, n + tile, tile, device=dev), max=n)].cpu().numpy()
    kept_t, kept_l, per_doc = [], [], []
    dense_rows = 0
    for t in range(len(bounds) - 1):
        lo, hi = int(bounds[t]), int(bounds[t + 1])
        d0, d1 = t * tile, min(n, (t + 1) * tile)
        tt = terms[lo:hi].to(torch.int64)
        dense = dense_segments(torch.bincount(tt, minlength=n_terms), n_terms, tile_bits, dense_min)
        dense_rows += int(dense.sum())
        keep = ~dense[tt]
        docs = torch.repeat_interleave(torch.arange(d1 - d0, device=dev), torch.diff(indptr[d0 : d1 + 1]))
        per_doc.append(torch.zeros(d1 - d0, dtype=torch.int64, device=dev).index_add_(0, docs, keep.to(torch.int64)))
        kept_t.append(terms[lo:hi][keep])
        kept_l.append(level[lo:hi][keep])
    out_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    if per_doc:
        out_ptr[1:] = torch.cumsum(torch.cat(per_doc), 0)
    empty_t, empty_l = terms[:0], level[:0]
    out = (out_ptr, torch.cat(kept_t) if kept_t else empty_t, torch.cat(kept_l) if kept_l else empty_l)
    return out, {"postings": int(indptr[-1]), "sparse_postings": int(out_ptr[-1]), "dense_rows": dense_rows,
                 "tile_bits": tile_bits, "dense_min": dense_min}  # fmt: skip


@dataclass(frozen=True)
class BatchTerms:
    """The batch as term → query lists (see the module docstring for the packing)."""

    tmap: torch.Tensor  # int16 [V]
    qptr: torch.Tensor  # int32 [n_bt + 1]
    qlist: torch.Tensor  # int16 [n_pairs]: uint16 bits query << 8 | level
    tinfo: torch.Tensor  # int32 [V]: qptr[bt] << 9 | m, 0 outside the batch
    n_queries: int

    @property
    def n_pairs(self) -> int:
        return self.qlist.numel()


def batch_terms(q_indptr: np.ndarray, q_terms: np.ndarray, q_level: np.ndarray, n_terms: int, device) -> BatchTerms:
    """:class:`BatchTerms` of a batch of quantized queries (CSR, levels 1..255), moved to ``device``."""
    b = len(q_indptr) - 1
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"a batch holds 1..{MAX_BATCH} queries, not {b}")
    if len(q_level) and (q_level.min() < 1 or q_level.max() > 255):
        raise ValueError("query levels must be in 1..255")
    rows = np.repeat(np.arange(b, dtype=np.int64), np.diff(q_indptr))
    order = np.lexsort((rows, q_terms))  # by term, then query
    t, r, lev = q_terms[order], rows[order], q_level[order]
    bt, first, counts = np.unique(t, return_index=True, return_counts=True)
    if len(t) >= 1 << 15 or len(bt) >= 1 << 15:
        raise ValueError("the batch has too many (query, term) pairs for the 15-bit qlist offsets")
    tmap = np.full(n_terms, -1, dtype=np.int16)
    tmap[bt] = np.arange(len(bt))
    qptr = np.zeros(len(bt) + 1, dtype=np.int32)
    qptr[1:] = np.cumsum(counts)
    qlist = ((r << 8) | lev).astype(np.uint16)
    tinfo = np.zeros(n_terms, dtype=np.int32)
    tinfo[bt] = (first.astype(np.int32) << 9) | counts.astype(np.int32)
    return BatchTerms(
        torch.from_numpy(tmap).to(device),
        torch.from_numpy(qptr).to(device),
        torch.from_numpy(qlist.view(np.int16)).to(device),
        torch.from_numpy(tinfo).to(device),
        b,
    )


def row_stride(b: int) -> int:
    """The accumulators' row stride: the batch size made odd, so the same query of consecutive
    documents falls in different shared-memory banks."""
    return b | 1


def reference_scores(
    d_indptr: torch.Tensor,
    d_terms: torch.Tensor,
    d_level: torch.Tensor,
    bt: BatchTerms,
    n_terms: int,
    queries: list[int] | None = None,
    group_postings: int = 1 << 24,
) -> torch.Tensor:
    """int64 ``[len(queries), N]`` (default: every query): ``Σ q_level · d_level`` by a scatter-add
    over the whole collection from the CSR, independent of the chunk layout and of the packing;
    ``group_postings`` postings at a time."""
    dev = d_terms.device
    rows = list(range(bt.n_queries)) if queries is None else list(queries)
    q = torch.zeros(bt.n_queries, n_terms, dtype=torch.int64, device=dev)
    ql = bt.qlist.to(torch.int64) & 0xFFFF
    tm = bt.tmap.to(torch.int64)
    terms = torch.nonzero(tm >= 0).flatten()
    counts = torch.diff(bt.qptr.to(torch.int64))[tm[terms]]
    term_of_pair = torch.repeat_interleave(terms, counts)  # pairs are stored by batch term, in term order
    q[ql >> 8, term_of_pair] = ql & 0xFF
    q = q[rows]
    indptr = d_indptr.to(torch.int64)
    n = indptr.numel() - 1
    out = torch.zeros(len(rows), n, dtype=torch.int64, device=dev)
    bounds = indptr.cpu().numpy()
    d0 = 0
    while d0 < n:
        d1 = max(d0 + 1, min(n, int(np.searchsorted(bounds, bounds[d0] + group_postings, side="right")) - 1))
        lo, hi = int(bounds[d0]), int(bounds[d1])
        docs = torch.repeat_interleave(torch.arange(d0, d1, device=dev), torch.diff(indptr[d0 : d1 + 1]))
        t = d_terms[lo:hi].to(torch.int64)
        lev = d_level[lo:hi].to(torch.int64)
        for i in range(len(rows)):
            out[i].index_add_(0, docs, q[i, t] * lev)
        d0 = d1
    return out


@dataclass
class Emulated:
    acc: torch.Tensor  # int64 [B, N]: the accumulated sums per (query, document)
    qmax: torch.Tensor  # int64 [B]
    candidates: list[torch.Tensor]  # per query, the documents with acc ≥ theta (ascending); none where theta = 0
    pairs: int


def _window_pairs(post: torch.Tensor, tinfo: torch.Tensor, qlist: torch.Tensor, variant: str):
    """The (offset, query, product) of every pair of one window of packed postings, enumerated
    as the kernel ``variant`` does."""
    p = post.to(torch.int64) & 0xFFFFFFFF
    term = p >> 16
    info = tinfo.to(torch.int64)[term]
    m = info & 0x1FF
    keep = m > 0  # compaction: the window's postings of batch terms
    cp, cinfo, cm = p[keep], info[keep], m[keep]
    if cp.numel() == 0:
        return None
    cpfx = torch.cumsum(cm, 0) - cm  # exclusive pair prefix
    total = int(cm.sum())
    if variant == "flat":
        # [0, P) split evenly over the threads; each finds its first posting by a search of the
        # prefix (merge path), then walks pairs: query + 1, wrap to the next posting. The pair
        # → (posting, query) map of that walk is this search, done for every pair.
        pair = torch.arange(total, device=p.device)
        posting = torch.searchsorted(cpfx, pair, right=True) - 1
        j = pair - cpfx[posting]
    elif variant == "warp":
        # runs: maximal equal-term ranges of compacted postings; a warp per run, lane l of a
        # step takes pair l: query l % m, posting l // m of the run
        ct = cp >> 16
        start = torch.ones_like(ct, dtype=torch.bool)
        start[1:] = ct[1:] != ct[:-1]
        rstart = torch.nonzero(start).flatten()
        rlen = torch.diff(torch.cat([rstart, torch.tensor([cp.numel()], device=p.device)]))
        rm = cm[rstart]
        per_run = rlen * rm
        run = torch.repeat_interleave(torch.arange(rstart.numel(), device=p.device), per_run)
        lane = torch.arange(total, device=p.device) - torch.repeat_interleave(
            torch.cumsum(per_run, 0) - per_run, per_run
        )
        posting = rstart[run] + lane // rm[run]
        j = lane % rm[run]
    else:
        raise ValueError(f"variant must be 'flat' or 'warp', not {variant!r}")
    entry = qlist.to(torch.int64)[(cinfo[posting] >> 9) + j] & 0xFFFF
    return (cp[posting] >> 8) & 0xFF, entry >> 8, (entry & 0xFF) * (cp[posting] & 0xFF), total


def emulate(
    layout: ChunkLayout,
    bt: BatchTerms,
    theta: torch.Tensor | None = None,
    *,
    variant: str = "flat",
    window: int = 2048,
) -> Emulated:
    """The kernels' computation, chunk by chunk and window by window, in PyTorch on the
    layout's device. ``theta`` int64 ``[B]`` (0: no candidates for that query)."""
    b, c, dev = bt.n_queries, layout.chunk, layout.post.device
    stride = row_stride(b)
    acc_all = torch.zeros(b, layout.n_docs, dtype=torch.int64, device=dev)
    starts = layout.chunk_start.cpu().tolist()
    pairs = 0
    for ch in range(layout.n_chunks):
        acc = torch.zeros(c * stride, dtype=torch.int64, device=dev)
        for w0 in range(starts[ch], starts[ch + 1], window):
            got = _window_pairs(layout.post[w0 : min(w0 + window, starts[ch + 1])], bt.tinfo, bt.qlist, variant)
            if got is not None:
                off, q, prod, total = got
                acc.index_add_(0, off * stride + q, prod)
                pairs += total
        docs = min(c, layout.n_docs - ch * c)
        acc_all[:, ch * c : ch * c + docs] = acc.view(c, stride)[:docs, :b].T
    qmax = acc_all.max(1).values if layout.n_docs else torch.zeros(b, dtype=torch.int64, device=dev)
    cands = []
    for q in range(b):
        t = 0 if theta is None else int(theta[q])
        cands.append(torch.nonzero(acc_all[q] >= t).flatten() if t > 0 else torch.empty(0, dtype=torch.int64))
    return Emulated(acc_all, qmax, cands, pairs)


def oracle_theta(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[B]``: each query's exact k-th largest score (its smallest if it has fewer than k
    documents; at least 1, so documents without a match are never candidates)."""
    kk = min(k, scores.shape[1])
    kth = torch.topk(scores, kk, dim=1).values[:, -1]
    return kth.clamp_min(1)


def chunk_statistics(layout: ChunkLayout, bt: BatchTerms, window: int = 4096) -> dict:
    """What predicts the kernels' cost, over every chunk: postings, postings of batch terms,
    (query, posting) pairs, runs (maximal equal-term ranges of batch terms, split at window
    boundaries as the kernels split them), the posting-weighted mean ``m`` (queries per
    posting read), and the share of pairs whose posting has ``m ≥ 32`` (a full warp of queries)."""
    term, _, _ = layout.unpack()
    m = (bt.tinfo.to(torch.int64)[term] & 0x1FF) if term.numel() else term
    pos = torch.arange(term.numel(), device=term.device)
    chunk_of = torch.searchsorted(layout.chunk_start, pos, right=True) - 1
    new_window = (pos - layout.chunk_start[chunk_of]) % window == 0
    start = torch.ones_like(term, dtype=torch.bool)
    start[1:] = term[1:] != term[:-1]
    start |= new_window
    run_start = start & (m > 0)
    n_ch = layout.n_chunks

    def per_chunk(x):
        return torch.zeros(n_ch, dtype=torch.float64, device=term.device).index_add_(0, chunk_of, x.to(torch.float64))

    postings = torch.diff(layout.chunk_start).to(torch.float64)
    in_batch, pairs, runs = per_chunk(m > 0), per_chunk(m), per_chunk(run_start)
    total_pairs = float(pairs.sum())
    # a warp per run takes ceil(r · m / 32) steps of 32 lanes
    run_id = torch.cumsum(run_start.to(torch.int64), 0) - 1
    inb = m > 0
    run_pairs = torch.zeros(int(run_start.sum()), dtype=torch.float64, device=term.device)
    run_pairs.index_add_(0, run_id[inb], m[inb].to(torch.float64))
    warp_steps = float(torch.ceil(run_pairs / 32).sum())
    wide = float(m[m >= 32].sum())
    windows = torch.ceil(postings / window)

    def summary(x):
        x = x.cpu()
        return {"mean": float(x.mean()), "p50": float(x.median()), "max": float(x.max())} if x.numel() else {}

    return {
        "chunk": layout.chunk,
        "n_chunks": n_ch,
        "window": window,
        "postings_per_chunk": summary(postings),
        "batch_postings_per_chunk": summary(in_batch),
        "pairs_per_chunk": summary(pairs),
        "runs_per_chunk": summary(runs),
        "windows_per_chunk": summary(windows),
        "pairs_total": total_pairs,
        "batch_postings_total": float(in_batch.sum()),
        "postings_total": float(postings.sum()),
        "mean_m_posting_weighted": total_pairs / max(1.0, float(in_batch.sum())),
        "share_pairs_m_ge_32": wide / max(1.0, total_pairs),
        "pairs_per_run": total_pairs / max(1.0, float(runs.sum())),
        "warp_steps_per_chunk": warp_steps / max(1, n_ch),
        "warp_lane_efficiency": total_pairs / max(1.0, 32 * warp_steps),
    }
