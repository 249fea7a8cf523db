"""Text query files (topics) in the formats of BEIR and Anserini, and telling them from vector files.

* BEIR ``queries.jsonl``: ``{"_id": ..., "text": ...}`` per line;
* Anserini JSONL topics: ``{"qid": ..., "query" | "title" | "text": ...}`` per line;
* Anserini TSV topics: ``qid<TAB>text`` per line (also the pretokenized ones: the text is
  then a list of tokens, see :func:`token_counts`).

Any of them may be gzipped (``.gz``). A JSONL record with a ``vector`` field is a vector
file (:func:`gpusparse.formats.read_vectors`), not a topic file: :func:`is_text_query_file`
tells the two apart from the first record.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .beir import Texts
from .collection import check_id, json_type_name
from .errors import InputError

ID_FIELDS = ("_id", "id", "qid")
TEXT_FIELDS = ("text", "query", "title")


def is_text_query_file(path: str | Path) -> bool:
    """Whether ``path`` holds text queries (a TSV line, or a JSON record without ``vector``);
    ``False`` for vector files (JSONL with ``vector``, Seismic ``.bin``) and unreadable ones
    (their reader reports the problem)."""
    path = Path(path)
    if path.suffix == ".bin" or not path.is_file():
        return False
    try:
        for _, line in _lines(path):
            if not line.lstrip().startswith("{"):
                return "\t" in line
            try:
                obj = json.loads(line)
            except ValueError:
                return False
            return isinstance(obj, dict) and "vector" not in obj and any(f in obj for f in TEXT_FIELDS)
    except InputError:
        return False
    return False


def read_query_texts(path: str | Path) -> Texts:
    """Ids and texts of a BEIR or Anserini query file (JSONL or TSV, gzipped or not).

    Raises:
        InputError: a record without an id or a text, a duplicate id, a TSV line without a
            tab, or a file that is empty, truncated or not UTF-8 (file, line and field).
    """
    path = Path(path)
    ids: list[str] = []
    texts: list[str] = []
    seen: dict[str, int] = {}
    for lineno, line in _lines(path):
        if line.lstrip().startswith("{"):
            qid, text = _json_record(line, path, lineno)
        else:
            qid_text, tab, text = line.rstrip("\r\n").partition("\t")
            if not tab:
                raise InputError("expected 'query id<TAB>text' (a TSV topic line)", path=path, line=lineno)
            qid = check_id(qid_text.strip(), path=path, line=lineno, field="qid")
        first = seen.setdefault(qid, lineno)
        if first != lineno:
            raise InputError(f"duplicate query id {qid!r} (first at line {first})", path=path, line=lineno)
        ids.append(qid)
        texts.append(text)
    if not ids:
        raise InputError("no queries: the file is empty or holds only blank lines", path=path)
    return Texts(ids, texts, path)


def token_counts(text: str) -> dict[str, float]:
    """A pretokenized query (Anserini's ``-pretokenized -impact``) as ``{token: weight}``:
    tokens separated by whitespace, each occurrence adding 1 to its token's weight."""
    return {t: float(n) for t, n in Counter(text.split()).items()}


def _json_record(line: str, path: Path, lineno: int) -> tuple[str, str]:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise InputError(f"not valid JSON ({exc})", path=path, line=lineno) from None
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {json_type_name(obj)}", path=path, line=lineno)
    id_field = next((f for f in ID_FIELDS if f in obj), "_id")
    qid = check_id(obj.get(id_field), path=path, line=lineno, field=id_field)
    text_field = next((f for f in TEXT_FIELDS if f in obj), None)
    if text_field is None:
        if "vector" in obj:
            raise InputError("a vector record in a text query file", path=path, line=lineno, field="vector")
        raise InputError(f"missing (one of {', '.join(TEXT_FIELDS)})", path=path, line=lineno, field="text")
    text = obj[text_field]
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise InputError(f"expected a string, got {json_type_name(text)}", path=path, line=lineno, field=text_field)
    return qid, text


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text", path=path) from None
