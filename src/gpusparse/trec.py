"""TREC run files (``qid Q0 docid rank score tag``) and TREC or BEIR qrels: readers and the
run writer. Reading and writing agree on ids: what :func:`write_trec_run` writes,
:func:`read_trec_run` reads back unchanged, and both refuse ids a whitespace-separated line
cannot hold. Files ending in ``.gz`` are (de)compressed transparently; every problem raises
:class:`~gpusparse.errors.InputError` naming the file and the line.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .collection import id_problem
from .errors import InputError


def write_trec_run(
    path: str | Path,
    qids: Sequence[str],
    doc_ids: Sequence[str],
    scores: np.ndarray,
    ranked: np.ndarray,
    *,
    tag: str = "gpusparse",
) -> int:
    """Write search results as a TREC run: ``qid Q0 docid rank score tag``.

    ``ranked`` holds internal document numbers ``[n_queries, k]`` (``-1`` = no result,
    skipped), ``scores`` their scores. Ranks start at 1. Returns the number of lines.

    Refuses, before writing anything: a score that is not finite (``inf`` from a float32
    overflow would rank wrongly and break readers), and a query id, document id or tag
    that a whitespace-separated line cannot hold (see :func:`~gpusparse.collection.id_problem`).
    """
    if id_problem(tag) is not None:
        raise ValueError(f"run tag {tag!r} must be one word")
    scores = np.asarray(scores, dtype=np.float32)
    ranked = np.asarray(ranked)
    _check_run(qids, doc_ids, scores, ranked)
    n = 0
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for qi, qid in enumerate(qids):
            lines = []
            for r, (d, s) in enumerate(zip(ranked[qi].tolist(), scores[qi], strict=True)):
                if d < 0:
                    break
                lines.append(f"{qid} Q0 {doc_ids[d]} {r + 1} {s!s} {tag}\n")  # shortest float32 repr
            f.writelines(lines)
            n += len(lines)
    return n


def _check_run(qids: Sequence[str], doc_ids: Sequence[str], scores: np.ndarray, ranked: np.ndarray) -> None:
    """What :func:`write_trec_run` refuses; whole-array checks, not per line."""
    bad = ~np.isfinite(scores[: len(qids)]) & (ranked[: len(qids)] >= 0)
    if bad.any():
        qi, r = (int(x) for x in np.argwhere(bad)[0])
        raise InputError(
            f"query {qids[qi]!r}: score {scores[qi, r]} for document {doc_ids[int(ranked[qi, r])]!r} is not finite "
            "(the query's weights are too large for float32 scores); no run written",
            field="scores",
        )
    used = np.unique(ranked[: len(qids)][ranked[: len(qids)] >= 0])
    for kind, ids in (("query", list(qids)), ("document", [doc_ids[i] for i in used.tolist()])):
        bad_id = _first_bad_id(ids)
        if bad_id is not None:
            raise InputError(f"{kind} id {bad_id!r} {id_problem(bad_id)}: a TREC run cannot hold it", field="id")


def _first_bad_id(ids: list[str]) -> str | None:
    """The first id :func:`id_problem` refuses, or ``None``; a few C calls when all are fine."""
    if all(ids) and (joined := "".join(ids)).isprintable() and " " not in joined:
        return None
    return next((i for i in ids if id_problem(i) is not None), None)


def read_trec_run(path: str | Path) -> dict[str, list[tuple[str, float]]]:
    """Read a TREC run into ``{qid: [(docid, score), ...]}`` in file order."""
    path = Path(path)
    run: dict[str, list[tuple[str, float]]] = {}
    for lineno, parts in _columns(path):
        if len(parts) != 6:
            raise InputError(
                f"expected 6 columns (qid Q0 docid rank score tag), got {len(parts)}", path=path, line=lineno
            )
        try:
            int(parts[3])
            score = float(parts[4])
        except ValueError:
            raise InputError(f"bad rank {parts[3]!r} or score {parts[4]!r}", path=path, line=lineno) from None
        if not math.isfinite(score):  # write_trec_run refuses these too; they sort arbitrarily
            raise InputError(f"score {parts[4]!r} is not finite", path=path, line=lineno)
        _check_columns_ids(parts[0], parts[2], path, lineno)
        run.setdefault(parts[0], []).append((parts[2], score))
    return run


def read_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """Read relevance judgments into ``{qid: {docid: grade}}``.

    Accepts TREC qrels (``qid iter docid grade``, whitespace-separated) and BEIR TSV
    (``query-id<TAB>corpus-id<TAB>score`` with that header line).
    """
    path = Path(path)
    qrels: dict[str, dict[str, int]] = {}
    for lineno, parts in _columns(path):
        if lineno == 1 and parts[:2] == ["query-id", "corpus-id"]:
            continue
        if len(parts) == 4:
            qid, doc, grade = parts[0], parts[2], parts[3]
        elif len(parts) == 3:
            qid, doc, grade = parts
        else:
            raise InputError(f"expected 3 (BEIR) or 4 (TREC) columns, got {len(parts)}", path=path, line=lineno)
        _check_columns_ids(qid, doc, path, lineno)
        try:
            g = int(grade) if grade.lstrip("-").isdigit() else int(float(grade))
        except (ValueError, OverflowError):
            raise InputError(f"relevance grade {grade!r} is not an integer", path=path, line=lineno) from None
        qrels.setdefault(qid, {})[doc] = g
    return qrels


def _check_columns_ids(qid: str, doc: str, path: Path, lineno: int) -> None:
    """Ids read from columns hold no whitespace; refuse the control and invisible
    characters that :func:`write_trec_run` refuses, so reading and writing agree."""
    if not (qid.isprintable() and doc.isprintable()):
        bad = qid if not qid.isprintable() else doc
        raise InputError(f"id {bad!r} {id_problem(bad)}", path=path, line=lineno)


def _columns(path: Path) -> Iterator[tuple[int, list[str]]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        if path.name.endswith(".gz") and path.stat().st_size == 0:
            raise InputError("empty file (0 bytes), not gzip data", path=path)
        # utf-8-sig: a byte-order mark (editors on Windows) is not part of the first qid
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.split()
                if parts:
                    yield lineno, parts
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=path) from None
