"""CPU engines beside the GPU systems: Seismic, BMP and PISA on the host's cores.

Each adapter is optional: its package is imported in :meth:`prepare`, and a missing one
raises :class:`~gpusparse_bench.systems.SystemUnavailable` with the install hint, which
the runner records as the skip reason. They take the same host collection as the GPU
systems (canonical CSR numpy arrays) and return ``(scores, ids)`` ``[B, k]`` CPU tensors.

Known pitfalls (``benchmarks.md``), handled here:

* BMP takes integer impacts and wraps instead of clipping: document weights are quantised
  to ``1..255`` (``round(w · 255 / max_w)``, clipped), queries to integers (BMP rescales
  them itself); it was seen to skip the last block of documents, so a block of dummy
  documents (a term no query has) is appended; its recall is measured, never assumed;
* PISA stores ``int(w · 100)``: weights under 0.01 vanish from its index; its own
  pure-Python ``toks`` indexer is far too slow for 1M documents, so the binary collection
  it would write (``inv.docs``/``inv.freqs``/``inv.sizes``, lexicons) is written here with
  numpy, in its format, and PISA compresses and queries it;
* Seismic stores half-precision values and wants token arrays of its own string dtype
  (``seismic.get_seismic_string()``); documents go in by integer component id.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpusparse.collection import SparseCollection

from .systems import System, SystemUnavailable, Workload


def host_csr(w: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The workload's documents as host numpy CSR (cached on the workload)."""
    cached = w.options.get("host_csr")
    if cached is None:
        indptr, terms, weights = w.forward
        cached = (indptr.cpu().numpy(), terms.cpu().numpy(), weights.cpu().numpy())
        w.options["host_csr"] = cached
    return cached  # type: ignore[return-value]


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class CpuEngine(System):
    family = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        super().__init__()
        self.threads = threads or cpu_threads()
        self.tmp: str | None = None

    def prepare(self, w: Workload) -> None:
        self.w = w
        t0 = time.perf_counter()
        self._prepare(w)
        self.prepare_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        super().close()


