"""The calibrated synthetic collection (:mod:`gpusparse.synthetic`) as a stream of document chunks.

:func:`gpusparse.synthetic.generate` draws a whole collection from one random stream, so a
part of it cannot be drawn again without drawing everything before it. A
:class:`SyntheticStream` uses the same model (one term model, from ``seed``) but draws every
chunk of ``chunk_docs`` documents from a random stream of its own (seeded from ``seed`` and
the chunk's number), so that:

* a collection larger than the device (100M documents: ~12e9 postings, 144 GB as CSR) is
  built chunk by chunk, never held whole (:func:`gpusparse.layout.chunked.build_tiled_chunks`);
* any chunk can be drawn again, bit for bit, later (an exact reference scores sampled queries
  against each chunk in turn, :mod:`gpusparse.engines.chunk_reference`).

The documents' statistics are :func:`~gpusparse.synthetic.generate`'s (same model, same
draws per document), not its exact collection: the random streams differ. The same
``(n_docs, spec, seed, chunk_docs, rows_per_step)`` on the same device gives the same chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .synthetic import CSR, SyntheticSpec, _generate_rows, _term_model

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, stream) pairs over the generator's seeds


class SyntheticStream:
    """``n_docs`` calibrated documents in chunks of ``chunk_docs`` (CSR on ``device``, doc ids
    contiguous), and queries from the same model.

    ``rows_per_step`` documents are sampled at a time inside a chunk (temporaries about 100
    bytes a posting of a step); it is part of what a chunk's draws depend on.
    """

    def __init__(
        self,
        n_docs: int,
        *,
        spec: SyntheticSpec | None = None,
        seed: int = 0,
        chunk_docs: int = 1 << 20,
        device: str | torch.device = "cpu",
        rows_per_step: int = 1 << 16,
    ) -> None:
        if n_docs < 0:
            raise ValueError(f"n_docs must be ≥ 0, not {n_docs}")
        if chunk_docs < 1 or rows_per_step < 1:
            raise ValueError("chunk_docs and rows_per_step must be ≥ 1")
        self.n_docs, self.seed, self.chunk_docs, self.rows_per_step = n_docs, seed, chunk_docs, rows_per_step
        self.spec = spec or SyntheticSpec()
        self.device = torch.device(device)
        self._doc_cdf, self._query_cdf = _term_model(self.spec, seed, self.device)

    @property
    def n_terms(self) -> int:
        """Vocabulary size of the model."""
        return self.spec.n_terms

    @property
    def n_chunks(self) -> int:
        """Number of chunks (the last may hold fewer than ``chunk_docs`` documents)."""
        return -(-self.n_docs // self.chunk_docs)

    def bounds(self, i: int) -> tuple[int, int]:
        """Documents ``[a, b)`` of chunk ``i``."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} of {self.n_chunks}")
        a = i * self.chunk_docs
        return a, min(self.n_docs, a + self.chunk_docs)

    def chunk(self, i: int) -> CSR:
        """Chunk ``i`` as canonical CSR ``(indptr int64, terms int32, weights float32)``: its
        rows are documents ``bounds(i)[0] ..``; the same tensors every time it is drawn."""
        a, b = self.bounds(i)
        spec = self.spec
        return _generate_rows(
            b - a, spec.doc_nnz_mean, spec.doc_nnz_sd, spec.doc_nnz_max, self._doc_cdf, spec,
            self._generator(i + 1), self.device, self.rows_per_step, spec.generic_frac,
        )  # fmt: skip

    def __iter__(self) -> Iterator[CSR]:
        """Every chunk, in order."""
        return (self.chunk(i) for i in range(self.n_chunks))

    def queries(self, n: int) -> CSR:
        """``n`` queries drawn from the model's query distribution (their own random stream)."""
        spec = self.spec
        return _generate_rows(
            n, spec.query_nnz_mean, spec.query_nnz_sd, spec.query_nnz_max, self._query_cdf, spec,
            self._generator(0), self.device, self.rows_per_step, 0.0,
        )  # fmt: skip

    def _generator(self, stream: int) -> torch.Generator:
        seed = (self.seed * _GOLDEN + stream * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)
        return torch.Generator(device=self.device).manual_seed(seed)
