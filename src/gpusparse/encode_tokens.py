"""Token batches for the SPLADE encoder: tokenised once, sorted by length, padded per batch.

Texts are taken a window at a time (``window`` texts, in input order; the first windows
are 4 batches and double up to ``window``, so the model can start early). A window is
tokenised at once: a BERT tokenizer's ASCII texts through a word cache
(:mod:`gpusparse.encode_wordpiece`), the others by the Hugging Face fast tokenizer's Rust
code (in parallel and without holding Python's GIL). Its texts are sorted by token length
(ties keep input order) and cut into batches of ``batch_size`` texts, each padded to its
own longest text. So padding is small while the output, put back in input order by the
caller, does not depend on the window beyond float rounding.

A batch's token ids are one int32 ``[b, longest]`` tensor, in page-locked (pinned) memory
when the model runs on a CUDA device, so its copy to the device is asynchronous.
:func:`prefetched` runs the tokenisation in a background thread ahead of the model (the
encoder lets it run a window ahead, so a window is tokenised while the model works through
the one before).

Empty (all-whitespace) texts are not tokenised: they get empty vectors without the model.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from .encode_wordpiece import BertWordPiece, bert_word_piece

DEFAULT_SORT_WINDOW = 16384  # texts tokenised and sorted together
_RUST_CHUNK = 1024  # texts per call of the Rust tokenizer
T = TypeVar("T")


@dataclass
class TokenBatch:
    """One batch of tokenised texts, shortest first.

    Attributes:
        rows: int64 ``[b]``: the texts' positions in the input.
        lengths: int64 ``[b]``: tokens of each text after truncation (ascending).
        input_ids: int32 ``[b, width]``: token ids, padded with the pad token (``width``:
            ``lengths.max()``, or more where the batches are padded to length buckets).
        lengths_t: ``lengths`` as a tensor (the device builds the attention mask from it).
        truncated: how many of the ``b`` texts were truncated.

    The two tensors are in pinned memory when they are meant for a CUDA device.
    """

    rows: np.ndarray
    lengths: np.ndarray
    input_ids: torch.Tensor
    lengths_t: torch.Tensor
    truncated: int


class Tokenize:
    """``tokenize(texts) -> (lengths, flat ids, truncated flags)`` with ``tokenizer``'s
    truncation at ``max_length`` tokens (special tokens included).

    A fast tokenizer is used through its Rust backend (a private copy, so the caller's
    tokenizer settings are untouched): one call encodes the batch and tells which texts it
    truncated. With ``word_cache``, a BERT tokenizer takes its ASCII texts through a word cache
    instead (:mod:`gpusparse.encode_wordpiece`: the same ids, several times faster on one
    core). A slow tokenizer goes through its ``__call__`` (twice: the second,
    at ``max_length + 1`` tokens, tells which texts were longer).
    """

    def __init__(self, tokenizer: Any, max_length: int, *, word_cache: bool = False) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.backend = None
        self.words: BertWordPiece | None = None
        if backend is not None:
            self.backend = copy.deepcopy(backend)
            self.backend.no_padding()
            self.backend.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))
            self.words = bert_word_piece(self.backend, max_length) if word_cache else None
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, bool)
        if self.words is None:
            return self._rust(texts)
        covered = np.fromiter(map(self.words.covers, texts), dtype=bool, count=len(texts))
        if covered.all():
            return self.words(texts)
        fast = np.flatnonzero(covered)
        rest = np.flatnonzero(~covered)
        parts = [self.words([texts[i] for i in fast.tolist()]), self._rust([texts[i] for i in rest.tolist()])]
        return _interleave(np.concatenate([fast, rest]), parts)

    def _rust(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.backend is not None:
            # In chunks: turning the Encodings into Python objects holds the GIL, which the
            # thread running the model needs too.
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # tokenizers >= 0.21
            ids, over = [], []
            for a in range(0, len(texts), _RUST_CHUNK):
                encodings = encode(list(texts[a : a + _RUST_CHUNK]), add_special_tokens=True)
                ids.extend(e.ids for e in encodings)
                over.extend(len(e.overflowing) > 0 for e in encodings)
                del encodings
            truncated = np.asarray(over, dtype=bool)
        else:
            ids = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
            longer = self.tokenizer(list(texts), truncation=True, max_length=self.max_length + 1)["input_ids"]
            truncated = np.fromiter((len(x) > self.max_length for x in longer), dtype=bool, count=len(texts))
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return lengths, flat, truncated


def _interleave(
    rows: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The texts of ``parts`` (one after the other; text ``j`` of them is input ``rows[j]``)
    as ``(lengths, flat, truncated)`` in input order."""
    lengths_in = np.concatenate([p[0] for p in parts])
    flat_in = np.concatenate([p[1] for p in parts])
    n = rows.size
    lengths = np.empty(n, dtype=np.int64)
    lengths[rows] = lengths_in
    truncated = np.empty(n, dtype=bool)
    truncated[rows] = np.concatenate([p[2] for p in parts])
    src = np.empty(n, dtype=np.int64)
    src[rows] = np.cumsum(lengths_in) - lengths_in
    dst = np.cumsum(lengths) - lengths
    gather = np.repeat(src - dst, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    return lengths, flat_in[gather], truncated


def token_batches(
    texts: Sequence[str],
    tokenize: Tokenize,
    batch_size: int,
    *,
    window: int = DEFAULT_SORT_WINDOW,
    pin: bool = False,
    timer: dict[str, float] | None = None,
    pad_to: Callable[[int], int] | None = None,
) -> Iterator[TokenBatch]:
    """The non-empty ``texts`` as :class:`TokenBatch` es (see the module docstring).

    The first windows are smaller (:func:`windows`), so the model starts early. ``timer``
    (when given) adds the seconds spent tokenising (``"tokenize"``) and padding (``"pad"``).
    ``pad_to``: the width of a batch whose longest text has ``n`` tokens (``>= n``; default
    ``n``), e.g. the length buckets of :mod:`gpusparse.encode_graphs`.

    Raises:
        TypeError: a text is not a ``str``.
    """
    clock = time.perf_counter
    for w0, w1 in windows(len(texts), window, batch_size):
        t0 = clock()
        rows = []
        for i in range(w0, w1):
            t = texts[i]
            if not isinstance(t, str):
                raise TypeError(f"text {i} is {type(t).__name__}, not str")
            if t.strip():
                rows.append(i)
        if not rows:
            continue
        lengths, flat, truncated = tokenize([texts[i] for i in rows])
        starts = np.cumsum(lengths) - lengths
        order = np.argsort(lengths, kind="stable")
        window_rows = np.asarray(rows, dtype=np.int64)
        if timer is not None:
            timer["tokenize"] = timer.get("tokenize", 0.0) + clock() - t0
        for b0 in range(0, order.size, batch_size):
            t0 = clock()
            sel = order[b0 : b0 + batch_size]
            longest = int(lengths[sel].max())
            width = longest if pad_to is None else pad_to(longest)
            if width < longest:
                raise ValueError(f"pad_to({longest}) = {width}: shorter than the batch's longest text")
            sub = (window_rows[sel], lengths[sel], starts[sel])
            batch = _padded(*sub, flat, int(truncated[sel].sum()), tokenize, pin, width)
            if timer is not None:
                timer["pad"] = timer.get("pad", 0.0) + clock() - t0
            yield batch
            time.sleep(0)  # in a thread: lets the thread running the model have the GIL now


def windows(n: int, window: int, batch_size: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of the windows of ``n`` texts sorted together: ``window`` texts (at
    least ``batch_size``), except the first ones, which start at 4 batches and double (the
    model waits for the first window only)."""
    window = max(window, batch_size)
    size, start = min(window, 4 * batch_size), 0
    while start < n:
        yield start, min(n, start + size)
        start += size
        size = min(window, 2 * size)


def _padded(
    rows: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    flat: np.ndarray,
    truncated: int,
    tok: Tokenize,
    pin: bool,
    width: int,
) -> TokenBatch:
    b = lengths.size
    ids = torch.empty((b, width), dtype=torch.int32, pin_memory=pin)
    view = ids.numpy()
    view.fill(tok.pad_id)
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths  # of each row in the batch's own flat order
    within = np.arange(total, dtype=np.int64) - np.repeat(first, lengths)
    view[np.repeat(np.arange(b), lengths), within] = flat[np.repeat(starts, lengths) + within]
    lengths_t = torch.empty(b, dtype=torch.int64, pin_memory=pin)
    lengths_t.numpy()[:] = lengths
    return TokenBatch(rows=rows, lengths=lengths, input_ids=ids, lengths_t=lengths_t, truncated=truncated)


_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetched(items: Iterator[T], depth: int = 4) -> Iterator[T]:
    """``items``, produced in a background thread up to ``depth`` ahead of the consumer.

    An exception in the thread is raised in the consumer; closing the iterator early stops
    the thread (after the item it is making).
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(_Failed(exc))

    thread = threading.Thread(target=work, name="gpusparse-tokenize", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()
