"""Seeded synthetic SPLADE-like collections, generated on the device that will search them.

The shape follows the statistics of SPLADE on MS MARCO (``../shared/design/benchmarks.md``):
a 30,522-term vocabulary with heavy-tailed term popularity, ~120 non-zeros per document,
~45 per query, query terms biased towards popular (long) posting lists, and weights shaped
like ``log(1 + relu(x))`` in (0, ~3.5]. It is a first approximation; the benchmark prints
the achieved statistics beside the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BERT_VOCAB_SIZE = 30522


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a synthetic collection (defaults: MS MARCO-like)."""

    n_terms: int = BERT_VOCAB_SIZE
    doc_nnz_mean: float = 120.0
    doc_nnz_sd: float = 34.0
    doc_nnz_max: int = 300
    query_nnz_mean: float = 45.0
    query_nnz_sd: float = 15.0
    query_nnz_max: int = 107
    zipf: float = 1.0  # term popularity ∝ 1 / rank**zipf
    query_bias: float = 0.6  # query term probability ∝ popularity**query_bias
    active_terms: int = 28_700  # terms that occur at all


def _popularity(spec: SyntheticSpec, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    ranks = torch.arange(1, spec.active_terms + 1, dtype=torch.float64, device=device)
    p_active = 1.0 / ranks**spec.zipf
    perm = torch.randperm(spec.n_terms, generator=gen, device="cpu").to(device)
    p = torch.zeros(spec.n_terms, dtype=torch.float64, device=device)
    p[perm[: spec.active_terms]] = p_active
    return p / p.sum()


def _sample_rows(
    n: int,
    probs: torch.Tensor,
    mean: float,
    sd: float,
    max_nnz: int,
    gen: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR rows of distinct terms drawn from ``probs``, weights log1p-shaped."""
    target = (torch.randn(n, generator=gen, device=device) * sd + mean).round().clamp(1, max_nnz).to(torch.int64)
    # Draw with replacement, a little more than needed, then keep distinct terms per row.
    draws = (target.to(torch.float64) * 1.25 + 4).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(n, device=device), draws)
    cdf = torch.cumsum(probs, 0)
    cdf = cdf / cdf[-1]
    u = torch.rand(rows.numel(), generator=gen, device=device, dtype=torch.float64)
    terms = torch.searchsorted(cdf, u).clamp_max(probs.numel() - 1)
    key = torch.unique(rows * probs.numel() + terms)  # sorted: by row, then term
    rows, terms = key // probs.numel(), key % probs.numel()
    # Trim each row to its target length (keep a random subset: order terms randomly).
    counts = torch.bincount(rows, minlength=n)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(key.numel(), device=device) - start[rows]
    shuffle = torch.rand(key.numel(), generator=gen, device=device)
    order = torch.argsort(rows.to(torch.float64) + shuffle)  # random order inside each row
    rank_random = torch.empty_like(rank)
    rank_random[order] = rank
    keep = rank_random < target[rows]
    rows, terms = rows[keep], terms[keep]
    counts = torch.bincount(rows, minlength=n)
    indptr = torch.zeros(n + 1, dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(counts, 0)
    x = torch.exp(torch.randn(terms.numel(), generator=gen, device=device) * 0.9 - 0.4)
    weights = torch.log1p(x).clamp(0.01, 3.5).to(torch.float32)
    return indptr, terms.to(torch.int32), weights


def generate(
    n_docs: int,
    n_queries: int,
    *,
    spec: SyntheticSpec | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    doc_chunk: int = 1 << 20,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Documents and queries as canonical CSR tensors ``(indptr, terms, weights)`` on ``device``.

    Documents are generated in chunks of ``doc_chunk`` rows to bound temporaries.
    """
    spec = spec or SyntheticSpec()
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    pop = _popularity(spec, cpu_gen, device)
    parts = []
    for a in range(0, n_docs, doc_chunk):
        parts.append(
            _sample_rows(
                min(doc_chunk, n_docs - a), pop, spec.doc_nnz_mean, spec.doc_nnz_sd, spec.doc_nnz_max, gen, device
            )
        )
    indptr = torch.zeros(n_docs + 1, dtype=torch.int64, device=device)
    base, row = 0, 0
    for ip, _, _ in parts:
        indptr[row + 1 : row + ip.numel()] = ip[1:] + base
        base += int(ip[-1])
        row += ip.numel() - 1
    docs = (indptr, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
    qprobs = pop**spec.query_bias
    qprobs = torch.where(pop > 0, qprobs, torch.zeros_like(qprobs))
    queries = _sample_rows(
        n_queries, qprobs / qprobs.sum(), spec.query_nnz_mean, spec.query_nnz_sd, spec.query_nnz_max, gen, device
    )
    return docs, queries
