"""An index that is its tiled layout and statistics alone: :class:`LayoutOnly`.

A collection too large for its padded lists to exist anywhere (100M documents: ~12e9
postings, ~100 GB of lists) is built straight into the tiled layout
(:func:`~gpusparse.layout.chunked.build_tiled_chunks`). The tiled engine needs besides the
layout only per-term statistics (the lists' largest weights, for each query's fixed-point
scale; the smallest weight, for the rows whose k-th score may fall below one unit), the
number of documents and the quantization: a :class:`LayoutOnly` carries those, no lists,
and answers the engine's request for its layout with the one it was built with.
:func:`gpusparse.search.search` with ``kernel="tiled"`` searches it like any index; the rows
the engine would search again on the lists are searched on the layout
(:func:`gpusparse.engines.tiled.layout_fallback.layout_reference_search`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import engine_config
from ..vocab import Vocabulary
from .chunked import ChunkStatistics
from .derived import same_device
from .postings import IndexStats, PostingLists
from .tiled import AUTO, TiledIndex, layout_defaults

if TYPE_CHECKING:
    from ..quantize import Quantization


class _OneLayout(dict):
    """The derived-layouts table of a :class:`LayoutOnly`: its one layout, never a build."""

    def __init__(self, key: tuple, layout: TiledIndex) -> None:
        super().__init__({key: layout})
        self.key = key

    def __contains__(self, key: object) -> bool:
        return True  # tiled_layout never builds: it reads the table, which answers below

    def __missing__(self, key: tuple):
        bits, dense_min, fixed = self.key
        raise ValueError(
            f"this index holds only the tiled layout it was built with (tile_bits={bits}, dense_min={dense_min}, "
            f"fixed point {'on' if fixed else 'off'}), not {key}: search it with the tiled engine and "
            f"EngineConfig(dense_min={dense_min}, fixed_point={fixed}" + (', accumulator="u32")' if fixed else ")")
        )


class LayoutOnly(PostingLists):
    """A tiled ``layout`` searched without posting lists (see the module docstring).

    ``key``: what :func:`~gpusparse.layout.tiled.tiled_layout` asks for this layout,
    ``(tile_bits, dense_min, fixed)`` — ``fixed`` true for float32 weights with a fixed-point
    exponent (``layout.weight_bits``) searched with the "u32" accumulator.
    """

    def __init__(
        self,
        layout: TiledIndex,
        stats: ChunkStatistics,
        *,
        dense_min: float | None,
        vocab: Vocabulary | None = None,
        quantization: Quantization | None = None,
    ) -> None:
        dev = layout.seg.device
        v = layout.n_terms
        if stats.n_docs != layout.n_docs or stats.lengths.numel() != v:
            raise ValueError("the statistics are not the layout's (documents or terms differ)")
        if (quantization is None) == layout.quantized:
            raise ValueError("a layout of 8-bit levels needs its quantization, and only it")
        no_lists = {
            "doc_ids": torch.zeros(0, dtype=torch.int32, device=dev),
            "scores": torch.zeros(0, dtype=torch.float32, device=dev),
            "offsets": torch.zeros(v, dtype=torch.int64, device=dev),
            "lengths": stats.lengths.to(dev, torch.int32),  # < 2**31: at most one posting a document
            "padded_lengths": torch.zeros(v, dtype=torch.int32, device=dev),
            "max_scores": stats.max_scores.to(dev, torch.float32),
        }
        PostingLists.__init__(self, no_lists, ids=None, vocab=vocab or Vocabulary.integer(v), n_docs=layout.n_docs,
                              n_empty_docs=stats.n_empty_docs, quantization=quantization)  # fmt: skip
        self.layout = layout
        self.n_postings = stats.n_postings
        self.derived.min_weight = stats.min_weight
        self.derived.layouts = _OneLayout((layout.tile_bits, dense_min, layout.weight_bits is not None), layout)

    @property
    def lists_resident(self) -> bool:
        """Never: there are no lists."""
        return False

    def to(self, device: str | torch.device):  # -> Self
        """Only where it is: the layout is not copied."""
        if not same_device(self.device, torch.device(device)):
            raise ValueError(f"a layout-only index on {self.device} is searched there, not on {device}")
        return self


def engine_layout(n_docs: int, quantized: bool) -> tuple[int, float | None, bool]:
    """``(tile_bits, dense_min, fixed)``: the layout the tiled engine asks of an index of
    ``n_docs`` documents without lists, under the configuration in force
    (:func:`gpusparse.engines.tiled.engine.layout_for_search`'s choice, default accumulator):
    what to build a :class:`LayoutOnly` with."""
    config = engine_config()
    fixed = config.fixed_point and config.accumulator == "u32" and not quantized
    bits, auto_dense = layout_defaults(n_docs, quantized, fixed)
    return bits, auto_dense if config.dense_min == AUTO else config.dense_min, fixed

    def stats(self) -> IndexStats:
        """Counts and the layout's bytes (no padded postings)."""
        return IndexStats(self.n_docs, len(self.vocab), int((self.lengths > 0).sum()), self.n_postings, 0,
                          self._n_empty_docs or 0, self.layout.nbytes)  # fmt: skip
