"""SPLADE encoding: text to sparse vectors with a masked-language model.

For a text with tokens ``t = 1..L`` (``[CLS]`` and ``[SEP]`` included), a masked-LM head
gives logits ``z[t, v]`` over the vocabulary; the sparse vector is

* ``max`` pooling (SPLADE v2 / SPLADE++): ``w[v] = max_t log(1 + relu(z[t, v])) · mask[t]``
* ``sum`` pooling (the original SPLADE):  ``w[v] = Σ_t  log(1 + relu(z[t, v])) · mask[t]``

where ``mask`` is the attention mask (padding contributes nothing). Any model that
``transformers.AutoModelForMaskedLM`` loads works: a local folder or a hub id (the
default is ``naver/splade-cocondenser-ensembledistil``).

Texts are batched in order of their token length, which cuts padding; results come back
in input order and do not depend on the batching beyond float rounding. Texts longer
than the maximum length are truncated and counted; empty texts give empty vectors
without running the model. On a GPU the model runs under fp16/bf16 autocast; pooling is
always done in float32.

``transformers`` is an optional dependency (``pip install 'gpusparse[encode]'``); it is
imported when an encoder is created, never when this module is.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from .collection import SparseCollection
from .errors import InputError
from .vocab import Vocabulary

Pooling = Literal["max", "sum"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Kind = Literal["query", "document"]

DEFAULT_MODEL = "naver/splade-cocondenser-ensembledistil"
DEFAULT_QUERY_MAX_LENGTH = 64
DEFAULT_DOC_MAX_LENGTH = 256
DEFAULT_BATCH_SIZE = 32
POOLINGS = ("max", "sum")
DTYPES = ("auto", "float32", "float16", "bfloat16")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
_INSTALL_HINT = "the SPLADE encoder needs transformers: pip install 'gpusparse[encode]'"


@dataclass
class EncodeStats:
    """What an encoding saw: counts a user should hear about."""

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


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling = "max") -> torch.Tensor:
    """``[B, L, V]`` masked-LM logits → ``[B, V]`` float32 SPLADE vectors (see the module docstring).

    Overwrites ``logits``. Max pooling takes the maximum of the logits first and applies
    ``log(1 + relu(.))`` to it: the function is monotone and maps padding (set to 0) to 0,
    so this is the same number, at a fraction of the cost.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    padding = (attention_mask == 0).unsqueeze(-1)
    if pooling == "max":
        top = logits.masked_fill_(padding, 0).amax(dim=1).float()
        return torch.log1p_(torch.relu_(top))
    w = logits.float() if logits.dtype != torch.float32 else logits
    w = torch.log1p_(torch.relu_(w)).masked_fill_(padding, 0)
    return w.sum(dim=1)


