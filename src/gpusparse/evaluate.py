"""Retrieval metrics with ``ir_measures`` (never computed by hand here).

:func:`evaluate` scores a run against relevance judgments with
``ir_measures.calc_aggregate`` for any measures ``ir_measures`` parses (``RR@10``,
``nDCG@10``, ``R@1000``, ``AP``, ``P@5``, ``nDCG@10(judged)`` ...; TREC names such as
``ndcg_cut.10`` are accepted too). Conventions, which are those of ``ir_measures``:

* every judged query counts: a query of the qrels with no results in the run scores 0
  (trec_eval's ``-c``); queries of the run without judgments are ignored;
* documents are ranked by score (descending), and ties are broken by the evaluator, not
  by the run's rank column (as trec_eval does);
* grades ≤ 0 are not relevant.

Nothing is dropped for having the same id as the query (BEIR's ``ignore_identical_ids``):
in Cranfield and CISI query and document ids collide and such pairs can be relevant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .beir import identical_id_pairs
from .errors import InputError
from .trec import read_qrels, read_trec_run

DEFAULT_MEASURES = ("RR@10", "nDCG@10", "R@100", "R@1000")

Run = Mapping[str, Mapping[str, float]]
Qrels = Mapping[str, Mapping[str, int]]


@dataclass(frozen=True)
class Evaluation:
    """Aggregate metrics of one run, with what a user should know about the inputs."""

    values: dict[str, float]
    n_queries: int
    missing_from_run: list[str] = field(default_factory=list)
    unjudged_in_run: list[str] = field(default_factory=list)
    identical_id_pairs: int = 0

    def warnings(self) -> list[str]:
        """Counted warnings, one line each, with examples."""
        out = []
        if self.missing_from_run:
            ex = ", ".join(repr(q) for q in self.missing_from_run[:3])
            out.append(
                f"{len(self.missing_from_run):,} of {self.n_queries:,} judged queries have no results in the run "
                f"(e.g. {ex}); they count as 0"
            )
        if self.unjudged_in_run:
            ex = ", ".join(repr(q) for q in self.unjudged_in_run[:3])
            out.append(f"{len(self.unjudged_in_run):,} queries of the run have no judgments (e.g. {ex}); ignored")
        return out

    def as_dict(self) -> dict[str, Any]:
        """For JSON reports."""
        return {
            "measures": dict(self.values),
            "judged_queries": self.n_queries,
            "judged_queries_without_results": len(self.missing_from_run),
            "run_queries_without_judgments": len(self.unjudged_in_run),
            "identical_id_relevant_pairs": self.identical_id_pairs,
        }


def parse_measures(spec: str | Sequence[str]) -> list[Any]:
    """``"RR@10 nDCG@10"`` (or a list of names) → ``ir_measures`` measures.

    Accepts ``ir_measures`` names (``nDCG@10``, ``R@1000``, ``AP(rel=2)``) and TREC names
    (``ndcg_cut.10``), separated by spaces or commas. Raises :class:`InputError` for a
    name neither understands.
    """
    import ir_measures

    names = spec.replace(",", " ").split() if isinstance(spec, str) else [str(s) for s in spec]
    if not names:
        raise InputError("no measures given", field="measures")
    out: list[Any] = []
    for name in names:
        try:
            out.append(ir_measures.parse_measure(name))
            continue
        except (ValueError, NameError, SyntaxError, TypeError, AttributeError):
            pass
        try:
            out.extend(ir_measures.parse_trec_measure(name))
        except (ValueError, NameError, SyntaxError, TypeError, AttributeError, KeyError):
            raise InputError(
                f"unknown measure {name!r} (examples: RR@10, nDCG@10, R@1000, AP, P@5, ndcg_cut.10)",
                field="measures",
            ) from None
    return list(dict.fromkeys(out))


def run_from_file(path: str | Path) -> dict[str, dict[str, float]]:
    """Read a TREC run into ``{qid: {docid: score}}``; a document listed twice for a query is an error."""
    run: dict[str, dict[str, float]] = {}
    for qid, rows in read_trec_run(path).items():
        docs: dict[str, float] = {}
        for doc, score in rows:
            if doc in docs:
                raise InputError(f"document {doc!r} appears twice for query {qid!r}", path=path)
            if not math.isfinite(score):
                raise InputError(f"score {score!r} of query {qid!r}, document {doc!r} is not finite", path=path)
            docs[doc] = score
        run[qid] = docs
    return run


def evaluate(
    run: Run | str | Path,
    qrels: Qrels | str | Path,
    measures: str | Sequence[str] | Sequence[Any] = DEFAULT_MEASURES,
) -> Evaluation:
    """Aggregate ``measures`` of ``run`` over the queries judged in ``qrels`` with ``ir_measures``.

    Args:
        run: ``{qid: {docid: score}}`` or a TREC run file.
        qrels: ``{qid: {docid: grade}}`` or a TREC / BEIR qrels file.
        measures: measure names (see :func:`parse_measures`) or ``ir_measures`` measures.

    Returns:
        :class:`Evaluation` with ``values[str(measure)]``.
    """
    import ir_measures

    if isinstance(measures, str):
        parsed = parse_measures(measures)
    else:
        parsed = [m if not isinstance(m, str) else None for m in measures]
        if any(m is None for m in parsed):
            parsed = parse_measures([str(m) for m in measures])
    run_d = run_from_file(run) if isinstance(run, str | Path) else {q: dict(d) for q, d in run.items()}
    qrels_d = read_qrels(qrels) if isinstance(qrels, str | Path) else {q: dict(d) for q, d in qrels.items()}
    if not qrels_d:
        raise InputError("no judgments in the qrels", path=qrels if isinstance(qrels, str | Path) else None)
    # ir_measures scores judged queries missing from the run as 0 and ignores unjudged ones.
    values = ir_measures.calc_aggregate(parsed, qrels_d, run_d)
    return Evaluation(
        values={str(m): float(values[m]) for m in parsed},
        n_queries=len(qrels_d),
        missing_from_run=[q for q in qrels_d if not run_d.get(q)],
        unjudged_in_run=[q for q in run_d if q not in qrels_d],
        identical_id_pairs=identical_id_pairs(qrels_d),
    )


def format_table(rows: Sequence[tuple[str, Evaluation]], *, digits: int = 4, label: str = "run") -> str:
    """A plain-text table: one row per run, one column per measure (and the judged-query count)."""
    if not rows:
        return ""
    measures = list(rows[0][1].values)
    header = [label, "queries", *measures]
    body = [
        [name, f"{ev.n_queries:,}", *(f"{ev.values.get(m, float('nan')):.{digits}f}" for m in measures)]
        for name, ev in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    return "\n".join([fmt(header), *(fmt(r) for r in body)])
