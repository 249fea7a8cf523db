"""Seeded synthetic SPLADE-like collections, generated on the device that will search them.

The shape follows the statistics of SPLADE (cocondenser-ensembledistil) on MS MARCO
(``../shared/design/benchmarks.md``); :data:`MSMARCO_TARGETS` lists them and
:func:`synthetic_stats` measures a generated collection so the benchmark can print both.

The model, per document ``d`` and query ``q``:

* term popularity ``π_t ∝ (rank_t + offset) ** -zipf`` over ``active_terms`` randomly
  chosen term ids (the rest never occur), so a few posting lists hold millions of
  documents at 8.8M and most hold a few thousand;
* topics: every document and query belongs to one of ``n_topics`` topics, and every term
  has a log-normal affinity ``a[t, c]`` (mean 1 over topics, spread ``topic_spread``).
  Documents draw terms with probability ``∝ π_t · a[t, z_d]``; queries draw them with
  probability ``∝ (π_t · a[t, z_q]) ** query_bias``. The affinity makes a query's terms
  co-occur in the same documents (as real queries' terms do), which sets how many
  documents a query touches for a given number of postings it reads; the bias makes
  queries favour long posting lists;
* the number of distinct terms per row is a clamped normal (mean, sd, max), drawn exactly:
  terms are sampled without replacement (successive sampling);
* weights ``log1p(exp(N(weight_mu, weight_sigma)))`` clamped to ``[1e-4, 3.5]``, the shape
  of ``log(1 + relu(x))`` that SPLADE outputs.

Documents are generated in chunks of rows, so temporaries stay bounded whatever the
collection's size; 8.8M documents (~1.06e9 postings) take seconds on an H100.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BERT_VOCAB_SIZE = 30522
MSMARCO_DOCS = 8_841_823

# What real SPLADE (cocondenser-ensembledistil) shows on MS MARCO passages, from
# benchmarks.md and the GPUSparse paper. ``postings_per_query_per_doc`` is inferred (see
# bench/NOTES.md): postings a query reads, divided by the collection's size.
MSMARCO_TARGETS: dict[str, float] = {
    "n_terms": BERT_VOCAB_SIZE,
    "nonempty_lists": 28_700,
    "doc_nnz_mean": 120.0,
    "doc_nnz_sd": 34.0,
    "doc_nnz_max": 300,
    "postings_at_8.8M": 1.06e9,
    "query_nnz_mean": 44.8,
    "query_nnz_max": 107,
    "frac_docs_touched": 0.53,
    "postings_per_query_per_doc": 2.0,
    "weight_max": 3.5,
}


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a synthetic collection (defaults: calibrated to MS MARCO SPLADE)."""

    n_terms: int = BERT_VOCAB_SIZE
    active_terms: int = 28_700  # terms that can occur at all
    doc_nnz_mean: float = 120.0
    doc_nnz_sd: float = 34.0
    doc_nnz_max: int = 300
    query_nnz_mean: float = 45.0
    query_nnz_sd: float = 15.0
    query_nnz_max: int = 107
    zipf: float = 1.1  # term popularity ∝ (rank + zipf_offset) ** -zipf
    zipf_offset: float = 20.0
    generic_frac: float = 0.43  # documents of the generic profile
    generic_exponent: float = 1.5  # generic documents draw terms ∝ π ** generic_exponent
    specific_exponent: float = 0.1  # the others ∝ π ** specific_exponent
    n_topics: int = 64
    topic_spread: float = 1.0  # sd of log affinity; 0 makes terms independent of topics
    query_bias: float = 0.75  # query term probability ∝ (π · affinity) ** query_bias
    weight_mu: float = -0.55  # weights are log1p(exp(N(mu, sigma)))
    weight_sigma: float = 1.1
    weight_max: float = 3.5

    def __post_init__(self) -> None:
        if not 0 < self.active_terms <= self.n_terms:
            raise ValueError(f"active_terms must be in [1, n_terms={self.n_terms}], not {self.active_terms}")
        for name in ("doc_nnz_max", "query_nnz_max"):
            if not 1 <= getattr(self, name) <= self.active_terms:
                raise ValueError(f"{name} must be in [1, active_terms], not {getattr(self, name)}")
        if self.n_topics < 1:
            raise ValueError(f"n_topics must be ≥ 1, not {self.n_topics}")
        if self.topic_spread < 0 or self.query_bias <= 0 or self.weight_sigma < 0:
            raise ValueError("topic_spread and weight_sigma must be ≥ 0 and query_bias > 0")
        if not 0 <= self.generic_frac <= 1:
            raise ValueError(f"generic_frac must be in [0, 1], not {self.generic_frac}")

    def with_doc_nnz(self, mean: float) -> SyntheticSpec:
        """The same model with ``mean`` non-zeros per document; the sd and the maximum scale with it.

        The calibrated shape (sd 34 and max 300 at mean 120) is kept in proportion, the
        maximum capped at ``active_terms``. Used by the paper's sparsity sweep.
        """
        if not mean >= 1:
            raise ValueError(f"mean non-zeros per document must be ≥ 1, not {mean}")
        scale = mean / self.doc_nnz_mean
        top = min(self.active_terms, max(1, round(self.doc_nnz_max * scale)))
        return replace(self, doc_nnz_mean=float(mean), doc_nnz_sd=self.doc_nnz_sd * scale, doc_nnz_max=top)

    def with_vocabulary(self, n_terms: int) -> SyntheticSpec:
        """The same model over ``n_terms`` terms: the share of terms that occur is kept
        (28,700 of 30,522), row lengths unchanged (capped at the active terms), so a
        collection of the same size has the same postings. Used by the vocabulary sweep.
        """
        if n_terms < 1:
            raise ValueError(f"n_terms must be ≥ 1, not {n_terms}")
        active = max(1, round(self.active_terms * n_terms / self.n_terms))
        return replace(
            self,
            n_terms=n_terms,
            active_terms=active,
            doc_nnz_max=min(self.doc_nnz_max, active),
            query_nnz_max=min(self.query_nnz_max, active),
        )

    def doc_chunk(self, postings: int = 1 << 26) -> int:
        """Documents generated at a time so a chunk holds about ``postings`` postings
        (at most ``2**19`` documents, the generator's default, which the calibrated mean keeps).
        """
        return max(1, min(1 << 19, int(postings // self.doc_nnz_mean)))


CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _term_model(spec: SyntheticSpec, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative term distributions: documents ``[2C, V]`` (row ``profile · C + topic``,
    profile 0 specific, 1 generic) and queries ``[C, V]``, float64.

    Drawn on the CPU from ``seed`` (small), so every device gets the same model.
    """
    gen = torch.Generator().manual_seed(seed)
    v, c = spec.n_terms, spec.n_topics
    ranks = torch.arange(1, spec.active_terms + 1, dtype=torch.float64)
    pop = torch.zeros(v, dtype=torch.float64)
    pop[torch.randperm(v, generator=gen)[: spec.active_terms]] = (ranks + spec.zipf_offset) ** -spec.zipf
    s = spec.topic_spread
    affinity = torch.exp(torch.randn((c, v), generator=gen, dtype=torch.float64) * s - s * s / 2)
    active = pop > 0
    profiles = torch.stack([_pow(pop, spec.specific_exponent, active), _pow(pop, spec.generic_exponent, active)])
    doc_p = (profiles[:, None, :] * affinity[None]).reshape(2 * c, v)
    query_p = _pow(pop * affinity, spec.query_bias, active)
    return _cdf(doc_p).to(device), _cdf(query_p).to(device)


def _pow(x: torch.Tensor, e: float, active: torch.Tensor) -> torch.Tensor:
    """``x ** e`` on active terms, 0 elsewhere (``0 ** 0`` would be 1)."""
    return torch.where(active, x**e, torch.zeros_like(x))


def _cdf(p: torch.Tensor) -> torch.Tensor:
    cdf = torch.cumsum(p, 1)
    return cdf / cdf[:, -1:]


def _row_lengths(n: int, mean: float, sd: float, max_nnz: int, gen: torch.Generator, device: torch.device):
    return (torch.randn(n, generator=gen, device=device) * sd + mean).round().clamp(1, max_nnz).to(torch.int64)


def _sample_rows(
    target: torch.Tensor, topics: torch.Tensor, cdf: torch.Tensor, gen: torch.Generator, max_rounds: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct terms of each row, drawn without replacement from its topic's distribution.

    Successive sampling: terms are drawn with replacement, and a row keeps the first
    ``target[row]`` distinct terms in draw order; rows that drew too few distinct terms
    draw again. Returns ``(rows, terms)`` int64, sorted by row, then term.
    """
    device = target.device
    n_rows, v = target.numel(), cdf.shape[1]
    flat_cdf = (cdf + torch.arange(cdf.shape[0], device=device, dtype=torch.float64)[:, None]).flatten()
    keys = torch.zeros(0, dtype=torch.int64, device=device)  # row * V + term, kept so far
    order = torch.zeros(0, dtype=torch.int64, device=device)  # draw position of each key
    drawn = 0
    need = target.clone()
    for round_ in range(max_rounds):
        short = need > 0
        if not bool(short.any()):
            break
        rows_short = short.nonzero().squeeze(1)
        # Enough draws that a row rarely needs a second round (popular terms repeat), and
        # twice as many each round for rows whose distribution is concentrated.
        extra = (need[rows_short].to(torch.float64) * (1.6 * 2.0 ** min(round_, 10)) + 8).to(torch.int64)
        rows = torch.repeat_interleave(rows_short, extra)
        u = torch.rand(rows.numel(), generator=gen, device=device, dtype=torch.float64)
        pos = torch.searchsorted(flat_cdf, u + topics[rows].to(torch.float64))
        terms = (pos - topics[rows] * v).clamp(0, v - 1)
        new_keys = rows * v + terms
        new_order = torch.arange(drawn, drawn + rows.numel(), device=device)
        drawn += rows.numel()
        # First occurrence of every distinct key, over what was kept and what was drawn.
        all_keys = torch.cat([keys, new_keys])
        all_order = torch.cat([order, new_order])
        uniq, inverse = torch.unique(all_keys, return_inverse=True)
        first = torch.full((uniq.numel(),), drawn, dtype=torch.int64, device=device)
        first.scatter_reduce_(0, inverse, all_order, reduce="amin")
        # Rank each row's distinct terms by draw order; keep the first target[row].
        urow = uniq // v
        by_draw = torch.argsort(urow * (drawn + 1) + first)
        counts = torch.bincount(urow, minlength=n_rows)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(by_draw)
        rank[by_draw] = torch.arange(by_draw.numel(), device=device) - start[urow[by_draw]]
        keep = rank < target[urow]
        keys, order = uniq[keep], first[keep]
        need = target - torch.bincount(urow[keep], minlength=n_rows)
    else:
        if bool((need > 0).any()):
            raise RuntimeError("could not draw enough distinct terms; lower the row lengths")
    return keys // v, keys % v  # unique() sorted the keys: by row, then term


def _weights(n: int, spec: SyntheticSpec, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    x = torch.randn(n, generator=gen, device=device) * spec.weight_sigma + spec.weight_mu
    return torch.nn.functional.softplus(x).clamp(1e-4, spec.weight_max).to(torch.float32)  # log1p(exp(x))


def _generate_rows(
    n: int,
    mean: float,
    sd: float,
    max_nnz: int,
    cdf: torch.Tensor,
    spec: SyntheticSpec,
    gen: torch.Generator,
    device: torch.device,
    chunk: int,
    generic_frac: float,
) -> CSR:
    """``n`` rows as canonical CSR, generated ``chunk`` rows at a time into preallocated arrays.

    Each row draws from row ``profile · C + topic`` of ``cdf``.
    """
    lengths = _row_lengths(n, mean, sd, max_nnz, gen, device)
    topics = torch.randint(0, spec.n_topics, (n,), generator=gen, device=device)
    generic = torch.rand(n, generator=gen, device=device) < generic_frac
    topics += generic.to(torch.int64) * spec.n_topics
    indptr = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=indptr[1:])
    nnz = int(indptr[-1])
    terms_out = torch.empty(nnz, dtype=torch.int32, device=device)
    weights_out = torch.empty(nnz, dtype=torch.float32, device=device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        _, terms = _sample_rows(lengths[a:b], topics[a:b], cdf, gen)
        lo, hi = int(indptr[a]), int(indptr[b])
        terms_out[lo:hi] = terms.to(torch.int32)
        weights_out[lo:hi] = _weights(hi - lo, spec, gen, device)
    return indptr, terms_out, weights_out


def generate(
    n_docs: int,
    n_queries: int,
    *,
    spec: SyntheticSpec | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    doc_chunk: int = 1 << 19,
) -> tuple[CSR, CSR]:
    """Documents and queries as canonical CSR tensors ``(indptr, terms, weights)`` on ``device``.

    ``indptr`` is int64, ``terms`` int32 (ascending and unique inside each row), ``weights``
    float32 in ``(0, spec.weight_max]``. The same ``seed`` on the same device gives the
    same collection; documents are generated ``doc_chunk`` rows at a time, which bounds
    temporaries to about 100 bytes per posting of a chunk.
    """
    if n_docs < 0 or n_queries < 0:
        raise ValueError("n_docs and n_queries must be ≥ 0")
    if doc_chunk < 1:
        raise ValueError("doc_chunk must be ≥ 1")
    spec = spec or SyntheticSpec()
    device = torch.device(device)
    doc_cdf, query_cdf = _term_model(spec, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    docs = _generate_rows(
        n_docs,
        spec.doc_nnz_mean,
        spec.doc_nnz_sd,
        spec.doc_nnz_max,
        doc_cdf,
        spec,
        gen,
        device,
        doc_chunk,
        spec.generic_frac,
    )
    queries = _generate_rows(
        n_queries,
        spec.query_nnz_mean,
        spec.query_nnz_sd,
        spec.query_nnz_max,
        query_cdf,
        spec,
        gen,
        device,
        doc_chunk,
        0.0,
    )
    return docs, queries


def synthetic_stats(
    docs: CSR,
    queries: CSR,
    *,
    n_terms: int = BERT_VOCAB_SIZE,
    max_queries: int = 64,
    chunk: int = 1 << 26,
) -> dict[str, float]:
    """Statistics of a collection and its queries, to compare with :data:`MSMARCO_TARGETS`.

    Works on any CSR ``(indptr, terms, weights)`` tensors (real or synthetic), on their
    device. The per-query figures (documents touched, postings read) average over the
    first ``max_queries`` queries; the fraction of documents touched and the postings per
    query per document do not depend on the collection's size for a given generator.
    """
    d_indptr, d_terms, d_weights = docs
    q_indptr, q_terms, _ = queries
    n_docs = d_indptr.numel() - 1
    dev = d_terms.device
    d_len = torch.diff(d_indptr).to(torch.float64)
    q_len = torch.diff(q_indptr).to(torch.float64)
    lengths = torch.zeros(n_terms, dtype=torch.int64, device=dev)
    for a in range(0, d_terms.numel(), chunk):
        lengths += torch.bincount(d_terms[a : a + chunk].to(torch.int64), minlength=n_terms)
    top = torch.sort(lengths, descending=True).values
    nonempty = int((lengths > 0).sum())
    n_post = int(d_terms.numel())
    stats: dict[str, float] = {
        "n_docs": n_docs,
        "n_postings": n_post,
        "doc_nnz_mean": float(d_len.mean()) if n_docs else 0.0,
        "doc_nnz_sd": float(d_len.std(correction=0)) if n_docs else 0.0,
        "doc_nnz_max": int(d_len.max()) if n_docs else 0,
        "nonempty_lists": nonempty,
        "longest_list": int(top[0]),
        "longest_list_frac": float(top[0]) / max(n_docs, 1),
        "lists_over_10pct_docs": int((lengths > 0.1 * n_docs).sum()),
        "median_nonempty_list": float(top[:nonempty].median()) if nonempty else 0.0,
        "postings_in_top_1pct_lists": float(top[: max(1, nonempty // 100)].sum()) / max(n_post, 1),
        "query_nnz_mean": float(q_len.mean()) if q_len.numel() else 0.0,
        "query_nnz_sd": float(q_len.std(correction=0)) if q_len.numel() else 0.0,
        "query_nnz_max": int(q_len.max()) if q_len.numel() else 0,
        "weight_median": _median(d_weights),
        "weight_p99": _quantile(d_weights, 0.99),
        "weight_max": float(d_weights.max()) if d_weights.numel() else 0.0,
        "weight_min": float(d_weights.min()) if d_weights.numel() else 0.0,
    }
    # Per query: postings of its terms, and distinct documents among them.
    nq = min(max_queries, q_indptr.numel() - 1)
    touched, postings, indep = [], [], []
    p_doc = lengths.to(torch.float64) / max(n_docs, 1)
    for i in range(nq):
        qt = q_terms[int(q_indptr[i]) : int(q_indptr[i + 1])].to(torch.int64)
        postings.append(float(lengths[qt].sum()))
        indep.append(1.0 - float(torch.prod(1.0 - p_doc[qt])))
        mask = torch.zeros(n_terms, dtype=torch.bool, device=dev)
        mask[qt] = True
        hit = torch.zeros(n_docs, dtype=torch.bool, device=dev)
        for a in range(0, n_post, chunk):
            pos = mask[d_terms[a : a + chunk].to(torch.int64)].nonzero().squeeze(1) + a
            if pos.numel():
                hit[torch.searchsorted(d_indptr, pos, right=True) - 1] = True
        touched.append(float(hit.sum()) / max(n_docs, 1))
    if nq:
        mean_post = sum(postings) / nq
        stats |= {
            "queries_measured": nq,
            "frac_docs_touched": sum(touched) / nq,
            "frac_docs_touched_if_independent": sum(indep) / nq,
            "postings_per_query": mean_post,
            "postings_per_query_per_doc": mean_post / max(n_docs, 1),
            "frac_postings_per_query": mean_post / max(n_post, 1),
            "mean_list_frac_of_query_terms": sum(postings) / max(float(q_len[:nq].sum()), 1.0) / max(n_docs, 1),
            "mean_list_frac_of_postings": float((lengths.to(torch.float64) ** 2).sum()) / max(n_post, 1) / n_docs,
        }
    return stats


def _quantile(x: torch.Tensor, q: float, sample: int = 1 << 20) -> float:
    if x.numel() == 0:
        return 0.0
    step = max(1, x.numel() // sample)
    return float(torch.quantile(x[::step].to(torch.float64), q))


def _median(x: torch.Tensor) -> float:
    return _quantile(x, 0.5)


def format_stats(stats: dict[str, float], targets: dict[str, float] | None = None) -> str:
    """Achieved statistics beside the targets, one per line."""
    targets = MSMARCO_TARGETS if targets is None else targets
    lines = [f"{'statistic':<36}{'achieved':>16}{'target':>14}"]
    for key, value in stats.items():
        tgt = targets.get(key)
        t = "" if tgt is None else _fmt(tgt)
        lines.append(f"{key:<36}{_fmt(value):>16}{t:>14}")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 100):
        return f"{int(x):,}"
    return f"{x:.4g}"
