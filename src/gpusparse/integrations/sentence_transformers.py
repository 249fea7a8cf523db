"""Any sentence-transformers ``SparseEncoder`` as GPUSparse's encoder.

:class:`SparseEncoderAdapter` wraps a ``SparseEncoder`` (SPLADE, and the asymmetric models
whose queries go through another module than documents, inference-free query sides
included) behind the interface of :class:`gpusparse.encode.SpladeEncoder` that
:class:`gpusparse.pipeline.TextPipeline` and the CLI use: ``encode(texts, ids, kind=...)``,
``encode_queries``, ``encode_documents``, ``vocab``, ``name``, ``device``. Queries go
through the model's ``encode_query``, documents through ``encode_document``, so a model's
query and document routes (or prompts) are used as its authors meant.

The model's output dimensions are mapped to a :class:`~gpusparse.vocab.Vocabulary` through
its tokenizer, as :func:`gpusparse.encode.model_vocabulary` does for our own encoder: a
BERT-vocabulary model gives :meth:`Vocabulary.bert`, so its vectors query indexes built from
any BERT-vocabulary vectors. Conventions kept from :class:`SpladeEncoder`: empty (all
whitespace) texts give empty vectors without running the model, texts longer than the
maximum length are truncated and counted, pruning is ours (``prune_top`` keeps the largest
weights of each vector, ties to the lower term id).

``sentence-transformers`` is optional (``pip install 'gpusparse[sentence-transformers]'``);
it is imported when an adapter loads a model by name, never when this module is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..collection import SparseCollection
from ..encode import EncodeStats, TextEncoder, model_vocabulary
from ._require import require

Kind = Literal["query", "document"]


class SparseEncoderAdapter(TextEncoder):
    """A sentence-transformers ``SparseEncoder`` with :class:`gpusparse.encode.SpladeEncoder`'s interface.

    Args:
        model: a ``SparseEncoder``, or a local folder / hub id to load one from.
        query_max_length: tokens per query; default: the model's ``max_seq_length``.
        doc_max_length: tokens per document; default: the model's ``max_seq_length``.
        batch_size: texts per forward pass.
        device: where a model loaded by name runs (``"cpu"``, ``"cuda"`` ...); default the
            library's choice. A given model stays where it is.

    Raises:
        ImportError: a model is loaded by name and sentence-transformers is not installed.
        ValueError: the model has no tokenizer or no fixed output dimension.
    """

    def __init__(
        self,
        model: Any,
        *,
        query_max_length: int | None = None,
        doc_max_length: int | None = None,
        batch_size: int = 32,
        device: str | torch.device | None = None,
    ) -> None:
        for name, value in (
            ("query_max_length", query_max_length),
            ("doc_max_length", doc_max_length),
            ("batch_size", batch_size),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if isinstance(model, str | Path):
            st = require("sentence_transformers", "sentence-transformers", "SparseEncoderAdapter")
            self.name = str(model)
            model = st.SparseEncoder(str(model), device=None if device is None else str(device))
        else:
            self.name = str(
                getattr(getattr(model, "model_card_data", None), "base_model", None) or type(model).__name__
            )
        self.model = model
        self.model.eval()
        self.batch_size = batch_size
        default_length = int(getattr(model, "max_seq_length", None) or 512)
        self.query_max_length = query_max_length or default_length
        self.doc_max_length = doc_max_length or default_length
        self.device = torch.device(model.device)
        self.autocast_dtype: torch.dtype | None = None  # the model runs in its own dtype
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("the SparseEncoder has no tokenizer to map its output dimensions to tokens")
        self.tokenizer = tokenizer
        self.vocab = model_vocabulary(tokenizer, self._output_size())

    def __repr__(self) -> str:
        return f"SparseEncoderAdapter({self.name!r}, device={self.device})"

    def encode(
        self,
        texts: Sequence[str],
        ids: Sequence[str] | None = None,
        *,
        kind: Kind = "document",
        max_length: int | None = None,
        prune_top: int | None = None,
        prune_threshold: float | None = None,
        progress: bool = False,
        stats: EncodeStats | None = None,
    ) -> SparseCollection:
        """Encode ``texts`` into a :class:`SparseCollection` in the model's vocabulary.

        The arguments are those of :meth:`gpusparse.encode.SpladeEncoder.encode`.
        """
        max_length = self._checked_length(texts, ids, kind, max_length, prune_top, prune_threshold)
        stats = EncodeStats() if stats is None else stats
        stats.kind, stats.max_length = kind, max_length
        t0 = time.perf_counter()
        lengths = self._token_lengths(texts, max_length)
        nonempty = [i for i, n in enumerate(lengths) if n > 0]
        stats.texts += len(texts)
        stats.empty_texts += len(texts) - len(nonempty)
        stats.truncated += sum(1 for i in nonempty if lengths[i] > max_length)

        if nonempty:
            encode = self.model.encode_query if kind == "query" else self.model.encode_document
            saved = self.model.max_seq_length
            self.model.max_seq_length = max_length
            try:
                with torch.inference_mode():
                    out = encode(
                        [texts[i] for i in nonempty],
                        batch_size=self.batch_size,
                        show_progress_bar=progress,
                        convert_to_sparse_tensor=True,
                    )
            finally:
                self.model.max_seq_length = saved
            rows = SparseCollection.from_torch_sparse(out)
        else:
            rows = SparseCollection(np.zeros(1, np.int64), [], [], vocab=self.vocab)
        indptr, indices, values = _prune(rows, prune_top, prune_threshold, stats)
        # Put the encoded rows where their texts are; empty texts get empty rows.
        row_len = np.zeros(len(texts), dtype=np.int64)
        row_len[nonempty] = np.diff(indptr)
        full_indptr = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(row_len, out=full_indptr[1:])
        coll = SparseCollection(full_indptr, indices, values, ids=ids, vocab=self.vocab)
        stats.nnz += coll.nnz
        stats.seconds += time.perf_counter() - t0
        return coll

    def _output_size(self) -> int:
        """Dimensions of the model's output, read from one encoded text: ``get_embedding_dimension()``
        can name the backbone's hidden size instead (sentence-transformers 6.2 on a SPLADE model
        whose pooling module was saved without its dimension)."""
        with torch.inference_mode():
            probe = self.model.encode_document(["a"], convert_to_sparse_tensor=True, show_progress_bar=False)
        return int(probe.shape[-1])


def _prune(
    rows: SparseCollection, top: int | None, threshold: float | None, stats: EncodeStats
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows' CSR arrays with weights below ``threshold`` dropped and only the ``top`` largest kept
    (ties to the lower term id); counted in ``stats``."""
    indptr, indices, values = rows.indptr, rows.indices, rows.values
    if top is None and threshold is None:
        return indptr, indices, values
    row_of = np.repeat(np.arange(len(rows)), np.diff(indptr))
    keep = np.ones(values.size, dtype=bool)
    if threshold is not None:
        keep &= values >= threshold
    if top is not None:
        # Rank each entry inside its row: by weight descending, then term ascending.
        order = np.lexsort((indices, -values.astype(np.float64), row_of))
        rank = np.arange(values.size) - indptr[row_of[order]]
        keep[order[rank >= top]] = False
    cut = np.bincount(row_of[~keep], minlength=len(rows))
    stats.pruned_terms += int(cut.sum())
    stats.pruned_vectors += int(np.count_nonzero(cut))
    new_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.diff(indptr) - cut, out=new_indptr[1:])
    return new_indptr, indices[keep], values[keep]
