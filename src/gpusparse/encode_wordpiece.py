"""BERT WordPiece tokenisation of ASCII texts with a word cache: the Rust tokenizer's ids, faster.

A BERT tokenizer (``BertNormalizer`` with ``clean_text``, ``BertPreTokenizer``, a
``WordPiece`` model, ``[CLS] text [SEP]``) does, on a text made only of ASCII characters
without control characters:

* normalisation: lower-casing (when its ``lowercase`` is on); accents and Chinese characters
  do not occur in ASCII;
* pre-tokenisation: the words are the runs of letters and digits, and each punctuation
  character (``string.punctuation``) on its own; whitespace separates;
* the WordPiece model on each word, which depends on the word alone.

So the ids of a word are computed once (by the tokenizer's own model) and kept in a cache;
a text costs a few string operations (lower-casing, spacing out punctuation, splitting) and
a dictionary look-up per word, all of it in C under Python, against the Rust tokenizer's
per-character alignment bookkeeping and its ``Encoding`` objects. Texts are put together
with numpy, then truncated (on the side and to the length the tokenizer would use) and
framed with the special tokens.

Texts this does not cover exactly go to the Rust tokenizer (:meth:`BertWordPiece.covers`):
any non-ASCII character, an ASCII control character (``clean_text`` removes them, which
can join words), or anything that reads as one of the tokenizer's added tokens
(``[MASK]``, ``[SEP]`` ..., compared without case). A tokenizer of another kind gets no
:class:`BertWordPiece` (:func:`bert_word_piece` returns ``None``). The cache holds up to
about a million words (~120 MB) and starts afresh beyond.
"""

from __future__ import annotations

import itertools
import json
import re
import string
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

_CONTROL = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f"  # ASCII control characters other than \t \n \r
_PUNCT = "[" + re.escape(string.punctuation) + "]"
_SEPARATOR = "\x00"
_CHUNK = 256  # texts per pass: keeps each C call (which holds the GIL) to about a millisecond
_MAX_CACHED_WORDS = 1 << 20  # the cache starts afresh beyond this many words (~120 MB)