def prune(vectors: torch.Tensor, *, top: int | None = None, threshold: float | None = None) -> torch.Tensor:
    """Keep the ``top`` largest weights of each row and/or those ``>= threshold`` (in place)."""
    if threshold is not None:
        vectors.masked_fill_(vectors < threshold, 0.0)
    if top is not None and top < vectors.shape[1]:
        kth = torch.topk(vectors, top, dim=1).indices
        keep = torch.zeros_like(vectors, dtype=torch.bool).scatter_(1, kth, True)
        vectors.masked_fill_(~keep, 0.0)
    return vectors


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
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        for name, value in (
            ("query_max_length", query_max_length),
            ("doc_max_length", doc_max_length),
            ("batch_size", batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
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
        max_length = self._checked_length(texts, ids, kind, max_length, prune_top, prune_threshold)
        stats = EncodeStats() if stats is None else stats
        stats.kind, stats.max_length = kind, max_length
        t0 = time.perf_counter()
        n, n_terms = len(texts), len(self.vocab)

        lengths = self._token_lengths(texts, max_length)
        nonempty = [i for i in range(n) if lengths[i] > 0]
        stats.texts += n
        stats.empty_texts += n - len(nonempty)
        stats.truncated += sum(1 for i in nonempty if lengths[i] > max_length)
        order = sorted(nonempty, key=lambda i: min(lengths[i], max_length))  # stable: ties keep input order

        row_len = np.zeros(n, dtype=np.int64)
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        bar = tqdm(total=n, unit=kind[0], desc=f"encoding {kind}s", disable=not progress or None, leave=False)
        bar.update(n - len(nonempty))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                reps = self._forward([texts[i] for i in batch], max_length)
                if prune_top is not None or prune_threshold is not None:
                    before = (reps > 0).sum(dim=1)
                    prune(reps, top=prune_top, threshold=prune_threshold)
                    cut = before - (reps > 0).sum(dim=1)
                    stats.pruned_terms += int(cut.sum())
                    stats.pruned_vectors += int((cut > 0).sum())
                r, c = torch.nonzero(reps, as_tuple=True)
                row_len[batch] = torch.bincount(r, minlength=len(batch)).cpu().numpy()
                cols.append(c.to(torch.int32).cpu().numpy())
                vals.append(reps[r, c].cpu().numpy())
                bar.update(len(batch))
        bar.close()

        # Rows were produced in `order`; put them back in input order.
        sorted_lengths = row_len[order]
        indptr = np.concatenate([[0], np.cumsum(sorted_lengths)])
        by_order = sp.csr_matrix(
            (
                np.concatenate(vals) if vals else np.zeros(0, np.float32),
                np.concatenate(cols) if cols else np.zeros(0, np.int32),
                indptr,
            ),
            shape=(len(order), n_terms),
        )
        pos = np.full(n, -1, dtype=np.int64)
        pos[order] = np.arange(len(order))
        empty = sp.csr_matrix((1, n_terms), dtype=np.float32)
        stacked = sp.vstack([by_order, empty], format="csr")  # row len(order) is the empty vector
        out = stacked[np.where(pos < 0, len(order), pos)]
        coll = SparseCollection(out.indptr, out.indices, out.data, ids=ids, vocab=self.vocab)
        stats.nnz += coll.nnz
        stats.seconds += time.perf_counter() - t0
        return coll

    # -- internals ----------------------------------------------------------------------

    def _forward(self, texts: list[str], max_length: int) -> torch.Tensor:
        enc = self.tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else nullcontext()
        )
        with ctx:
            logits = self.model(**enc).logits
        return splade_pool(logits, enc["attention_mask"], self.pooling)


def _autocast_dtype(dtype: DType, device: torch.device) -> torch.dtype | None:
    if dtype == "float32" or (dtype == "auto" and device.type != "cuda"):
        return None
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if dtype == "float16" else torch.bfloat16


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return transformers


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1


def check_model_folder(path: Path) -> None:
    """Refuse a local model folder that lacks a config, weights or a tokenizer."""
    if not path.is_dir():
        raise InputError("not a folder (expected a model folder or a hub id)", path=path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in _WEIGHT_FILES):
        missing.append("weights (model.safetensors or pytorch_model.bin)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or vocab.txt)")
    if missing:
        raise InputError(f"model folder lacks {', '.join(missing)}", path=path)


def load_masked_lm(model: str | Path) -> tuple[Any, torch.nn.Module]:
    """Load ``(tokenizer, AutoModelForMaskedLM)`` from a local folder or a hub id.

    Raises:
        InputError: the folder is missing files, or loading fails (one line, with the cause).
    """
    transformers = _transformers()
    name = str(model)
    path = Path(name).expanduser()
    if path.exists():
        check_model_folder(path)
        source: str = str(path)
    elif isinstance(model, Path) or _looks_local(name):
        raise InputError("no such model folder", path=name)
    else:
        source = name
    # A hub id without a network: read the local cache only (transformers would retry for
    # about a minute before failing).
    offline = not path.exists() and (_env_true("HF_HUB_OFFLINE") or not hub_reachable())
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=offline)
        mlm = transformers.AutoModelForMaskedLM.from_pretrained(source, local_files_only=offline)
    except Exception as exc:  # transformers, safetensors and torch raise many kinds for a bad folder
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if path.exists():
            hint = ""
        elif offline:
            first = "the hub is offline (HF_HUB_OFFLINE=1) or unreachable, and the model is not in the local cache"
            hint = "; give the path of a downloaded model folder, or download it where there is a network"
        else:
            hint = " (without a network, set HF_HUB_OFFLINE=1 to use the local cache, or give a model folder's path)"
        raise InputError(f"cannot load a masked-LM model: {first}{hint}", path=name) from None
    return tokenizer, mlm


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub (``HF_ENDPOINT``, default huggingface.co) accepts a TCP
    connection within ``timeout`` seconds; ``True`` behind a proxy (not probed)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def model_vocabulary(tokenizer: Any, size: int) -> Vocabulary:
    """The vocabulary of the model's output layer: token of each logit index ``0 .. size-1``.

    BERT's WordPiece vocabulary (as used by SPLADE) comes back as :meth:`Vocabulary.bert`,
    so vectors from such models query indexes built from files written by other tools.
    """
    tokens = [f"[gpusparse:unnamed-{i}]" for i in range(size)]
    for tok, i in tokenizer.get_vocab().items():
        if 0 <= i < size:
            tokens[i] = tok
    bert = Vocabulary.bert()
    if size == len(bert) and tokens == bert.tokens():
        return bert
    return Vocabulary(tokens)


def random_bert_base(tokenizer_source: str | Path, *, seed: int = 0, **overrides: Any) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, BertForMaskedLM)``: BERT-base sizes (``transformers.BertConfig()`` defaults:
    12 layers, hidden 768, 12 heads) with random weights, and the tokenizer of a local folder.

    For timing a full-size SPLADE encoder where no checkpoint is available: the cost of a
    forward pass does not depend on the weights (its output's sparsity does). The output
    layer has the tokenizer's vocabulary size. ``overrides`` change config fields (the
    benchmark's dry run shrinks the model with them). Nothing is downloaded.
    """
    transformers = _transformers()
    path = Path(tokenizer_source).expanduser()
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise InputError("no tokenizer here (tokenizer.json or vocab.txt)", path=path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    config = transformers.BertConfig(vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    return tokenizer, transformers.BertForMaskedLM(config)
