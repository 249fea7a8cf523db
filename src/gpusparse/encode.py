"""SPLADE encoding: text to sparse vectors with a masked-language model.

For a text with tokens ``t = 1..L`` (``[CLS]`` and ``[SEP]`` included), a masked-LM head
gives logits ``z[t, v]`` over the vocabulary; the sparse vector is

* ``max`` pooling (SPLADE v2 / SPLADE++): ``w[v] = max_t log(1 + relu(z[t, v])) · mask[t]``
* ``sum`` pooling (the original SPLADE):  ``w[v] = Σ_t  log(1 + relu(z[t, v])) · mask[t]``

where ``mask`` is the attention mask (padding contributes nothing). Any model that
``transformers.AutoModelForMaskedLM`` loads works: a local folder or a hub id (the
default is ``naver/splade-cocondenser-ensembledistil``).

Texts are tokenised once, a window at a time in a background thread while the model runs,
and batched in order of their token length, each batch padded to its longest text
(:mod:`gpusparse.encode_tokens`); results come back in input order and do not depend on the
batching beyond float rounding. Pooling, pruning and the extraction of the non-zeros run on
the device, and the host does not wait for the batch the device is running
(:mod:`gpusparse.encode_device`). :meth:`SpladeEncoder.encode_batches` yields each batch's
CSR arrays (what ``gpusparse encode --index`` indexes); :meth:`SpladeEncoder.encode` puts
them together into a :class:`~gpusparse.collection.SparseCollection`. Texts longer than
the maximum length are truncated and counted; empty texts give empty vectors without
running the model. On a GPU the model runs under fp16/bf16 autocast; pooling is always
done in float32. On CUDA the forward is captured as CUDA graphs, one per batch-length bucket,
and replayed (:mod:`gpusparse.encode_graphs`; ``cuda_graphs=False`` runs it eagerly).

``transformers`` is an optional dependency (``pip install 'gpusparse[encode]'``); it is
imported when an encoder is created, never when this module is.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from .collection import SparseCollection
from .encode_device import POOLINGS, Pooling, SparseBatch, assemble, prune, sparse_batches, splade_pool
from .encode_graphs import BucketedForward, bucket_length
from .encode_models import check_model_folder, hub_reachable, load_masked_lm, model_vocabulary, random_bert_base
from .encode_tokens import DEFAULT_SORT_WINDOW, Tokenize, prefetched, token_batches

# with the names defined here; the model loaders live in gpusparse.encode_models
__all__ = [
    "SparseBatch",
    "check_model_folder",
    "hub_reachable",
    "load_masked_lm",
    "model_vocabulary",
    "prune",
    "random_bert_base",
    "splade_pool",
]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Kind = Literal["query", "document"]

DEFAULT_MODEL = "naver/splade-cocondenser-ensembledistil"
DEFAULT_QUERY_MAX_LENGTH = 64
DEFAULT_DOC_MAX_LENGTH = 256
DEFAULT_BATCH_SIZE = 32
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EncodeStats:
    """What an encoding saw: counts a user should hear about.

    ``stages``: seconds by stage of the work, summed over the encodings this object saw:
    ``tokenize`` and ``pad`` (in the tokenising thread), ``wait_tokens``, ``launch``,
    ``wait_device``, ``host`` (see :func:`~gpusparse.encode_device.sparse_batches`) and
    ``assemble`` (putting the rows in input order, in :meth:`SpladeEncoder.encode`).
    """

    texts: int = 0
    empty_texts: int = 0
    truncated: int = 0
    max_length: int = 0
    nnz: int = 0
    pruned_terms: int = 0
    pruned_vectors: int = 0
    seconds: float = 0.0
    kind: str = "text"
    extra: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for the CLI."""
        rate = self.texts / self.seconds if self.seconds > 0 else float("inf")
        mean = self.nnz / self.texts if self.texts else 0.0
        what = {"query": "queries", "document": "documents"}.get(self.kind, f"{self.kind}s")
        parts = [f"encoded {self.texts:,} {what} in {self.seconds:.1f} s ({rate:,.0f}/s), {mean:.1f} non-zeros each"]
        if self.truncated:
            parts.append(f"{self.truncated:,} truncated to {self.max_length} tokens")
        if self.empty_texts:
            parts.append(f"{self.empty_texts:,} empty (empty vectors)")
        if self.pruned_terms:
            parts.append(f"pruned {self.pruned_terms:,} terms from {self.pruned_vectors:,} vectors")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The counts, for JSON reports."""
        return {
            "texts": self.texts,
            "empty_texts": self.empty_texts,
            "truncated": self.truncated,
            "max_length": self.max_length,
            "nnz": self.nnz,
            "mean_nnz": self.nnz / self.texts if self.texts else 0.0,
            "pruned_terms": self.pruned_terms,
            "pruned_vectors": self.pruned_vectors,
            "seconds": round(self.seconds, 3),
        }


class TextEncoder:
    """What every text encoder of GPUSparse offers (our :class:`SpladeEncoder`, the
    sentence-transformers adapter): ``encode(texts, ids, kind=...)`` and its two shortcuts."""

    query_max_length: int
    doc_max_length: int
    tokenizer: Any  # a Hugging Face tokenizer: counts tokens for the truncation statistics

    def encode(self, texts: Sequence[str], ids: Sequence[str] | None = None, **kwargs: Any) -> SparseCollection:
        """Encode ``texts`` (``kind="query"`` or ``"document"``) into a :class:`SparseCollection`."""
        raise NotImplementedError

    def encode_queries(self, texts: Sequence[str], ids: Sequence[str] | None = None, **kwargs: Any) -> SparseCollection:
        """Encode queries (the encoder's query side and length); see :meth:`encode`."""
        return self.encode(texts, ids, kind="query", **kwargs)

    def encode_documents(
        self, texts: Sequence[str], ids: Sequence[str] | None = None, **kwargs: Any
    ) -> SparseCollection:
        """Encode documents (the encoder's document side and length); see :meth:`encode`."""
        return self.encode(texts, ids, kind="document", **kwargs)

    def _checked_length(
        self,
        texts: Sequence[str],
        ids: Sequence[str] | None,
        kind: str,
        max_length: int | None,
        prune_top: int | None,
        prune_threshold: float | None,
    ) -> int:
        """Refuse bad :meth:`encode` arguments; the maximum length for ``kind`` (the encoder's
        ``query_max_length`` / ``doc_max_length`` unless ``max_length`` is given)."""
        if kind not in ("query", "document"):
            raise ValueError(f"kind must be 'query' or 'document', not {kind!r}")
        if max_length is None:
            max_length = self.query_max_length if kind == "query" else self.doc_max_length
        if prune_top is not None and (isinstance(prune_top, bool) or prune_top < 1):
            raise ValueError(f"prune_top must be a positive integer, not {prune_top!r}")
        if prune_threshold is not None and not prune_threshold >= 0:
            raise ValueError(f"prune_threshold must be >= 0, not {prune_threshold!r}")
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        return max_length

    def _token_lengths(self, texts: Sequence[str], max_length: int) -> list[int]:
        """Token count (by ``self.tokenizer``) of each text capped at ``max_length + 1`` (so
        ``> max_length`` means truncated); 0 = empty."""
        out = [0] * len(texts)
        idx = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"text {i} is {type(t).__name__}, not str")
            if t.strip():
                idx.append(i)
        step = 8192
        for a in range(0, len(idx), step):
            chunk = idx[a : a + step]
            enc = self.tokenizer([texts[i] for i in chunk], truncation=True, max_length=max_length + 1)
            for i, tokens in zip(chunk, enc["input_ids"], strict=True):
                out[i] = len(tokens)
        return out


