"""Reading BEIR-layout collections: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

A BEIR folder holds

* ``corpus.jsonl`` (or ``.jsonl.gz``): one ``{"_id", "title", "text"}`` object per line;
* ``queries.jsonl`` (or ``.jsonl.gz``): one ``{"_id", "text"}`` object per line;
* ``qrels/<split>.tsv``: the header ``query-id<TAB>corpus-id<TAB>score``, then one judged
  pair per line.

A document's text is ``title + " " + text`` (the text alone when the title is empty), as
BEIR's own dense and sparse retrievers join them.

**Identical ids.** Query ids and document ids live in separate namespaces: query ``23``
and document ``23`` are unrelated. BEIR's evaluation drops document *d* from the ranking
of query *d* by default (``ignore_identical_ids=True``), which is wrong for collections
whose numeric ids collide (Cranfield, CISI) and where such pairs are truly relevant.
Nothing here drops them; :func:`identical_id_pairs` only counts them for reports.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .collection import check_id, json_type_name
from .errors import InputError
from .formats import decode_json_line, record_dict
from .trec import read_qrels


@dataclass(frozen=True)
class Texts:
    """Ids and texts read from a BEIR JSONL file, in file order."""

    ids: list[str]
    texts: list[str]
    path: Path

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_empty(self) -> int:
        """Texts that are empty or only whitespace."""
        return sum(1 for t in self.texts if not t.strip())

    def select(self, ids: set[str]) -> Texts:
        """The entries whose id is in ``ids``, in file order."""
        keep = [i for i, x in enumerate(self.ids) if x in ids]
        return Texts([self.ids[i] for i in keep], [self.texts[i] for i in keep], self.path)


@dataclass(frozen=True)
class QrelsCheck:
    """How qrels relate to the queries and documents they name (for warnings)."""

    unknown_queries: list[str] = field(default_factory=list)
    unknown_documents: list[tuple[str, str]] = field(default_factory=list)
    identical_id_pairs: int = 0

    def warnings(self, qrels_path: str | Path) -> list[str]:
        """One line per problem, counted, with examples."""
        out = []
        if self.unknown_queries:
            ex = ", ".join(repr(q) for q in self.unknown_queries[:3])
            out.append(
                f"{qrels_path}: {len(self.unknown_queries):,} judged queries are not in the queries file "
                f"(e.g. {ex}); they have no results and count as 0 in the averages"
            )
        if self.unknown_documents:
            q, d = self.unknown_documents[0]
            out.append(
                f"{qrels_path}: {len(self.unknown_documents):,} judged pairs name documents missing from the corpus "
                f"(e.g. query {q!r}, document {d!r}); no run can retrieve them"
            )
        return out


@dataclass(frozen=True)
class BeirCollection:
    """A BEIR folder read into memory: corpus, queries and the qrels of one split."""

    path: Path
    corpus: Texts
    queries: Texts
    qrels: dict[str, dict[str, int]]
    qrels_path: Path | None

    def judged_queries(self) -> Texts:
        """The queries that have at least one judgment in the qrels (all if there are no qrels)."""
        if self.qrels_path is None:
            return self.queries
        return self.queries.select(set(self.qrels))

    def check_qrels(self) -> QrelsCheck:
        """Qrels queries and documents that the files do not have, and identical-id pairs."""
        return check_qrels(self.qrels, set(self.queries.ids), set(self.corpus.ids))


def document_text(title: object, text: object) -> str:
    """``title + " " + text``, or the text alone when the title is empty."""
    title = (title or "").strip() if isinstance(title, str) else ""
    text = text if isinstance(text, str) else ""
    return f"{title} {text}" if title else text


def beir_file(folder: str | Path, name: str) -> Path:
    """``folder/name.jsonl`` or ``folder/name.jsonl.gz``; :class:`InputError` if neither exists."""
    folder = Path(folder)
    for suffix in (".jsonl", ".jsonl.gz"):
        p = folder / f"{name}{suffix}"
        if p.is_file():
            return p
    raise InputError(f"{name}.jsonl not found (a BEIR folder holds corpus.jsonl, queries.jsonl, qrels/)", path=folder)


def read_beir(folder: str | Path, split: str = "test", *, require_qrels: bool = True) -> BeirCollection:
    """Read a BEIR folder: corpus, queries and ``qrels/<split>.tsv``.

    Raises :class:`InputError` naming the file (and line and field) for a missing folder
    or file, an empty corpus or queries file, malformed JSON, a missing, duplicate or
    unprintable ``_id`` (see :func:`~gpusparse.collection.id_problem`), or a non-string text. Empty
    texts are allowed (see :attr:`Texts.n_empty`); callers report them.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(
            "no such folder (expected a BEIR folder with corpus.jsonl, queries.jsonl, qrels/)", path=folder
        )
    corpus = read_corpus(beir_file(folder, "corpus"))
    queries = read_queries(beir_file(folder, "queries"))
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        if require_qrels:
            splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv")) if (folder / "qrels").is_dir() else []
            have = f"; it has: {', '.join(splits)}" if splits else ""
            raise InputError(f"qrels/{split}.tsv not found{have}", path=folder)
        return BeirCollection(folder, corpus, queries, {}, None)
    return BeirCollection(folder, corpus, queries, read_qrels(qrels_path), qrels_path)


