"""PyTerrier transformers: :class:`GPUSparseRetriever` (queries → ranked documents) and
:class:`GPUSparseIndexer` (documents with token weights → an index folder).

They follow PyTerrier's conventions for learned sparse retrieval (as pyterrier-pisa and
pyterrier_splade do): queries come as a DataFrame with ``qid`` and ``query_toks`` (a
``{token: weight}`` dict, e.g. from a SPLADE query encoder), or ``qid`` and ``query`` text
when the retriever has an encoder; results are the query rows repeated with ``docno``,
``score`` and ``rank`` (0 first) added, best first. Documents come as dicts (or a
DataFrame) with ``docno`` and ``toks`` (pyterrier_splade's name; ``doc_toks`` is read too).
``pt.Experiment`` and ``>>`` pipelines take them unchanged, and no JVM is started.

This module needs ``python-terrier`` (``pip install 'gpusparse[pyterrier]'``) when it is
imported: its classes are PyTerrier transformers. ``import gpusparse`` never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..collection import SparseCollection
from ..index import Index
from ..vocab import Vocabulary
from ._require import require

pt = require("pyterrier", "pyterrier", "gpusparse.integrations.pyterrier")
pd = require("pandas", "pyterrier", "gpusparse.integrations.pyterrier")

DEFAULT_BATCH_SIZE = 1024
_TOKS_FIELDS = ("toks", "doc_toks")


class GPUSparseRetriever(pt.Transformer):
    """Exact top-``k`` retrieval from a GPUSparse index, as a PyTerrier transformer.

    Args:
        index: an :class:`~gpusparse.Index` or its folder (loaded onto ``device``).
        k: results per query.
        encoder: encodes a ``query`` column when there is no ``query_toks`` (a
            :class:`gpusparse.encode.SpladeEncoder`, a
            :class:`~gpusparse.integrations.sentence_transformers.SparseEncoderAdapter`, ...).
        batch_size: queries searched together.
        device: where to search (default: where the index is).
        unknown: ``"error"`` refuses ``query_toks`` tokens outside the index's vocabulary,
            ``"skip"`` drops them.
        search_options: passed to :meth:`Index.search` (``kernel``, ``memory_budget`` ...).
    """

    def __init__(
        self,
        index: Index | str | Path,
        k: int = 1000,
        *,
        encoder: Any = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str | None = None,
        unknown: str = "error",
        **search_options: Any,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, not {k!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
        if unknown not in ("error", "skip"):
            raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
        self.index = index if isinstance(index, Index) else Index.load(index, device=device or "cpu")
        self.k, self.encoder, self.batch_size, self.device = k, encoder, batch_size, device
        self.unknown, self.search_options = unknown, search_options

    def __repr__(self) -> str:
        return f"GPUSparseRetriever(<index of {self.index.n_docs:,} documents>, k={self.k})"

    def fuse_rank_cutoff(self, k: int) -> GPUSparseRetriever | None:
        """``self >> pt.RankCutoff(k)`` as one retriever with a smaller ``k`` (PyTerrier's fusion hook)."""
        if k >= self.k:
            return None
        return GPUSparseRetriever(
            self.index,
            k,
            encoder=self.encoder,
            batch_size=self.batch_size,
            device=self.device,
            unknown=self.unknown,
            **self.search_options,
        )

    def transform(self, inp: Any) -> Any:
        """Queries (``qid`` + ``query_toks``, or ``qid`` + ``query`` with an encoder) → results."""
        with pt.validate.any(inp) as v:
            v.query_frame(extra_columns=["query_toks"])
            v.query_frame(extra_columns=["query"])
        use_toks = "query_toks" in inp.columns
        if not use_toks and self.encoder is None:
            raise ValueError("queries have no query_toks column: give the retriever an encoder to encode 'query'")
        parts = []
        for start in range(0, len(inp), self.batch_size):
            batch = inp.iloc[start : start + self.batch_size]
            queries = self._queries(batch, use_toks)
            res = self.index.search(queries, self.k, device=self.device, **self.search_options)
            ids, scores = res.ids.numpy(), res.scores.numpy()
            valid = ids >= 0  # padding: fewer than k documents share a term with the query
            rows = np.repeat(np.arange(len(batch)), valid.sum(axis=1))
            out = batch.iloc[rows].reset_index(drop=True)
            out["docno"] = np.asarray(self.index.ids, dtype=object)[ids[valid]]
            out["score"] = scores[valid].astype(np.float64)
            out["rank"] = (np.cumsum(valid, axis=1) - 1)[valid]
            parts.append(out)
        if not parts:
            return pd.DataFrame(columns=[*inp.columns, "docno", "score", "rank"])
        return pd.concat(parts, ignore_index=True)

    def _queries(self, batch: Any, use_toks: bool) -> SparseCollection:
        ids = [str(q) for q in batch["qid"]]
        if use_toks:
            toks = list(batch["query_toks"])
            for q, t in zip(ids, toks, strict=True):
                if not isinstance(t, Mapping):
                    raise TypeError(f"query_toks of query {q!r} is {type(t).__name__}, not a {{token: weight}} dict")
            return SparseCollection.from_dicts(toks, vocab=self.index.vocab, unknown=self.unknown, ids=_unique(ids))
        return self.encoder.encode_queries([str(t) for t in batch["query"]], _unique(ids))


class GPUSparseIndexer(pt.Indexer):
    """Index documents with token weights into a GPUSparse index folder.

    ``GPUSparseIndexer(path).index(docs)`` reads dicts (or a DataFrame's rows) with ``docno``
    and ``toks`` (or ``doc_toks``): ``{token: weight}``; it returns ``path``. ``quantize``,
    ``device`` and ``vocab`` are those of ``gpusparse index``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        vocab: Vocabulary | str | None = None,
        quantize: int | None = None,
        device: str = "cpu",
        overwrite: bool = False,
        unknown: str = "error",
        chunk_size: int = 10_000,
    ) -> None:
        self.path, self.vocab = Path(path), Vocabulary.resolve(vocab)
        self.quantize, self.device, self.overwrite = quantize, device, overwrite
        self.unknown, self.chunk_size = unknown, chunk_size

    def index(self, it: Iterable[Mapping[str, Any]] | Any) -> Path:
        """Build and save the index of ``it``; the folder's path."""
        if self.path.exists() and not self.overwrite:
            raise FileExistsError(f"{self.path} already exists (GPUSparseIndexer(..., overwrite=True) replaces it)")
        records = it.to_dict(orient="records") if isinstance(it, pd.DataFrame) else it
        field: str | None = None
        parts: list[SparseCollection] = []
        ids: list[str] = []
        vectors: list[Mapping[str, float]] = []
        for n, doc in enumerate(records):
            if field is None:
                field = next((f for f in _TOKS_FIELDS if f in doc), None)
                if field is None:
                    raise ValueError(f"document 1 has none of the fields {', '.join(_TOKS_FIELDS)} (keys: {list(doc)})")
            if "docno" not in doc or field not in doc:
                raise ValueError(f"document {n + 1} lacks 'docno' or {field!r}")
            ids.append(str(doc["docno"]))
            vectors.append(doc[field])
            if len(vectors) == self.chunk_size:
                parts.append(SparseCollection.from_dicts(vectors, vocab=self.vocab, unknown=self.unknown))
                vectors = []
        if vectors or not parts:
            parts.append(SparseCollection.from_dicts(vectors, vocab=self.vocab, unknown=self.unknown))
        coll = SparseCollection.concat(parts)
        coll = SparseCollection(coll.indptr, coll.indices, coll.values, ids=ids, vocab=self.vocab, copy=False)
        Index.build(coll, device=self.device, quantize=self.quantize).save(self.path, overwrite=self.overwrite)
        return self.path


def _unique(ids: list[str]) -> list[str]:
    """Query ids as row names: a qid may repeat in a PyTerrier frame, our collections' ids may not."""
    return ids if len(set(ids)) == len(ids) else [f"{q}#{i}" for i, q in enumerate(ids)]
