"""The GPU systems of the benchmark, each a small class: ``prepare(workload)``, ``search(queries, k)``.

Every system takes the same queries (a host :class:`~gpusparse.SparseCollection`) and
returns ``(scores, ids)``: float32 and int64 CPU tensors of shape ``[n_queries, k]``, so
each is timed host to host, queries in and results out, like :meth:`gpusparse.Index.search`.
Baselines return what their pipeline returns (``torch.topk`` breaks ties arbitrarily and
scores are float32 sums in arbitrary order); the runner compares them with the exact
reference.

* ``ours-<kernel>``: :meth:`gpusparse.Index.search` with every kernel of
  :func:`gpusparse.engines.names`, exact by contract;
* ``paper-scatter``: the GPUSparse paper's pipeline as published: a float32 ``[B, N]``
  buffer, its fused Triton scatter-add (:func:`gpusparse.kernels.scatter_add_scores`,
  one program per (query, term), ``BLOCK_PL=128``, ``tl.atomic_add``), then ``torch.topk``;
* ``paper-scatter-chunked``: the same over query chunks and document chunks with a
  compacted top-k merge (each chunk's top-k, then the top-k of those), as the authors
  re-measured it for 8.8M documents;
* ``paper-docpar``: the paper's document-parallel CSR kernel into the same buffer, then
  ``torch.topk``;
* ``spare-iterative``: SPARe's iterative scorer: per query term, ``index_add_`` of its
  posting list (CSC) into the query's score row, then ``torch.topk``;
* ``cusparse-spmm``: ``torch.sparse`` CSR documents ``[N, V]`` × dense query batch
  ``[V, B]`` (cuSPARSE SpMM), then top-k over documents;
* ``cusparse-spgemm``: CSR query batch ``[B, V]`` × CSR ``[V, N]`` (the inverted index as
  a sparse matrix; cuSPARSE SpGEMM), densified, then ``torch.topk``;
* ``dense-matmul`` / ``dense-compiled``: a dense float32 ``[N, V]`` document matrix times
  the dense query batch (and the same under ``torch.compile``), where it fits.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from gpusparse import engines
from gpusparse.collection import SparseCollection
from gpusparse.index import Index
from gpusparse.queries import QueryBatch, query_batch


class SystemUnavailable(Exception):
    """The system cannot run here (missing package, device, or memory): the reason is recorded."""


@dataclass
class Workload:
    """One collection on one device, shared by every system of a run.

    ``forward`` is the document-major CSR ``(indptr int64, terms int32, weights float32)``
    of the same collection (the generator's output), on the index's device.
    """

    index: Index | None  # None for the CPU engines' worker, which needs only ``forward``
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    memory_budget: int = 4 << 30
    dense_max_bytes: int = 16 << 30
    options: dict[str, object] = field(default_factory=dict)
    n_terms_hint: int = 30522

    @property
    def device(self) -> torch.device:
        return self.index.device if self.index is not None else self.forward[1].device

    @property
    def n_docs(self) -> int:
        return self.index.n_docs if self.index is not None else self.forward[0].numel() - 1

    @property
    def n_terms(self) -> int:
        return len(self.index.vocab) if self.index is not None else self.n_terms_hint


class System:
    """A searchable system: build what it needs once, then answer query batches."""

    name = "system"
    family = "baseline"  # ours | paper | baseline | cpu
    needs_cuda = False
    description = ""

    def __init__(self) -> None:
        self.w: Workload | None = None
        self.extra_bytes = 0  # device bytes of structures built by prepare()
        self.prepare_s = 0.0

    def prepare(self, w: Workload) -> None:
        if self.needs_cuda and w.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemUnavailable(f"needs a CUDA device (Triton kernel), not {w.device}")
        self.w = w
        t0 = time.perf_counter()
        self._prepare(w)
        _sync(w.device)
        self.prepare_s = time.perf_counter() - t0

    def _prepare(self, w: Workload) -> None:
        """Build device structures; raise :class:`SystemUnavailable` when impossible."""

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def own_reference(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact top-k of what this system searches, when that differs from the
        collection's float32 vectors (a quantized index); ``None`` otherwise."""
        return None

    def close(self) -> None:
        """Free what :meth:`prepare` built."""
        self.w = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _host(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Results to the host as ``[B, k]`` (padded with score 0 / id -1 when fewer columns)."""
    s, i = scores.to(torch.float32).cpu(), ids.to(torch.int64).cpu()
    if s.shape[1] < k:
        pad = k - s.shape[1]
        s = torch.cat([s, torch.zeros((s.shape[0], pad), dtype=torch.float32)], 1)
        i = torch.cat([i, torch.full((i.shape[0], pad), -1, dtype=torch.int64)], 1)
    return s, i


def _csr(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A sparse CSR tensor, without torch's "beta" and invariant-check warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, val, size=size)


def _dense_queries(batch: QueryBatch, n_rows: int, n_terms: int, *, transposed: bool = False) -> torch.Tensor:
    """The query batch as a dense float32 ``[B, V]`` matrix (``[V, B]`` if transposed)."""
    dev = batch.terms.device
    if transposed:
        q = torch.zeros((n_terms, n_rows), dtype=torch.float32, device=dev)
        q[batch.terms, batch.rows] = batch.weights
    else:
        q = torch.zeros((n_rows, n_terms), dtype=torch.float32, device=dev)
        q[batch.rows, batch.terms] = batch.weights
    return q


# -- ours -----------------------------------------------------------------------------------


class OursKernel(System):
    """:meth:`gpusparse.Index.search` with one kernel: exact top-k, tie-broken, host to host."""

    family = "ours"

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.name = f"ours-{kernel}"
        self.description = f"Index.search(kernel={kernel!r})"

    def _prepare(self, w: Workload) -> None:
        try:
            engines.choose(self.kernel, w.device)
        except (ValueError, ImportError) as e:
            raise SystemUnavailable(str(e)) from e

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        r = w.index.search(queries, k, kernel=self.kernel, memory_budget=w.memory_budget, batch_size=len(queries))
        return r.scores, r.ids

    def close(self) -> None:
        # Derived structures (tiled layout, ...) are rebuilt on demand; keep the forward CSR.
        if self.w is not None:
            self.w.index.derived.reset(keep_forward=True)
        super().close()


class OursQuantized(System):
    """:meth:`gpusparse.Index.search` on an index of 8-bit impacts (queries quantized alike).

    Exact for the quantized vectors (checked against the exact search of the same quantized
    index); its recall against the float32 exact top-k says what quantization changes.
    """

    family = "ours"

    def __init__(self, kernel: str = "tiled", bits: int = 8) -> None:
        super().__init__()
        self.kernel, self.bits = kernel, bits
        self.name = f"ours-{kernel}-q{bits}"
        self.description = f"Index.from_csr(quantize={bits}).search(kernel={kernel!r})"
        self.index: Index | None = None
        self._refs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _prepare(self, w: Workload) -> None:
        try:
            engines.choose(self.kernel, w.device)
        except (ValueError, ImportError) as e:
            raise SystemUnavailable(str(e)) from e
        indptr, terms, weights = w.forward
        self.index = Index.from_csr(indptr, terms, weights, w.index.vocab, device=w.device, quantize=self.bits)
        self.extra_bytes = self.index.stats().bytes

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        r = self.index.search(queries, k, kernel=self.kernel, memory_budget=w.memory_budget, batch_size=len(queries))
        return r.scores, r.ids

    def own_reference(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (len(queries), k)
        if key not in self._refs:
            # the scatter path is exact (tested against float64) and fast; reference without Triton
            kernel = "scatter" if self.w.device.type == "cuda" else "reference"
            r = self.index.search(queries, k, kernel=kernel, memory_budget=self.w.memory_budget)
            self._refs[key] = (r.scores, r.ids)
        return self._refs[key]

    def close(self) -> None:
        self.index = None
        self._refs.clear()
        super().close()


# -- the paper's pipelines ------------------------------------------------------------------


class PaperScatter(System):
    """``[B, N]`` float32 buffer + the fused Triton scatter-add + ``torch.topk`` (one pass)."""

    name = "paper-scatter"
    family = "paper"
    needs_cuda = True
    description = "paper: [B,N] fp32 buffer, fused Triton scatter-add (BLOCK_PL=128, atomics), torch.topk"

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        from gpusparse.kernels import scatter_add_scores

        w = self.w
        batch = query_batch(queries, w.device)
        buf = torch.empty((len(queries), w.n_docs), dtype=torch.float32, device=w.device)
        scatter_add_scores(w.index, batch, 0, w.n_docs, buf)
        top = torch.topk(buf, min(k, w.n_docs), dim=1)
        return _host(top.values, top.indices, k)


class PaperScatterChunked(System):
    """The paper's scorer over query chunks × document chunks, with a compacted top-k merge.

    Per query chunk, each document chunk is scored into a small buffer and reduced to its
    top-k at once; the chunk top-ks are concatenated and reduced again. Peak memory is the
    index plus one ``[query_chunk, doc_chunk]`` buffer.
    """

    name = "paper-scatter-chunked"
    family = "paper"
    needs_cuda = True

    def __init__(self, query_chunk: int = 64, doc_chunk: int = 1 << 21) -> None:
        super().__init__()
        self.query_chunk, self.doc_chunk = query_chunk, doc_chunk
        self.description = (
            f"paper, chunked: {query_chunk} queries x {doc_chunk:,} documents per scatter-add, "
            "per-chunk torch.topk, compacted merge"
        )

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        from gpusparse.kernels import scatter_add_scores

        w = self.w
        n, b = w.n_docs, len(queries)
        qc, dc = min(self.query_chunk, b), min(self.doc_chunk, n)
        buf = torch.empty(qc * dc, dtype=torch.float32, device=w.device)
        out_s, out_i = [], []
        for a in range(0, b, qc):
            sub = query_batch(queries[a : a + qc], w.device)
            bq = sub.n_terms.numel()
            vals, ids = [], []
            for d0 in range(0, n, dc):
                width = min(dc, n - d0)
                out = buf[: bq * width].view(bq, width)
                scatter_add_scores(w.index, sub, d0, width, out)
                top = torch.topk(out, min(k, width), dim=1)
                vals.append(top.values)
                ids.append(top.indices + d0)
            v, i = torch.cat(vals, 1), torch.cat(ids, 1)
            top = torch.topk(v, min(k, v.shape[1]), dim=1)
            out_s.append(top.values)
            out_i.append(i.gather(1, top.indices))
        return _host(torch.cat(out_s), torch.cat(out_i), k)


class PaperDocPar(System):
    """``[B, N]`` buffer + the paper's document-parallel CSR kernel + ``torch.topk``."""

    name = "paper-docpar"
    family = "paper"
    needs_cuda = True
    description = "paper's contrast kernel: one program per (query, 32 docs) over the CSR, dense [B,V] queries"

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        from gpusparse.kernels import docpar_scores

        w = self.w
        batch = query_batch(queries, w.device)
        buf = torch.empty((len(queries), w.n_docs), dtype=torch.float32, device=w.device)
        docpar_scores(w.index, batch, 0, w.n_docs, w.forward, buf)
        top = torch.topk(buf, min(k, w.n_docs), dim=1)
        return _host(top.values, top.indices, k)


# -- other GPU baselines ------------------------------------------------------------------


class SpareIterative(System):
    """SPARe's iterative scorer: one ``index_add_`` per (query, term) over the CSC index."""

    name = "spare-iterative"
    description = "per (query, term): scores[q].index_add_(doc_ids of the list, w_q * w_d), then torch.topk"

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        idx = w.index
        batch = query_batch(queries, w.device)
        scores = torch.zeros((len(queries), w.n_docs), dtype=torch.float32, device=w.device)
        starts = idx.offsets[batch.terms].tolist()
        counts = idx.lengths[batch.terms].tolist()
        rows = batch.rows.tolist()
        weights = batch.weights.tolist()
        for r, a, m, wq in zip(rows, starts, counts, weights, strict=True):
            if m:
                scores[r].index_add_(0, idx.doc_ids[a : a + m], idx.scores[a : a + m], alpha=wq)
        top = torch.topk(scores, min(k, w.n_docs), dim=1)
        return _host(top.values, top.indices, k)


class CuSparseSpMM(System):
    """``torch.sparse`` CSR documents ``[N, V]`` @ dense queries ``[V, B]``, top-k over documents."""

    name = "cusparse-spmm"
    description = "torch.sparse CSR [N,V] @ dense [V,B] (cuSPARSE SpMM), torch.topk over documents"

    def _prepare(self, w: Workload) -> None:
        indptr, terms, weights = w.forward
        if terms.numel() >= 2**31:
            raise SystemUnavailable("more than 2**31 postings: int32 CSR indices overflow")
        crow = indptr.to(torch.int32)
        self.matrix = _csr(crow, terms, weights, (w.n_docs, w.n_terms))
        self.extra_bytes = _nbytes(crow)  # terms and weights are shared with the forward CSR

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        batch = query_batch(queries, w.device)
        q = _dense_queries(batch, len(queries), w.n_terms, transposed=True)
        s = self.matrix @ q  # [N, B]
        top = torch.topk(s, min(k, w.n_docs), dim=0)
        return _host(top.values.T, top.indices.T, k)

    def close(self) -> None:
        self.matrix = None
        super().close()


class CuSparseSpGEMM(System):
    """CSR queries ``[B, V]`` @ CSR ``[V, N]`` (the inverted index), densified, ``torch.topk``."""

    name = "cusparse-spgemm"
    description = "torch.sparse CSR [B,V] @ CSR [V,N] (cuSPARSE SpGEMM), to_dense, torch.topk"

    def _prepare(self, w: Workload) -> None:
        idx = w.index
        real = idx.doc_ids >= 0  # padding sits at the end of each list: order is kept
        cols = idx.doc_ids[real]
        vals = idx.scores[real]
        if cols.numel() >= 2**31:
            raise SystemUnavailable("more than 2**31 postings: int32 CSR indices overflow")
        crow = torch.zeros(w.n_terms + 1, dtype=torch.int64, device=w.device)
        torch.cumsum(idx.lengths.to(torch.int64), 0, out=crow[1:])
        self.matrix = _csr(crow.to(torch.int32), cols, vals, (w.n_terms, w.n_docs))
        self.extra_bytes = _nbytes(cols, vals) + 4 * (w.n_terms + 1)

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        dev = w.device
        lengths = torch.from_numpy(queries.row_lengths).to(dev)
        crow = torch.zeros(len(queries) + 1, dtype=torch.int32, device=dev)
        torch.cumsum(lengths, 0, out=crow[1:])
        q = _csr(
            crow,
            torch.from_numpy(queries.indices).to(dev, torch.int32),
            torch.from_numpy(queries.values).to(dev, torch.float32),
            (len(queries), w.n_terms),
        )
        s = (q @ self.matrix).to_dense()
        top = torch.topk(s, min(k, w.n_docs), dim=1)
        return _host(top.values, top.indices, k)

    def close(self) -> None:
        self.matrix = None
        super().close()


class DenseMatmul(System):
    """Dense float32 ``[N, V]`` documents: ``Q @ Dᵀ`` (cuBLAS, full float32), ``torch.topk``."""

    name = "dense-matmul"
    description = "dense fp32 [B,V] @ [V,N] (TF32 off), torch.topk"
    compiled = False

    def _prepare(self, w: Workload) -> None:
        need = w.n_docs * w.n_terms * 4
        if need > w.dense_max_bytes:
            raise SystemUnavailable(
                f"dense [N, V] float32 needs {need / 2**30:.1f} GiB, "
                f"over the {w.dense_max_bytes / 2**30:.1f} GiB allowed"
            )
        indptr, terms, weights = w.forward
        self.matrix = torch.zeros((w.n_docs, w.n_terms), dtype=torch.float32, device=w.device)
        step = 1 << 24
        for a in range(0, terms.numel(), step):
            pos = torch.arange(a, min(a + step, terms.numel()), device=w.device)
            rows = torch.searchsorted(indptr, pos, right=True) - 1
            self.matrix[rows, terms[pos].to(torch.int64)] = weights[pos]
        self.extra_bytes = _nbytes(self.matrix)
        self.fn = self._build()

    def _build(self):
        def scores_topk(q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            top = torch.topk(q @ self.matrix.T, k, dim=1)
            return top.values, top.indices

        return scores_topk

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        batch = query_batch(queries, w.device)
        q = _dense_queries(batch, len(queries), w.n_terms)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as the others
        try:
            s, i = self.fn(q, min(k, w.n_docs))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        return _host(s, i, k)

    def close(self) -> None:
        self.matrix = None
        self.fn = None
        super().close()


class DenseCompiled(DenseMatmul):
    """:class:`DenseMatmul` under ``torch.compile`` (compiled on the first call of each shape)."""

    name = "dense-compiled"
    description = "torch.compile of the dense fp32 matmul + topk"
    compiled = True

    def _build(self):
        # Default dynamism: the first shape compiles static, a second one recompiles with
        # dynamic sizes that later batches and k reuse (a few compiles, not one per shape).
        return torch.compile(super()._build())


def gpu_systems(kernels: tuple[str, ...] | None = None) -> list[System]:
    """Every GPU system of the benchmark, ours first (one per engine of ``engines.names()``)."""
    ours = [OursKernel(k) for k in (kernels or engines.names())]
    return [
        *ours,
        OursQuantized(),
        PaperScatter(),
        PaperScatterChunked(),
        PaperDocPar(),
        SpareIterative(),
        CuSparseSpMM(),
        CuSparseSpGEMM(),
        DenseMatmul(),
        DenseCompiled(),
    ]
