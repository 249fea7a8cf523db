"""An index larger than the device's memory, searched from host memory piece by piece.

**Streaming** (:class:`StreamedIndex`). The index (or shard) stays in host memory (pinned,
for a GPU) cut into document-range pieces. For each query batch, piece ``i + 1`` is copied on
a side CUDA stream while piece ``i`` is searched, and the pieces' top-k are merged on the
device the way shards' are. On a CPU the same loop runs without streams.
:func:`open_for_search` decides between resident and streamed from a device-memory budget.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, replace

import torch

from . import engines
from .collection import SparseCollection
from .config import engine_config
from .device_memory import DeviceMemoryWarning, is_out_of_memory, out_of_memory_error, search_plan
from .engines.base import DEFAULT_MEMORY_BUDGET, BatchResult, SearchPlan
from .engines.tiled.engine import layout_for_search
from .layout.postings import PostingLists
from .layout.statistics import max_scores_host
from .queries import prepare_queries
from .search import SearchResults, check_search_args, padded, result_width, search_batches, search_width
from .shards import document_ranges, slice_documents
from .topk import merge_results

# Share of the device's free memory an index may take when no budget is given.
FREE_MEMORY_SHARE = 0.9


class StreamedIndex:
    """An index kept in host memory in ``n_pieces`` document ranges, searched on ``device``
    piece by piece (see the module docstring). ``kernel`` is resolved once; for the tiled
    engine each piece's tiled layout is built once (on ``device``) and kept in host memory
    beside it, so a piece travels in both layouts (about 14 instead of 8 bytes a posting).

    Args:
        index: the documents, on any device (pieces are cut where it is, then moved to the host).
        n_pieces: document ranges (at most ``index.n_docs``); two are on the device at once.
        device: where to search.
        kernel: ``"auto"`` or a kernel name, as for :meth:`Index.search`.
    """

    def __init__(self, index: PostingLists, n_pieces: int, device: str | torch.device, *, kernel: str = "auto") -> None:
        self.device = torch.device(device)
        self.engine = engines.choose(kernel, self.device)
        self.vocab = index.vocab
        self.quantization = index.quantization
        self.n_docs = index.n_docs
        self.term_max_scores = max_scores_host(index)  # float64 [V]: bounds the scores (prepare_queries)
        self._ids = index._ids
        cuda = self.device.type == "cuda"
        self.pieces: list[tuple[int, PostingLists]] = []
        for a, b in document_ranges(index.n_docs, n_pieces):
            piece = slice_documents(index, a, b)
            if cuda and self.kernel == "tiled":
                on_device = piece.to(self.device)
                layout_for_search(on_device, forward=False)  # the layout the search will ask for, to stream
                piece.derived.layouts.update(on_device.derived.layouts)
                del on_device
            self.pieces.append((a, _moved(piece, "cpu", pin=cuda)))
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

    @property
    def kernel(self) -> str:
        """The name of the engine the pieces were prepared for."""
        return self.engine.name

    @property
    def ids(self) -> list[str]:
        """The documents' string ids, by document number."""
        if self._ids is None:
            self._ids = [str(i) for i in range(self.n_docs)]
        return self._ids

    @property
    def nbytes(self) -> int:
        """Host bytes of the pieces (both layouts)."""
        return sum(t.numel() * t.element_size() for _, p in self.pieces for t in _tensors(p))

    def search(
        self,
        queries: SparseCollection | object,
        k: int = 1000,
        *,
        batch_size: int | None = None,
        kernel: str = "auto",
        memory_budget: int | None = None,
        progress: bool = False,
    ) -> SearchResults:
        """Exact top-``k``, as :meth:`Index.search` (same results, bit for bit)."""
        budget = check_search_args(k, batch_size, memory_budget)
        self.check_kernel(kernel)
        q = prepare_queries(queries, self.vocab, self.quantization, self.term_max_scores)
        kk = search_width(k, self.n_docs)
        try:
            res = search_batches(
                lambda part, plan: BatchResult(*self.search_pieces(part, kk, plan)),
                q, kk, self.n_docs, self.device, budget=budget, batch_size=batch_size, progress=progress,
                engine=self.kernel,
            )  # fmt: skip
        except Exception as exc:
            if is_out_of_memory(exc):
                raise out_of_memory_error(self.device, batch_size=batch_size, k=k) from exc
            raise
        return padded(res, result_width(k, self.n_docs))

    def check_kernel(self, kernel: str) -> None:
        """Refuse a ``kernel`` other than ``"auto"`` or the one the pieces were prepared for."""
        if kernel not in ("auto", self.kernel):
            raise ValueError(f"this StreamedIndex was prepared for kernel {self.kernel!r}, not {kernel!r}")

    def search_pieces(self, queries: SparseCollection, k: int, plan: SearchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One query batch over all pieces: ``(scores, ids)`` ``[B, k]`` on the device."""
        n_q = len(queries)
        best_s = torch.zeros((n_q, 0), dtype=torch.float32, device=self.device)
        best_i = torch.zeros((n_q, 0), dtype=torch.int64, device=self.device)
        arriving = self._fetch(0)
        device_plan = replace(plan, to_host=False)  # each piece's results are merged here
        for j, (base, _) in enumerate(self.pieces):
            piece = arriving
            if self._copy_stream is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(self._copy_stream)  # piece j has arrived
                for t in _tensors(piece):  # its memory is reused only after this stream's work
                    t.record_stream(compute)
            # Piece j + 1 starts copying now, on the side stream, while piece j is searched.
            arriving = self._fetch(j + 1) if j + 1 < len(self.pieces) else None
            s, i = self.engine.search_batch(piece, queries, k, device_plan).resolved()
            i = torch.where(i >= 0, i + base, i)
            best_s, best_i = merge_results(torch.cat([best_s, s], 1), torch.cat([best_i, i], 1), k)
            del piece
        return best_s, best_i

    def _fetch(self, j: int) -> PostingLists:
        piece = self.pieces[j][1]
        if self._copy_stream is None:
            return piece
        with torch.cuda.stream(self._copy_stream):
            return _moved(piece, self.device, non_blocking=True)

    def __repr__(self) -> str:
        return f"StreamedIndex(n_docs={self.n_docs}, pieces={len(self.pieces)}, device={self.device})"


def _tensors(index: PostingLists) -> list[torch.Tensor]:
    out = list(index.arrays().values())
    for value in index.derived.layouts.values():
        out += [getattr(value, f.name) for f in fields(value) if isinstance(getattr(value, f.name), torch.Tensor)]
    return out


def _moved(
    index: PostingLists, device: str | torch.device, *, pin: bool = False, non_blocking: bool = False
) -> PostingLists:
    """A copy of ``index`` on ``device`` with its tiled layouts (``pin``: in pinned host memory)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if pin:  # straight into page-locked memory, without a pageable copy first
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.to(device, non_blocking=non_blocking)

    arrays = {k: move(v) for k, v in index.arrays().items()}
    out = PostingLists(arrays, ids=None, vocab=index.vocab, n_docs=index.n_docs, quantization=index.quantization)
    for key, value in index.derived.layouts.items():
        tensors = {f.name: getattr(value, f.name) for f in fields(value)}
        moved = {n: move(t) for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        # Without the forward copy (8 more bytes a posting to stream): rescoring then
        # searches the inverted lists, with the same results.
        out.derived.layouts[key] = replace(value, **moved, forward=None)
    return out


def index_bytes(index: PostingLists, kernel: str) -> int:
    """Device bytes ``index`` needs for ``kernel`` (the tiled engine: its layout and forward copy too)."""
    n = sum(t.numel() * t.element_size() for t in index.arrays().values())
    return 3 * n if kernel == "tiled" else n  # + the tiled layout (~6 bytes a posting) and the forward copy (8)


def open_for_search(
    index: PostingLists,
    device: str | torch.device,
    *,
    kernel: str = "auto",
    index_memory: int | None = None,
    pieces: int | None = None,
    memory_budget: int | None = None,
    batch_size: int | None = None,
    k: int = 1000,
) -> PostingLists | StreamedIndex:
    """``index`` on ``device``, or streamed from host memory when it does not fit.

    ``pieces`` forces streaming in that many pieces. Under a device memory limit
    (:attr:`~gpusparse.config.EngineConfig.device_memory_limit`) on a GPU, the prediction for
    searches of ``batch_size`` at ``k`` decides (:func:`gpusparse.device_memory.search_plan`:
    resident lists, the tiled layout alone, streamed, the scatter kernel; an index to be
    searched resident stays where it is until its first search). Otherwise the index is
    streamed when it needs more than ``index_memory`` bytes (default for an index not yet on
    the GPU: 90% of the GPU's free memory less ``memory_budget``; no limit on a CPU), in
    pieces small enough for two to fit.
    """
    dev = torch.device(device)
    name = engines.choose(kernel, dev).name
    if pieces is not None and pieces < 1:
        raise ValueError("pieces must be at least 1")
    limit = engine_config().device_memory_limit
    if pieces is None and index_memory is None and limit is not None and dev.type == "cuda":
        plan = search_plan(index, dev, limit, kernel=kernel, batch_size=batch_size, k=k, memory_budget=memory_budget,
                           allow_streaming=True, warn=False)  # fmt: skip
        if plan.chosen.mode != "streamed":
            if hasattr(index, "search_device"):  # an Index: its search plans again (and warns) and uploads
                index.search_device = dev  # type: ignore[attr-defined]
                return index
            return index.resident_on(dev)
        warnings.warn(plan.message(), DeviceMemoryWarning, stacklevel=2)
        return StreamedIndex(index, plan.chosen.pieces, dev, kernel=name)
    if pieces is None and (index_memory is not None or index.device != dev):
        budget = index_memory
        if budget is None and dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            budget = int(free * FREE_MEMORY_SHARE) - (memory_budget or DEFAULT_MEMORY_BUDGET)
        need = index_bytes(index, name)
        if budget is not None and need > budget:
            pieces = min(index.n_docs, -(-2 * need // max(budget, 1)))
    if pieces is None:
        return index.resident_on(dev)
    return StreamedIndex(index, pieces, dev, kernel=name)
