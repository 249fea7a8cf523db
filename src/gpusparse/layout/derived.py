"""What is built from an index's arrays on demand, typed: :class:`DerivedState`.

An index object builds each of these at most once, on its own device: the document-major
forward copy, tiled layouts (one per layout key), host statistics read before every search
(list maxima, the smallest weight) and the tiled engine's captured CUDA graphs. A copy of the
index on another device starts with the host statistics only (they do not depend on the
device); the arrays' other structures are built again where they are needed.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

SEARCHES_KEPT = 16  # resolved searches an index keeps (DerivedState.searches)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two device names mean the same device (``cuda`` is the current CUDA device)."""
    return normalize_device(a) == normalize_device(b)


def normalize_device(device: torch.device) -> torch.device:
    """``device`` with its index filled in (``cuda`` → ``cuda:<current>``) where that is known."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class DerivedState:
    """Structures derived from one index object's arrays (see the module docstring).

    Attributes:
        forward: the document-major copy ``(indptr, terms, weights)``
            (:func:`gpusparse.layout.forward.forward_index`).
        layouts: tiled layouts by key (:func:`gpusparse.layout.tiled.tiled_layout`).
        chosen: the layout a search's arguments resolved to, with the settings (the
            :class:`~gpusparse.config.EngineConfig` object) in force then
            (:func:`gpusparse.engines.tiled.engine.layout_for_search`).
        graph_steps: the steps a CUDA graph of the tiled engine captures, by their arguments
            (:func:`gpusparse.engines.tiled.device.graphed_steps`).
        searches: :class:`gpusparse.search.Search` objects by the arguments of
            :meth:`gpusparse.Index.search` they resolve, with the settings in force then; the
            last :data:`SEARCHES_KEPT` (:meth:`keep_search`).
        max_scores_host: the lists' largest weights, float64 on the host.
        max_scores_device: those weights (float32) on the device the graphs run on, where the
            lists are not (:func:`gpusparse.layout.statistics.max_scores_on`).
        max_score: the largest of them.
        min_weight: the smallest document weight (+inf for an empty index).
        graphs: the tiled engine's captured CUDA graphs, least recently used first.
        graph_shapes: batch shapes seen once (a larger batch's graph is captured the second
            time its shape comes: :attr:`~gpusparse.config.EngineConfig.graph_repeat_batch`).
        copy: ``(device, index)``: the copy searched on another device
            (:meth:`PostingLists.resident_on`).
        views: a host index's views searched from the tiled layout alone, by device
            (:func:`gpusparse.layout.resident.tiled_resident`).
    """

    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    layouts: dict[tuple, Any] = field(default_factory=dict)
    chosen: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    graph_steps: dict[tuple, tuple] = field(default_factory=dict)
    searches: OrderedDict = field(default_factory=OrderedDict)
    max_scores_host: np.ndarray | None = None
    max_scores_device: torch.Tensor | None = None
    max_score: float | None = None
    min_weight: float | None = None
    graphs: OrderedDict = field(default_factory=OrderedDict)
    graph_shapes: OrderedDict = field(default_factory=OrderedDict)
    copy: tuple[torch.device, Any] | None = None
    views: dict[torch.device, Any] = field(default_factory=dict)

    def share_host_statistics(self, other: DerivedState) -> None:
        """Take ``other``'s device-independent statistics."""
        self.max_scores_host, self.max_score, self.min_weight = other.max_scores_host, other.max_score, other.min_weight

    def copy_on(self, device: torch.device) -> Any:
        """The kept copy on ``device``, or ``None``."""
        if self.copy is not None and same_device(self.copy[0], device):
            return self.copy[1]
        return None

    def keep_search(self, key: tuple, config: Any, search: Any) -> None:
        """Keep ``search`` (resolved under ``config``) for the arguments ``key``: the last
        :data:`SEARCHES_KEPT`."""
        self.searches[key] = (config, search)
        self.searches.move_to_end(key)
        while len(self.searches) > SEARCHES_KEPT:
            self.searches.popitem(last=False)

    def keep_copy(self, device: torch.device, index: Any) -> None:
        """Keep ``index`` as the copy on ``device`` (replacing any other)."""
        self.copy = (normalize_device(device), index)

    def reset(self, *, keep_forward: bool = False) -> None:
        """Drop what was built on the device (layouts, graphs, the copy on another device), and
        the forward copy unless ``keep_forward``; the host statistics stay."""
        forward = self.forward if keep_forward else None
        self.layouts.clear()
        self.chosen.clear()
        self.searches.clear()
        self.graph_steps.clear()
        self.graphs.clear()
        self.max_scores_device = None
        self.copy = None
        self.views.clear()
        self.forward = forward

    def device_bytes(self, *, forward: bool = True) -> int:
        """Bytes of the tensors built on the index's device (each counted once: a layout holds
        the forward copy it shares); the forward copy left out unless ``forward``."""
        skip = {t.data_ptr() for t in self.forward or ()} if not forward else set()
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor] = list(self.forward or ()) if forward else []
        for layout in self.layouts.values():
            for f in dataclasses.fields(layout):
                value = getattr(layout, f.name)
                parts = value if isinstance(value, tuple) else (value,)
                tensors += [v for v in parts if isinstance(v, torch.Tensor)]
        for t in tensors:
            ptr = t.data_ptr()
            if ptr in seen or ptr in skip:
                continue
            seen.add(ptr)
            total += t.numel() * t.element_size()
        return total