def _result_arrays(rows: list[tuple[list[int], list[float]]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query (ids, scores) lists → ``[B, k]`` tensors, padded with -1 / 0."""
    ids = torch.full((len(rows), k), -1, dtype=torch.int64)
    scores = torch.zeros((len(rows), k), dtype=torch.float32)
    for r, (i, s) in enumerate(rows):
        n = min(k, len(i))
        if n:
            ids[r, :n] = torch.tensor(i[:n], dtype=torch.int64)
            scores[r, :n] = torch.tensor(s[:n], dtype=torch.float32)
    return scores, ids


def _query_rows(queries: SparseCollection) -> list[tuple[np.ndarray, np.ndarray]]:
    ip = queries.indptr
    return [(queries.indices[ip[i] : ip[i + 1]], queries.values[ip[i] : ip[i + 1]]) for i in range(len(queries))]


class Seismic(CpuEngine):
    """Seismic (``pyseismic-lsr``): approximate, ``query_cut`` 20, ``heap_factor`` 0.7 (the paper's setting)."""

    name = "seismic"

    def __init__(self, threads: int | None = None, *, query_cut: int = 20, heap_factor: float = 0.7) -> None:
        super().__init__(threads)
        self.query_cut, self.heap_factor = query_cut, heap_factor
        self.description = f"Seismic, query_cut={query_cut}, heap_factor={heap_factor}, {self.threads} threads"

    def _prepare(self, w: Workload) -> None:
        try:
            import seismic
        except ImportError as e:
            raise SystemUnavailable("pip install pyseismic-lsr") from e
        self.seismic = seismic
        indptr, terms, weights = host_csr(w)
        self.string_type = seismic.get_seismic_string()
        ds = seismic.SeismicDataset()
        if hasattr(ds, "add_documents_by_id"):  # pyseismic-lsr ≥ 0.5.4: CSR in one call
            ds.add_documents_by_id(
                [str(i) for i in range(w.n_docs)],
                terms.astype(np.int64),
                weights.astype(np.float32),
                indptr.astype(np.int64),
            )
        else:  # one document at a time, tokens as Seismic's own string dtype
            names = np.array([str(t) for t in range(w.n_terms)], dtype=self.string_type)
            w32 = weights.astype(np.float32)
            for i in range(w.n_docs):
                a, b = indptr[i], indptr[i + 1]
                if b > a:
                    ds.add_document(str(i), names[terms[a:b]], w32[a:b])
        self.index = seismic.SeismicIndex.build_from_dataset(ds, num_threads=self.threads)

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _query_rows(queries)
        comps = [np.array([str(t) for t in t_], dtype=self.string_type) for t_, _ in rows]
        vals = [v.astype(np.float32) for _, v in rows]
        ids = np.array([str(i) for i in range(len(rows))], dtype=self.string_type)
        res = self.index.batch_search(ids, comps, vals, k, self.query_cut, self.heap_factor, num_threads=self.threads)
        # Results come back per query, not necessarily in input order: place them by query id.
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        for r in res:
            if r:
                out[int(r[0][0])] = ([int(d) for _, _, d in r], [float(s) for _, s, _ in r])
        return _result_arrays(out, k)

    def close(self) -> None:
        self.index = None
        super().close()


class BMP(CpuEngine):
    """BMP (block-max pruning, ``bmp``): exact settings (``alpha = beta = 1``), 8-bit impacts."""

    name = "bmp"

    def __init__(self, threads: int | None = None, *, bsize: int = 32) -> None:
        super().__init__(1)  # its Python binding holds the GIL: threads would not help
        self.bsize = bsize
        self.description = f"BMP, block {bsize}, alpha=beta=1 (exact on 8-bit impacts), 1 thread (GIL-bound binding)"

    def _prepare(self, w: Workload) -> None:
        try:
            import bmp
        except ImportError as e:
            raise SystemUnavailable("pip install bmp") from e
        indptr, terms, weights = host_csr(w)
        self.scale = 255.0 / max(float(weights.max()), 1e-9) if weights.size else 1.0
        impacts = np.clip(np.rint(weights * self.scale), 1, 255).astype(np.int64).tolist()
        names = [str(t) for t in range(w.n_terms)]
        tl = terms.tolist()
        ip = indptr.tolist()
        self.tmp = tempfile.mkdtemp(prefix="gpusparse-bmp-")
        path = os.path.join(self.tmp, "index.bmp")
        ix = bmp.Indexer(path, self.bsize, False)
        for i in range(w.n_docs):
            a, b = ip[i], ip[i + 1]
            ix.add_document(str(i), dict(zip([names[t] for t in tl[a:b]], impacts[a:b], strict=True)))
        # BMP was seen to drop the last block of documents: pad with a block of dummies.
        for j in range(2 * self.bsize):
            ix.add_document(f"pad{j}", {"__pad__": 1})
        ix.finish()
        self.searcher = bmp.Searcher(path)

    def _one(self, t: np.ndarray, v: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        q = {str(int(a)): max(1, round(float(b) * 100)) for a, b in zip(t, v, strict=True)}
        if not q:
            return [], []
        docnos, scores = self.searcher.search(q, k, 1.0, 1.0)
        ids, sc = [], []
        for d, s in zip(docnos, scores, strict=True):
            if not d.startswith("pad"):
                ids.append(int(d))
                sc.append(float(s))
        return ids, sc

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _result_arrays([self._one(t, v, k) for t, v in _query_rows(queries)], k)

    def close(self) -> None:
        self.searcher = None
        super().close()


class PISA(CpuEngine):
    """PISA through ``pyterrier-pisa``: block-max WAND over ``int(w · 100)`` impacts (exact on them)."""

    name = "pisa"

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self.description = f"PISA block_max_wand, quantized scorer, int(w*100) impacts, {self.threads} threads"

    def _prepare(self, w: Workload) -> None:
        try:
            import pandas as pd
            from pyterrier_pisa import PisaIndex, _pisathon
        except (ImportError, OSError) as e:  # OSError: libtbb missing
            raise SystemUnavailable(f"pyterrier-pisa unusable: {e}") from e
        self.pd = pd
        indptr, terms, weights = host_csr(w)
        self.tmp = tempfile.mkdtemp(prefix="gpusparse-pisa-")
        path = Path(self.tmp) / "index"
        path.mkdir()
        _write_pisa_collection(path, indptr, terms, weights, w.n_terms)
        _pisathon.build_binlex(str(path / "fwd.documents"), str(path / "fwd.doclex"))
        _pisathon.build_binlex(str(path / "fwd.terms"), str(path / "fwd.termlex"))
        (path / "pt_meta.json").write_text(
            json.dumps({"type": "sparse_index", "format": "pisa", "package_hint": "pyterrier-pisa", "stemmer": "none"})
        )
        self.index = PisaIndex(str(path), stemmer="none", threads=self.threads)
        self.retrievers: dict[int, object] = {}

    def search(self, queries: SparseCollection, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self.retrievers:
            self.retrievers[k] = self.index.quantized(num_results=k, threads=self.threads)
        rows = _query_rows(queries)
        frame = self.pd.DataFrame(
            {
                "qid": [str(i) for i in range(len(rows))],
                "query_toks": [{str(int(t)): float(v) for t, v in zip(tt, vv, strict=True)} for tt, vv in rows],
            }
        )
        res = self.retrievers[k](frame)
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        if len(res):
            res = res.sort_values(["qid", "rank"])
            for qid, g in res.groupby("qid", sort=False):
                out[int(qid)] = (g["docno"].astype(int).tolist(), g["score"].astype(float).tolist())
        return _result_arrays(out, k)

    def close(self) -> None:
        self.index = None
        self.retrievers = {}
        super().close()


def _write_pisa_collection(
    path: Path, indptr: np.ndarray, terms: np.ndarray, weights: np.ndarray, n_terms: int
) -> None:
    """PISA's binary collection of ``int(w · 100)`` impacts, as ``PisaToksIndexer`` writes it.

    ``inv.docs``: ``[1, n_docs]`` then per term ``[length, doc ids…]``; ``inv.freqs``: per
    term ``[length, impacts…]``; ``inv.sizes``: ``[n_docs, document lengths…]`` (sum of
    impacts); terms in lexicographic order of their names (``fwd.terms``); document names
    ``0 … n-1`` (``fwd.documents``). Postings whose impact is 0 are dropped, as PISA does.
    """
    n_docs = indptr.size - 1
    impact = (weights.astype(np.float64) * 100).astype(np.int64)  # int(score * scale)
    keep = impact > 0
    rows = np.repeat(np.arange(n_docs, dtype=np.int64), np.diff(indptr))[keep]
    t = terms.astype(np.int64)[keep]
    imp = impact[keep]
    order = np.lexsort((rows, t))  # by term, then document
    t, rows, imp = t[order], rows[order], imp[order]
    counts = np.bincount(t, minlength=n_terms)
    starts = np.concatenate([[0], np.cumsum(counts)])
    present = np.nonzero(counts)[0]
    names = sorted(str(x) for x in present)
    with open(path / "fwd.terms", "w") as f:
        f.write("".join(f"{n}\n" for n in names))
    with open(path / "fwd.documents", "w") as f:
        f.write("".join(f"{i}\n" for i in range(n_docs)))
    with open(path / "inv.docs", "wb") as fd, open(path / "inv.freqs", "wb") as ff:
        fd.write(np.array([1, n_docs], dtype=np.uint32).tobytes())
        for name in names:
            x = int(name)
            a, b = starts[x], starts[x + 1]
            head = np.array([b - a], dtype=np.uint32).tobytes()
            fd.write(head + rows[a:b].astype(np.uint32).tobytes())
            ff.write(head + imp[a:b].astype(np.uint32).tobytes())
    doclen = np.bincount(rows, weights=imp, minlength=n_docs).astype(np.int64)
    with open(path / "inv.sizes", "wb") as fs:
        fs.write(np.array([n_docs], dtype=np.uint32).tobytes() + doclen.astype(np.uint32).tobytes())


def cpu_engines(threads: int | None = None) -> list[CpuEngine]:
    """Seismic, BMP and PISA adapters."""
    return [Seismic(threads), BMP(threads), PISA(threads)]
