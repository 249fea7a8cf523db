"""Vocabularies: the mapping between tokens and integer term ids.

A learned sparse model scores over a fixed vocabulary (SPLADE: the 30,522 BERT WordPiece
tokens). Vectors in text formats name tokens; the index stores term ids; the
vocabulary connects the two and travels with the index so that queries are always
read in the vocabulary the documents were indexed with.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from importlib import resources
from pathlib import Path

from .errors import InputError

BERT_VOCAB_FILE = "bert-base-uncased-vocab.txt"


class Vocabulary:
    """Tokens ↔ term ids.

    Two kinds exist:

    * a **token vocabulary** (``Vocabulary(tokens)``), where term id ``i`` is
      ``tokens[i]`` — e.g. :meth:`bert`, :meth:`from_file`, :meth:`from_pretrained`;
    * an **integer vocabulary** (``Vocabulary.integer(size)``) for vectors that come with
      term ids and no tokens: the "token" of term ``i`` is the decimal string ``"i"``.
    """

    def __init__(self, tokens: Sequence[str] | None = None, *, size: int | None = None) -> None:
        if tokens is None:
            if size is None or size <= 0:
                raise ValueError("an integer vocabulary needs a positive size")
            self._tokens: list[str] | None = None
            self._size = int(size)
            self._ids: dict[str, int] | None = None
            return
        self._tokens = list(tokens)
        self._size = len(self._tokens)
        if self._size == 0:
            raise ValueError("a vocabulary needs at least one token")
        self._ids = {}
        for i, tok in enumerate(self._tokens):
            # First occurrence wins, as in HF tokenizers' vocab.txt loading.
            self._ids.setdefault(tok, i)

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def integer(cls, size: int) -> Vocabulary:
        """A vocabulary of ``size`` anonymous terms named ``"0"`` .. ``"size-1"``."""
        return cls(None, size=size)

    @classmethod
    def bert(cls) -> Vocabulary:
        """The BERT (bert-base-uncased) WordPiece vocabulary of 30,522 tokens, as used by SPLADE."""
        return _bert_vocab()

    @classmethod
    def from_file(cls, path: str | Path) -> Vocabulary:
        """Read a ``vocab.txt`` (one token per line, line ``i`` is term id ``i``)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot read vocabulary: {exc.strerror}", path=path) from None
        tokens = text.split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        if not tokens:
            raise InputError("vocabulary file is empty", path=path)
        return cls([t.rstrip("\r") for t in tokens])

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Vocabulary:
        """Read the vocabulary of a Hugging Face tokenizer folder (``vocab.txt`` or ``tokenizer.json``)."""
        path = Path(path)
        if path.is_file():
            if path.name == "tokenizer.json":
                return cls._from_tokenizer_json(path)
            return cls.from_file(path)
        if (path / "vocab.txt").is_file():
            return cls.from_file(path / "vocab.txt")
        if (path / "tokenizer.json").is_file():
            return cls._from_tokenizer_json(path / "tokenizer.json")
        raise InputError("no vocab.txt or tokenizer.json found", path=path)

    @classmethod
    def _from_tokenizer_json(cls, path: Path) -> Vocabulary:
        try:
            with path.open(encoding="utf-8") as f:
                data = json.load(f)
            vocab = data["model"]["vocab"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"not a tokenizer.json with a model vocab ({exc})", path=path) from None
        if not isinstance(vocab, dict):
            raise InputError("model.vocab is not a token → id mapping", path=path, field="model.vocab")
        size = max(vocab.values()) + 1
        tokens = [""] * size
        seen = [False] * size
        for tok, i in vocab.items():
            tokens[i] = tok
            seen[i] = True
        if not all(seen):
            raise InputError("term ids in model.vocab are not contiguous", path=path, field="model.vocab")
        # added_tokens with ids past the vocab are not scored by an MLM head; ignore them.
        return cls(tokens)

    @classmethod
    def resolve(cls, spec: str | Path | Vocabulary | None) -> Vocabulary:
        """Turn a CLI/API vocabulary spec into a vocabulary.

        ``None`` or ``"bert"``: the BERT vocabulary; ``"integer:N"``: an integer vocabulary
        of N terms; otherwise a vocab file or a tokenizer folder.
        """
        if isinstance(spec, Vocabulary):
            return spec
        if spec is None or str(spec) == "bert":
            return cls.bert()
        s = str(spec)
        if s.startswith("integer:"):
            try:
                return cls.integer(int(s.split(":", 1)[1]))
            except ValueError:
                raise InputError(f"bad vocabulary spec {s!r}: expected integer:N") from None
        return cls.from_pretrained(s)

    # -- queries ------------------------------------------------------------------------

    @property
    def is_integer(self) -> bool:
        """True for an integer vocabulary (no token strings)."""
        return self._tokens is None

    def __len__(self) -> int:
        return self._size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        kind = "integer" if self.is_integer else "tokens"
        return f"Vocabulary({kind}, size={self._size}, fingerprint={self.fingerprint[:12]})"

    def get(self, token: str) -> int | None:
        """The term id of ``token``, or ``None`` if it is not in the vocabulary."""
        if self._ids is not None:
            return self._ids.get(token)
        if token.isdigit() and token.isascii():
            i = int(token)
            return i if i < self._size else None
        return None

    @property
    def lookup(self) -> Callable[[str], int | None]:
        """:meth:`get` as a callable that is as fast as it can be: for a token vocabulary the
        bound ``dict.get`` itself, so readers can ``map`` it over a vector's tokens in C."""
        return self._ids.get if self._ids is not None else self.get

    def token(self, term_id: int) -> str:
        """The token of ``term_id``."""
        if not 0 <= term_id < self._size:
            raise IndexError(f"term id {term_id} out of range for a vocabulary of {self._size}")
        return str(term_id) if self._tokens is None else self._tokens[term_id]

    def tokens(self) -> list[str]:
        """All tokens in term-id order."""
        if self._tokens is None:
            return [str(i) for i in range(self._size)]
        return list(self._tokens)

    @property
    def fingerprint(self) -> str:
        """A SHA-256 of the vocabulary, stored in indexes to detect mismatches."""
        fp = getattr(self, "_fp", None)
        if fp is None:
            h = hashlib.sha256()
            if self._tokens is None:
                h.update(f"integer:{self._size}".encode())
            else:
                for tok in self._tokens:
                    h.update(tok.encode("utf-8"))
                    h.update(b"\n")
            fp = self._fp = h.hexdigest()
        return fp

    # -- persistence --------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write as ``vocab.txt`` (token vocabularies) or a one-line ``integer:N`` file."""
        path = Path(path)
        if self._tokens is None:
            path.write_text(f"integer:{self._size}\n", encoding="utf-8")
        else:
            _check_tokens_writable(self._tokens)
            path.write_text("".join(t + "\n" for t in self._tokens), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read what :meth:`save` wrote."""
        path = Path(path)
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        if first.startswith("integer:") and first.strip()[8:].isdigit():
            return cls.integer(int(first.strip()[8:]))
        return cls.from_file(path)


def _check_tokens_writable(tokens: Iterable[str]) -> None:
    for tok in tokens:
        if "\n" in tok:
            raise ValueError(f"token {tok!r} contains a newline and cannot be saved")


@cache
def _bert_vocab() -> Vocabulary:
    text = resources.files("gpusparse").joinpath("data", BERT_VOCAB_FILE).read_text(encoding="utf-8")
    return Vocabulary(text.split("\n")[:-1])
