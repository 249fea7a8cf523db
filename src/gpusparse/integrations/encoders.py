"""The one place that picks an encoder backend by name: ``make_encoder(model, backend=...)``.

``"transformers"`` is our :class:`gpusparse.encode.SpladeEncoder` (any masked-LM model, max
or sum pooling, autocast on a GPU); ``"sentence-transformers"`` is
:class:`~gpusparse.integrations.sentence_transformers.SparseEncoderAdapter` (any
``SparseEncoder``: SPLADE, asymmetric and inference-free query encoders). Both return
:class:`~gpusparse.collection.SparseCollection` from ``encode(texts, ids, kind=...)``, so
``gpusparse encode``/``pipeline`` and :class:`gpusparse.pipeline.TextPipeline` take either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from ..encode import DEFAULT_BATCH_SIZE, DEFAULT_DOC_MAX_LENGTH, DEFAULT_QUERY_MAX_LENGTH, SpladeEncoder
from .sentence_transformers import SparseEncoderAdapter

Backend = Literal["transformers", "sentence-transformers"]
BACKENDS = ("transformers", "sentence-transformers")


def make_encoder(
    model: str | Path | Any,
    backend: Backend = "transformers",
    *,
    pooling: str = "max",
    query_max_length: int | None = DEFAULT_QUERY_MAX_LENGTH,
    doc_max_length: int | None = DEFAULT_DOC_MAX_LENGTH,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device | None = None,
    dtype: str = "auto",
    cuda_graphs: bool | str = "auto",
) -> SpladeEncoder | SparseEncoderAdapter:
    """An encoder of ``model`` (a folder or hub id; a loaded ``SparseEncoder`` for that backend).

    ``pooling``, ``dtype`` and ``cuda_graphs`` are the ``transformers`` backend's (a
    ``SparseEncoder`` carries its own pooling and dtype: anything but the defaults is refused
    there, rather than ignored). ``None`` lengths mean the model's own maximum
    (``sentence-transformers``).

    Raises:
        ValueError: an unknown backend, or an option the backend does not have.
        ImportError: the backend's package is not installed (with the extra to install).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "transformers":
        return SpladeEncoder(
            model,
            pooling=pooling,  # type: ignore[arg-type]
            query_max_length=query_max_length or DEFAULT_QUERY_MAX_LENGTH,
            doc_max_length=doc_max_length or DEFAULT_DOC_MAX_LENGTH,
            batch_size=batch_size,
            device=device,
            dtype=dtype,  # type: ignore[arg-type]
            cuda_graphs=cuda_graphs,  # type: ignore[arg-type]
        )
    if pooling != "max" or dtype != "auto" or cuda_graphs != "auto":
        raise ValueError(
            "the sentence-transformers backend takes pooling and dtype from the model and has no CUDA-graph "
            f"switch; drop pooling={pooling!r} / dtype={dtype!r} / cuda_graphs={cuda_graphs!r}"
        )
    return SparseEncoderAdapter(
        model,
        query_max_length=query_max_length,
        doc_max_length=doc_max_length,
        batch_size=batch_size,
        device=device,
    )