class BertWordPiece:
    """``texts -> (lengths, flat ids, truncated flags)`` for ASCII texts, as the Rust tokenizer
    ``backend`` (truncating at ``max_length`` tokens, special tokens included) gives them.

    Build it with :func:`bert_word_piece`, which checks that ``backend`` is of the BERT kind.
    """

    def __init__(
        self,
        backend: Any,
        max_length: int,
        *,
        lowercase: bool,
        prefix: list[int],
        suffix: list[int],
        left: bool,
        added: list[str],
    ) -> None:
        self.model = backend.model
        self.max_length, self.lowercase, self.left = max_length, lowercase, left
        self.prefix = np.asarray(prefix, dtype=np.int32)
        self.suffix = np.asarray(suffix, dtype=np.int32)
        self.budget = max_length - len(prefix) - len(suffix)  # tokens of the text itself
        self._spaced = re.compile(_PUNCT).sub  # " c " for each punctuation character c
        refuse = [f"[{_CONTROL}]", *(re.escape(a) for a in added)]
        self._refuse = re.compile("|".join(refuse), re.IGNORECASE).search
        starts = "".join(sorted({c for a in added for c in (a[0].lower(), a[0].upper())}))
        self._suspect = re.compile(f"[{_CONTROL}{re.escape(starts)}]").search  # a quick first look
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._codes: dict[str, int] = {_SEPARATOR: 0}  # code 0: between texts, no pieces
        self._start = np.zeros(1024, dtype=np.int64)  # of each cached word's pieces in _pieces
        self._count = np.zeros(1024, dtype=np.int64)  # pieces of each cached word
        self._pieces = np.zeros(4096, dtype=np.int32)
        self._used = 0  # entries of _pieces in use

    def covers(self, text: str) -> bool:
        """Whether ``text`` is tokenised here exactly (else the Rust tokenizer must do it)."""
        return text.isascii() and (self._suspect(text) is None or self._refuse(text) is None)

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokenise ``texts``, each of which :meth:`covers`; flat ids in input order."""
        parts = []
        with self._lock:
            for a in range(0, len(texts), _CHUNK):
                if len(self._codes) > _MAX_CACHED_WORDS:
                    self._reset()
                parts.append(self._encode(texts[a : a + _CHUNK]))
                time.sleep(0)  # lets a thread waiting for the GIL (the model's) have it now
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, bool)
        lengths, flat, truncated = zip(*parts, strict=True)
        return np.concatenate(lengths), np.concatenate(flat), np.concatenate(truncated)

    def _encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(texts)
        # The texts' words one after the other, a separator word (a control character, which
        # no covered text holds) between two texts: one C call each to join, lower, space out
        # the punctuation and split.
        joined = f" {_SEPARATOR} ".join(texts)
        words = self._spaced(r" \g<0> ", joined.lower() if self.lowercase else joined).split()
        codes = np.fromiter(map(self._codes.get, words, itertools.repeat(-1)), dtype=np.int64, count=len(words))
        missing = np.flatnonzero(codes < 0)
        if missing.size:
            self._learn({words[i] for i in missing.tolist()})
            get = self._codes.__getitem__
            codes[missing] = np.fromiter((get(words[i]) for i in missing.tolist()), dtype=np.int64, count=missing.size)
        count = self._count[codes]
        # Token counts per text before truncation, from the running sum over words (the
        # separators count no tokens).
        csum = np.zeros(codes.size + 1, dtype=np.int64)
        np.cumsum(count, out=csum[1:])
        bounds = np.concatenate([[0], np.flatnonzero(codes == 0), [codes.size]])
        if bounds.size != n + 1:
            raise RuntimeError("text separators lost in the split")
        raw = csum[bounds[1:]] - csum[bounds[:-1]]
        kept = np.minimum(raw, self.budget)
        drop = raw - kept if self.left else np.zeros(n, dtype=np.int64)  # tokens cut off at the start
        n_special = self.prefix.size + self.suffix.size
        lengths = kept + n_special
        out_start = np.cumsum(lengths) - lengths
        flat = np.empty(int(lengths.sum()), dtype=np.int32)
        for j, tok in enumerate(self.prefix.tolist()):
            flat[out_start + j] = tok
        for j, tok in enumerate(self.suffix.tolist()):
            flat[out_start + self.prefix.size + kept + j] = tok
        total = int(csum[-1])
        if total:
            # Each token of each word: its id, and its place in its text's token list.
            first = np.repeat(self._start[codes] - csum[:-1], count) + np.arange(total, dtype=np.int64)
            ids = self._pieces[first]
            text_start = np.cumsum(raw) - raw
            owner = np.repeat(np.arange(n, dtype=np.int64), raw)
            within = np.arange(total, dtype=np.int64) - text_start[owner] - drop[owner]
            keep = (within >= 0) & (within < kept[owner])
            flat[(out_start[owner] + self.prefix.size + within)[keep]] = ids[keep]
        return lengths, flat, raw > self.budget

    def _learn(self, words: set[str]) -> None:
        """Put ``words`` (not cached yet) into the cache with their WordPiece ids."""
        for w in words:
            ids = [t.id for t in self.model.tokenize(w)]
            code = len(self._codes)
            if code >= self._start.size:
                self._start = np.resize(self._start, 2 * self._start.size)
                self._count = np.resize(self._count, 2 * self._count.size)
            if self._used + len(ids) > self._pieces.size:
                self._pieces = np.resize(self._pieces, 2 * (self._used + len(ids)))
            self._pieces[self._used : self._used + len(ids)] = ids
            self._start[code], self._count[code] = self._used, len(ids)
            self._used += len(ids)
            self._codes[w] = code


def bert_word_piece(backend: Any, max_length: int) -> BertWordPiece | None:
    """A :class:`BertWordPiece` giving ``backend`` 's ids (a ``tokenizers.Tokenizer`` set to
    truncate at ``max_length``, without padding), or ``None`` when ``backend`` is not of the
    BERT kind described in the module docstring."""
    try:
        config = json.loads(backend.to_str())
    except Exception:  # a backend that cannot describe itself gets the Rust path
        return None
    norm, pre = config.get("normalizer") or {}, config.get("pre_tokenizer") or {}
    model, post = config.get("model") or {}, config.get("post_processor") or {}
    trunc = config.get("truncation") or {}
    if (
        norm.get("type") != "BertNormalizer"
        or norm.get("clean_text") is not True
        or pre.get("type") != "BertPreTokenizer"
        or model.get("type") != "WordPiece"
        or post.get("type") not in ("TemplateProcessing", "BertProcessing")
        or config.get("padding") is not None
        or trunc.get("max_length") != max_length
        or trunc.get("stride", 0) != 0
    ):
        return None
    added = [str(a.get("content", "")) for a in config.get("added_tokens") or []]
    if any(not a or any(c.isspace() for c in a) for a in added):
        return None
    probe = backend.encode("a", add_special_tokens=True)
    seq = probe.sequence_ids
    if seq.count(0) != 1 or len(probe.ids) != backend.num_special_tokens_to_add(False) + 1:
        return None
    at = seq.index(0)
    prefix, suffix = probe.ids[:at], probe.ids[at + 1 :]
    if max_length <= len(prefix) + len(suffix):
        return None  # the Rust tokenizer's arithmetic for this edge is its own
    return BertWordPiece(
        backend,
        max_length,
        lowercase=bool(norm.get("lowercase", True)),
        prefix=prefix,
        suffix=suffix,
        left=str(trunc.get("direction", "right")).lower() == "left",
        added=added,
    )
