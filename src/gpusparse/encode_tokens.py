"""Token batches for the SPLADE encoder: tokenised once, sorted by length, padded per batch.

Texts are taken a window at a time (``window`` texts, in input order). A window is
tokenised in one call (a Hugging Face fast tokenizer encodes a batch in Rust, in parallel
and without holding Python's GIL), its texts are sorted by token length (ties keep input
order) and cut into batches of ``batch_size`` texts, each padded to its own longest text.
So padding is small while the output, put back in input order by the caller, does not
depend on the window beyond float rounding.

A batch's token ids are one int32 ``[b, longest]`` tensor, in page-locked (pinned) memory
when the model runs on a CUDA device, so its copy to the device is asynchronous.
:func:`prefetched` runs the tokenisation in a background thread, a few batches ahead of
the model.

Empty (all-whitespace) texts are not tokenised: they get empty vectors without the model.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

DEFAULT_SORT_WINDOW = 16384  # texts tokenised and sorted together
T = TypeVar("T")


@dataclass
class TokenBatch:
    """One batch of tokenised texts, shortest first.

    Attributes:
        rows: int64 ``[b]``: the texts' positions in the input.
        lengths: int64 ``[b]``: tokens of each text after truncation (ascending).
        input_ids: int32 ``[b, lengths.max()]``: token ids, padded with the pad token.
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
    truncated. A slow tokenizer goes through its ``__call__`` (twice: the second, at
    ``max_length + 1`` tokens, tells which texts were longer).
    """

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.backend = None
        if backend is not None:
            self.backend = copy.deepcopy(backend)
            self.backend.no_padding()
            self.backend.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, bool)
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # tokenizers >= 0.21
            encodings = encode(list(texts), add_special_tokens=True)
            ids = [e.ids for e in encodings]
            truncated = np.fromiter((len(e.overflowing) > 0 for e in encodings), dtype=bool, count=len(texts))
        else:
            ids = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
            longer = self.tokenizer(list(texts), truncation=True, max_length=self.max_length + 1)["input_ids"]
            truncated = np.fromiter((len(x) > self.max_length for x in longer), dtype=bool, count=len(texts))
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return lengths, flat, truncated


def token_batches(
    texts: Sequence[str], tokenize: Tokenize, batch_size: int, *, window: int = DEFAULT_SORT_WINDOW, pin: bool = False
) -> Iterator[TokenBatch]:
    """The non-empty ``texts`` as :class:`TokenBatch` es (see the module docstring).

    Raises:
        TypeError: a text is not a ``str``.
    """
    window = max(window, batch_size)
    for w0 in range(0, len(texts), window):
        rows = []
        for i in range(w0, min(len(texts), w0 + window)):
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
        for b0 in range(0, order.size, batch_size):
            sel = order[b0 : b0 + batch_size]
            yield _padded(window_rows[sel], lengths[sel], starts[sel], flat, int(truncated[sel].sum()), tokenize, pin)


def _padded(
    rows: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    flat: np.ndarray,
    truncated: int,
    tok: Tokenize,
    pin: bool,
) -> TokenBatch:
    b, longest = lengths.size, int(lengths.max())
    ids = torch.empty((b, longest), dtype=torch.int32, pin_memory=pin)
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
