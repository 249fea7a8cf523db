"""Text to metrics: a BEIR collection's texts → SPLADE vectors → index → exact top-k → run.

The steps of ``gpusparse pipeline`` (and the encoding of ``gpusparse encode``), and of the
quality part of the benchmark harness (``bench/gpusparse_bench/paper.py``), so that the
command and the benchmark run the same code. :class:`TextPipeline` takes one collection
through them in order; each step keeps what it made and how long it took, so that a
caller can print, save or check between steps (the command writes the vectors before
indexing and saves the index before searching) and :meth:`TextPipeline.summary` reports
the counts and timings. Evaluation is the caller's: the command scores the run file it
wrote, the benchmark the run in memory (:func:`gpusparse.evaluate.evaluate` takes both).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .beir import Texts
from .collection import SparseCollection
from .encode import EncodeStats, SpladeEncoder
from .errors import InputError
from .index import Index
from .search import SearchResults
from .trec import write_trec_run


class TextPipeline:
    """One collection's documents and queries through encoding, indexing and search.

    Args:
        corpus: the documents' ids and texts.
        queries: the queries' ids and texts (e.g. only the judged ones).
        encoder: the SPLADE encoder of both: a :class:`~gpusparse.encode.SpladeEncoder` or any
            object with its ``encode(texts, ids, kind=..., prune_top=, prune_threshold=,
            progress=, stats=)`` (e.g. :class:`gpusparse.integrations.sentence_transformers.SparseEncoderAdapter`).
        log: called with one line after each encoding (its :meth:`EncodeStats.summary`).
    """

    def __init__(
        self, corpus: Texts, queries: Texts, encoder: SpladeEncoder | Any, *, log: Callable[[str], None] | None = None
    ) -> None:
        self.corpus, self.query_texts, self.encoder = corpus, queries, encoder
        self._log = log or (lambda line: None)
        self.docs: SparseCollection | None = None
        self.queries: SparseCollection | None = None
        self.doc_stats, self.query_stats = EncodeStats(), EncodeStats()
        self.index: Index | None = None
        self.results: SearchResults | None = None
        self.device: str | None = None
        self.encode_seconds = self.index_seconds = self.search_seconds = 0.0

    def encode(
        self, *, prune_top: int | None = None, prune_threshold: float | None = None, progress: bool = False
    ) -> tuple[SparseCollection, SparseCollection]:
        """Encode the documents, then the queries; ``(documents, queries)`` as sparse vectors."""
        t0 = time.perf_counter()
        self.docs = self._encode("document", prune_top, prune_threshold, progress)
        self.queries = self._encode("query", prune_top, prune_threshold, progress)
        self.encode_seconds = time.perf_counter() - t0
        return self.docs, self.queries

    def encode_documents(
        self, *, prune_top: int | None = None, prune_threshold: float | None = None, progress: bool = False
    ) -> SparseCollection:
        """Encode the documents alone (e.g. to index them, with no queries to search)."""
        t0 = time.perf_counter()
        self.docs = self._encode("document", prune_top, prune_threshold, progress)
        self.encode_seconds = time.perf_counter() - t0
        return self.docs

    def encode_queries(
        self, *, prune_top: int | None = None, prune_threshold: float | None = None, progress: bool = False
    ) -> SparseCollection:
        """Encode the queries alone (the documents come from :meth:`use_documents`, or are not needed)."""
        t0 = time.perf_counter()
        self.queries = self._encode("query", prune_top, prune_threshold, progress)
        self.encode_seconds = time.perf_counter() - t0
        return self.queries

    def use_documents(self, docs: SparseCollection) -> None:
        """Take already encoded document vectors instead of encoding the corpus (their ids must be its ids)."""
        have = set(docs.ids)
        if len(docs) != len(self.corpus) or not have.issuperset(self.corpus.ids):
            missing = next((i for i in self.corpus.ids if i not in have), None)
            what = f"document {missing!r} has no vector" if missing is not None else "they hold other documents too"
            raise InputError(
                f"not the vectors of the corpus {self.corpus.path}: {what} "
                f"({len(docs):,} vectors, {len(self.corpus):,} documents)"
            )
        self.docs = docs

    def _encode(
        self, kind: str, prune_top: int | None, prune_threshold: float | None, progress: bool
    ) -> SparseCollection:
        texts, stats = (self.corpus, self.doc_stats) if kind == "document" else (self.query_texts, self.query_stats)
        coll = self.encoder.encode(
            texts.texts,
            texts.ids,
            kind=kind,
            prune_top=prune_top,
            prune_threshold=prune_threshold,
            progress=progress,
            stats=stats,
        )
        self._log(stats.summary())
        return coll

    def build_index(self, device: str | torch.device, *, progress: bool = False) -> Index:
        """Index the encoded documents on ``device``."""
        if self.docs is None:
            raise RuntimeError("encode() first")
        t0 = time.perf_counter()
        self.index = Index.build(self.docs, device=device, progress=progress)
        self.index_seconds = time.perf_counter() - t0
        self.device = str(device)
        return self.index

    def search(
        self, k: int, *, kernel: str = "auto", memory_budget: int | None = None, progress: bool = False
    ) -> SearchResults:
        """The exact top-``k`` of every encoded query (results on the host, so the time is complete)."""
        if self.index is None or self.queries is None:
            raise RuntimeError("build_index() first")
        t0 = time.perf_counter()
        self.results = self.index.search(self.queries, k, kernel=kernel, memory_budget=memory_budget, progress=progress)
        self.search_seconds = time.perf_counter() - t0
        return self.results

    def run(self) -> dict[str, list[tuple[str, float]]]:
        """``{query id: [(document id, score), ...]}``, best first, as :meth:`Index.retrieve`."""
        index, res, queries = self._searched()
        return {
            qid: [
                (index.ids[d], float(s))
                for d, s in zip(res.ids[qi].tolist(), res.scores[qi].tolist(), strict=True)
                if d >= 0
            ]
            for qi, qid in enumerate(queries.ids)
        }

    def write_run(self, path: str | Path, *, tag: str = "gpusparse") -> int:
        """Write the results as a TREC run; the number of lines."""
        index, res, queries = self._searched()
        return write_trec_run(path, queries.ids, index.ids, res.scores.numpy(), res.ids.numpy(), tag=tag)

    def summary(self) -> dict[str, Any]:
        """Counts and seconds of the steps run so far (the ``encode``, ``index``, ``search`` of metrics.json)."""
        out: dict[str, Any] = {"encode": {"corpus": self.doc_stats.as_dict(), "queries": self.query_stats.as_dict()}}
        if self.index is not None:
            st = self.index.stats()
            out["index"] = {"documents": st.n_docs, "postings": st.n_postings, "seconds": round(self.index_seconds, 3)}
        if self.results is not None and self.queries is not None:
            out["search"] = {
                "queries": len(self.queries),
                "device": self.device,
                "seconds": round(self.search_seconds, 3),
            }
        return out

    def _searched(self) -> tuple[Index, SearchResults, SparseCollection]:
        if self.index is None or self.results is None or self.queries is None:
            raise RuntimeError("search() first")
        return self.index, self.results, self.queries