def read_corpus(path: str | Path) -> Texts:
    """Read ``corpus.jsonl``: ids and ``title + " " + text``."""
    path = Path(path)
    ids: list[str] = []
    texts: list[str] = []
    seen: dict[str, int] = {}
    for lineno, obj in _records(path):
        doc_id = _id(obj, path, lineno, seen)
        text = obj.get("text", "")
        title = obj.get("title", "")
        for name, value in (("text", text), ("title", title)):
            if value is not None and not isinstance(value, str):
                raise InputError(f"expected a string, got {json_type_name(value)}", path=path, line=lineno, field=name)
        ids.append(doc_id)
        texts.append(document_text(title, text))
    return Texts(ids, texts, path)


def read_queries(path: str | Path) -> Texts:
    """Read ``queries.jsonl``: ids and texts."""
    path = Path(path)
    ids: list[str] = []
    texts: list[str] = []
    seen: dict[str, int] = {}
    for lineno, obj in _records(path):
        qid = _id(obj, path, lineno, seen)
        if "text" not in obj:
            raise InputError("missing", path=path, line=lineno, field="text")
        text = obj["text"]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise InputError(f"expected a string, got {json_type_name(text)}", path=path, line=lineno, field="text")
        ids.append(qid)
        texts.append(text)
    return Texts(ids, texts, path)


def check_qrels(qrels: Mapping[str, Mapping[str, int]], query_ids: set[str], doc_ids: set[str]) -> QrelsCheck:
    """Judged queries missing from ``query_ids``, judged documents missing from ``doc_ids``,
    and the number of judged pairs whose query id equals the document id (kept, never dropped).
    """
    unknown_q = [q for q in qrels if q not in query_ids]
    unknown_d = [(q, d) for q, docs in qrels.items() for d in docs if d not in doc_ids]
    return QrelsCheck(unknown_q, unknown_d, identical_id_pairs(qrels))


def identical_id_pairs(qrels: Mapping[str, Mapping[str, int]]) -> int:
    """Relevant judged pairs (grade > 0) whose query id equals the document id."""
    return sum(1 for q, docs in qrels.items() if docs.get(q, 0) > 0)


def _id(obj: dict, path: Path, lineno: int, seen: dict[str, int]) -> str:
    # The same rules as vector files: these ids end up in the same TREC runs.
    s = check_id(obj.get("_id", obj.get("id")), path=path, line=lineno, field="_id")
    first = seen.setdefault(s, lineno)
    if first != lineno:
        raise InputError(f"duplicate id {s!r} (first at line {first})", path=path, line=lineno, field="_id")
    return s


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    n = 0
    try:
        if path.name.endswith(".gz") and path.stat().st_size == 0:
            raise InputError("empty file (0 bytes), not gzip data", path=path)
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = decode_json_line(line, path=path, line=lineno)
                if type(obj) is tuple:  # a repeated key
                    obj = record_dict(obj, ("_id", "id", "title", "text"), path=path, line=lineno)
                if not isinstance(obj, dict):
                    raise InputError(f"expected a JSON object, got {json_type_name(obj)}", path=path, line=lineno)
                n += 1
                yield lineno, obj
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=path) from None
    if n == 0:
        raise InputError("no records: the file is empty or holds only blank lines", path=path)