class SpladeEncoder(TextEncoder):
    """A SPLADE-style encoder: masked-LM logits → ``log(1 + relu)`` → max or sum pooling.

    Args:
        model: a local model folder or a hub id (``AutoModelForMaskedLM`` + ``AutoTokenizer``).
        pooling: ``"max"`` (SPLADE v2/++) or ``"sum"`` (original SPLADE).
        query_max_length: tokens per query, ``[CLS]``/``[SEP]`` included; longer ones are truncated.
        doc_max_length: tokens per document, likewise.
        batch_size: texts per forward pass.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; default CUDA when available.
        dtype: ``"auto"`` (bf16 autocast on a GPU that supports it, else fp16; float32 on
            the CPU), ``"float32"``, ``"float16"`` or ``"bfloat16"`` (autocast).
        loaded: an already built ``(tokenizer, masked-LM module)`` pair to use instead of
            loading ``model`` (which is then only its name), e.g. :func:`random_bert_base`.
        sort_window: texts tokenised and sorted by length together (see
            :mod:`gpusparse.encode_tokens`); larger windows pad less.
        word_cache: tokenise a BERT tokenizer's ASCII texts through a word cache (the same
            ids, several times faster on one core: :mod:`gpusparse.encode_wordpiece`). Off by
            default: inside the encoder on a 16-core GPU host it measured slower than the Rust
            tokenizer (splade-tiny on an H200: 32,113 against 37,809 passages/s), its Python
            work competing with the model's launches for the GIL; it can pay where cores are few.
        prefetch: token batches made ahead of the model (default: a window's worth and 4).
        cuda_graphs: capture the forward as CUDA graphs, one per length bucket, and replay them
            (:mod:`gpusparse.encode_graphs`): ``"auto"`` (on for a CUDA device, off on the
            CPU), ``True`` (a CUDA device only) or ``False`` (eager, batches padded to their
            longest text). Where capture fails, the encoder warns once and runs eagerly.

    Raises:
        InputError: a model folder that is missing files or cannot be loaded.
        ImportError: ``transformers`` is not installed.
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        pooling: Pooling = "max",
        query_max_length: int = DEFAULT_QUERY_MAX_LENGTH,
        doc_max_length: int = DEFAULT_DOC_MAX_LENGTH,
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str | torch.device | None = None,
        dtype: DType = "auto",
        loaded: tuple[Any, torch.nn.Module] | None = None,
        sort_window: int = DEFAULT_SORT_WINDOW,
        word_cache: bool = False,
        prefetch: int | None = None,
        cuda_graphs: bool | Literal["auto"] = "auto",
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        for name, value in (
            ("query_max_length", query_max_length),
            ("doc_max_length", doc_max_length),
            ("batch_size", batch_size),
            ("sort_window", sort_window),
            ("prefetch", 1 if prefetch is None else prefetch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self.sort_window, self.word_cache, self.prefetch = sort_window, word_cache, prefetch
        self._tokenizers: dict[tuple[int, bool], Tokenize] = {}
        self.pooling: Pooling = pooling
        self.query_max_length = query_max_length
        self.doc_max_length = doc_max_length
        self.batch_size = batch_size
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.autocast_dtype = _autocast_dtype(dtype, self.device)
        self.name = str(model)
        self.tokenizer, self.model = loaded if loaded is not None else load_masked_lm(model)
        self.model.to(self.device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", None)
        for name, value in (("query_max_length", query_max_length), ("doc_max_length", doc_max_length)):
            if limit is not None and value > limit:
                raise ValueError(f"{name} {value} exceeds the model's {limit} positions")
        self.vocab = model_vocabulary(self.tokenizer, int(self.model.config.vocab_size))
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', not {cuda_graphs!r}")
        if cuda_graphs is True and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this encoder runs on {self.device}")
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs == "auto" else bool(cuda_graphs)
        self._graphs = self._bucketed(capture=True) if self.cuda_graphs else None

    @property
    def cuda_graph_stats(self) -> dict[str, Any] | None:
        """Graphs captured, capture seconds, batches run eagerly and why graphs are off
        (:meth:`~gpusparse.encode_graphs.BucketedForward.summary`); ``None`` without graphs."""
        return None if self._graphs is None else self._graphs.summary()

    def __repr__(self) -> str:
        return (
            f"SpladeEncoder({self.name!r}, pooling={self.pooling!r}, query_max_length={self.query_max_length}, "
            f"doc_max_length={self.doc_max_length}, device={self.device})"
        )

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

        Args:
            texts: the texts; an empty (or all-whitespace) text gives an empty vector.
            ids: their ids (default ``"0"``, ``"1"``, ...).
            kind: ``"query"`` or ``"document"``: picks the default maximum length.
            max_length: tokens per text, overriding the encoder's setting for ``kind``.
            prune_top: keep only the ``n`` largest weights of each vector.
            prune_threshold: drop weights below this value.
            progress: show a progress bar.
            stats: filled with counts (truncated and empty texts, pruned terms ...).

        Returns:
            Row ``i`` is the vector of ``texts[i]``; weights float32, ≥ 0.
        """
        n = len(texts)
        bar = tqdm(total=n, unit=kind[0], desc=f"encoding {kind}s", disable=not progress or None, leave=False)
        batches = []
        t0 = time.perf_counter()
        stats = EncodeStats() if stats is None else stats
        seconds = stats.seconds
        for batch in self.encode_batches(
            texts, ids, kind=kind, max_length=max_length, prune_top=prune_top, prune_threshold=prune_threshold,
            stats=stats,
        ):  # fmt: skip
            batches.append(batch)
            bar.update(len(batch.rows))
        bar.update(n - bar.n)
        bar.close()
        t1 = time.perf_counter()
        indptr, indices, values = assemble(batches, n)
        stats.stages["assemble"] = stats.stages.get("assemble", 0.0) + time.perf_counter() - t1
        coll = SparseCollection(indptr, indices, values, ids=ids, vocab=self.vocab, copy=False)
        stats.seconds = seconds + time.perf_counter() - t0
        return coll

    def encode_batches(
        self,
        texts: Sequence[str],
        ids: Sequence[str] | None = None,
        *,
        kind: Kind = "document",
        max_length: int | None = None,
        prune_top: int | None = None,
        prune_threshold: float | None = None,
        stats: EncodeStats | None = None,
    ) -> Iterator[SparseBatch]:
        """Encode ``texts`` batch by batch: each batch's vectors as CSR arrays on the host.

        The arguments are those of :meth:`encode`. Batches come in encoding order (by token
        length within windows of texts); a :class:`~gpusparse.encode_device.SparseBatch`
        names the input positions of its rows. Empty texts are in no batch. ``stats`` is
        complete once the iterator is exhausted. See :mod:`gpusparse.encode_device` for what
        runs on the device and how the host avoids waiting for it.
        """
        max_length = self._checked_length(texts, ids, kind, max_length, prune_top, prune_threshold)
        stats = EncodeStats() if stats is None else stats
        stats.kind, stats.max_length = kind, max_length
        t0 = time.perf_counter()
        n = len(texts)
        pin = self.device.type == "cuda"
        key = (max_length, self.word_cache)
        tokenize = self._tokenizers.get(key)
        if tokenize is None:  # a copy of the Rust tokenizer: made once per length (it takes ~0.1 s)
            tokenize = self._tokenizers[key] = Tokenize(self.tokenizer, max_length, word_cache=self.word_cache)
        if self._graphs is not None and self._graphs.batch_size != self.batch_size:  # batch_size was changed
            self._graphs.close()
            self._graphs = self._bucketed(capture=self._graphs.capture)
        graphs = self._graphs is not None and self._graphs.failed is None
        pad_to = functools.partial(bucket_length, max_length=max_length) if graphs else None
        tokens = token_batches(
            texts, tokenize, self.batch_size, window=self.sort_window, pin=pin, timer=stats.stages, pad_to=pad_to
        )
        if n > self.batch_size:
            # The next batches are tokenised while the model runs, a window ahead: the thread
            # tokenises the next window while the model works through this one's batches.
            depth = self.prefetch if self.prefetch is not None else -(-self.sort_window // self.batch_size) + 4
            tokens = prefetched(tokens, depth=depth)
        nonempty = 0
        try:
            for batch in sparse_batches(
                tokens, self._forward, self.device, prune_top=prune_top, prune_threshold=prune_threshold,
                timer=stats.stages,
            ):  # fmt: skip
                nonempty += len(batch.rows)
                lengths = np.diff(batch.indptr)
                stats.truncated += batch.truncated
                stats.nnz += int(batch.indptr[-1])
                stats.pruned_terms += int((batch.nnz_before - lengths).sum())
                stats.pruned_vectors += int(np.count_nonzero(batch.nnz_before > lengths))
                yield batch
        finally:
            tokens.close()  # type: ignore[attr-defined]
        stats.texts += n
        stats.empty_texts += n - nonempty
        stats.seconds += time.perf_counter() - t0

    # -- internals ----------------------------------------------------------------------

    def _bucketed(self, *, capture: bool) -> BucketedForward:
        """The forward on bucket-padded batches: CUDA graphs (``capture``) or the same eagerly."""
        pad = self.tokenizer.pad_token_id
        return BucketedForward(
            self.model, self.pooling, self.autocast_dtype, self.batch_size, self.device,
            eager=self._eager_forward, capture=capture, pad_id=int(pad) if pad is not None else 0,
        )  # fmt: skip

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, shortest: int) -> torch.Tensor:
        """Token ids and mask on the device → ``[b, V]`` float32 SPLADE vectors."""
        if self._graphs is not None:
            return self._graphs(input_ids, attention_mask, shortest)
        return self._eager_forward(input_ids, attention_mask, shortest)

    def _eager_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, shortest: int) -> torch.Tensor:
        """:meth:`_forward` without graphs: the model's own launches and its 2-D mask."""
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else nullcontext()
        )
        with ctx:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return splade_pool(logits, attention_mask, self.pooling, shortest=shortest)


def _autocast_dtype(dtype: DType, device: torch.device) -> torch.dtype | None:
    if dtype == "float32" or (dtype == "auto" and device.type != "cuda"):
        return None
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if dtype == "float16" else torch.bfloat16
